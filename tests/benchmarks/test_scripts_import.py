"""Every benchmark script imports: a script's helpers moving between modules must not
leave it unable to start (planner_exact.py once imported a test helper that had moved)."""

import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_every_benchmark_script_imports():
    names = sorted(p.stem for p in BENCHMARKS.glob("*.py"))
    assert "planner_exact" in names and "planner_faithful" in names
    code = "import importlib, sys; sys.path.insert(0, sys.argv[1]); [importlib.import_module(n) for n in sys.argv[2:]]"
    done = subprocess.run(
        [sys.executable, "-c", code, str(BENCHMARKS), *names], capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-2000:]
