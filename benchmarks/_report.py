"""Shared helpers for benchmark scripts: the environment line, dated result files, and
the rank correlation the measured benchmarks report."""

from __future__ import annotations

import csv
import datetime
import functools
import platform
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
    on where a file of that stem is there already: a second run of a day never overwrites
    the first, whose notes may have been written by hand. One stem per script run, so its
    Markdown, CSV and pictures stay together."""
    return RESULTS / f"{_run_stem(name, datetime.date.today().isoformat())}{suffix}"


@functools.cache  # once per run: every file of one run shares its stem
def _run_stem(name: str, day: str) -> str:
    return free_stem(RESULTS, name, day)


def free_stem(folder: Path, name: str, day: str) -> str:
    """``<name>_<day>``, numbered from 2 where ``folder`` holds a file of that stem (its
    Markdown, CSV, picture, or ``<stem>_profiles.json``)."""
    names = [p.name for p in folder.glob(f"{name}_{day}*")]
    stem, n = f"{name}_{day}", 1
    while any(other[len(stem) : len(stem) + 1] in (".", "_") and other.startswith(stem) for other in names):
        n += 1
        stem = f"{name}_{day}-{n}"
    return stem


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
