"""The fastest times of runs of identical units in one stage, as arrays.

A run of ``n`` identical units sharing one layout chooses a recompute mode per unit:
with the options of a layout sorted by time (and hence by decreasing memory), the best
counts follow from every count of the options slower than the fastest two, the fastest
two splitting the rest in closed form (as many of the fastest as the memory left
allows). :func:`homogeneous_times` and :func:`single_and_run_times` evaluate that closed
form for every count at once, and over stages (their budgets and in-flight counts as a
leading axis): what the pipeline split's band of a transformer asks for
(:mod:`autopar.search.split_table`), and what :mod:`autopar.search.stage_solver`'s
knapsack uses for one or two kinds of repeated units.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from autopar.search.stage_solver import Priced


@functools.cache
def splits(k: int, parts: int) -> np.ndarray:
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


def pareto(opts: tuple[Priced, ...], idx: list[int], inflight: float) -> list[int]:
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
    ``counts`` given, shared or one row per stage as :func:`run_times` takes them): the
    closed form of :func:`solve_stage` vectorised over ``n``, and
    over stages (budgets and in-flight counts given as arrays: a leading axis) that hold
    the same kind of unit (what pipeline splits of repeated blocks ask for)."""
    budgets, inflights = np.broadcast_arrays(np.atleast_1d(budget_bytes), np.atleast_1d(inflight))
    wanted = np.arange(n_max + 1) if counts is None else np.asarray(counts)
    some = wanted > 0
    best = np.broadcast_to(np.where(some, np.inf, 0.0), (budgets.size, wanted.shape[-1])).copy()
    for tau in sorted({o.transient_bytes for o in opts}):
        allowed = [i for i, o in enumerate(opts) if o.transient_bytes <= tau]
        times = run_times(opts, allowed, n_max, budgets - tau, inflights, counts=wanted)
        best = np.where(some, np.minimum(best, times), best)
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
        times = run_times(run, list(allowed), n_max, room, inflight, counts=n)
        out = np.minimum(out, (single_s[:, None] + times).min(axis=0))
    return out


def run_times(
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
    and ``inflight`` may be arrays (a leading axis of stages); ``counts``, where given,
    the counts to price, for all of them or (two axes) one row per stage. Options of one
    layout hold the same model states, so their order by bytes, and which of them are
    worth keeping, do not depend on the in-flight count."""
    scalar = np.ndim(room) == 0 and np.ndim(inflight) == 0
    rooms, inflights = np.broadcast_arrays(np.atleast_1d(np.asarray(room, dtype=float)), np.atleast_1d(inflight))
    rooms, inflights = rooms[:, None, None], inflights[:, None, None]
    wanted = np.arange(n_max + 1) if counts is None else np.asarray(counts)
    n = wanted.astype(np.float64)[..., None] if wanted.ndim == 2 else wanted.astype(np.float64)[None, :, None]
    best = np.full((rooms.shape[0], wanted.shape[-1]), np.inf)
    if not allowed:
        best[...] = np.where((wanted == 0) & (rooms[:, :, 0] >= 0), 0.0, np.inf)
        return best[0] if scalar else best
    for lay in sorted({opts[i].layout for i in allowed}):
        idx = pareto(opts, [i for i in allowed if opts[i].layout == lay], float(inflights.flat[0]))
        w = [opts[i].static_bytes + inflights * opts[i].act_bytes for i in idx]
        t = [opts[i].time_s for i in idx]
        if len(idx) == 1:
            times = np.where(n[:, :, 0] * w[0][:, :, 0] <= rooms[:, :, 0], n[:, :, 0] * t[0], np.inf)
            best = np.minimum(best, times)
            continue
        # the last axis: every count of the options slower than the fastest two
        slow = splits(int(wanted.max(initial=0)), len(idx) - 2).astype(np.float64)
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
        out[:, part] = mix_totals(n[:, part], rooms, w, t, slow)[0].min(axis=2)
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
    n_of = np.broadcast_to(n, (*found.shape, 1))  # counts are per stage or shared
    # where no row of one slow option fits, neither does a mix: all of the slowest holds the least
    slack = np.where(np.isfinite(found), found - n[:, :, 0] * t[0] + 1e-9 * np.maximum(1.0, np.abs(found)), -np.inf)
    out = np.full(found.shape, np.inf)
    chunk = MIXED_ROWS_PER_PASS
    for lo in range(0, len(slow), chunk):
        live = slack >= extra[lo]
        if not live.any():
            break
        k, c = stages[live], counts[live]
        e_n = n_of[k, c, 0][:, None, None]
        e_rooms = np.broadcast_to(rooms, (rooms.shape[0], 1, 1))[k]
        e_w = [np.broadcast_to(x, (rooms.shape[0], 1, 1))[k] for x in w]
        rows = slow[lo : lo + chunk]
        step = max(1, KERNEL_ELEMENTS // max(len(rows), 1))
        for a in range(0, len(k), step):
            part = slice(a, a + step)
            got = mix_totals(e_n[part], e_rooms[part], [x[part] for x in e_w], t, rows)[0].min(axis=2)[:, 0]
            out[k[part], c[part]] = np.minimum(out[k[part], c[part]], got)
    return out


KERNEL_ELEMENTS = 1 << 22
"""Elements of the largest array :func:`run_times` builds at once (32 MiB of float64):
a deep stage with four options per layout runs in slices of its counts."""
MIXED_ROWS_PER_PASS = 256
"""Mixes of both slow options :func:`_mixed_rows` prices at once, in order of their excess
time: small enough that the stages and counts left live shrink from one pass to the next."""


def mix_totals(n: np.ndarray, rooms: np.ndarray | float, w: list, t: list, slow: np.ndarray) -> tuple:
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
