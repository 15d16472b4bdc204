"""The GPU loop's script runs end to end before a GPU is lent: its CPU path (a tiny
model, eager, one process) profiles, plans, trains and writes its table. It runs as a
user runs it, in a process of its own: a gloo group made in the test process would
leave gloo's cached device to the ranks later tests fork."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(600)
def test_the_gpu_loop_runs_on_cpu_with_a_tiny_model(tmp_path):
    argv = ["--device", "cpu", "--tiny", "--steps", "2", "--warmup", "1", "--out", str(tmp_path)]
    done = subprocess.run(
        [sys.executable, "benchmarks/gpu_loop.py", *argv], cwd=ROOT, capture_output=True, text=True, timeout=540
    )
    assert done.returncode == 0, done.stderr[-2000:]
    with open(tmp_path / "gpu_loop.csv") as f:
        (row,) = list(csv.DictReader(f))
    assert row["variant"] == "eager"
    assert float(row["predicted step (ms)"]) > 0 and float(row["measured step (ms)"]) > 0
    assert len(row["steps (ms)"].split()) == 2
    assert (tmp_path / "gpu_profile.json").exists()
    assert "| eager |" in (tmp_path / "gpu_loop.md").read_text()
