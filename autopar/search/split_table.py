"""The pipeline split's cost table: the time of every stage a split may use.

``cost_table`` prices ``table[k, i, j]`` (stage ``k`` holding units ``i..j-1``) once per
distinct range content and in-flight count, extends ranges only while they cost at most
a cutoff (a stage's time grows with its range, and no split better than the even one
uses a longer stage), and prices the middle stages of a run of identical blocks once per
length, from a table over counts solved in one vectorised pass.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from autopar.plan import ParallelConfig
from autopar.search.stage_solver import homogeneous_times
from autopar.vocab import Recompute

if TYPE_CHECKING:
    from autopar.search.evaluate import Evaluator


def cost_table(
    ev: Evaluator,
    config: ParallelConfig,
    modes: tuple[Recompute, ...],
    inflight: list[float],
    cutoff_s: float = math.inf,
) -> np.ndarray:
    """``table[k, i, j]``: per-micro-batch time of stage ``k`` holding units ``i..j-1``
    (inf where it does not fit or a split cannot put it), priced once per distinct
    range content. A stage's time grows with its range, so ranges are extended only
    while their time is at most ``cutoff_s`` (no better split uses a longer one)."""
    n = len(ev.graph.units)
    pp = config.pp
    table = np.full((pp, n + 1, n + 1), np.inf)
    costs: dict[tuple[int, float], float] = {}
    for k in range(pp):
        lo_i, hi_i = (0, 0) if k == 0 else (k, n - (pp - k))
        lo_j, hi_j = (n, n) if k == pp - 1 else (k + 1, n - (pp - k - 1))
        if 0 < lo_i and hi_j < n and ev.run_end[lo_i] >= hi_j - 1:
            _fill_repeated(ev, table[k], lo_i, hi_i, lo_j, hi_j, config, modes, inflight[k], cutoff_s)
            continue
        starts = np.arange(lo_i, hi_i + 1)
        alive = np.ones(starts.size, dtype=bool)
        for w in range(max(1, lo_j - hi_i), hi_j - lo_i + 1):
            live = starts[alive]
            if live.size == 0 or live[0] + w > hi_j:
                break
            ends = starts + w
            ok = alive & (ends >= lo_j) & (ends <= hi_j)
            if not ok.any():
                continue
            ii, jj = starts[ok], ends[ok]
            row = np.empty(ii.size)
            homog = jj <= ev.run_end[ii] + 1
            if homog.any():
                hi_idx = np.flatnonzero(homog)
                kind = ev.kind_ids[ii[hi_idx]] * 4 + (ii[hi_idx] == 0) * 2 + (jj[hi_idx] == n)
                _, first_at, inv = np.unique(kind, return_index=True, return_inverse=True)
                vals = np.array(
                    [homogeneous_cost(ev, int(ii[hi_idx[a]]), w, config, modes, inflight[k]) for a in first_at.tolist()]
                )
                row[hi_idx] = vals[inv]
            rest = np.flatnonzero(~homog)
            if rest.size:
                _fill_general(ev, row, rest, ii, jj, w, k, costs, config, modes, inflight)
            keep = row <= cutoff_s
            table[k, ii[keep], jj[keep]] = row[keep]
            dead = np.flatnonzero(ok)[~keep]
            alive[dead] = False
            if lo_j == hi_j and not keep.any():
                break  # the last stage's ranges all end at the last unit: longer ones only cost more
    return table


def _fill_repeated(
    ev: Evaluator,
    row: np.ndarray,
    lo_i: int,
    hi_i: int,
    lo_j: int,
    hi_j: int,
    config: ParallelConfig,
    modes: tuple[Recompute, ...],
    inflight: float,
    cutoff_s: float,
) -> None:
    """A middle stage inside a run of identical units: the cost depends on the
    range's length only, so price each length once and fill the table at once."""
    for w in range(1, hi_j - lo_i + 1):
        c = homogeneous_cost(ev, lo_i, w, config, modes, inflight)
        if c > cutoff_s:
            break
        starts = np.arange(max(lo_i, lo_j - w), min(hi_i, hi_j - w) + 1)
        row[starts, starts + w] = c


def _fill_general(ev: Evaluator, row, rest, ii, jj, w, k, costs, config, modes, inflight) -> None:
    """Price ranges that mix unit kinds, once per distinct content."""
    uniq, first, inverse = np.unique(ev.range_signature[ii[rest], jj[rest]], return_index=True, return_inverse=True)
    values = np.empty(uniq.size)
    for u_idx, (s_id, at) in enumerate(zip(uniq.tolist(), first.tolist())):
        key = (s_id, inflight[k])
        if key not in costs:
            i0 = int(ii[rest[at]])
            plan = ev.solve_units(tuple(range(i0, i0 + w)), config, modes, inflight[k], k)
            costs[key] = math.inf if plan is None else ev.stage_cost_s(plan, config)
        values[u_idx] = costs[key]
    row[rest] = values[inverse]


def homogeneous_cost(
    ev: Evaluator, start: int, count: int, config: ParallelConfig, modes: tuple[Recompute, ...], inflight: float
) -> float:
    """Per-micro-batch time of ``count`` identical units from ``start`` as a stage,
    from a table over counts computed once per unit kind and in-flight count."""
    # the schedule's buffers depend on the stage's neighbours, not on its length
    ends = (start > 0, start + count < len(ev.graph.units))
    key = ("homog", ev.unit_keys[start], ev.config_key(config, modes), inflight, config.num_microbatches, ends)
    table = ev.memo.get(key)
    if table is None or table.size <= count:
        grow = max(count, 8, 2 * (table.size if table is not None else 0))
        opts, priced = ev.priced_options(start, config, modes)
        buffers = ev.pipeline_buffer_bytes(
            tuple(range(start, start + count)), config, inflight, ev.any_layout(config, modes)
        )
        table = homogeneous_times(priced, grow, ev.budget() - buffers, inflight)
        ev.memo[key] = table
    t = float(table[count])
    if not math.isfinite(t):
        return math.inf
    opts = ev.priced_options(start, config, modes)[0]
    units = (start, start + count - 1)
    f, b = ev.stage_p2p_s(units, (opts[0],) * 2, config)
    return t + f + b


def split_cutoff(ev: Evaluator, config: ParallelConfig, modes: tuple[Recompute, ...], inflight: list[float]) -> float:
    """``T_even / m``: in any split no worse than the even one, every stage costs at
    most this, since ``(m - 1) max c + sum c >= m c_k`` for each stage ``k``."""
    bounds = ev.even_split(config.pp)
    if bounds is None or config.pp == 1:
        return math.inf
    costs = []
    for k in range(config.pp):
        plan = ev.solve_units(tuple(range(bounds[k], bounds[k + 1])), config, modes, inflight[k], k)
        if plan is None:
            return math.inf
        costs.append(ev.stage_cost_s(plan, config))
    m = config.num_microbatches
    return ((m - 1) * max(costs) + sum(costs)) / m * (1 + 1e-12)
