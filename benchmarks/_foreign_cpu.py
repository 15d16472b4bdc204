"""How much of the machine's CPU other processes took while a benchmark measured.

The load average cannot tell: it counts the benchmark's own ranks, so a round that
follows four profiling processes starts at "load 3.4" on an otherwise idle box. What
decides whether a measurement is noisy is the CPU time spent outside this process and
its children. Linux's ``/proc/stat`` gives the machine's busy time and what the
hypervisor took (``steal``) (proc(5)); ``os.times`` gives this process's CPU time and
that of the children it has reaped (POSIX ``times``). Their difference over a window,
divided by its wall time, is the cores other processes kept busy.

Children still running when a window ends count as foreign until reaped: sample after
joining them (``run_locally`` joins its ranks before it returns).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

_STAT = Path("/proc/stat")


@dataclass(frozen=True, kw_only=True)
class CpuSample:
    """Cumulative CPU seconds at one moment."""

    wall_s: float
    busy_s: float
    """user + nice + system time of every core (interrupts left out: loopback traffic is
    handled there, for whichever process sent it)."""
    steal_s: float
    """time the hypervisor ran something else while a core wanted to run."""
    ours_s: float
    """this process's user + system time and that of its reaped children."""


@dataclass(frozen=True, kw_only=True)
class ForeignCpu:
    """Cores, on average over a window, that other processes and the hypervisor took."""

    foreign_cores: float
    steal_cores: float


def sample(stat: Path = _STAT) -> CpuSample | None:
    """The machine's and this process's CPU time now; None where ``/proc/stat`` is
    missing (not Linux)."""
    try:
        first = stat.read_text().splitlines()[0].split()
    except OSError:
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    user, nice, system = (int(first[i]) / ticks for i in (1, 2, 3))
    steal = int(first[8]) / ticks if len(first) > 8 else 0.0
    t = os.times()
    return CpuSample(
        wall_s=time.monotonic(),
        busy_s=user + nice + system,
        steal_s=steal,
        ours_s=t.user + t.system + t.children_user + t.children_system,
    )


def between(start: CpuSample | None, end: CpuSample | None) -> ForeignCpu | None:
    """What other processes took between two samples, in cores; None if either is."""
    if start is None or end is None or end.wall_s <= start.wall_s:
        return None
    wall = end.wall_s - start.wall_s
    foreign = (end.busy_s - start.busy_s) - (end.ours_s - start.ours_s)
    return ForeignCpu(foreign_cores=max(foreign, 0.0) / wall, steal_cores=(end.steal_s - start.steal_s) / wall)


def describe(windows: list[ForeignCpu | None]) -> str:
    """``0.02 / 0.41 / 0.03 cores (steal 0.00 / 0.01 / 0.00)``, or why there is none."""
    if not windows or any(w is None for w in windows):
        return "not measured (no /proc/stat)"
    cores = " / ".join(f"{w.foreign_cores:.2f}" for w in windows)
    steal = " / ".join(f"{w.steal_cores:.2f}" for w in windows)
    return f"{cores} cores (steal {steal})"
