"""The pipeline split: contiguous units per stage, minimising the pipeline time.

With stage ``k`` costing ``c_k`` per micro-batch, one stage per rank, the pipeline takes
``(m - 1) max_k c_k + sum_k c_k`` (:mod:`autopar.cost.pipeline`). As in Alpa's
inter-operator pass (Zheng et al. 2022, section 5.2), the max is removed by enumerating
a threshold ``C`` over the distinct stage costs: for each ``C`` a dynamic program finds
the split of least ``sum c_k`` with every stage at most ``C``. Feasibility is monotone
in ``C``, so the smallest feasible threshold is found by bisection; from there
thresholds are tried in increasing order and the scan stops once ``(m - 1) C`` plus a
lower bound of the sum cannot beat the best split found. Stage costs depend on the stage's index (its
in-flight micro-batches and memory), and infeasible stages (out of memory) cost
infinity.

The DP is over a band of stage costs ``band[k, i, w - 1]`` (stage ``k`` holds the ``w``
units from ``i``; :mod:`autopar.search.split_table` prices it); :func:`brute_force_split`
enumerates every split of a full table ``table[k, i, j]`` and is what the DP is tested
against. Interleaved schedules split by a fixed rule instead (:func:`even_bounds`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np

from autopar.graph.layer_graph import Unit


def best_split(band: np.ndarray, num_microbatches: int) -> tuple[float, tuple[int, ...]] | None:
    """The split (stage boundaries ``0 = b_0 < ... < b_S = L``) minimising
    ``(m - 1) max c + sum c`` over the stage costs ``band[k, i, w - 1]`` (stage ``k``
    holding the ``w`` units from ``i``; :func:`band_of` makes one from a full table),
    with its value; None if no split fits."""
    thresholds = np.unique(band[np.isfinite(band)])
    lower_sum = _min_sum(band, np.inf)
    if lower_sum is None:
        return None
    lo = _first_feasible(band, thresholds)
    best_value, best_bounds = math.inf, None
    for c in thresholds[lo:]:
        if (num_microbatches - 1) * c + lower_sum[0] >= best_value:
            break
        found = _min_sum(band, c)
        if found is None:
            continue
        total, bounds = found
        value = (num_microbatches - 1) * _max_stage(band, bounds) + total
        if value < best_value:
            best_value, best_bounds = value, bounds
    if best_bounds is None:
        return None
    return best_value, best_bounds


def least_largest(band: np.ndarray) -> float:
    """The least cost of the dearest stage over every split of the stage costs ``band``
    (:func:`best_split`'s form); inf where no split fits."""
    thresholds = np.unique(band[np.isfinite(band)])
    if _min_sum(band, np.inf) is None:
        return math.inf
    return float(thresholds[_first_feasible(band, thresholds)])


def _first_feasible(band: np.ndarray, thresholds: np.ndarray) -> int:
    """The index of the smallest of the sorted ``thresholds`` under which a split fits
    (one does under the largest): feasibility is monotone in the threshold, so by
    bisection."""
    lo, hi = 0, len(thresholds) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if _min_sum(band, thresholds[mid]) is None:
            lo = mid + 1
        else:
            hi = mid
    return lo


def band_of(table: np.ndarray) -> np.ndarray:
    """``band[k, i, w - 1] = table[k, i, i + w]`` for the lengths ``w`` that have any
    finite entry: ranges are short next to the model, so the DP runs on the band."""
    num_stages, n1, _ = table.shape
    i_idx, j_idx = np.nonzero(np.isfinite(table).any(axis=0))
    width = int((j_idx - i_idx).max()) if i_idx.size else 1
    band = np.full((num_stages, n1, width), np.inf)
    for w in range(1, width + 1):
        rows = np.arange(n1 - w)
        band[:, rows, w - 1] = table[:, rows, rows + w]
    return band


def _min_sum(band: np.ndarray, cap: float) -> tuple[float, tuple[int, ...]] | None:
    """Least ``sum c_k`` over splits with every stage at most ``cap`` (None if none): a
    DP over stages, each step one gather over every end and width (ties go to the
    shortest last stage)."""
    num_stages, n1, width = band.shape
    masked = np.where(band <= cap, band, np.inf)
    widths = np.arange(1, width + 1)[None, :]
    source = np.arange(n1)[:, None] - widths
    reachable = source >= 0
    source = np.where(reachable, source, 0)
    rows = np.arange(n1)
    best = np.full(n1, np.inf)
    best[0] = 0.0
    parents = []
    for k in range(num_stages):
        cand = np.where(reachable, best[source] + masked[k, source, widths - 1], np.inf)
        arg = cand.argmin(axis=1)
        best = cand[rows, arg]
        parents.append(source[rows, arg])
    if not np.isfinite(best[n1 - 1]):
        return None
    bounds = [n1 - 1]
    for k in range(num_stages - 1, -1, -1):
        bounds.append(int(parents[k][bounds[-1]]))
    return float(best[n1 - 1]), tuple(reversed(bounds))


def _max_stage(band: np.ndarray, bounds: tuple[int, ...]) -> float:
    return max(band[k, bounds[k], bounds[k + 1] - bounds[k] - 1] for k in range(len(bounds) - 1))


def brute_force_split(table: np.ndarray, num_microbatches: int) -> tuple[float, tuple[int, ...]] | None:
    """Every split, exhaustively (tests only)."""
    num_stages, n1, _ = table.shape
    best_value, best_bounds = math.inf, None
    for cuts in itertools.combinations(range(1, n1 - 1), num_stages - 1):
        bounds = (0, *cuts, n1 - 1)
        costs = [table[k, bounds[k], bounds[k + 1]] for k in range(num_stages)]
        if not all(np.isfinite(costs)):
            continue
        value = (num_microbatches - 1) * max(costs) + sum(costs)
        if value < best_value:
            best_value, best_bounds = value, bounds
    if best_bounds is None:
        return None
    return best_value, best_bounds


def even_bounds_of(units: Sequence[Unit], chunks: int, *, exact: bool = False) -> tuple[int, ...] | None:
    """:func:`even_bounds` for a model's units: a first unit outside any block is the
    prologue, a last one (of three or more) the epilogue."""
    n = len(units)
    first = 1 if n > 1 and not units[0].prefix else 0
    last = 1 if n > 2 and not units[-1].prefix else 0
    return even_bounds(n, first, last, chunks, exact=exact)


def even_bounds(n: int, first: int, last: int, chunks: int, *, exact: bool = False) -> tuple[int, ...] | None:
    """Stage boundaries spreading ``n`` units over ``chunks`` stages evenly: the blocks
    (the units but a prologue, ``first`` = 1, and an epilogue, ``last`` = 1) as evenly as
    possible, the prologue on the first stage and the epilogue on the last. None when
    there are fewer blocks than stages (but for one unit per stage, below).

    With ``exact`` (the rule for interleaved stages), every stage must hold the same
    number: of blocks (Megatron-LM's rule), or else of units, when a prologue and an
    epilogue exist and the units divide evenly: the first and the last stage then hold
    one block fewer, the embedding and the loss counting as a layer each (Megatron-LM's
    ``--account-for-embedding-in-pipeline-split`` and ``--account-for-loss-in-pipeline-split``).
    At one unit per stage the first stage holds the embedding alone and the last the
    loss alone: Llama 3 405B trained so, 126 layers and those two on 16 x 8 stages
    (Llama Team 2024, "The Llama 3 Herd of Models", section 3.3.2: its first chunk "has
    only the embedding"). None when neither divides."""
    blocks = n - first - last
    if blocks < chunks and not (exact and first and last and n == chunks):
        return None
    if exact and blocks % chunks:
        if not (first and last) or n % chunks:
            return None
        return tuple(k * (n // chunks) for k in range(chunks + 1))
    sizes = [blocks // chunks + (1 if k < blocks % chunks else 0) for k in range(chunks)]
    bounds = [0]
    for k, size in enumerate(sizes):
        bounds.append(bounds[-1] + size + (first if k == 0 else 0))
    bounds[-1] = n
    return tuple(bounds)


def placeable(n: int, pp: int, width: int) -> np.ndarray:
    """``mask[k, i, w - 1]``: whether a split can give stage ``k`` the ``w`` units from
    ``i`` (the stages before it and after it each hold at least one unit)."""
    k = np.arange(pp)[:, None, None]
    i = np.arange(n + 1)[None, :, None]
    j = i + np.arange(1, width + 1)[None, None, :]
    first = np.where(k == 0, i == 0, (i >= k) & (i <= n - (pp - k)))
    last = np.where(k == pp - 1, j == n, (j >= k + 1) & (j <= n - (pp - k - 1)))
    return first & last
