"""Identical units whose activations weigh two amounts: a V schedule's rank, an
interleaved 1F1B rank.

A rank of ``zbv`` or ``dualpipev`` holds its two stages' micro-batches in unequal numbers,
and an interleaved 1F1B rank its first chunks' more than its last's, in two numbers
(:func:`autopar.cost.pipeline.stage_inflight_microbatches`), so a block of a heavier
stage weighs its activations more than the same block of a lighter one. For counts of
options over such a kind of unit, the least memory puts the options with the smallest
activations on the heavier units (exchanging a heavier unit's larger option with a
lighter unit's smaller one never adds bytes and keeps the time), so a kind stays one
group of the knapsack, priced with that placement, and its best counts keep a closed
form: the slower options are enumerated as for one weight, and the fastest two split
the rest over the heavier slots left and the lighter ones.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from autopar.search.stage_solver import Priced


@dataclass(frozen=True)
class TwoWeights:
    """``heavy_units`` of a group's units weigh their activations ``heavy`` times, the
    rest ``light`` times (``heavy > light``)."""

    heavy_units: int
    heavy: float
    light: float


def placed_act_bytes(opts: Sequence[Priced], counts: Sequence[int], weights: TwoWeights | None) -> float:
    """The weighted activation bytes of ``counts`` of ``opts``, smallest activations on
    the heavier units."""
    if weights is None:
        return sum(c * o.act_bytes for o, c in zip(opts, counts))
    left, total = weights.heavy_units, 0.0
    for i in sorted(range(len(opts)), key=lambda i: opts[i].act_bytes):
        heavy = min(counts[i], left)
        left -= heavy
        total += opts[i].act_bytes * (heavy * weights.heavy + (counts[i] - heavy) * weights.light)
    return total


def best_counts(
    k: int, opts: Sequence[Priced], idx: list[int], slow: np.ndarray, room: float, inflight: float, w: TwoWeights
) -> tuple[float, dict[int, int]] | None:
    """The fastest counts of ``k`` units over the options ``idx`` of one layout (sorted
    by time, activations strictly decreasing) within ``room``, for
    every row of ``slow`` (counts of ``idx[2:]``): the slowest options fill the heavier
    slots first, then the second fastest, then the fastest; as many of the fastest as
    the room allows, in closed form on each side of the point where it reaches the
    heavier slots."""
    static = np.array([opts[i].static_bytes for i in idx])
    act = np.array([opts[i].act_bytes for i in idx])
    t = np.array([opts[i].time_s for i in idx])
    if len(idx) == 1:
        heavy = min(w.heavy_units, k)
        mem = k * static[0] + inflight * act[0] * (heavy * w.heavy + (k - heavy) * w.light)
        return (k * t[0], {idx[0]: k}) if mem <= room + 1e-9 * max(1.0, abs(room)) else None
    rows = slow.astype(np.float64)
    used = rows.sum(axis=1)
    left = np.full(len(rows), float(w.heavy_units))
    mem = np.zeros(len(rows))
    for j in range(rows.shape[1] - 1, -1, -1):  # the slowest options take the heavier slots first
        heavy = np.minimum(rows[:, j], left)
        left -= heavy
        mem += rows[:, j] * static[2 + j] + inflight * act[2 + j] * (heavy * w.heavy + (rows[:, j] - heavy) * w.light)
    r = k - used
    a = np.minimum(left, r)  # heavier slots left for the fastest two
    unit = {
        (o, side): static[o] + inflight * act[o] * (w.heavy if side else w.light) for o in (0, 1) for side in (0, 1)
    }
    none_fast = mem + a * unit[1, 1] + (r - a) * unit[1, 0]  # every one of the rest at the second fastest
    tol = 1e-9 * np.maximum(1.0, np.abs(room - mem))
    ok = (r >= 0) & (none_fast <= room + tol)
    # the fastest take the lighter slots first (their larger activations weigh less there)
    light_n = np.clip(np.floor((room - none_fast) / (unit[0, 0] - unit[1, 0]) + 1e-12), 0.0, r - a)
    full_light = none_fast + (r - a) * (unit[0, 0] - unit[1, 0])
    heavy_n = np.floor((room - full_light) / (unit[0, 1] - unit[1, 1]) + 1e-12)
    n1 = np.where(light_n >= r - a, (r - a) + np.clip(heavy_n, 0.0, a), light_n)
    total = n1 * t[0] + (r - n1) * t[1] + rows @ t[2:]
    total = np.where(ok, total, np.inf)
    j = int(np.argmin(total))
    if not math.isfinite(total[j]):
        return None
    n1j, rj = int(n1[j]), int(r[j])
    counts = dict(zip(idx, [n1j, rj - n1j, *(int(c) for c in rows[j])]))
    return float(total[j]), {i: c for i, c in counts.items() if c}
