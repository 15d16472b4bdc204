"""Waiting on peers at blocking collectives: the cost of synchronising noisy ranks.

Ranks that do the same work do not finish it at the same moment: the scheduler, other
processes, caches and frequency changes add noise. A blocking collective makes every
rank of its group wait for the last one, so a step with many of them (tensor
parallelism's all-reduces, issued in the middle of each layer and waited on at once)
pays for every rank's noise at every meeting, beyond the collectives' own transfer time.

Model: a rank's time for ``T`` seconds of work deviates by independent increments, with
standard deviation ``sigma * sqrt(T)`` (a random walk, so the noise of two halves adds in
variance). Ranks leave a collective together and meet at the next, so each meeting of
``n`` ranks costs the expected maximum of their deviations, ``e_n * sigma * sqrt(T)``,
where ``e_n`` is the expected maximum of ``n`` standard normal variables (Tippett 1925;
``e_2 = 1 / sqrt(pi)``). ``k`` meetings that split ``W`` seconds of work into equal parts
cost ``k * e_n * sigma * sqrt(W / k) = e_n * sigma * sqrt(k * W)``: more meetings cost more,
but less than in proportion. Equal parts are the dearest split of a given ``W`` and ``k``
(the square root is concave), which suits a planner that must not promise too much.

``sigma`` (``DeviceSpec.sync_noise_s_per_sqrt_s``) is measured by a network profile
(:mod:`profiler.sync_skew`): 0.005-0.018 s per sqrt(s) over runs with 2 gloo ranks on a
shared 2-core box, about 0.03 with 4 (a 4 KiB all-reduce after 7 ms of matrix multiplies
took about 1 ms longer there than back to back). GPU presets set 0.
"""

from __future__ import annotations

import functools
import math

_GRID_POINTS = 801
_GRID_HALF_WIDTH = 10.0


@functools.lru_cache(maxsize=64)
def expected_max_normal(n: int) -> float:
    """The expected maximum of ``n`` independent standard normal variables (0 for one),
    by Simpson's rule over +-10 standard deviations (error below 1e-9; memoised, since
    the search asks for the same few group sizes for every candidate)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"expected_max_normal needs a rank count >= 1, got {n!r}.")
    if n == 1:
        return 0.0
    h = 2 * _GRID_HALF_WIDTH / (_GRID_POINTS - 1)
    total = 0.0
    for i in range(_GRID_POINTS):
        x = -_GRID_HALF_WIDTH + i * h
        pdf = math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
        cdf = 0.5 * (1 + math.erf(x / math.sqrt(2)))
        weight = 1 if i in (0, _GRID_POINTS - 1) else (4 if i % 2 else 2)
        total += weight * x * n * pdf * cdf ** (n - 1)
    return total * h / 3


def sync_wait_s(noise_s_per_sqrt_s: float, ranks: int, meetings: float, work_s: float) -> float:
    """Seconds ``ranks`` ranks wait on each other at ``meetings`` blocking collectives
    that split ``work_s`` seconds of work: ``e_ranks * sigma * sqrt(meetings * work_s)``
    (module docstring). 0 for one rank, no meetings or no noise."""
    if ranks < 2 or meetings <= 0 or work_s <= 0 or noise_s_per_sqrt_s <= 0:
        return 0.0
    return expected_max_normal(ranks) * noise_s_per_sqrt_s * math.sqrt(meetings * work_s)
