"""The GPU loop's script runs end to end before a GPU is lent: its CPU path (a tiny
model, eager, one process) profiles, plans, trains and writes its table."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.timeout(600)
def test_the_gpu_loop_runs_on_cpu_with_a_tiny_model(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setattr(sys, "argv", ["gpu_loop.py"])
    monkeypatch.setenv("MASTER_PORT", "29631")
    import gpu_loop

    rows = gpu_loop.main(["--device", "cpu", "--tiny", "--steps", "2", "--warmup", "1", "--out", str(tmp_path)])
    assert [r["variant"] for r in rows] == ["eager"]
    assert float(rows[0]["predicted step (ms)"]) > 0 and float(rows[0]["measured step (ms)"]) > 0
    assert len(rows[0]["steps (ms)"].split()) == 2
    assert (tmp_path / "gpu_profile.json").exists()
    with open(tmp_path / "gpu_loop.csv") as f:
        assert [r["variant"] for r in csv.DictReader(f)] == ["eager"]
    assert "| eager |" in (tmp_path / "gpu_loop.md").read_text()
