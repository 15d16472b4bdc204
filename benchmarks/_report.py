"""Shared helpers for benchmark scripts: the environment line and dated result files."""

from __future__ import annotations

import datetime
import platform
import sys
from pathlib import Path


def environment() -> str:
    """Python, torch, pulp, highspy versions and the machine."""
    import highspy  # noqa: F401 - only for its version
    import pulp
    import torch

    try:
        from importlib.metadata import version
        highs = version("highspy")
    except Exception:  # metadata missing: say so rather than guess
        highs = "unknown"
    cpu = platform.processor() or platform.machine()
    return (f"Python {platform.python_version()}, torch {torch.__version__}, pulp {pulp.__version__}, highspy {highs}; "
            f"{cpu}, {_cores()} cores")


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def write_result(name: str, title: str, body: str) -> Path:
    """Write ``benchmarks/results/<name>_<date>.md`` with the command and environment."""
    today = datetime.date.today().isoformat()
    path = Path(__file__).parent / "results" / f"{name}_{today}.md"
    command = "python " + " ".join(["benchmarks/" + Path(sys.argv[0]).name, *sys.argv[1:]])
    path.write_text(f"# {title}\n\nDate: {today}  \nCommand: `{command}`  \nEnvironment: {environment()}\n\n{body}\n")
    return path
