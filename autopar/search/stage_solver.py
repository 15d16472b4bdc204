"""The per-stage choice: one option (layout, recompute) per unit, fastest under memory.

A stage's peak memory is ``sum static + inflight * sum act + max transient``; its time
the sum of its units' times. Minimising time under the memory cap is a multiple-choice
knapsack with a max term. The max term is removed by trying each transient level
``tau`` (only options with ``transient <= tau``, budget less ``tau``), and the rest is
solved exactly:

- units in groups of identical units (the blocks of a transformer) share one layout per
  stage and choose recompute modes by count: with the options sorted by time (and hence
  by decreasing memory) the best counts follow from the numbers of the options slower
  than the fastest two by a closed form, a scan of O(k^2) vectorised cases at most
  (:mod:`autopar.search.run_times`);
- two kinds of repeated blocks (Gemma 3's five sliding-window layers to one global,
  dense layers between mixture-of-experts ones): every count of the smaller group's
  options whose time no lighter count beats, each with the larger group's closed form
  for the memory left, vectorised over those counts (also where a kind sits in chunks
  of an interleaved rank that weigh its activations unequally);
- anything else (three kinds of repeated blocks or more, all-different units as in a
  CNN) is an integer program with counts per option, solved with pulp/HiGHS.

:func:`brute_force_stage` enumerates every per-unit assignment: the reference both paths
are tested against.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from autopar.search.ilp import Infeasible, Program, solve
from autopar.search.run_times import mix_totals, pareto, run_times, splits
from autopar.search.split_weights import TwoWeights, placed_act_bytes
from autopar.search.split_weights import best_counts as two_weights_counts


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
    groups: list[tuple[int, tuple[Priced, ...]]],
    counts: tuple[tuple[int, ...], ...],
    inflight: float,
    weights: Sequence[TwoWeights | None] | None = None,
) -> float:
    """Peak bytes of a stage for given counts (a group with :class:`TwoWeights` places
    its smallest activations on its heavier units)."""
    total = 0.0
    transient = 0.0
    for g, ((_, opts), cs) in enumerate(zip(groups, counts)):
        total += inflight * placed_act_bytes(opts, cs, weights[g] if weights else None)
        for o, c in zip(opts, cs):
            if c:
                total += c * o.static_bytes
                transient = max(transient, o.transient_bytes)
    return total + transient


def time_of(groups: list[tuple[int, tuple[Priced, ...]]], counts: tuple[tuple[int, ...], ...]) -> float:
    """Time of a stage for given counts."""
    return sum(c * o.time_s for (_, opts), cs in zip(groups, counts) for o, c in zip(opts, cs))


def solve_stage(
    groups: list[tuple[int, tuple[Priced, ...]]],
    budget_bytes: float,
    inflight: float,
    solver: str = "highs",
    weights: Sequence[TwoWeights | None] | None = None,
) -> StageChoice | None:
    """Fastest counts within ``budget_bytes``, or None if nothing fits.

    ``groups``: (number of identical units, their options); ``weights``: per group, the
    two weights of its activations where its units weigh them unequally (a V's rank)."""
    fastest = tuple(tuple(k if i == _argmin_time(opts) else 0 for i in range(len(opts))) for k, opts in groups)
    mem = memory_of(groups, fastest, inflight, weights)
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
            found = _solve_closed_form(allowed, room, inflight, multi, singles, weights)
        elif len(multi) == 2 and single_combos <= 64:
            found = _solve_two_kinds(allowed, room, inflight, multi, singles, solver, weights)
        else:
            found = _solve_ilp_weighted(allowed, room, inflight, solver, weights)
        if found is None:
            continue
        counts = _expand(groups, allowed, found)
        choice = StageChoice(
            time_s=time_of(groups, counts), memory_bytes=memory_of(groups, counts, inflight, weights), counts=counts
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


def _solve_ilp_weighted(groups, room: float, inflight: float, solver: str, weights):
    """The integer program, a group of two weights split into its heavier and lighter
    units (each its own group, exact), their counts added back."""
    if not weights or all(w is None for w in weights):
        return _solve_ilp(groups, room, inflight, solver)
    parts, owner, ties = [], [], []
    for g, (k, opts) in enumerate(groups):
        w = weights[g]
        if w is None:
            parts.append((k, opts))
            owner.append(g)
            continue
        for n, f in ((w.heavy_units, w.heavy), (k - w.heavy_units, w.light)):
            parts.append((n, tuple(replace(o, act_bytes=o.act_bytes * f) for o in opts)))
            owner.append(g)
        ties.append((len(parts) - 2, len(parts) - 1))
    found = _solve_ilp(parts, room, inflight, solver, ties)
    if found is None:
        return None
    merged: list[dict[int, int]] = [{} for _ in groups]
    for g, counts in zip(owner, found):
        for j, c in counts.items():
            merged[g][j] = merged[g].get(j, 0) + c
    return merged


def _solve_closed_form(groups, room: float, inflight: float, multi: list[int], singles: list[int], weights=None):
    best_t, best = math.inf, None
    for combo in itertools.product(*(range(len(groups[i][1])) for i in singles)):
        used_t, used_m = 0.0, 0.0
        for i, j in zip(singles, combo):
            o = groups[i][1][j]
            used_t += o.time_s
            used_m += o.static_bytes + inflight * o.act_bytes
        if multi:
            g = multi[0]
            res = _best_counts(groups[g][0], groups[g][1], room - used_m, inflight, weights[g] if weights else None)
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


def _solve_two_kinds(
    groups, room: float, inflight: float, multi: list[int], singles: list[int], solver: str, weights=None
):
    """Two groups of identical units beside at most 64 combinations of single units:
    every count of the smaller group's options on its time-memory frontier (per layout,
    :func:`autopar.search.run_times.pareto`), the larger group's best time in the memory
    each leaves (:func:`autopar.search.run_times.run_times`, vectorised over them; for
    a group of two weights, its closed form per count). A group of two weights (a kind
    in both of an interleaved rank's chunks) places its smallest activations on its
    heavier units, on the frontier as in the closed form."""
    two = list(weights) if weights else [None] * len(groups)
    small, large = sorted(multi, key=lambda g: (groups[g][0], g))
    k_small, opts_small = groups[small]
    k_large, opts_large = groups[large]
    weight, time, counts = frontier(k_small, opts_small, inflight, two[small])
    best_t, best = math.inf, None
    for combo in itertools.product(*(range(len(groups[i][1])) for i in singles)):
        picked = [groups[i][1][j] for i, j in zip(singles, combo)]
        used_t = sum(o.time_s for o in picked)
        used_m = sum(o.static_bytes + inflight * o.act_bytes for o in picked)
        rest = room - used_m - weight
        if two[large] is None:
            large_t = run_times(opts_large, list(range(len(opts_large))), k_large, rest, inflight, counts=[k_large])
            large_t = large_t[:, 0]
        else:
            large_t = _weighted_times(k_large, opts_large, rest, inflight, two[large], best_t - used_t - time)
        total = used_t + time + large_t
        f = int(np.argmin(total))
        if total[f] < best_t - 1e-15:
            best_t, best = float(total[f]), (combo, f, float(rest[f]))
    if best is None:
        return None
    combo, f, rest = best
    found = _best_counts(k_large, opts_large, rest, inflight, two[large])
    if found is None:  # the vectorised and the scalar closed form disagree at the memory's edge
        return _solve_ilp_weighted(groups, room, inflight, solver, weights)
    out: list[dict[int, int]] = [{} for _ in groups]
    for i, j in zip(singles, combo):
        out[i] = {j: 1}
    out[small], out[large] = dict(counts[f]), found[1]
    return out


def _weighted_times(
    k: int, opts: tuple[Priced, ...], rooms: np.ndarray, inflight: float, w: TwoWeights, worth_s: np.ndarray
) -> np.ndarray:
    """The fastest time of ``k`` units of two weights in each of ``rooms`` (inf where
    they do not fit), priced only where it could come under ``worth_s`` (inf elsewhere):
    no count of them is faster than all at their fastest option."""
    floor_s = k * min(o.time_s for o in opts)
    out = np.full(len(rooms), math.inf)
    for f in np.flatnonzero(worth_s > floor_s):
        found = _best_counts(k, opts, float(rooms[f]), inflight, w)
        if found is not None:
            out[f] = found[0]
    return out


@functools.lru_cache(maxsize=4096)
def frontier(
    k: int, opts: tuple[Priced, ...], inflight: float, w: TwoWeights | None = None
) -> tuple[np.ndarray, np.ndarray, list[dict[int, int]]]:
    """Every way ``k`` identical units sharing a layout can take its options (those worth
    keeping) that no way holding fewer bytes beats in time: bytes, times and counts,
    lightest first (cached: a band asks for the same groups under many budgets). With
    ``w``, the bytes place the smallest activations on the heavier units
    (:func:`autopar.search.split_weights.placed_act_bytes`)."""
    weights, times, ways = [], [], []
    for lay in sorted({o.layout for o in opts}):
        idx = pareto(opts, [i for i, o in enumerate(opts) if o.layout == lay], inflight)
        counts = _compositions(k, len(idx))
        static = np.array([opts[i].static_bytes for i in idx])
        act = np.array([opts[i].act_bytes for i in idx])
        weights.append(counts @ static + inflight * _placed(counts, act, w))
        times.append(counts @ np.array([opts[i].time_s for i in idx]))
        ways += [(idx, row) for row in counts]
    weight, time = np.concatenate(weights), np.concatenate(times)
    order = np.lexsort((time, weight))
    best_before = np.minimum.accumulate(np.concatenate([[np.inf], time[order][:-1]]))
    chosen = order[time[order] < best_before].tolist()
    weight, time = weight[chosen], time[chosen]
    weight.setflags(write=False)
    time.setflags(write=False)
    return weight, time, [{i: int(n) for i, n in zip(*ways[c]) if n} for c in chosen]


def _placed(counts: np.ndarray, act: np.ndarray, w: TwoWeights | None) -> np.ndarray:
    """Each row's activation bytes (``counts`` of the options with ``act``), the smallest
    on the heavier units where ``w`` weighs them two ways."""
    if w is None:
        return counts @ act
    order = np.argsort(act, kind="stable")
    ordered = counts[:, order].astype(np.float64)
    before = np.cumsum(ordered, axis=1) - ordered
    heavy = np.clip(w.heavy_units - before, 0.0, ordered)
    return (heavy * w.heavy + (ordered - heavy) * w.light) @ act[order]


def _compositions(k: int, parts: int) -> np.ndarray:
    """Every vector of ``parts`` non-negative counts summing to ``k``, one row each."""
    rows = [c for c in itertools.product(range(k + 1), repeat=parts - 1) if sum(c) <= k]
    out = np.array([[*c, k - sum(c)] for c in rows], dtype=np.int64).reshape(-1, parts)
    out.setflags(write=False)
    return out


def _best_counts(k: int, opts: tuple[Priced, ...], room: float, inflight: float, weights: TwoWeights | None = None):
    """Exact best counts for ``k`` identical units sharing one layout: every count of
    the options slower than the fastest two is tried, and the fastest two split the
    rest in closed form (as many of the fastest as the memory left allows; over the
    heavier and the lighter units with ``weights``, :mod:`autopar.search.split_weights`)."""
    best_t, best = math.inf, None
    for lay in sorted({o.layout for o in opts}):
        idx = pareto(opts, [i for i, o in enumerate(opts) if o.layout == lay], inflight)
        if weights is not None:
            found = two_weights_counts(k, opts, idx, splits(k, max(len(idx) - 2, 0)), room, inflight, weights)
            if found is not None and found[0] < best_t - 1e-15:
                best_t, best = found
            continue
        w = np.array([opts[i].static_bytes + inflight * opts[i].act_bytes for i in idx])
        t = np.array([opts[i].time_s for i in idx])
        if len(idx) == 1:
            if k * w[0] <= room and k * t[0] < best_t:
                best_t, best = k * t[0], {idx[0]: k}
            continue
        if len(idx) == 2:  # the common case, in scalars
            if k * w[1] > room + 1e-9 * max(1.0, abs(room)):
                continue
            n1 = min(k, math.floor((room - k * w[1]) / (w[0] - w[1]) + 1e-12))
            total = n1 * t[0] + (k - n1) * t[1]
            if total < best_t - 1e-15:
                best_t, best = float(total), {idx[0]: n1, idx[1]: k - n1}
            continue
        slow = splits(k, len(idx) - 2)
        total, fastest = mix_totals(np.full((1, 1, 1), float(k)), room, list(w), list(t), slow.astype(np.float64))
        total, fastest = total[0, 0], fastest[0, 0]
        j = int(np.argmin(total))
        if total[j] < best_t - 1e-15:
            best_t = float(total[j])
            n1, rest = int(fastest[j]), k - int(slow[j].sum())
            best = dict(zip(idx, [n1, rest - n1, *(int(c) for c in slow[j])]))
    if best is None:
        return None
    return best_t, {i: c for i, c in best.items() if c}


def _solve_ilp(groups, room: float, inflight: float, solver: str, ties: Sequence[tuple[int, int]] = ()):
    """The knapsack as an integer program; ``ties``: pairs of groups that share one layout
    (the heavier and lighter units of one kind)."""
    prog = Program("stage_recompute")
    n = {}
    layout_of = {}
    tied = {g for pair in ties for g in pair}
    for g, (k, opts) in enumerate(groups):
        lays = sorted({o.layout for o in opts})
        if (k > 1 or g in tied) and len(lays) > 1:
            for lay in lays:
                layout_of[g, lay] = prog.binary()
            prog.constrain({layout_of[g, lay]: 1.0 for lay in lays}, lower=1.0, upper=1.0)
        for j, o in enumerate(opts):
            n[g, j] = prog.var(lower=0.0, upper=k, integer=True, cost=o.time_s)
            if (g, o.layout) in layout_of:
                prog.constrain({n[g, j]: 1.0, layout_of[g, o.layout]: -float(k)}, upper=0.0)
        prog.constrain({n[g, j]: 1.0 for j in range(len(opts))}, lower=k, upper=k)
    weights = {
        n[g, j]: o.static_bytes + inflight * o.act_bytes
        for g, (_, opts) in enumerate(groups)
        for j, o in enumerate(opts)
    }
    prog.constrain(weights, upper=room)
    for a, b in ties:
        for lay in sorted({o.layout for o in groups[a][1]}):
            if (a, lay) in layout_of:
                prog.constrain({layout_of[a, lay]: 1.0, layout_of[b, lay]: -1.0}, lower=0.0, upper=0.0)
    try:
        values = solve(prog, solver)
    except Infeasible:
        return None
    return [
        {j: round(values[n[g, j]]) for j in range(len(opts)) if round(values[n[g, j]])}
        for g, (_, opts) in enumerate(groups)
    ]
