"""Shared helpers for benchmark scripts: the environment line, dated result files, and
the rank correlation the measured benchmarks report."""

from __future__ import annotations

import csv
import datetime
import functools
import platform
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


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
    return (
        f"Python {platform.python_version()}, torch {torch.__version__}, pulp {pulp.__version__}, highspy {highs}; "
        f"{cpu}, {_cores()} cores"
    )


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


RESULTS = Path(__file__).parent / "results"


def result_path(name: str, suffix: str) -> Path:
    """``benchmarks/results/<name>_<today><suffix>``, or ``<name>_<today>-2<suffix>`` and
    on where a file of this script's run of that day is there already: a second run of a
    day never overwrites the first, whose notes may have been written by hand. One tag
    per script run, whatever names it writes (``planner_exact`` and
    ``planner_exact_parts``), so its Markdown, CSV and pictures stay together."""
    day = datetime.date.today().isoformat()
    return RESULTS / f"{name}_{day}{_run_tag(Path(sys.argv[0]).stem, day)}{suffix}"


@functools.cache  # once per run: every file of one run shares its tag
def _run_tag(family: str, day: str) -> str:
    return free_tag(RESULTS, family, day)


def free_tag(folder: Path, family: str, day: str) -> str:
    """``""``, or ``-2``, ``-3``...: the first that no file of ``folder`` whose name
    starts with ``family`` has after its ``_<day>`` (before a ``.`` or ``_``)."""
    names = [p.name for p in folder.glob(f"{family}*_{day}*")]
    n = 1
    while any(re.search(rf"_{re.escape(day + _tag(n))}[._]", name) for name in names):
        n += 1
    return _tag(n)


def _tag(n: int) -> str:
    return "" if n == 1 else f"-{n}"


def command() -> str:
    """The command line that ran this script, as a user would type it from the repository root."""
    return "python " + " ".join(["benchmarks/" + Path(sys.argv[0]).name, *sys.argv[1:]])


def write_result(name: str, title: str, body: str, path: Path | None = None) -> Path:
    """Write ``benchmarks/results/<name>_<date>.md`` (or ``path``) with the command and
    environment."""
    path = path or result_path(name, ".md")
    today = datetime.date.today().isoformat()
    path.write_text(f"# {title}\n\nDate: {today}  \nCommand: `{command()}`  \nEnvironment: {environment()}\n\n{body}\n")
    return path


def write_csv(name: str, rows: Sequence[Mapping[str, Any]]) -> Path:
    """Write ``benchmarks/results/<name>_<date>.csv``: one row per mapping, the columns
    in the order the first row gives them (later rows may not add columns)."""
    path = result_path(name, ".csv")
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else [])
        writer.writeheader()
        writer.writerows(rows)
    return path


def markdown_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """A Markdown table of ``rows``, the columns in the order the first row gives them:
    the same rows :func:`write_csv` writes, so the Markdown and the CSV never disagree."""
    if not rows:
        return ""
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(row[c]) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def write_png(name: str, fig: Any) -> Path:
    """Save a matplotlib figure as ``benchmarks/results/<name>_<date>.png``."""
    path = result_path(name, ".png")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks of ``values``, ties sharing the mean of the ranks they span."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Spearman's rank correlation: Pearson's correlation of the ranks (ties averaged,
    so it equals ``1 - 6 sum d^2 / (n (n^2 - 1))`` when there are none). NaN when
    either side has fewer than two distinct values."""
    if len(xs) != len(ys):
        raise ValueError(f"spearman: {len(xs)} predicted values against {len(ys)} measured; give pairs.")
    rx, ry = ranks(xs), ranks(ys)
    n = len(rx)
    if n < 2:
        return float("nan")
    mx, my = sum(rx) / n, sum(ry) / n
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    vx = sum((a - mx) ** 2 for a in rx)
    vy = sum((b - my) ** 2 for b in ry)
    return cov / (vx * vy) ** 0.5 if vx > 0 and vy > 0 else float("nan")
