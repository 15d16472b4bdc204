"""The per-stage choice: one option (layout, recompute) per unit, fastest under memory.

A stage's peak memory is ``sum static + inflight * sum act + max transient``; its time
the sum of its units' times. Minimising time under the memory cap is a multiple-choice
knapsack with a max term. The max term is removed by trying each transient level
``tau`` (only options with ``transient <= tau``, budget less ``tau``), and the rest is
solved exactly:

- units in groups of identical units (the blocks of a transformer) share one layout per
  stage and choose recompute modes by count: with the options sorted by time (and hence
  by decreasing memory) the best counts follow from the numbers of the options slower
  than the fastest two by a closed form, a scan of O(k^2) vectorised cases at most;
- anything else (several kinds of repeated blocks, or all-different units as in a CNN)
  is an integer program with counts per option, solved with pulp/HiGHS.

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


def _best_counts(k: int, opts: tuple[Priced, ...], room: float, inflight: float, weights: TwoWeights | None = None):
    """Exact best counts for ``k`` identical units sharing one layout: every count of
    the options slower than the fastest two is tried, and the fastest two split the
    rest in closed form (as many of the fastest as the memory left allows; over the
    heavier and the lighter units with ``weights``, :mod:`autopar.search.split_weights`)."""
    best_t, best = math.inf, None
    for lay in sorted({o.layout for o in opts}):
        idx = _pareto(opts, [i for i, o in enumerate(opts) if o.layout == lay], inflight)
        if weights is not None:
            found = two_weights_counts(k, opts, idx, _splits(k, max(len(idx) - 2, 0)), room, inflight, weights)
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
        slow = _splits(k, len(idx) - 2)
        total, fastest = _mix_totals(np.full((1, 1, 1), float(k)), room, list(w), list(t), slow.astype(np.float64))
        total, fastest = total[0, 0], fastest[0, 0]
        j = int(np.argmin(total))
        if total[j] < best_t - 1e-15:
            best_t = float(total[j])
            n1, rest = int(fastest[j]), k - int(slow[j].sum())
            best = dict(zip(idx, [n1, rest - n1, *(int(c) for c in slow[j])]))
    if best is None:
        return None
    return best_t, {i: c for i, c in best.items() if c}


@functools.cache
def _splits(k: int, parts: int) -> np.ndarray:
    """Every vector of ``parts`` (0, 1 or 2) non-negative counts summing to at most ``k``,
    one row each (read-only: cached, as the search asks for the same few again and
    again)."""
    if parts == 0:
        out = np.zeros((1, 0), dtype=np.int64)
    elif parts == 1:
        out = np.arange(k + 1)[:, None]
    else:
        first, total = np.triu_indices(k + 1)
        out = np.stack([first, total - first], axis=1)
    out.setflags(write=False)
    return out


def _pareto(opts: tuple[Priced, ...], idx: list[int], inflight: float) -> list[int]:
    """Options sorted by time with strictly decreasing weight (dominated ones dropped).
    At most four remain for one layout (none, selective, op, full)."""
    ordered = sorted(idx, key=lambda i: (opts[i].time_s, opts[i].static_bytes + inflight * opts[i].act_bytes))
    kept: list[int] = []
    for i in ordered:
        w = opts[i].static_bytes + inflight * opts[i].act_bytes
        if not kept or w < opts[kept[-1]].static_bytes + inflight * opts[kept[-1]].act_bytes:
            kept.append(i)
    if len(kept) > 4:
        raise AssertionError(f"more than four undominated options for one layout: {len(kept)}")
    return kept


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


def homogeneous_times(
    opts: tuple[Priced, ...],
    n_max: int,
    budget_bytes: np.ndarray | float,
    inflight: np.ndarray | float,
    *,
    counts: np.ndarray | None = None,
) -> np.ndarray:
    """``out[..., n]``: the fastest time of ``n`` identical units with options ``opts`` in
    one stage (inf where they do not fit), for every ``n <= n_max`` at once (or only the
    ``counts`` given): the closed form of :func:`solve_stage` vectorised over ``n``, and
    over stages (budgets and in-flight counts given as arrays: a leading axis) that hold
    the same kind of unit (what pipeline splits of repeated blocks ask for)."""
    budgets, inflights = np.broadcast_arrays(np.atleast_1d(budget_bytes), np.atleast_1d(inflight))
    wanted = np.arange(n_max + 1) if counts is None else np.asarray(counts)
    best = np.where(wanted == 0, 0.0, np.inf)[None, :].repeat(budgets.size, axis=0)
    some = wanted > 0
    for tau in sorted({o.transient_bytes for o in opts}):
        allowed = [i for i, o in enumerate(opts) if o.transient_bytes <= tau]
        times = _run_times(opts, allowed, n_max, budgets - tau, inflights, counts=wanted)
        best[:, some] = np.minimum(best[:, some], times[:, some])
    return best if np.ndim(budget_bytes) or np.ndim(inflight) else best[0]


def single_and_run_times(
    single: tuple[Priced, ...],
    run: tuple[Priced, ...],
    n_max: int,
    budget_bytes: float,
    inflight: float,
    *,
    counts: np.ndarray | None = None,
) -> np.ndarray:
    """``out[n]``: the fastest time of one unit with options ``single`` and ``n`` identical
    units with options ``run`` in one stage (inf where they do not fit), for every
    ``n <= n_max`` at once (or only the ``counts`` given): :func:`solve_stage`'s closed
    form for a single unit beside a group (the first or last stage of a transformer: the
    embeddings or the head with blocks), vectorised over ``n`` and the single's options."""
    n = np.arange(n_max + 1) if counts is None else np.asarray(counts)
    out = np.full(n.size, np.inf)
    # one pass per set of run options a transient allows, every (transient, single) room at once
    rooms: dict[tuple[int, ...], list[tuple[float, float]]] = {}
    for tau in sorted({o.transient_bytes for o in (*single, *run)}):
        allowed = tuple(i for i, o in enumerate(run) if o.transient_bytes <= tau)
        for s in single:
            if s.transient_bytes <= tau:
                room = budget_bytes - tau - (s.static_bytes + inflight * s.act_bytes)
                rooms.setdefault(allowed, []).append((room, s.time_s))
    for allowed, pairs in rooms.items():
        room, single_s = np.array(pairs).T
        times = _run_times(run, list(allowed), n_max, room, inflight, counts=n)
        out = np.minimum(out, (single_s[:, None] + times).min(axis=0))
    return out


def _run_times(
    opts: tuple[Priced, ...],
    allowed: list[int],
    n_max: int,
    room: np.ndarray | float,
    inflight: np.ndarray | float,
    *,
    counts: np.ndarray | None = None,
) -> np.ndarray:
    """``out[..., n]``: the fastest time of ``n`` identical units sharing one layout, each
    taking one of ``opts[allowed]``, with their bytes (static plus ``inflight`` x
    activations) within ``room``; 0 for no unit where ``room`` is not negative. ``room``
    and ``inflight`` may be arrays (a leading axis of stages). Options of one layout hold
    the same model states, so their order by bytes, and which of them are worth
    keeping, do not depend on the in-flight count."""
    scalar = np.ndim(room) == 0 and np.ndim(inflight) == 0
    rooms, inflights = np.broadcast_arrays(np.atleast_1d(np.asarray(room, dtype=float)), np.atleast_1d(inflight))
    rooms, inflights = rooms[:, None, None], inflights[:, None, None]
    wanted = np.arange(n_max + 1) if counts is None else np.asarray(counts)
    n = wanted.astype(np.float64)[None, :, None]
    best = np.full((rooms.shape[0], wanted.size), np.inf)
    if not allowed:
        best[:, wanted == 0] = np.where(rooms[:, 0, 0] >= 0, 0.0, np.inf)[:, None]
        return best[0] if scalar else best
    for lay in sorted({opts[i].layout for i in allowed}):
        idx = _pareto(opts, [i for i in allowed if opts[i].layout == lay], float(inflights.flat[0]))
        w = [opts[i].static_bytes + inflights * opts[i].act_bytes for i in idx]
        t = [opts[i].time_s for i in idx]
        if len(idx) == 1:
            times = np.where(n[:, :, 0] * w[0][:, :, 0] <= rooms[:, :, 0], n[:, :, 0] * t[0], np.inf)
            best = np.minimum(best, times)
            continue
        # the last axis: every count of the options slower than the fastest two
        slow = _splits(int(wanted.max(initial=0)), len(idx) - 2).astype(np.float64)
        mixed = (slow > 0).all(axis=1) if slow.shape[1] == 2 else np.zeros(len(slow), dtype=bool)
        best = np.minimum(best, _mix_rows(n, rooms, w, t, slow[~mixed]))
        if mixed.any():
            best = np.minimum(best, _mixed_rows(n, rooms, w, t, slow[mixed], best))
    return best[0] if scalar else best


def _mix_rows(n: np.ndarray, rooms: np.ndarray, w: list, t: list, slow: np.ndarray) -> np.ndarray:
    """``out[stage, count]``: the fastest of the mixes ``slow`` (rows of counts of the
    options slower than the fastest two), in slices of at most :data:`KERNEL_ELEMENTS`."""
    out = np.full((rooms.shape[0], n.shape[1]), np.inf)
    step = max(1, KERNEL_ELEMENTS // (rooms.shape[0] * max(len(slow), 1)))
    for lo in range(0, n.shape[1], step):
        part = slice(lo, lo + step)
        out[:, part] = _mix_totals(n[:, part], rooms, w, t, slow)[0].min(axis=2)
    return out


def _mixed_rows(n: np.ndarray, rooms: np.ndarray, w: list, t: list, slow: np.ndarray, found: np.ndarray) -> np.ndarray:
    """:func:`_mix_rows` of the mixes that use both slow options, for the stages and
    counts where they can beat ``found`` (a feasible time): a mix costs at least ``n``
    fastest units plus its slow units' excess over the fastest, so rows are taken in
    order of that excess, each only where it is below ``found``'s slack. Exact, and
    where memory is loose it leaves almost every row out (the two slow options together
    are a corner case, the mixes of ``n`` units grow as ``n^2``)."""
    extra = slow @ (np.asarray(t[2:], dtype=np.float64) - t[0])
    slow = slow[np.argsort(extra, kind="stable")]
    extra = np.sort(extra, kind="stable")
    stages = np.broadcast_to(np.arange(rooms.shape[0])[:, None], found.shape)
    counts = np.broadcast_to(np.arange(n.shape[1])[None, :], found.shape)
    # where no row of one slow option fits, neither does a mix: all of the slowest holds the least
    slack = np.where(np.isfinite(found), found - n[:, :, 0] * t[0] + 1e-9 * np.maximum(1.0, np.abs(found)), -np.inf)
    out = np.full(found.shape, np.inf)
    chunk = MIXED_ROWS_PER_PASS
    for lo in range(0, len(slow), chunk):
        live = slack >= extra[lo]
        if not live.any():
            break
        k, c = stages[live], counts[live]
        e_n = n[0, c, 0][:, None, None]
        e_rooms = np.broadcast_to(rooms, (rooms.shape[0], 1, 1))[k]
        e_w = [np.broadcast_to(x, (rooms.shape[0], 1, 1))[k] for x in w]
        rows = slow[lo : lo + chunk]
        step = max(1, KERNEL_ELEMENTS // max(len(rows), 1))
        for a in range(0, len(k), step):
            part = slice(a, a + step)
            got = _mix_totals(e_n[part], e_rooms[part], [x[part] for x in e_w], t, rows)[0].min(axis=2)[:, 0]
            out[k[part], c[part]] = np.minimum(out[k[part], c[part]], got)
    return out


KERNEL_ELEMENTS = 1 << 22
"""Elements of the largest array :func:`_run_times` builds at once (32 MiB of float64):
a deep stage with four options per layout runs in slices of its counts."""
MIXED_ROWS_PER_PASS = 256
"""Mixes of both slow options :func:`_mixed_rows` prices at once, in order of their excess
time: small enough that the stages and counts left live shrink from one pass to the next."""


def _mix_totals(n: np.ndarray, rooms: np.ndarray | float, w: list, t: list, slow: np.ndarray) -> tuple:
    """The fastest mixes of a layout's options for counts ``n`` (shape ``(1, W, 1)``),
    one per row of ``slow`` (counts of the options slower than the fastest two, the
    last axis): ``(time, count of the fastest)``, each ``[stage, count, row]``, the time
    infinite where the mix does not fit ``rooms``. The fastest two split the rest in
    closed form: as many of the fastest as the memory left allows."""
    used = slow.sum(axis=1)[None, None, :]
    r = n - used
    left = rooms - sum((slow[None, None, :, j] * w[2 + j] for j in range(slow.shape[1])), np.zeros(1))
    ok = (used <= n) & ~(r * w[1] > left + 1e-9 * np.maximum(1.0, np.abs(left)))
    n1 = np.minimum(r, np.floor((left - r * w[1]) / (w[0] - w[1]) + 1e-12))
    total = n1 * t[0] + (r - n1) * t[1] + slow @ np.array(t[2:], dtype=np.float64)
    return np.where(ok, total, np.inf), n1
