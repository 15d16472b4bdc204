"""The launcher: ``autopar run`` through torchrun (real processes, env-var rendezvous)
and ``autopar dry-run`` of plans for 64 ranks on this machine."""

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from parity import LOSS_ATOL, make_plan, reference

import autopar
from autopar.graph.units import model_fingerprint
from autopar.models import build_named_model
from autopar.present.units import count
from autopar.runtime import orphan
from autopar.runtime.dry_run import dry_run
from autopar.runtime.dry_run_cli import add_dry_run_parser
from autopar.runtime.launch import add_run_parser

SCRIPT = Path(__file__).parent / "scripts" / "train_gpt.py"


def _cli(*argv: str) -> subprocess.CompletedProcess:
    """Run the two sub-commands as the lead's cli.py will: a parser with both registered."""
    code = (
        "import argparse, sys; from autopar.runtime.launch import add_run_parser; "
        "from autopar.runtime.dry_run_cli import add_dry_run_parser; "
        "p = argparse.ArgumentParser(prog='autopar'); s = p.add_subparsers(required=True); "
        "add_run_parser(s); add_dry_run_parser(s); a = p.parse_args(sys.argv[1:]); sys.exit(a.func(a))"
    )
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=180)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_autopar_run_trains_under_torchrun(tmp_path):
    plan = make_plan("gpt", dp=2)
    plan.save(tmp_path / "plan.json")
    out = tmp_path / "losses.json"
    done = _cli("run", "--plan", str(tmp_path / "plan.json"), "--nproc-per-node", "2", str(SCRIPT), str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    losses = json.loads(out.read_text())
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor(reference("gpt", plan, steps=3).losses), rtol=0, atol=LOSS_ATOL
    )


@pytest.mark.multiprocess
@pytest.mark.slow
def test_autopar_run_names_the_failed_rank(tmp_path):
    plan = make_plan("gpt", dp=2)
    plan.save(tmp_path / "plan.json")
    start = time.monotonic()
    done = _cli(
        "run",
        "--plan",
        str(tmp_path / "plan.json"),
        "--nproc-per-node",
        "2",
        "--pg-timeout-s",
        "20",
        str(SCRIPT),
        str(tmp_path / "losses.json"),
        "fail",
    )
    assert done.returncode == 1
    # the rank exits with code 1, or, when gloo's threads are torn down mid-collective
    # under load, with SIGABRT (seen once in CI); either way the launcher names it and its error
    assert re.search(
        r"rank 1 \(local rank 1\) failed with (exit code 1|signal SIGABRT): "
        r"RuntimeError: rank 1 fails on purpose",
        done.stderr,
    ), done.stderr[-3000:]
    assert time.monotonic() - start < 90


def test_autopar_run_refuses_another_world_size(tmp_path):
    make_plan("gpt", dp=2, tp=2).save(tmp_path / "plan.json")
    done = _cli("run", "--plan", str(tmp_path / "plan.json"), "--nproc-per-node", "2", str(SCRIPT), "x")
    assert done.returncode == 2
    assert done.stderr.startswith("autopar run: error: the plan runs on") and "= 4 processes" in done.stderr


def test_parsers_register_their_commands():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    add_run_parser(sub)
    add_dry_run_parser(sub)
    args = parser.parse_args(
        [
            "run",
            "--plan",
            "p.json",
            "--nproc-per-node",
            "8",
            "--nnodes",
            "2",
            "--rdzv-endpoint",
            "node0:29400",
            "train.py",
            "--lr",
            "3e-4",
        ]
    )
    assert args.training_script == "train.py" and args.training_script_args == ["--lr", "3e-4"]
    assert args.nnodes == "2" and args.nproc_per_node == "8"
    args = parser.parse_args(["dry-run", "--plan", "p.json", "--model", "gpt3-175b"])
    assert args.model == "gpt3-175b"


def _big_plan(**config):
    cluster = autopar.preset("dgx-a100-80gb", nodes=8)
    base = {"micro_batch_size": 1, "num_microbatches": 16, "sequence_parallel": True}
    return autopar.estimate(
        build_named_model("gpt3-175b"), cluster, {**base, **config}, global_batch_size=16, seq_len=2048
    )


def _expected_param_bytes(model, plan, pipeline_rank):
    """fp32 bytes a rank of ``pipeline_rank`` holds, from the plan's styles alone: column
    splits a weight and its bias, row a weight (its bias stays whole), vocab an
    embedding's rows; everything else is replicated on the tensor-parallel ranks."""
    tp, styles, total = plan.config.tp, plan.layer_strategies.tp, 0
    for index in plan.stage_of_rank(pipeline_rank):
        for unit in plan.stages[index]:
            for name, p in model.get_submodule(unit).named_parameters():
                leaf = f"{unit}.{name}".rsplit(".", 1)[0]
                style = styles.get(leaf, autopar.TPStyle.REPLICATE)
                split = style in (autopar.TPStyle.COLUMN, autopar.TPStyle.VOCAB) or (
                    style is autopar.TPStyle.ROW and name.endswith("weight")
                )
                total += 4 * (p.numel() // tp if split else p.numel())
    return total


def test_dry_run_of_gpt3_175b_on_64_ranks():
    """tp=8 x pp=8 with ZeRO-1 (parameters not sharded over dp): what each pipeline
    rank's first rank holds, measured on the DTensor shards parallelize made, equals
    what the plan's styles imply."""
    plan = _big_plan(dp=1, tp=8, pp=8, zero_stage=1)
    report = dry_run(lambda: build_named_model("gpt3-175b"), plan)
    assert report.ok, report.problems
    assert [r.coordinate for r in report.ranks] == [(p, 0, 0, 0) for p in range(8)]  # (pp, dp, cp, tp)
    model = build_named_model("gpt3-175b")
    assert [r.param_bytes for r in report.ranks] == [_expected_param_bytes(model, plan, p) for p in range(8)]
    assert all(r.predicted_param_bytes > 0 for r in report.ranks)


def test_dry_run_refuses_a_plan_for_another_model_in_one_line_as_export_does(tmp_path, capsys):
    """A plan for GPT-2 small dry-run with GPT-2 medium: one line naming both fingerprints,
    exit 2, what ``autopar export`` says of the same mistake but for its advice (a dry
    run needs a model: it cannot take none), and no report (it had listed a problem for
    every unit and layer, the real cause near the end)."""
    from autopar.cli import main

    plan_file = tmp_path / "plan.json"
    cpu = ["--cluster", "local-cpu:1", "--seq-len", "16", "--global-batch-size", "8"]
    assert main(["plan", "--model", "gpt2-small", *cpu, "--out", str(plan_file)]) == 0
    capsys.readouterr()
    assert main(["dry-run", "--plan", str(plan_file), "--model", "gpt2-medium"]) == 2
    dry = capsys.readouterr()
    assert main(["export", str(plan_file), "--to", "megatron", "--model", "gpt2-medium"]) == 2
    export = capsys.readouterr()
    assert dry.out == "" and dry.err.count("\n") == 1, dry
    assert dry.err.endswith("; pass the plan's model.\n") and export.err.endswith("; pass the plan's model, or none.\n")
    assert dry.err.rsplit(";", 1)[0] == export.err.rsplit(";", 1)[0]
    medium_model = build_named_model("gpt2-medium")
    medium = model_fingerprint(medium_model)
    planned = autopar.Plan.load(plan_file).model
    small = planned.fingerprint
    assert medium != small
    sizes = count(sum(p.numel() for p in medium_model.parameters())), count(planned.num_params)
    assert dry.err.startswith(
        f"autopar: error: the model given (GPT, {sizes[0]} parameters, fingerprint {medium}) is not "
    ), dry
    assert f"the plan was made for (GPT, {sizes[1]} parameters, fingerprint {small})" in dry.err
    assert main(["dry-run", "--plan", str(plan_file), "--model", "gpt2-small"]) == 0  # the plan's own model
    assert ": OK" in capsys.readouterr().out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (killed, not yet reaped by anyone) counts as gone
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(") ")[-1].startswith("Z"))


@pytest.mark.multiprocess
@pytest.mark.slow
def test_the_ranks_end_when_the_launcher_is_killed(tmp_path):
    """SIGKILL of ``autopar run`` itself (a scheduler's or the OOM killer's) reaches no
    handler, and torch's agent starts each rank in its own session: the ranks notice
    they were re-parented and end within seconds (autopar.runtime.orphan)."""
    plan = make_plan("gpt", dp=2)
    plan.save(tmp_path / "plan.json")
    script = Path(__file__).parent / "scripts" / "wait_in_barriers.py"
    code = (
        "import argparse, sys; from autopar.runtime.launch import add_run_parser; "
        "p = argparse.ArgumentParser(prog='autopar'); s = p.add_subparsers(required=True); "
        "add_run_parser(s); a = p.parse_args(sys.argv[1:]); sys.exit(a.func(a))"
    )
    argv = ["run", "--plan", str(tmp_path / "plan.json"), "--nproc-per-node", "2", str(script), str(tmp_path)]
    launcher = subprocess.Popen([sys.executable, "-c", code, *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 90
        while len(pids) < 2 and time.monotonic() < deadline and launcher.poll() is None:
            pids = [int(p.read_text()) for p in tmp_path.glob("rank-*.pid") if p.read_text()]
            time.sleep(0.2)
        assert len(pids) == 2, launcher.stderr.read().decode()[-3000:] if launcher.poll() is not None else pids
        assert all(_alive(p) for p in pids)
        launcher.kill()
        launcher.wait()
        gone_by = time.monotonic() + 10 * orphan.POLL_S
        while any(_alive(p) for p in pids) and time.monotonic() < gone_by:
            time.sleep(0.1)
        assert not any(_alive(p) for p in pids), "a rank outlived its launcher"
    finally:
        (tmp_path / "stop").write_text("")
        launcher.kill()
        for p in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
