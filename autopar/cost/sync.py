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

The random walk is not all of it. A rank's speed also wanders on the scale of a whole
step, so over ``T`` seconds of work it runs ``delta * T`` apart as well
(``DeviceSpec.sync_speed_spread``): the variance of a segment is ``sigma^2 T + delta^2
T^2``, and ``k`` equal meetings over ``W`` cost ``e_n * sqrt(k sigma^2 W + delta^2 W^2)``.
The second term does not grow with the meetings: a slower rank loses its share of the
work at each, however often the ranks resynchronise, and it is what DDP's one meeting
per step (its gradient all-reduce) mostly waits for. On a 2-vCPU guest, two ranks doing
the same 0.39-0.43 s forward and backward of a small GPT at once finished 31-35 ms apart
on average over 12 repeats, where a random walk fitted on 7-10 ms segments allows about
4 ms.

``sigma`` (``DeviceSpec.sync_noise_s_per_sqrt_s``) is measured by a network profile
(:mod:`profiler.sync_skew`): 0.005-0.018 s per sqrt(s) over runs with 2 gloo ranks on a
shared 2-core box, about 0.03 with 4 (a 4 KiB all-reduce after 7 ms of matrix multiplies
took about 1 ms longer there than back to back); ``delta`` by the same profile from
segments of a fifth of a second (:func:`profiler.sync_skew.speed_spread`). GPU presets
set both 0.
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


def sync_wait_s(
    noise_s_per_sqrt_s: float, ranks: int, meetings: float, work_s: float, *, speed_spread: float = 0.0
) -> float:
    """Seconds ``ranks`` ranks wait on each other at ``meetings`` blocking collectives
    that split ``work_s`` seconds of work: ``e_ranks * sqrt(meetings * sigma^2 * W +
    delta^2 * W^2)`` with ``delta`` the ``speed_spread`` (module docstring). 0 for one
    rank, no meetings or no noise."""
    if ranks < 2 or meetings <= 0 or work_s <= 0 or (noise_s_per_sqrt_s <= 0 and speed_spread <= 0):
        return 0.0
    variance = meetings * noise_s_per_sqrt_s**2 * work_s + (speed_spread * work_s) ** 2
    return expected_max_normal(ranks) * math.sqrt(variance)
