"""``autopar run`` is torchrun with a plan: every torchrun flag in both spellings, the
launch decided from the plan where torchrun's user would decide it, and torchrun's own
refusals (asserts and bare ValueErrors) as one line."""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from parity import LOSS_ATOL, make_plan, reference
from torch.distributed.run import determine_local_world_size, get_args_parser

import autopar
from autopar.errors import ConfigError
from autopar.runtime.errors import PlanMismatchError
from autopar.runtime.launch import add_run_parser, check_endpoint, torchrun_args

SCRIPT = Path(__file__).parent / "scripts" / "train_gpt.py"
CLI = "import sys; from autopar.cli import main; sys.exit(main(sys.argv[1:]))"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_run_parser(parser.add_subparsers())
    return parser


def _launch(*argv: str, dp: int = 2, tp: int = 1, cluster: autopar.Cluster | None = None) -> argparse.Namespace:
    """torchrun's arguments for ``autopar run ARGV train.py`` under a dp x tp plan (on
    ``cluster``, else one local-cpu node of dp x tp processes)."""
    args = _parser().parse_args(["run", "--plan", "plan.json", *argv, "train.py", "--lr", "1"])
    return torchrun_args(make_plan("gpt", dp=dp, tp=tp, cluster=cluster), args)


DGX_X4 = autopar.preset("dgx-a100-80gb", nodes=4)
"""A cluster of 4 nodes of 8 GPUs: a plan for it runs 32 processes, 8 on each node."""


def test_every_torchrun_flag_is_an_autopar_run_flag_in_every_spelling():
    """The reference is torchrun's own parser: each of its option strings (both the dash
    and the underscore spelling) parses under ``autopar run`` to the same destination."""
    ours = {
        s: a.dest for a in _parser()._subparsers._group_actions[0].choices["run"]._actions for s in a.option_strings
    }
    theirs = {s: a.dest for a in get_args_parser()._actions for s in a.option_strings}
    assert len(theirs) > 50
    assert {s: ours.get(s) for s in theirs} == theirs


def test_underscore_and_dash_spellings_launch_the_same():
    dash = _launch("--nproc-per-node", "2", "--max-restarts", "3", "--local-ranks-filter", "0", "--log-dir", "logs")
    under = _launch("--nproc_per_node", "2", "--max_restarts", "3", "--local_ranks_filter", "0", "--log_dir", "logs")
    assert vars(dash) == vars(under)
    assert dash.max_restarts == 3 and dash.local_ranks_filter == "0" and dash.log_dir == "logs"


def test_the_script_and_its_flags_pass_through_untouched():
    launch = _launch("--tee", "3", "-r", "1")
    assert launch.training_script == "train.py" and launch.training_script_args == ["--lr", "1"]
    assert (launch.tee, launch.redirects) == ("3", "1")


def test_one_node_defaults_to_the_plans_world_size_standalone():
    assert make_plan("gpt", dp=2, tp=2).cluster.nodes == 1
    launch = _launch(dp=2, tp=2)
    assert (launch.nproc_per_node, launch.nnodes, launch.standalone) == ("4", "1", True)


def test_a_plan_for_several_nodes_needs_nnodes_or_nproc_per_node():
    """Neither flag would start all 32 ranks of a 4 x 8 plan on this node: refused, naming
    the plan's nodes and devices per node and both ways on."""
    with pytest.raises(ConfigError) as caught:
        _launch(dp=8, tp=4, cluster=DGX_X4)
    message = str(caught.value)
    assert "\n" not in message
    assert "the plan is for 4 nodes x 8 devices = 32 processes" in message
    assert "pass --nnodes 4 with a rendezvous" in message and "starts 8 processes per node" in message
    assert "--nproc-per-node 32 to run every rank on this machine" in message


def test_nnodes_of_a_multi_node_plan_defaults_nproc_per_node_to_its_devices_per_node():
    launch = _launch("--nnodes", "4", "--rdzv-endpoint", "node0:29400", dp=8, tp=4, cluster=DGX_X4)
    assert (launch.nproc_per_node, launch.nnodes, launch.rdzv_backend, launch.standalone) == ("8", "4", "c10d", False)
    static = _launch("--nnodes", "4", "--master-addr", "node0", "--node-rank", "3", dp=8, tp=4, cluster=DGX_X4)
    assert (static.nproc_per_node, static.nnodes, static.node_rank) == ("8", "4", 3)


def test_nproc_per_node_runs_every_rank_of_a_multi_node_plan_here_deliberately():
    launch = _launch("--nproc-per-node", "32", dp=8, tp=4, cluster=DGX_X4)
    assert (launch.nproc_per_node, launch.nnodes, launch.standalone) == ("32", "1", True)
    with pytest.raises(PlanMismatchError, match=r"--nproc-per-node 8 x --nnodes 1 = 8"):
        _launch("--nproc-per-node", "8", dp=8, tp=4, cluster=DGX_X4)


def test_the_command_refuses_a_multi_node_plan_in_one_line_before_starting(tmp_path, capsys):
    """Through ``autopar``'s entry point: exit 2 and one line. The script does not exist,
    so were the plan not refused the script check would stop the command, not 32 ranks."""
    from autopar.cli import main

    make_plan("gpt", dp=8, tp=4, cluster=DGX_X4).save(tmp_path / "plan.json")
    code = main(["run", "--plan", str(tmp_path / "plan.json"), str(tmp_path / "missing.py")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("autopar: error: the plan is for 4 nodes x 8 devices"), err


def test_an_endpoint_means_c10d_and_master_addr_means_static():
    c10d = _launch("--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", "node0:29400")
    assert (c10d.rdzv_backend, c10d.rdzv_endpoint, c10d.rdzv_id, c10d.standalone) == (
        "c10d",
        "node0:29400",
        "autopar",
        False,
    )
    static = _launch("--nnodes", "2", "--master-addr", "node0", "--master-port", "1234", "--node-rank", "1")
    assert (static.rdzv_backend, static.master_addr, static.master_port, static.node_rank) == (
        "static",
        "node0",
        1234,
        1,
    )
    assert static.nproc_per_node == "1"
    explicit = _launch("--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0")
    assert (explicit.rdzv_backend, explicit.standalone) == ("c10d", False)


def test_nproc_per_node_words_are_read_as_torchrun_reads_them():
    count = determine_local_world_size("cpu")
    if count == 2:
        assert _launch("--nproc-per-node", "cpu").nproc_per_node == "2"
    else:
        with pytest.raises(PlanMismatchError, match=rf"--nproc-per-node {count} \(cpu here\) x --nnodes 1"):
            _launch("--nproc-per-node", "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_nproc_per_node_gpu_without_gpus_is_one_line():
    with pytest.raises(ConfigError, match=r"--nproc-per-node gpu is not allowed here \(Cuda is not available\)") as err:
        _launch("--nproc-per-node", "gpu")
    assert "give a positive integer, or cpu, auto or xpu (what this node has)" in str(err.value)


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (("--nnodes", "1:4"), r"elastic MIN:MAX ranges are not supported"),
        (("--nnodes", "0"), r"--nnodes 0 is not allowed"),
        (("--nnodes", "two"), r"--nnodes two is not allowed"),
        (("--nproc-per-node", "many"), r"--nproc-per-node many is not allowed here \(it is not understood\)"),
        (("--nproc-per-node", "0"), r"--nproc-per-node 0 is not allowed"),
        (("--nnodes", "3"), r"the plan's 2 processes do not divide over --nnodes 3"),
        (("--nnodes", "2", "--nproc-per-node", "1"), r"needs --rdzv-endpoint host:port"),
        (("--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "n0"), r"needs --node-rank \(0 on the node"),
        (
            ("--nnodes", "2", "--nproc-per-node", "1", "--node-rank", "2", "--master-addr", "n0"),
            r"--node-rank 2 is not",
        ),
        (("--max-restarts", "-1"), r"torchrun refuses these arguments: max_restarts must be >= 0"),
        (("--local-ranks-filter", "a,b"), r"torchrun refuses these arguments: --local_ranks_filter must be"),
        (("--redirects", "7"), r"torchrun refuses these arguments"),
        (("--log-dir", __file__), r"torchrun refuses these arguments: log_dir: .* is a file"),
        (("--monitor-interval", "0"), r"--monitor-interval 0 is not allowed: .* give a positive number"),
        (("--signals-to-handle", "SIGTERM,SIGFOO"), r"--signals-to-handle names 'SIGFOO', which is not a signal"),
    ],
)
def test_what_torchrun_would_refuse_with_a_traceback_is_one_line(argv, match):
    with pytest.raises(ConfigError, match=match) as caught:
        _launch(*argv)
    assert "\n" not in str(caught.value)


def test_an_unknown_rendezvous_backend_is_one_line(tmp_path):
    """torchrun reads --rdzv-backend only as its agent starts, and raised a ValueError
    with its traceback; 'autopar run' says it in one line, exit 2, no rank started."""
    make_plan("gpt", dp=2).save(tmp_path / "plan.json")
    command = ["run", "--plan", str(tmp_path / "plan.json"), "--rdzv-backend", "bogus", str(tmp_path / "t.py")]
    (tmp_path / "t.py").write_text("raise SystemExit('no rank should start')\n")
    done = subprocess.run(
        [sys.executable, "-m", "autopar", *command], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .startswith("autopar run: torchrun refuses these arguments: The rendezvous backend 'bogus' is not registered")
    )
    assert "no rank should start" not in done.stderr


def test_a_plan_predicted_not_to_fit_is_not_launched(tmp_path):
    """An estimate saved as it was, predicted at 394 GiB per 80 GiB A100: 'autopar run'
    refuses it in one line before any rank starts (it started every rank), as export
    and time_to_train refuse it."""
    from autopar.models import build_named_model

    with torch.device("meta"):
        model = build_named_model("gpt3-175b")
    plan = autopar.estimate(model, "dgx-a100-80gb:1", {"tp": 8}, global_batch_size=8, seq_len=2048)
    assert not plan.prediction.fits
    plan.save(tmp_path / "plan.json")
    (tmp_path / "t.py").write_text("raise SystemExit('no rank should start')\n")
    command = ["run", "--plan", str(tmp_path / "plan.json"), str(tmp_path / "t.py")]
    done = subprocess.run(
        [sys.executable, "-c", CLI, *command], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr and "no rank" not in done.stderr, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert "the plan does not fit: it predicts" in line and "so it would run out of memory at its first step" in line


def test_a_held_static_master_port_is_refused_like_a_rendezvous_port():
    import socket

    with socket.create_server(("", 0)) as server:
        port = server.getsockname()[1]
        args = _parser().parse_args(
            ["run", "--plan", "p.json", "--master-addr", "127.0.0.1", "--master-port", str(port), "train.py"]
        )
        with pytest.raises(ConfigError, match=f"port {port} on 127.0.0.1 is held by another process.*--master-addr"):
            check_endpoint(args, torchrun_args(make_plan("gpt", dp=2), args))


def test_a_module_needs_no_script_file(tmp_path):
    """``-m`` names a module and ``--no-python`` a program, not a file: the command's
    script check lets them through, and refuses a script path that is not there."""
    from autopar.cli import build_parser, check_run_args

    make_plan("gpt", dp=2).save(tmp_path / "plan.json")
    run = ["run", "--plan", str(tmp_path / "plan.json")]
    check_run_args(build_parser().parse_args([*run, "-m", "mypkg.train"]))
    check_run_args(build_parser().parse_args([*run, "--no-python", "echo"]))
    with pytest.raises(ConfigError, match="training script 'missing.py' does not exist"):
        check_run_args(build_parser().parse_args([*run, "missing.py"]))


@pytest.mark.multiprocess
@pytest.mark.slow
def test_torchrun_flags_reach_torchrun(tmp_path):
    """A real launch with torchrun's flags in underscore spelling and no process count:
    rank 1 fails in the first attempt, ``--max_restarts 1`` restarts the job, which then
    trains to the single-process losses; ``--log_dir`` and ``--redirects`` put each
    attempt's rank output in files."""
    plan = make_plan("gpt", dp=2)
    plan.save(tmp_path / "plan.json")
    out, logs = tmp_path / "losses.json", tmp_path / "logs"
    done = subprocess.run(
        [
            sys.executable, "-c", CLI, "run", "--plan", str(tmp_path / "plan.json"), "--max_restarts", "1",
            "--log_dir", str(logs), "--redirects", "3", "--monitor_interval", "0.5", str(SCRIPT), str(out), "fail-once",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    losses = json.loads(out.read_text())
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor(reference("gpt", plan, steps=3).losses), rtol=0, atol=LOSS_ATOL
    )
    attempts = sorted(p.name for p in logs.glob("*/attempt_*"))
    assert attempts == ["attempt_0", "attempt_1"], attempts
    first = next(logs.glob("*/attempt_0/1/stderr.log")).read_text()
    assert "rank 1 fails on purpose" in first
