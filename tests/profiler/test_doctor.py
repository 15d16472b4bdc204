"""``autopar doctor`` on local processes launched like torchrun, with failures injected."""

import dataclasses
import os
import time

import pytest
import torch

import autopar
from autopar.models import MLPConfig, MLPStack
from profiler.__main__ import main
from profiler.doctor import DoctorSettings, run_doctor
from profiler.errors import SettingsError
from profiler.launch import launch_local

pytestmark = pytest.mark.multiprocess
QUICK = DoctorSettings(join_timeout_s=3, pg_timeout_s=6, link_bytes=2**20, repeats=2)


def _doctor(rank, world, settings, broken=()):
    if rank in broken:
        if rank % 2:
            time.sleep(120)  # hangs before joining
        os._exit(3)  # dies before joining
    return run_doctor(settings)


def _report(results):
    assert results[0].ok, results[0].error
    return results[0].value


def test_healthy_run_checks_the_plans_groups(tmp_path, capsys):
    """Four healthy ranks are ready, with every group of the plan checked. The ranks join
    within the default 60 s: four processes importing torch on two busy cores took more
    than 10 s in a full CI run, and a healthy run waits only as long as its ranks take.
    The process-group timeout of 40 s puts the doctor's own limit on its ranks (join +
    2 x that + 120 s) under pytest's 300 s, so a rank that hangs is reported by name
    rather than the test killed (a full CI run once sat here past 300 s)."""
    model = MLPStack(MLPConfig(in_dim=16, dim=32, ffn_dim=64, n_layers=2, out_dim=4))
    cluster = autopar.preset("local-cpu", devices_per_node=4)
    plan = autopar.estimate(
        model, cluster, {"dp": 2, "tp": 2, "pp": 1}, global_batch_size=8, sample_input=torch.zeros(1, 16)
    )
    plan.save(tmp_path / "plan.json")
    code = main(
        [
            "doctor",
            "--nproc",
            "4",
            "--plan",
            str(tmp_path / "plan.json"),
            "--link-bytes",
            "262144",
            "--pg-timeout",
            "40",
            "--out",
            str(tmp_path / "doctor.json"),
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.out + captured.err
    out = captured.out
    assert "[ ok ] rendezvous: all 4 ranks joined" in out
    assert "[ ok ] all-reduce: 5 groups (world, tp, dp) returned exact sums on every rank" in out
    assert "verdict: ready" in out and (tmp_path / "doctor.json").is_file()


@pytest.mark.parametrize("dp", [1, 4])
def test_a_plan_for_another_number_of_ranks_stops_the_check(dp, tmp_path, capsys):
    """A plan for 1 or 4 ranks checked on a job of 2: the doctor names both sizes (a
    smaller plan has no group reaching past the job, and once passed without a word)."""
    model = MLPStack(MLPConfig(in_dim=16, dim=32, ffn_dim=64, n_layers=2, out_dim=4))
    cluster = autopar.preset("local-cpu", devices_per_node=dp)
    plan = autopar.estimate(model, cluster, {"dp": dp}, global_batch_size=8, sample_input=torch.zeros(1, 16))
    plan.save(tmp_path / "plan.json")
    argv = ["doctor", "--nproc", "2", "--plan", str(tmp_path / "plan.json"), "--join-timeout", "10"]
    code = main(argv)
    out = capsys.readouterr().out
    assert code == 1, out
    assert f"the plan runs on {dp} ranks (dp x cp x tp x pp) but the job has 2 ranks" in out
    assert f"launch {dp} ranks, or plan for 2 devices" in out


def test_ranks_that_never_join_are_named_quickly():
    start = time.monotonic()
    report = _report(launch_local(_doctor, 4, QUICK, (2, 3), timeout_s=8))  # then the hung rank 3 is killed
    assert time.monotonic() - start < 15
    (join,) = [f for f in report.findings if f.check == "rendezvous"]
    assert join.severity == "error" and join.ranks == (2, 3)
    assert "died or hangs before joining" in join.message
    assert not report.ok and report.links == ()  # stopped before forming a process group


def test_a_missing_node_is_named_as_a_node():
    def env(rank):
        return {"GROUP_RANK": str(rank // 2), "LOCAL_RANK": str(rank % 2), "LOCAL_WORLD_SIZE": "2"}

    report = _report(launch_local(_doctor, 4, QUICK, (2, 3), timeout_s=8, env_of_rank=env))
    (join,) = report.errors()
    assert join.ranks == (2, 3) and "all of node #1" in join.message


def test_mismatched_settings_and_a_rank_that_cannot_join_the_group():
    """Every rank joins (rank 0 waits for them as long as they take: with QUICK's 3 s a
    rank still importing torch on a busy machine was left out, and its setting with it),
    then rank 2 cannot form the process group."""

    def env(rank):
        return {"NCCL_IB_DISABLE": "1"} if rank == 1 else {"GLOO_DEVICE_TRANSPORT": "NOPE"} if rank == 2 else {}

    settings = dataclasses.replace(QUICK, join_timeout_s=120)
    report = _report(launch_local(_doctor, 4, settings, timeout_s=240, env_of_rank=env))
    settings = [f for f in report.findings if f.check == "settings"]
    assert {f.message.split(" ")[0] for f in settings} == {"NCCL_IB_DISABLE", "GLOO_DEVICE_TRANSPORT"}
    assert next(f for f in settings if f.message.startswith("NCCL")).ranks == (1,)
    (cause,) = report.errors()
    assert cause.check == "process group" and cause.ranks == (2,) and "unsupported gloo device" in cause.message


def test_a_missing_interface_stops_before_the_process_group():
    """The one error is the environment's, on the rank whose interface is missing: no
    process group was formed, so none timed out (timed, the check failed on a loaded
    machine, where three ranks starting took longer than the bound)."""
    env = {"GLOO_SOCKET_IFNAME": "nosuchnic0"}
    settings = dataclasses.replace(QUICK, join_timeout_s=120)  # every rank joins, however long it takes
    report = _report(launch_local(_doctor, 3, settings, timeout_s=240, env_of_rank=lambda r: env if r == 2 else {}))
    assert not [f for f in report.findings if f.check == "process group"]
    (err,) = report.errors()
    assert err.check == "environment" and err.ranks == (2,) and "nosuchnic0" in err.message and "lo" in err.fix


def test_a_directory_as_out_is_refused_before_the_check(tmp_path, capsys):
    """``--out`` naming a directory is one line before any rank starts, not an error after
    the whole check has run."""
    code = main(["doctor", "--nproc", "2", "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code != 0
    assert "ranks joined" not in out.lower()
    assert f"--out {str(tmp_path)!r} cannot be written (it is a directory)" in err
    assert "Traceback" not in err
    assert "wrote" not in out
    assert list(tmp_path.iterdir()) == []


def _doctor_hanging_in_links(rank, world, settings):
    if rank == 1:  # joins, then hangs where the links are timed
        import profiler.doctor as doctor

        doctor._time_links = lambda *a, **k: time.sleep(120)
    return run_doctor(settings)


def test_a_rank_that_hangs_mid_check_is_a_finding_not_a_traceback():
    """Rank 1 joins the process group, then hangs in the link timing: rank 0's collective
    times out after --pg-timeout, and the report says which check failed and that every
    rank had entered it (the timeout's message on its first line), in place of the
    RuntimeError that ended the doctor."""
    results = launch_local(_doctor_hanging_in_links, 2, QUICK, timeout_s=60)
    report = _report(results)
    (err,) = report.errors()
    assert err.check == "collectives" and "the link timing failed on rank 0" in err.message
    assert "every rank had entered it, so one died or hung inside it" in err.message
    assert "--pg-timeout (6 s)" in err.fix


def test_a_store_it_cannot_reach_is_one_line(monkeypatch):
    """A rank started without torchrun whose rank 0 is not up: one line naming the
    address, what to check, in place of torch's DistNetworkError traceback."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29689")
    with pytest.raises(SettingsError, match=r"rank 1 could not reach the rendezvous store at 127.0.0.1:29689 \("):
        run_doctor(dataclasses.replace(QUICK, join_timeout_s=1))


def test_a_link_test_below_one_float_is_refused(capsys):
    """Each link sends fp32 elements: fewer than 4 bytes would time empty messages and
    compare nothing."""
    with pytest.raises(SystemExit) as stopped:
        main(["doctor", "--nproc", "2", "--link-bytes", "2"])
    assert stopped.value.code == 2
    assert "'2' is below 4 bytes, one fp32 element; use e.g. 4M." in capsys.readouterr().err
