"""``autopar run`` fails fast and loud: a rendezvous endpoint it cannot bind or reach is
refused in one line before launching, Ctrl-C stops every rank and exits 130 after one
line, and the summary of a failed rank always names it and its error (exit code, signal
or recorded exception)."""

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from parity import make_plan
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, ProcessFailure

import autopar
from autopar.errors import ConfigError
from autopar.plan import Plan
from autopar.runtime import orphan
from autopar.runtime.launch import (
    PLAN_ENV,
    TIMEOUT_ENV,
    add_run_parser,
    check_endpoint,
    describe_failures,
    run_command,
    torchrun_args,
)

SCRIPTS = Path(__file__).parent / "scripts"
CLI = "import sys; from autopar.cli import main; sys.exit(main(sys.argv[1:]))"
TORCH_LOG = re.compile(r"^[DIWEF]\d{4} \d\d:\d\d:\d\d")
"""A record of torch's own logging (``W1201 22:53:04.453000 28189 torch/...``)."""


def _run_args(*argv: str, plan: str = "plan.json") -> argparse.Namespace:
    """``autopar run`` arguments as the command parses them."""
    parser = argparse.ArgumentParser()
    add_run_parser(parser.add_subparsers())
    return parser.parse_args(["run", "--plan", plan, *argv, "train.py"])


@contextlib.contextmanager
def _held_port():
    """A port this process listens on, as another program's server would."""
    with socket.create_server(("", 0)) as server:
        yield server.getsockname()[1]


def _free_port() -> int:
    """A port nothing listens on (free a moment ago)."""
    with socket.create_server(("", 0)) as server:
        return server.getsockname()[1]


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def _cli(*argv: str) -> subprocess.CompletedProcess:
    """The ``autopar`` command itself, stdout and stderr together."""
    return subprocess.run(
        [sys.executable, "-c", CLI, *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60
    )


def _plan(tmp_path: Path) -> str:
    path = tmp_path / "plan.json"
    make_plan("gpt", dp=2).save(path)
    return str(path)


def _connect_fails(port: int) -> bool:
    """Whether nothing accepts connections on ``port`` here."""
    try:
        socket.create_connection(("localhost", port), timeout=1).close()
    except OSError:
        return True
    return False


def _check(tmp_path: Path, *argv: str) -> None:
    """The rendezvous check ``autopar run`` makes for ``argv`` under a 2-process plan."""
    args = _run_args(*argv, plan=_plan(tmp_path))
    check_endpoint(args, torchrun_args(Plan.load(args.plan), args))


def _node_of_two(node_rank: int, endpoint: str) -> tuple[str, ...]:
    """``autopar run`` flags of one process on node ``node_rank`` of two meeting at ``endpoint``."""
    return ("--nproc-per-node", "1", "--nnodes", "2", "--node-rank", str(node_rank), "--rdzv-endpoint", endpoint)


def _run_command_raising(monkeypatch, tmp_path, exc: BaseException, *argv: str) -> int:
    """``autopar run`` with torchrun's ``run`` raising ``exc``; the environment it sets for
    the ranks is undone afterwards."""
    import torch.distributed.run

    def run(_args):
        raise exc

    monkeypatch.setattr(torch.distributed.run, "run", run)
    for name in (PLAN_ENV, TIMEOUT_ENV, orphan.LAUNCHER_ENV):
        monkeypatch.setenv(name, "")
    return run_command(_run_args(*argv, plan=_plan(tmp_path)))


# -- the rendezvous endpoint ------------------------------------------------------------


def test_a_held_port_is_refused_naming_it_and_its_process(tmp_path):
    with _held_port() as port:
        with pytest.raises(ConfigError) as caught:
            _check(tmp_path, "--nproc-per-node", "2", "--rdzv-endpoint", f"localhost:{port}")
    message = str(caught.value)
    assert f"rendezvous port {port} on localhost is held by another process (pid {os.getpid()}," in message
    assert "omit --rdzv-endpoint" in message and "\n" not in message


def test_a_held_port_on_node_0_asks_for_another_port_on_every_node(tmp_path):
    with _held_port() as port:
        with pytest.raises(ConfigError, match="pass another port on every node"):
            _check(tmp_path, *_node_of_two(0, f"127.0.0.1:{port}"))


def test_a_free_port_and_standalone_pass(tmp_path):
    _check(tmp_path, "--nproc-per-node", "2", "--rdzv-endpoint", f"localhost:{_free_port()}")
    _check(tmp_path, "--nproc-per-node", "2")


def test_an_endpoint_nobody_serves_is_refused_after_the_wait(tmp_path):
    port = _free_port()
    with pytest.raises(ConfigError, match=f"endpoint localhost:{port} could not be reached within 0.5 s"):
        _check(tmp_path, *_node_of_two(1, f"localhost:{port}"), "--rdzv-wait-s", "0.5")


def test_a_reachable_endpoint_passes_on_another_node(tmp_path):
    with _held_port() as port:
        _check(tmp_path, *_node_of_two(1, f"localhost:{port}"))


@pytest.mark.parametrize(
    ("endpoint", "match"),
    [("localhost:http", "must be host:port"), ("no-such-host.invalid:29400", "does not resolve")],
)
def test_a_bad_endpoint_is_refused(tmp_path, endpoint, match):
    with pytest.raises(ConfigError, match=match):
        _check(tmp_path, "--nproc-per-node", "1", "--nnodes", "2", "--rdzv-endpoint", endpoint)


def test_autopar_run_on_a_held_port_fails_in_one_line(tmp_path):
    """The reported hang: torchrun connected to the other process's port as a client and
    waited for its answer without a word."""
    plan = _plan(tmp_path)
    with _held_port() as port:
        done = _cli(
            "run", "--plan", plan, "--nproc-per-node", "2", "--rdzv-endpoint", f"localhost:{port}",
            str(SCRIPTS / "wait_in_barriers.py"), str(tmp_path),
        )  # fmt: skip
    assert done.returncode == 2, done.stdout[-3000:]
    assert _lines(done.stdout) == [
        f"autopar run: error: the rendezvous port {port} on localhost is held by another process "
        f"(pid {os.getpid()}, {Path(f'/proc/{os.getpid()}/comm').read_text().strip()}); omit --rdzv-endpoint (one "
        f"node then picks a free port itself), pass another port, or stop that process."
    ]


def test_autopar_run_on_another_node_fails_in_one_line_when_node_0_never_comes(tmp_path):
    port = _free_port()
    done = _cli(
        "run", "--plan", _plan(tmp_path), "--nproc-per-node", "1", "--nnodes", "2", "--node-rank", "1",
        "--rdzv-endpoint", f"localhost:{port}", "--rdzv-wait-s", "1", str(SCRIPTS / "wait_in_barriers.py"),
        str(tmp_path),
    )  # fmt: skip
    assert done.returncode == 2
    [line] = _lines(done.stdout)
    assert line.startswith(f"autopar run: error: the rendezvous endpoint localhost:{port} could not be reached")


def test_a_rendezvous_torchrun_gives_up_on_is_one_line(monkeypatch, tmp_path, capsys):
    """An endpoint that answers but is no rendezvous store (seen: a proxy answering for a
    remote address) fails in torch after its 60 s read timeout, with a traceback."""
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError

    exc = RendezvousConnectionError("The connection to the C10d store has failed. See inner exception for details.")
    exc.__cause__ = RuntimeError("Ping failed, invalid value returned from server. Expected: 8097, Got: 1347703880")
    with _held_port() as port:  # node 0's store, as far as the check before launching sees
        node_1 = ["--nproc-per-node", "1", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", f"localhost:{port}"]
        assert _run_command_raising(monkeypatch, tmp_path, exc, *node_1) == 2
    waiting, line = _lines(capsys.readouterr().err)
    assert waiting == _waiting(f"localhost:{port}")
    assert line.startswith(
        f"autopar run: RendezvousConnectionError: the rendezvous through localhost:{port} failed (Ping failed, invalid"
    )


# -- Ctrl-C -----------------------------------------------------------------------------


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, killed but not yet reaped, counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    with contextlib.suppress(OSError):
        return not stat.read_text().split(") ")[-1].startswith("Z")
    return False


@pytest.mark.multiprocess
@pytest.mark.slow
def test_ctrl_c_stops_every_rank_and_exits_130_in_one_line(tmp_path):
    script = SCRIPTS / "wait_in_barriers.py"
    argv = ["run", "--plan", _plan(tmp_path), "--nproc-per-node", "2", str(script), str(tmp_path)]
    log = tmp_path / "output.txt"
    pids: list[int] = []
    with log.open("w") as out:
        launcher = subprocess.Popen([sys.executable, "-c", CLI, *argv], stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while len(pids) < 2 and time.monotonic() < deadline and launcher.poll() is None:
            pids = [int(p.read_text()) for p in tmp_path.glob("rank-*.pid") if p.read_text()]
            time.sleep(0.1)
        assert len(pids) == 2, log.read_text()[-3000:]
        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(timeout=60) == 130, log.read_text()[-3000:]
        output = log.read_text()
        ours = [line for line in _lines(output) if not TORCH_LOG.match(line)]
        assert ours == ["autopar run: interrupted; all 2 ranks stopped"], output[-3000:]
        assert "Traceback" not in output and "KeyboardInterrupt" not in output
        assert not [p for p in pids if _alive(p)], "a rank outlived Ctrl-C"
    finally:
        (tmp_path / "stop").write_text("")
        launcher.kill()
        launcher.wait()
        for p in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)


def test_a_rank_prints_no_traceback_for_ctrl_c_but_for_any_other_error():
    seen = []
    hook = orphan._quiet_on_interrupt(lambda kind, value, tb: seen.append(kind))
    hook(KeyboardInterrupt, KeyboardInterrupt(), None)
    hook(ValueError, ValueError("x"), None)
    assert seen == [ValueError]


def _waiting(endpoint: str) -> str:
    """The line a launcher of a two-node plan says before it waits for the other node."""
    return (
        f"autopar run: waiting at {endpoint} until all 2 nodes join (start 'autopar run' with the same --nnodes and "
        f"rendezvous on each); the ranks start then"
    )


def test_ctrl_c_while_waiting_for_the_other_nodes_exits_130_in_one_line(tmp_path):
    """Before the ranks start torch handles no signal: Ctrl-C is a KeyboardInterrupt in
    the rendezvous, here node 0 waiting for a node 1 that never comes."""
    port = _free_port()
    argv = [
        "run", "--plan", _plan(tmp_path), "--nproc-per-node", "1", "--nnodes", "2", "--node-rank", "0",
        "--rdzv-endpoint", f"localhost:{port}", str(SCRIPTS / "wait_in_barriers.py"), str(tmp_path),
    ]  # fmt: skip
    launcher = subprocess.Popen(
        [sys.executable, "-c", CLI, *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 60
        while _connect_fails(port) and time.monotonic() < deadline and launcher.poll() is None:
            time.sleep(0.1)
        launcher.send_signal(signal.SIGINT)
        output, _ = launcher.communicate(timeout=60)
        assert launcher.returncode == 130, output[-3000:]
        assert [line for line in _lines(output) if not TORCH_LOG.match(line)] == [
            _waiting(f"localhost:{port}"),
            "autopar run: interrupted before any rank started",
        ], output[-3000:]
    finally:
        launcher.kill()
        launcher.wait()


def test_sigterm_stops_the_ranks_and_exits_143_in_one_line(monkeypatch, tmp_path, capsys):
    from torch.distributed.elastic.multiprocessing.api import SignalException

    exc = SignalException("Process 1 got signal: 15", sigval=signal.SIGTERM)
    assert _run_command_raising(monkeypatch, tmp_path, exc, "--nproc-per-node", "2") == 143
    assert _lines(capsys.readouterr().err) == ["autopar run: stopped by SIGTERM; all 2 ranks stopped"]


# -- the failure summary ----------------------------------------------------------------


def _failure(tmp_path: Path, exitcode: int, error: BaseException | None = None, local_rank: int = 1) -> ProcessFailure:
    """torch's record of a rank that ended with ``exitcode``; with ``error``, recorded as
    ``@record`` records it."""
    error_file = tmp_path / f"error-{local_rank}.json"
    if error is not None:
        with pytest.MonkeyPatch.context() as env:
            env.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
            try:
                raise error
            except type(error) as exc:
                ErrorHandler().record_exception(exc)
        assert "message" in json.loads(error_file.read_text())
    return ProcessFailure(local_rank=local_rank, pid=1000 + local_rank, exitcode=exitcode, error_file=str(error_file))


@pytest.mark.parametrize(
    ("exitcode", "error", "expected"),
    [
        (1, ValueError("bad value"), "failed with exit code 1: ValueError: bad value"),
        (1, RuntimeError(), "failed with exit code 1: RuntimeError (no message)"),
        (1, RuntimeError(""), "failed with exit code 1: RuntimeError (no message)"),
        (1, RuntimeError("\nsecond line"), "failed with exit code 1: RuntimeError: second line"),
        (-signal.SIGABRT, RuntimeError("abort"), "failed with signal SIGABRT: RuntimeError: abort"),
        (3, None, "failed with exit code 3 (no Python error recorded; see its output above)"),
        (1, None, "failed with exit code 1 (no Python error recorded; see its output above)"),
        (-signal.SIGKILL, None, "failed with signal SIGKILL (no Python error recorded; see its output above)"),
        (-77, None, "failed with signal 77 (no Python error recorded; see its output above)"),
    ],
)
def test_the_summary_names_the_rank_and_its_error(tmp_path, exitcode, error, expected):
    assert describe_failures({3: _failure(tmp_path, exitcode, error)}) == f"rank 3 (local rank 1) {expected}"


def test_the_summary_leaves_out_the_ranks_the_launcher_stopped(tmp_path):
    stopped = _failure(tmp_path, -signal.SIGTERM, local_rank=0)
    failed = _failure(tmp_path, 1, ValueError("bad value"), local_rank=1)
    assert (
        describe_failures({0: stopped, 1: failed})
        == "rank 1 (local rank 1) failed with exit code 1: ValueError: bad value"
    )
    assert describe_failures({0: stopped}) == (
        "rank 0 (local rank 0) failed with signal SIGTERM (no Python error recorded; see its output above)"
    )


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("exit-3", "failed with exit code 3 (no Python error recorded; see its output above)"),
        ("os-exit-4", "failed with exit code 4 (no Python error recorded; see its output above)"),
        ("sigkill", "failed with signal SIGKILL (no Python error recorded; see its output above)"),
        ("empty-message", "failed with exit code 1: RuntimeError (no message)"),
    ],
)
def test_autopar_run_names_the_rank_however_it_failed(tmp_path, mode, expected):
    done = _cli("run", "--plan", _plan(tmp_path), "--nproc-per-node", "2", str(SCRIPTS / "fail_as.py"), mode)
    assert done.returncode == 1, done.stdout[-3000:]
    summary = [line for line in _lines(done.stdout) if line.startswith("autopar run:")]
    assert summary == [f"autopar run: rank 1 (local rank 1) {expected}"], done.stdout[-3000:]


@pytest.mark.parametrize(
    "fixed, cluster, refusal",
    [
        (
            {"dp": 1, "tp": 2, "pp": 1, "sequence_parallel": True, "regather": True, "compile": True},
            ("local-cpu", {"devices_per_node": 2}),
            "regather=True with compile=True is priced for Megatron-LM",
        ),
        (
            {"dp": 8, "tp": 1, "pp": 1, "fp8": True, "compile": False},
            ("dgx-h100", {"nodes": 1}),
            "fp8=True priced for Megatron-LM's kernels",
        ),
    ],
    ids=["kept-shards-compiled", "fp8-inputs-in-fp8"],
)
def test_a_plan_the_runtime_cannot_run_is_refused_before_any_rank_starts(
    tmp_path, monkeypatch, capsys, fixed, cluster, refusal
):
    """Plans priced for Megatron-LM's kernels that autopar's runtime would not run as
    priced (kept gather shards on compiled blocks; FP8 layers keeping their inputs in
    FP8): ``autopar run`` refuses the plan in one line, exit 2, without launching
    (torchrun's ``run`` raises if it is called)."""
    import torch.distributed.run

    from autopar.graph import extract
    from autopar.models import GPT, GPTConfig

    graph = extract(GPT(GPTConfig(vocab_size=256, seq_len=64, dim=64, n_layers=2, n_heads=4)), seq_len=64)
    devices = fixed["dp"] * fixed["tp"]
    preset = autopar.preset(cluster[0], **cluster[1])
    plan = autopar.estimate(graph, preset, fixed, global_batch_size=fixed["dp"] * 2, activations="sequence-first")
    path = tmp_path / "plan.json"
    plan.save(path)

    def run(_args):
        raise AssertionError("launched")

    monkeypatch.setattr(torch.distributed.run, "run", run)
    assert run_command(_run_args("--nproc-per-node", str(devices), plan=str(path))) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"autopar run: error: {refusal}")
    assert "\n" not in err
