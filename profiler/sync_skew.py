"""How unevenly the ranks of a group finish the same work: what blocking collectives wait.

A collective's time from the sweep is for calls back to back: every rank arrives at once.
In training a blocking collective follows work (tensor parallelism's all-reduces, issued
in the middle of every layer and waited on at once), the ranks finish that work at
different moments, and each waits for the last. :mod:`autopar.cost.host` models a rank's
time for ``T`` seconds of work as deviating by ``sigma * sqrt(T)``, so a meeting of ``n``
ranks waits ``e_n * sigma * sqrt(T)`` on average; this module measures ``sigma``.

Every rank of the group repeats a meeting: the same fixed amount of work (forward and
backward passes of a small MLP, about ``T`` seconds; the count is set from the slowest
rank's rate, so all do identical work), timed on each rank, then a 4 KiB all-reduce,
which releases the ranks together for the next meeting. :func:`noise_s_per_sqrt_s` turns
the times into ``sigma``: the mean over meetings of the slowest rank's time less the
ranks' mean is the mean wait, its least-squares line through the origin in ``sqrt(T)``
has slope ``e_n * sigma``. Timing the work rather than the collective keeps the
collective's heavy-tailed time out (on 2 gloo ranks a 4 KiB all-reduce back to back took
0.4-0.8 ms at the median and 1-2 ms on average over runs).

That this wait is all a collective after work costs beyond back to back was checked on
a 2-core box with 2 gloo ranks: after 1.7, 5.4 and 17.6 ms of the MLP's passes the
all-reduce took 1.56, 1.86 and 2.90 ms on average, the same all-reduce repeated at once
1.93, 1.64 and 1.72 ms, and the ranks' own waits for the slowest were 0.18, 0.57 and
1.66 ms: what is left is noise of the collective's own time (-0.5 to -0.3 ms), not a
cost of its own.

Over longer work the ranks drift apart faster than a random walk: their speeds wander on
the scale of a step. :func:`speed_spread` meets after ``LONG_WORK_S`` of the same passes
and takes what ``sigma`` does not explain as ``delta``, a fraction of the work.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from autopar.cost.host import expected_max_normal
from profiler.timing import synchronize

WORK_S = (0.001, 0.004, 0.016)
"""Work between meetings: the range a tensor-parallel layer's pieces take on CPUs."""
MEETINGS_PER_REPEAT = 40
"""Meetings per work length for each of a network sweep's repeats, plus two (a wait is a
difference of times, noisier than either): 200 for the default 3 repeats. 100 read back
injected noise within 7% (``tests/profiler/test_sync_skew.py``)."""
MEETINGS = 5 * MEETINGS_PER_REPEAT
LONG_WORK_S = 0.2
"""Work between meetings where a rank's speed spread shows: about a step's backward on
the benchmarks' local processes."""
LONG_MEETINGS = 32
NBYTES = 4096
"""A message whose own transfer is mostly latency."""
_DIM, _ROWS = 128, 32

Work = Callable[[float], None]
"""``work(seconds)``: do about that much work on this rank, the same amount on every
rank of the group."""


def sync_noise_s_per_sqrt_s(
    group: dist.ProcessGroup,
    device: torch.device,
    *,
    work: Work | None = None,
    work_s: tuple[float, ...] = WORK_S,
    meetings: int = MEETINGS,
) -> float:
    """``sigma`` of ``group`` (2 ranks or more) in seconds per square root of a second of
    work, from ``meetings`` meetings per work length; call on every rank. ``work``
    replaces the MLP passes (tests inject known noise with it). The same value on every
    rank."""
    if len(set(work_s)) < 2:
        raise ValueError(f"a sync-noise measurement needs at least two different work lengths, got {work_s}.")
    n = dist.get_world_size(group)
    if n < 2:
        raise ValueError(f"a sync-noise measurement needs a group of 2 ranks or more, got {n}.")
    work = work or _training_work(group, device)
    return noise_s_per_sqrt_s([_meetings(group, device, work, t, meetings) for t in work_s])


def noise_s_per_sqrt_s(per_length: Sequence[Sequence[Sequence[float]]]) -> float:
    """``sigma`` from each work length's times, ``ranks x meetings`` seconds (module
    docstring)."""
    waits, means = zip(*(_wait_and_work_s(times) for times in per_length))
    c = sum(w * math.sqrt(t) for w, t in zip(waits, means)) / sum(means)
    return c / expected_max_normal(len(per_length[0]))


def _wait_and_work_s(times: Sequence[Sequence[float]]) -> tuple[float, float]:
    """(mean wait of the slowest rank beyond the ranks' mean, mean work time) over
    ``ranks x meetings`` seconds of one work length."""
    work = torch.tensor(times, dtype=torch.float64)
    return float((work.max(dim=0).values - work.mean(dim=0)).mean()), float(work.mean())


def speed_spread(
    group: dist.ProcessGroup,
    device: torch.device,
    noise_s_per_sqrt_s: float,
    *,
    work: Work | None = None,
    work_s: float = LONG_WORK_S,
    meetings: int = LONG_MEETINGS,
) -> float:
    """``delta``, the relative spread of a rank's speed over a stretch of work
    (:func:`autopar.cost.host.ranks_wait_s`), of ``group`` (2 ranks or more); call on every rank. The
    ranks meet ``meetings`` times after ``work_s`` seconds of work each; the mean wait
    for the slowest is ``e_n * sqrt(sigma^2 T + delta^2 T^2)``, and what the random walk
    ``noise_s_per_sqrt_s`` does not explain is ``delta``. The same value on every rank."""
    n = dist.get_world_size(group)
    if n < 2:
        raise ValueError(f"a speed-spread measurement needs a group of 2 ranks or more, got {n}.")
    times = _meetings(group, device, work or _training_work(group, device), work_s, meetings)
    return spread_from_times(times, noise_s_per_sqrt_s)


def spread_from_times(times: Sequence[Sequence[float]], noise_s_per_sqrt_s: float) -> float:
    """``delta`` from ``ranks x meetings`` seconds of one work length, given ``sigma``."""
    wait, t = _wait_and_work_s(times)
    deviation = wait / expected_max_normal(len(times))
    return math.sqrt(max(deviation**2 - noise_s_per_sqrt_s**2 * t, 0.0)) / t


def _meetings(
    group: dist.ProcessGroup, device: torch.device, work: Work, work_s: float, meetings: int
) -> list[list[float]]:
    """Every rank's time for ``work(work_s)`` at each of ``meetings`` meetings (a 4 KiB
    all-reduce releases the ranks together after each): ``ranks x meetings`` seconds."""
    n = dist.get_world_size(group)
    x = torch.zeros(NBYTES // 4, device=device)
    for _ in range(3):
        dist.all_reduce(x, group=group)
    mine = []
    for _ in range(meetings):
        start = time.perf_counter()
        work(work_s)
        synchronize(device)
        mine.append(time.perf_counter() - start)
        dist.all_reduce(x, group=group)
    everyone = [torch.empty(len(mine), dtype=torch.float64, device=device) for _ in range(n)]
    dist.all_gather(everyone, torch.tensor(mine, dtype=torch.float64, device=device), group=group)
    return torch.stack(everyone).cpu().tolist()


def _training_work(group: dist.ProcessGroup, device: torch.device) -> Work:
    """Forward and backward passes of a small MLP (matrix multiplies, an activation,
    autograd's bookkeeping: the mix of a training step, whose noise differs from pure
    matrix multiplies'), the same count on every rank, set from the slowest rank's
    rate."""
    gen = torch.Generator().manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(_DIM, 4 * _DIM), torch.nn.GELU(), torch.nn.Linear(4 * _DIM, _DIM))
    mlp = mlp.to(device)
    x = torch.randn(_ROWS, _DIM, generator=gen).to(device)

    def one() -> None:
        mlp(x).sum().backward()

    for _ in range(3):
        one()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(10):
        one()
    synchronize(device)
    per = torch.tensor([(time.perf_counter() - start) / 10], dtype=torch.float64, device=device)
    dist.all_reduce(per, op=dist.ReduceOp.MAX, group=group)
    per_pass_s = float(per[0])

    def work(seconds: float) -> None:
        for _ in range(max(1, round(seconds / per_pass_s))):
            one()

    return work
