"""A memory-aware lower bound of a pipeline of two kinds of blocks (Gemma 3).

The plain bound (:class:`autopar.search.bounds.TimeBound`) takes every unit at its
fastest option, whatever its memory; where memory binds (long sequences, few ranks per
model replica) that is far below any plan, and the search would solve candidates that
cannot fit at all. For a skeleton the refined bound prices each stage's blocks at the
fastest options that fit; for blocks of two kinds this module does the same through a
relaxation of the stage's knapsack: ``a`` rare and ``b`` common blocks take at least the
time ``a`` rare blocks take alone in the memory ``b`` common blocks leave at their
lightest, plus the time ``b`` common blocks take alone in the memory ``a`` rare blocks
leave at their lightest (each part's bytes and transient fit beside the other's least
bytes, so neither part can be faster than that). Beside them a stage holds at least its
own end unit at its lightest and its pipeline buffers (the least any range's bounds give,
where the split is not known), and that unit counts at its fastest time. Both kinds'
closed forms are vectorised over counts and stages
(:func:`autopar.search.run_times.homogeneous_times`), so the bound costs a fraction of
solving the candidate.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from autopar.cost.pipeline import (
    inflight_microbatches,
    least_stage_inflight,
    pipeline_lower_bound_s,
    pipeline_time_s,
)
from autopar.cost.stage import runs_buffer_bytes
from autopar.plan import ParallelConfig
from autopar.search.run_times import homogeneous_times
from autopar.search.split import least_largest, placeable
from autopar.vocab import Recompute

if TYPE_CHECKING:
    from autopar.search.solve import ConfigSolver


def relaxed_times(
    ev: ConfigSolver,
    config: ParallelConfig,
    modes: tuple[Recompute, ...],
    inflight: np.ndarray,
    room: np.ndarray,
    rare_count: np.ndarray,
    common_count: np.ndarray,
) -> np.ndarray:
    """``out[i]``: a lower bound of the time of ``rare_count[i]`` rare and
    ``common_count[i]`` common blocks in one stage with ``inflight[i]`` micro-batches in
    flight within ``room[i]`` bytes (module docstring); inf where they cannot fit."""
    shape = ev.two_kinds
    rare = ev.priced_options(shape.rare_unit, config, modes)[1]
    common = ev.priced_options(shape.common_unit, config, modes)[1]
    x = np.asarray(inflight, dtype=float)
    a, b = np.asarray(rare_count), np.asarray(common_count)
    lightest_rare = np.min([o.static_bytes + x * o.act_bytes for o in rare], axis=0)
    lightest_common = np.min([o.static_bytes + x * o.act_bytes for o in common], axis=0)
    rare_s = homogeneous_times(rare, int(a.max()), room - b * lightest_common, x, counts=a[:, None])
    common_s = homogeneous_times(common, int(b.max()), room - a * lightest_rare, x, counts=b[:, None])
    return (rare_s + common_s)[:, 0]


def refined_pipeline_s(
    ev: ConfigSolver,
    config: ParallelConfig,
    modes: tuple[Recompute, ...],
    fastest: dict[int, float],
    send_s: float,
    back_s: float,
) -> float:
    """The pipeline's part of the refined bound of ``config`` on a
    :class:`~autopar.search.two_kinds_band.TwoKinds` model: without a pipeline, the
    relaxed time of the whole model through :func:`pipeline_lower_bound_s`; with one
    stage per rank, ``(m - 1)`` times the least largest relaxed stage over every split
    plus every unit at its fastest (``fastest``: per unit kind) and every boundary's
    sends; with several, each rank's relaxed time on the even split through the
    schedule's formula. Infinite where some stage or rank cannot fit."""
    shape, n = ev.two_kinds, ev.num_units
    pp, v, m = config.pp, config.virtual_stages, config.num_microbatches
    first, last = fastest[ev.kind_rep[0]], fastest[ev.kind_rep[n - 1]]
    rare, block = shape.rare_before, shape.blocks_before
    layout = ev.any_layout(config, modes)
    reps = (0, shape.rare_unit, shape.common_unit, n - 1)

    def held_beside(x: float, ends: tuple[bool, bool], runs: list[tuple[int, int]] | None) -> float:
        """What a stage (or rank) holds beside its blocks at least: its own end units at
        their lightest (the larger alone where they may share a tied weight), and its
        pipeline buffers (``runs``: its stages; None: the least of any stage's)."""
        lightest = [
            min(o.static_bytes + x * o.act_bytes for o in ev.priced_options(u, config, modes)[1])
            for u, here in zip((0, n - 1), ends)
            if here
        ]
        # a weight tied between the two (GPT's embedding and head) may be held once
        own = max(lightest, default=0.0) if ev.model.graph.shared else sum(lightest)
        if runs is None:
            runs_of = [[(f, g)] for f in reps for g in reps]  # any kind may start or end it
            return own + min(runs_buffer_bytes(ev.model, r, config, x, layout) for r in runs_of)
        return own + runs_buffer_bytes(ev.model, runs, config, x, layout)

    if pp == 1:  # one stage of everything
        room = ev.budget_bytes - held_beside(1.0, (True, True), [(0, n - 1)])
        found = relaxed_times(ev, config, modes, np.ones(1), np.array([room]), rare[-1:], block[-1:] - rare[-1:])
        return pipeline_lower_bound_s(float(found[0]) + first + last, config)
    if v == 1:
        flights = np.array([inflight_microbatches(config.schedule, pp, 1, m, k) for k in range(pp)])
        rooms = np.array([ev.budget_bytes - held_beside(flights[k], (k == 0, k == pp - 1), None) for k in range(pp)])
        width = n - pp + 1
        _, a, b = shape.range_counts(width)
        pairs = np.stack([a, b], axis=-1).reshape(-1, 2)
        pairs, where = np.unique(pairs, axis=0, return_inverse=True)
        p = len(pairs)  # every stage with every pair, one row each
        rows = (np.repeat(flights, p), np.repeat(rooms, p), np.tile(pairs[:, 0], pp), np.tile(pairs[:, 1], pp))
        band = relaxed_times(ev, config, modes, *rows).reshape(pp, p)[:, where.reshape(a.shape)]
        band[0] += first + send_s
        band[1 : pp - 1] += send_s + back_s
        band[pp - 1] += last + back_s
        largest = least_largest(np.where(placeable(n, pp, width), band, np.inf))
        if math.isinf(largest):
            return math.inf
        total = sum(fastest[ev.kind_rep[u]] for u in range(n))
        return (m - 1) * largest + total + (pp - 1) * (send_s + back_s)
    bounds = ev.even_split(pp * v, exact=True)
    if bounds is None:
        return 0.0
    flights = np.array([least_stage_inflight(config.schedule, pp, v, m, r) for r in range(pp)])
    rooms, counts, ends = [], [], []
    for r in range(pp):
        chunks = config.stages_of_rank(r)
        here = (any(bounds[c] == 0 for c in chunks), any(bounds[c + 1] == n for c in chunks))
        runs = [(bounds[c], bounds[c + 1] - 1) for c in chunks]
        rooms.append(ev.budget_bytes - held_beside(flights[r], here, runs))
        a = sum(int(rare[bounds[c + 1]] - rare[bounds[c]]) for c in chunks)
        counts.append((a, sum(int(block[bounds[c + 1]] - block[bounds[c]]) for c in chunks) - a))
        ends.append(first * here[0] + last * here[1])
    a, b = np.array(counts).T
    times = relaxed_times(ev, config, modes, flights, np.array(rooms), a, b)  # one row per rank
    work = times + np.array(ends) + v * (send_s + back_s)
    work[0] -= back_s
    work[config.rank_of_stage(pp * v - 1)] -= send_s
    if not np.isfinite(work).all():
        return math.inf
    return pipeline_time_s(work.tolist(), m, v, schedule=config.schedule)
