"""The command line: ``python -m profiler ...`` and ``add_profile_parser`` for ``autopar profile``."""

import argparse
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from autopar.models import GPT, GPTConfig
from autopar.profiles.report import ProfileReport
from profiler.__main__ import main
from profiler.cli import add_profile_parser, parse_bytes

ROOT = Path(__file__).resolve().parents[2]


def tiny_gpt():
    """A --model-fn target."""
    return GPT(GPTConfig(vocab_size=128, seq_len=32, dim=32, n_layers=2, n_heads=2))


def test_sizes_parse():
    assert [parse_bytes(t) for t in ("4096", "1K", "64M", "256MiB", "1G", "1.5K")] == [
        4096,
        1024,
        64 * 2**20,
        256 * 2**20,
        2**30,
        1536,
    ]
    with pytest.raises(argparse.ArgumentTypeError):
        parse_bytes("lots")


def test_profile_registers_on_autopars_parser():
    parser = argparse.ArgumentParser(prog="autopar")
    add_profile_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["profile", "device", "--sizes", "16,32", "--out", "d.json"])
    assert args.sizes == (16, 32) and callable(args.func)
    for cmd in ("model --model gpt2-small --out m.json", "network --nproc 2 --out n.json", "report a.json"):
        assert callable(parser.parse_args(["profile", *cmd.split()]).func)


def test_model_device_and_report_commands(tmp_path, capsys):
    model_json, device_json = tmp_path / "model.json", tmp_path / "device.json"
    assert (
        main(
            [
                "model",
                "--model-fn",
                "test_cli:tiny_gpt",
                "--seq-len",
                "16",
                "--batch",
                "2",
                "--repeats",
                "3",
                "--no-device",
                "--quiet",
                "--out",
                str(model_json),
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "device",
                "--sizes",
                "16,64",
                "--dtypes",
                "fp32",
                "--array-sizes",
                "64K,1M",
                "--quiet",
                "--out",
                str(device_json),
            ]
        )
        == 0
    )
    model = ProfileReport.load(model_json)
    assert model.measured == ("layers",) and model.layers.model == "test_cli:tiny_gpt"
    assert model.layers.sample_shape == (2, 16) and "--model-fn test_cli:tiny_gpt" in model.layers.provenance.command
    assert len(ProfileReport.load(device_json).device.matmul) == 2
    out = tmp_path / "r" / "report"
    assert (
        main(
            [
                "report",
                str(model_json),
                str(device_json),
                "--html",
                f"{out}.html",
                "--markdown",
                f"{out}.md",
                "--out",
                f"{out}.json",
            ]
        )
        == 0
    )
    assert ProfileReport.load(f"{out}.json").measured == ("device", "layers")
    assert "data:image/png;base64," in Path(f"{out}.html").read_text()
    assert (tmp_path / "r" / "report_files" / "unit_times.png").is_file()
    assert "report_files/unit_times.png" in Path(f"{out}.md").read_text()
    printed = capsys.readouterr().out
    assert "layers: test_cli:tiny_gpt batch 2 x seq 16 fp32" in printed


@pytest.mark.multiprocess
def test_network_on_local_processes(tmp_path):
    out = tmp_path / "net.json"
    assert (
        main(
            [
                "network",
                "--nproc",
                "2",
                "--max-bytes",
                "256K",
                "--factor",
                "16",
                "--repeats",
                "1",
                "--ops",
                "all_reduce,broadcast",
                "--quiet",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    net = ProfileReport.load(out).network
    assert net.world_size == 2 and {s.op for s in net.series} == {"all_reduce", "broadcast"}


def test_errors_are_messages_not_tracebacks(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert main(["network", "--out", str(tmp_path / "n.json")]) == 2
    assert "run under torchrun" in capsys.readouterr().err
    assert main(["model", "--model", "no-such-model", "--out", str(tmp_path / "m.json")]) == 2
    assert "unknown model 'no-such-model'" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "missing.json")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["model", "--model-fn", "test_cli:tiny_gpt", "--out", str(tmp_path / "m.json")]) == 2
    assert "--seq-len" in capsys.readouterr().err
    # an fp16 layer profile of CPU processes, which no plan can use, is refused before measuring
    assert (
        main(
            ["model", "--model", "gpt2-small", "--dtype", "fp16", "--device", "cpu", "--out", str(tmp_path / "m.json")]
        )
        == 2
    )
    assert "--dtype fp16 on cpu is not allowed" in capsys.readouterr().err and not (tmp_path / "m.json").exists()


def test_profiling_more_than_the_machine_holds_is_one_line(tmp_path, capsys):
    """A batch of two billion samples (2 TB of inputs, more than any machine holds): torch's
    allocator refuses it with a RuntimeError, which both command lines (``python -m
    profiler`` and ``autopar profile``) print as one line with what to do, exit 2, where
    it was a traceback."""
    from autopar.cli import main as autopar_main

    argv = ["model", "--model", "moe-tiny", "--seq-len", "128", "--batch", "2000000000", "--no-device"]
    argv += ["--out", str(tmp_path / "m.json")]
    for run, prefix in ((main, "error: "), (lambda a: autopar_main(["profile", *a]), "autopar: error: ")):
        assert run(argv) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"{prefix}this machine ran out of memory (")
        assert "can't allocate memory" in lines[0] and lines[0].endswith("or free memory on this machine.")
    assert not (tmp_path / "m.json").exists()


def test_a_network_profile_larger_than_memory_is_one_line(tmp_path, capsys):
    """4 TiB messages on 2 local processes: each rank's allocation fails; the command
    says so once, in one line, where each rank's traceback was printed."""
    argv = ["network", "--nproc", "2", "--min-bytes", "4096G", "--max-bytes", "4096G", "--ops", "all_reduce", "--quiet"]
    assert main([*argv, "--out", str(tmp_path / "n.json")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: this machine ran out of memory (")
    assert not (tmp_path / "n.json").exists()


def test_only_failed_allocations_are_called_out_of_memory():
    import torch

    from autopar.errors import out_of_memory

    assert out_of_memory(MemoryError()).startswith("this machine ran out of memory (MemoryError); give smaller")
    assert out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")) is not None
    assert out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried")) is not None
    assert out_of_memory(RuntimeError("shape '[2, 3]' is invalid for input of size 5")) is None
    assert out_of_memory(ValueError("can't allocate memory")) is None


@pytest.mark.multiprocess
@pytest.mark.skipif(
    shutil.which("torchrun") is None and not (Path(sys.executable).parent / "torchrun").exists(),
    reason="torchrun not installed",
)
def test_doctor_under_torchrun(tmp_path):
    """The real launcher: torchrun's agent hosts the store (TORCHELASTIC_USE_AGENT_STORE)."""
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [
            torchrun,
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "profiler",
            "doctor",
            "--link-bytes",
            "65536",
            "--out",
            str(tmp_path / "doctor.json"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[ ok ] rendezvous: all 2 ranks joined" in done.stdout and "verdict: ready" in done.stdout


@pytest.mark.multiprocess
@pytest.mark.skipif(
    shutil.which("torchrun") is None and not (Path(sys.executable).parent / "torchrun").exists(),
    reason="torchrun not installed",
)
def test_a_network_profile_refused_on_every_rank_says_so_once(tmp_path):
    """Between-node links only, on one node: every rank finds no group to measure; rank
    0 says why in one line, the others exit with its code without repeating it (each rank
    printed the same error before)."""
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = ["-m", "profiler", "network", "--levels", "inter", "--out", str(tmp_path / "net.json")]
    done = subprocess.run(
        [torchrun, "--standalone", "--nproc-per-node", "2", *command],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=ROOT,
    )
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, done.stderr
    assert "no group of >= 2 ranks at levels ('inter',)" in errors[0] and "choose other levels" in errors[0]
    assert not (tmp_path / "net.json").exists()


@pytest.mark.multiprocess
def test_a_rank_whose_peers_never_join_says_so_in_one_line(tmp_path):
    """Rank 0 of 2 started alone under torchrun's environment: after --timeout it names
    itself, the rendezvous address and what to check, exit 2, where the store's
    traceback was printed."""
    with socket.socket() as probe:  # a port nothing listens on now
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "WORLD_SIZE": "2",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    command = [sys.executable, "-m", "profiler", "network", "--timeout", "3", "--out", str(tmp_path / "net.json")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(
        f"error: rank 0 of 2 could not join the process group at 127.0.0.1:{port} within --timeout 3 s"
    )
    assert line.endswith("or raise --timeout.") and not (tmp_path / "net.json").exists()
