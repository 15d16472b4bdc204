"""The per-stage choice: one option (layout, recompute) per unit, fastest under memory.

A stage's peak memory is ``sum static + inflight * sum act + max transient``; its time
the sum of its units' times. Minimising time under the memory cap is a multiple-choice
knapsack with a max term. The max term is removed by trying each transient level
``tau`` (only options with ``transient <= tau``, budget less ``tau``), and the rest is
solved exactly:

- units in groups of identical units (the blocks of a transformer) share one layout per
  stage and choose recompute modes by count: with the options sorted by time (and hence
  by decreasing memory) the best counts follow from the number of the slowest option by
  a closed form, an O(k) scan;
- anything else (several kinds of repeated blocks, or all-different units as in a CNN)
  is an integer program with counts per option, solved with pulp/HiGHS.

:func:`brute_force_stage` enumerates every per-unit assignment: the reference both paths
are tested against.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
import pulp

from autopar.search.ilp import SolverError, make_solver, solve


@dataclass(frozen=True, kw_only=True)
class Priced:
    """One option of one unit, priced for a stage: seconds per micro-batch, bytes kept
    for the whole step (``static``), bytes per in-flight micro-batch (``act``), and the
    transient peak while it runs (``transient``). ``layout`` groups options that share a
    tensor-parallel layout. ``rebuild`` is the unit's share of DDP's one-time bucket
    rebuild, which the evaluator checks apart (it never coincides with activations)."""

    time_s: float
    static_bytes: float
    act_bytes: float
    transient_bytes: float
    layout: int
    rebuild_bytes: float = 0.0


@dataclass(frozen=True, kw_only=True)
class StageChoice:
    """The solution: for each group, how many of its units take each option."""

    time_s: float
    memory_bytes: float
    counts: tuple[tuple[int, ...], ...]


def memory_of(
    groups: list[tuple[int, tuple[Priced, ...]]], counts: tuple[tuple[int, ...], ...], inflight: float
) -> float:
    """Peak bytes of a stage for given counts."""
    total = 0.0
    transient = 0.0
    for (_, opts), cs in zip(groups, counts):
        for o, c in zip(opts, cs):
            if c:
                total += c * (o.static_bytes + inflight * o.act_bytes)
                transient = max(transient, o.transient_bytes)
    return total + transient


def time_of(groups: list[tuple[int, tuple[Priced, ...]]], counts: tuple[tuple[int, ...], ...]) -> float:
    """Time of a stage for given counts."""
    return sum(c * o.time_s for (_, opts), cs in zip(groups, counts) for o, c in zip(opts, cs))


def solve_stage(
    groups: list[tuple[int, tuple[Priced, ...]]],
    budget_bytes: float,
    inflight: float,
    solver: pulp.LpSolver | None = None,
) -> StageChoice | None:
    """Fastest counts within ``budget_bytes``, or None if nothing fits.

    ``groups``: (number of identical units, their options)."""
    fastest = tuple(tuple(k if i == _argmin_time(opts) else 0 for i in range(len(opts))) for k, opts in groups)
    mem = memory_of(groups, fastest, inflight)
    if mem <= budget_bytes:
        return StageChoice(time_s=time_of(groups, fastest), memory_bytes=mem, counts=fastest)
    levels = sorted({o.transient_bytes for _, opts in groups for o in opts}, reverse=True)
    best: StageChoice | None = None
    multi = [i for i, (k, _) in enumerate(groups) if k > 1]
    singles = [i for i, (k, _) in enumerate(groups) if k == 1]
    single_combos = math.prod(len(groups[i][1]) for i in singles)
    for tau in levels:
        allowed = [(k, tuple(o for o in opts if o.transient_bytes <= tau)) for k, opts in groups]
        if any(not opts for _, opts in allowed):
            continue
        if best is not None and sum(k * min(o.time_s for o in opts) for k, opts in allowed) >= best.time_s:
            continue  # even the fastest options allowed at this level cannot do better
        room = budget_bytes - tau
        if len(multi) <= 1 and single_combos <= 64:
            found = _solve_closed_form(allowed, room, inflight, multi, singles)
        else:
            found = _solve_ilp(allowed, room, inflight, solver)
        if found is None:
            continue
        counts = _expand(groups, allowed, found)
        choice = StageChoice(
            time_s=time_of(groups, counts), memory_bytes=memory_of(groups, counts, inflight), counts=counts
        )
        if best is None or choice.time_s < best.time_s - 1e-15:
            best = choice
    return best


def brute_force_stage(
    groups: list[tuple[int, tuple[Priced, ...]]], budget_bytes: float, inflight: float
) -> StageChoice | None:
    """Every per-unit assignment (identical units of a group share a layout). Tests only."""
    per_group = []
    for k, opts in groups:
        assignments = set()
        for combo in itertools.product(range(len(opts)), repeat=k):
            if len({opts[i].layout for i in combo}) > 1:
                continue
            assignments.add(tuple(combo.count(i) for i in range(len(opts))))
        per_group.append(sorted(assignments))
    best: StageChoice | None = None
    for counts in itertools.product(*per_group):
        mem = memory_of(groups, counts, inflight)
        if mem > budget_bytes:
            continue
        t = time_of(groups, counts)
        if best is None or t < best.time_s - 1e-15:
            best = StageChoice(time_s=t, memory_bytes=mem, counts=counts)
    return best


def _argmin_time(opts: tuple[Priced, ...]) -> int:
    return min(range(len(opts)), key=lambda i: (opts[i].time_s, opts[i].static_bytes + opts[i].act_bytes))


def _expand(groups, allowed, found: list[dict[int, int]]) -> tuple[tuple[int, ...], ...]:
    """Map counts over allowed options back to the full option lists."""
    out = []
    for (_, opts), (_, sub), cnt in zip(groups, allowed, found):
        full = [0] * len(opts)
        for j, c in cnt.items():
            full[opts.index(sub[j])] += c
        out.append(tuple(full))
    return tuple(out)


def _solve_closed_form(groups, room: float, inflight: float, multi: list[int], singles: list[int]):
    best_t, best = math.inf, None
    for combo in itertools.product(*(range(len(groups[i][1])) for i in singles)):
        used_t, used_m = 0.0, 0.0
        for i, j in zip(singles, combo):
            o = groups[i][1][j]
            used_t += o.time_s
            used_m += o.static_bytes + inflight * o.act_bytes
        if multi:
            g = multi[0]
            res = _best_counts(groups[g][0], groups[g][1], room - used_m, inflight)
            if res is None:
                continue
            t, counts = res
        else:
            if used_m > room:
                continue
            t, counts = 0.0, None
        if used_t + t < best_t - 1e-15:
            best_t = used_t + t
            best = [dict() for _ in groups]
            for i, j in zip(singles, combo):
                best[i] = {j: 1}
            if multi:
                best[multi[0]] = counts
    return best


def _best_counts(k: int, opts: tuple[Priced, ...], room: float, inflight: float):
    """Exact best counts for ``k`` identical units sharing one layout."""
    best_t, best = math.inf, None
    for lay in sorted({o.layout for o in opts}):
        idx = [i for i, o in enumerate(opts) if o.layout == lay]
        idx = _pareto(opts, idx, inflight)
        w = [opts[i].static_bytes + inflight * opts[i].act_bytes for i in idx]
        t = [opts[i].time_s for i in idx]
        if len(idx) == 1:
            if k * w[0] <= room and k * t[0] < best_t:
                best_t, best = k * t[0], {idx[0]: k}
            continue
        if len(idx) == 2:
            n_slow_range = [0]
        else:
            n_slow_range = range(k + 1)
        for n3 in n_slow_range:
            r = k - n3
            left = room - (n3 * w[2] if len(idx) == 3 else 0.0)
            if r * w[1] > left + 1e-9 * max(1.0, abs(left)):
                continue
            n1 = r if w[0] <= w[1] else min(r, math.floor((left - r * w[1]) / (w[0] - w[1]) + 1e-12))
            n2 = r - n1
            total = n1 * t[0] + n2 * t[1] + (n3 * t[2] if len(idx) == 3 else 0.0)
            if total < best_t - 1e-15:
                best_t = total
                best = {idx[0]: n1, idx[1]: n2}
                if len(idx) == 3:
                    best[idx[2]] = n3
    if best is None:
        return None
    return best_t, {i: c for i, c in best.items() if c}


def _pareto(opts: tuple[Priced, ...], idx: list[int], inflight: float) -> list[int]:
    """Options sorted by time with strictly decreasing weight (dominated ones dropped).
    At most three remain for one layout (none, selective, full)."""
    ordered = sorted(idx, key=lambda i: (opts[i].time_s, opts[i].static_bytes + inflight * opts[i].act_bytes))
    kept: list[int] = []
    for i in ordered:
        w = opts[i].static_bytes + inflight * opts[i].act_bytes
        if not kept or w < opts[kept[-1]].static_bytes + inflight * opts[kept[-1]].act_bytes:
            kept.append(i)
    if len(kept) > 3:
        raise AssertionError(f"more than three undominated options for one layout: {len(kept)}")
    return kept


def _solve_ilp(groups, room: float, inflight: float, solver: pulp.LpSolver | None):
    prob = pulp.LpProblem("stage_recompute", pulp.LpMinimize)
    n = {}
    layout_of = {}
    for g, (k, opts) in enumerate(groups):
        lays = sorted({o.layout for o in opts})
        if k > 1 and len(lays) > 1:
            for lay in lays:
                layout_of[g, lay] = prob.add_variable(f"lay_{g}_{lay}", cat="Binary")
            prob += pulp.lpSum(layout_of[g, lay] for lay in lays) == 1
        for j, o in enumerate(opts):
            n[g, j] = prob.add_variable(f"n_{g}_{j}", lowBound=0, upBound=k, cat="Integer")
            if (g, o.layout) in layout_of:
                prob += n[g, j] <= k * layout_of[g, o.layout]
        prob += pulp.lpSum(n[g, j] for j in range(len(opts))) == k
    prob += (
        pulp.lpSum(
            n[g, j] * (o.static_bytes + inflight * o.act_bytes)
            for g, (_, opts) in enumerate(groups)
            for j, o in enumerate(opts)
        )
        <= room
    )
    prob += pulp.lpSum(n[g, j] * o.time_s for g, (_, opts) in enumerate(groups) for j, o in enumerate(opts))
    try:
        solve(prob, solver or make_solver())
    except SolverError:
        if pulp.LpStatus[prob.status] == "Infeasible":
            return None
        raise
    return [
        {j: round(n[g, j].value() or 0) for j in range(len(opts)) if round(n[g, j].value() or 0)}
        for g, (_, opts) in enumerate(groups)
    ]


def homogeneous_times(opts: tuple[Priced, ...], n_max: int, budget_bytes: float, inflight: float) -> np.ndarray:
    """``out[n]``: the fastest time of ``n`` identical units with options ``opts`` in one
    stage (inf where they do not fit), for every ``n <= n_max`` at once: the closed form
    of :func:`solve_stage` vectorised over ``n`` (what pipeline splits of repeated blocks
    ask for, once per in-flight count)."""
    n = np.arange(n_max + 1, dtype=np.float64)[:, None]
    n3 = np.arange(n_max + 1, dtype=np.float64)[None, :]
    best = np.full(n_max + 1, np.inf)
    best[0] = 0.0
    for tau in sorted({o.transient_bytes for o in opts}):
        allowed = [i for i, o in enumerate(opts) if o.transient_bytes <= tau]
        room = budget_bytes - tau
        for lay in sorted({opts[i].layout for i in allowed}):
            idx = _pareto(opts, [i for i in allowed if opts[i].layout == lay], inflight)
            w = [opts[i].static_bytes + inflight * opts[i].act_bytes for i in idx]
            t = [opts[i].time_s for i in idx]
            if len(idx) == 1:
                times = np.where(n[:, 0] * w[0] <= room, n[:, 0] * t[0], np.inf)
            else:
                slow = n3 if len(idx) == 3 else np.zeros_like(n3[:, :1])
                r = n - slow
                left = room - (slow * w[2] if len(idx) == 3 else 0.0)
                ok = (slow <= n) & ~(r * w[1] > left + 1e-9 * np.maximum(1.0, np.abs(left)))
                n1 = r if w[0] <= w[1] else np.minimum(r, np.floor((left - r * w[1]) / (w[0] - w[1]) + 1e-12))
                total = n1 * t[0] + (r - n1) * t[1] + (slow * t[2] if len(idx) == 3 else 0.0)
                times = np.where(ok, total, np.inf).min(axis=1)
            best[1:] = np.minimum(best[1:], times[1:])
    return best
