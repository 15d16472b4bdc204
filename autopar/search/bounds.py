"""A lower bound of a configuration's step time, cheap enough to take for every candidate.

Every unit runs its fastest option (memory ignored), every stage boundary pays its
point-to-point, and the pipeline is split as well as those allow: for a model that is
runs of one block beside a prologue and an epilogue (a transformer), the best split of
the blocks is found exactly (the least largest stage, by bisection over how many blocks
it holds), where a balanced pipeline would ignore that the embeddings and the head sit
whole on the first and the last stage; interleaved schedules split evenly by rule, so
their ranks' work is known. What no schedule hides of the tail comes on top. No split
and no choice of options does better, so pruning by the bound loses nothing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from autopar.cost.bounds import micro_batch_scaling_holds, smallest_scaled_micro_batch, unit_floor
from autopar.cost.data_parallel import unhidden_floor_s
from autopar.cost.pipeline import inflight_microbatches, least_stage_inflight, pipeline_lower_bound_s, pipeline_time_s
from autopar.cost.stage import runs_buffer_bytes, stage_p2p_s
from autopar.plan import ParallelConfig
from autopar.search.run_times import homogeneous_times, single_and_run_times
from autopar.search.solve import ConfigSolver, Skeleton
from autopar.search.split_table import skeleton_stage_times
from autopar.search.two_kinds_bound import refined_pipeline_s
from autopar.vocab import Recompute


@dataclass(frozen=True, kw_only=True)
class _Units:
    """What the bounds of candidates with one unit structure share: each unit kind's
    fastest option time, their sum over the model, and its running sum in model order."""

    fastest: dict[int, float]
    total_s: float
    cumulative_s: np.ndarray

    def scaled(self, factor: float) -> _Units:
        """Every time times ``factor``."""
        return _Units(
            fastest={u: t * factor for u, t in self.fastest.items()},
            total_s=self.total_s * factor,
            cumulative_s=self.cumulative_s * factor,
        )


class TimeBound:
    """The lower bound of each candidate's step time (module docstring), with what
    candidates share computed once: per unit structure (tensor parallelism, sequence
    parallelism, micro-batch, precision) each unit kind's fastest option, per pipeline
    shape the pipeline's bound, per sharding the tail's.

    Three bounds, each tighter and dearer than the one before: :meth:`scaled` needs the
    options of one micro-batch size per family of candidates, :meth:`__call__` those of
    the candidate's own, :meth:`refined` solves its ranks' memory. The scan takes the
    next only for a candidate that is next in line, so most of the space never needs its
    own micro-batch size priced.
    """

    def __init__(self, solver: ConfigSolver, modes: tuple[Recompute, ...], configs: Iterable[ParallelConfig] = ()):
        self.solver = solver
        self.modes = modes
        self.shape = solver.skeleton
        self._cache: dict[tuple, Any] = {}
        self._largest: dict[tuple, int] = {}
        """Per family (:attr:`ParallelConfig.unit_family`), the largest
        micro-batch size among ``configs``: :meth:`scaled`'s reference."""
        # the fastest option is then a layout's time with no recomputation, the quantity
        # that scales; recomputing units could be cheaper at one size and not another
        if micro_batch_scaling_holds(solver.model) and Recompute.NONE in modes:
            for c in configs:
                family = c.unit_family
                self._largest[family] = max(self._largest.get(family, 0), c.micro_batch_size)

    def __call__(self, config: ParallelConfig) -> float:
        pipeline = self._pipeline_s(config, config.micro_batch_size, *self._p2p(config))
        return pipeline + self._tail_s(config)

    def scaled(self, config: ParallelConfig) -> float:
        """A looser bound, priced from the options of the family's largest micro-batch
        size ``B`` alone: every unit at ``b / B`` of its fastest time there
        (:func:`autopar.cost.bounds.micro_batch_scaling_holds`; from
        :func:`autopar.cost.bounds.smallest_scaled_micro_batch` up) and no point-to-point
        (the boundary's layout may differ between sizes); the pipeline's bound scales
        with its units' times. The plain bound where the scaling does not hold."""
        return self._scaled_pipeline(config) + self._tail_s(config)

    def scaled_with_siblings(self, config: ParallelConfig, shards: tuple[int, ...]) -> float:
        """:meth:`scaled` of the least of ``config`` and its HSDP siblings with shard groups
        ``shards``, without building them: the pipeline's part is the same for every shard
        group (their units and boundaries are), so only the tails differ."""
        if not shards:
            return self.scaled(config)
        key = (
            *config.unit_family,
            "sibling tails",
            config.pp,
            config.dp,
        )
        key += (config.zero_stage, shards)
        if key not in self._cache:
            self._cache[key] = min(self._tail_s(replace(config, dp_shard=s)) for s in shards)
        return self._scaled_pipeline(config) + min(self._tail_s(config), self._cache[key])

    def _scaled_pipeline(self, config: ParallelConfig) -> float:
        """:meth:`scaled` without the tail."""
        largest = self._largest.get(config.unit_family, 0)
        smallest = smallest_scaled_micro_batch(self.solver.model, config)
        if largest < config.micro_batch_size or config.micro_batch_size < smallest:
            return self._pipeline_s(config, config.micro_batch_size, *self._p2p(config))
        pipeline = self._pipeline_s(config, largest, 0.0, 0.0) * (config.micro_batch_size / largest)
        return pipeline * (1 - 1e-12)

    def refined(self, config: ParallelConfig) -> float:
        """A tighter lower bound, worth its cost only for a candidate the scan is about to
        solve: for an interleaved schedule on a skeleton, each rank's units at the fastest
        options that fit its memory (the stage knapsack, priced for every rank at once,
        where the plain bound takes every unit at its fastest), every boundary's send,
        and the tail's floor; on blocks of two kinds (Gemma 3), the same through a
        relaxation of each stage's knapsack (:mod:`autopar.search.two_kinds_bound`).
        Infinite where a rank cannot fit. Other candidates keep the plain bound.

        An HSDP candidate takes the pipeline part of its plain-FSDP twin: it holds more
        state per device (sharded over its group, not all of dp), so no unit gets a faster
        option that fits than its twin's, and the twin's knapsack, priced once, bounds
        every shard group's."""
        two_kinds = self.shape is None and self.solver.two_kinds is not None
        if not two_kinds and (config.pp == 1 or self.shape is None):
            return self(config)
        twin = replace(config, dp_shard=None)
        key = ("refined", twin)
        if key not in self._cache:
            if two_kinds:  # no looser than the plain bound, which holds too
                fastest, p2p = self._units(twin, twin.micro_batch_size).fastest, self._p2p(twin)
                found = refined_pipeline_s(self.solver, twin, self.modes, fastest, *p2p)
                self._cache[key] = max(found, self._pipeline_s(twin, twin.micro_batch_size, *p2p))
            else:
                self._cache[key] = self._refined_pipeline(twin)
        return self._cache[key] + self._tail_s(config)

    def _refined_pipeline(self, config: ParallelConfig) -> float:
        """:meth:`refined` without the tail."""
        shape, solver = self.shape, self.solver
        if config.virtual_stages == 1:
            return self._refined_split(config)
        pp, v, m = config.pp, config.virtual_stages, config.num_microbatches
        chunks = pp * v
        bounds = solver.even_split(chunks, exact=True)
        if bounds is None:
            return self(config)
        last = config.rank_of_stage(chunks - 1)
        ends = {0: shape.prologue, last: shape.epilogue}
        counts = []  # blocks per rank: the ends hold one fewer where the units split evenly
        for r in range(pp):
            held = sum(bounds[c + 1] - bounds[c] for c in config.stages_of_rank(r))
            held -= (r == 0 and shape.prologue is not None) + (r == last and shape.epilogue is not None)
            counts.append(held)
        # a V's two stages hold unequal counts: its blocks are bounded by the fewer
        flights = [least_stage_inflight(config.schedule, pp, v, m, r) for r in range(pp)]
        layout = solver.any_layout(config, self.modes)
        rooms = []
        for r in range(pp):
            runs = [(bounds[c], bounds[c + 1] - 1) for c in config.stages_of_rank(r)]
            rooms.append(solver.budget_bytes - runs_buffer_bytes(solver.model, runs, config, flights[r], layout))
        blocks = solver.priced_options(shape.block, config, self.modes)[1]
        distinct = sorted(set(counts))
        table = homogeneous_times(
            blocks, distinct[-1], np.asarray(rooms), np.asarray(flights), counts=np.array(distinct)
        )
        times = np.array([table[r, distinct.index(counts[r])] for r in range(pp)])
        for r, single in ends.items():
            if single is not None:
                alone = solver.priced_options(single, config, self.modes)[1]
                # in a V both land on rank 0: the epilogue's time replaces the prologue's (still a bound)
                times[r] = single_and_run_times(
                    alone, blocks, counts[r], rooms[r], flights[r], counts=np.array([counts[r]])
                )[0]
        if not np.isfinite(times).all():
            return math.inf
        send, back = self._p2p(config)
        work = times + v * (send + back)
        work[0] -= back
        work[last] -= send
        return pipeline_time_s(work.tolist(), m, v, schedule=config.schedule)

    def _refined_split(self, config: ParallelConfig) -> float:
        """One stage per rank on a skeleton, without the tail: the least largest stage over
        every split, each stage priced by how many blocks it holds at the fastest options
        that fit its memory (:func:`autopar.search.split_table.skeleton_stage_times`), and
        the sum of every unit at its fastest; infinite where no split fits."""
        shape, pp, m = self.shape, config.pp, config.num_microbatches
        flights = [inflight_microbatches(config.schedule, pp, 1, m, k) for k in range(pp)]
        width = min(shape.count, 2 * -(-shape.count // pp) + 2)
        times = skeleton_stage_times(self.solver, config, self.modes, flights, width)
        largest = _least_largest_of(times, shape.count)
        if math.isinf(largest):
            return math.inf
        send, back = self._p2p(config)
        return (m - 1) * largest + self._units(config, config.micro_batch_size).total_s + (pp - 1) * (send + back)

    def _units(self, config: ParallelConfig, micro_batch_size: int) -> _Units:
        """The unit times of ``config``'s structure on micro-batches of ``micro_batch_size``."""
        key = (
            *config.unit_family,
            micro_batch_size,
            "units",
        )
        if key not in self._cache:
            solver = self.solver
            if micro_batch_size != config.micro_batch_size:
                config = replace(config, micro_batch_size=micro_batch_size)
            fastest = {u: min(o.time_s for o in solver.options(u, config, self.modes)) for u, _ in solver.unit_kinds}
            times = np.array([fastest[solver.kind_rep[u]] for u in range(solver.num_units)])
            self._cache[key] = _Units(
                fastest=fastest,
                total_s=sum(count * fastest[u] for u, count in solver.unit_kinds),
                cumulative_s=np.concatenate(([0.0], np.cumsum(times))),
            )
        return self._cache[key]

    def _p2p(self, config: ParallelConfig) -> tuple[float, float]:
        key = (
            *config.unit_family,
            config.micro_batch_size,
            "p2p",
            config.pp,
        )
        if key not in self._cache:
            self._cache[key] = _boundary_p2p_s(self.solver, config, self.modes)
        return self._cache[key]

    def _tail_s(self, config: ParallelConfig) -> float:
        """What no schedule hides of the tail, for the fewest parameters any layout holds
        (each leaf at its fewest: :func:`autopar.cost.bounds.unit_floor`)."""
        key = (
            *config.unit_family,
            "tail",
            config.pp,
            config.dp,
            config.zero_stage,
            config.dp_shard,
        )
        if key not in self._cache:
            model = self.solver.model
            shared = sum(s.numel for s in model.graph.shared) / config.tp  # tied weights once
            self._cache[key] = unhidden_floor_s(model, config, (self._fewest_params(config) - shared) / config.pp)
        return self._cache[key]

    def _fewest_params(self, config: ParallelConfig) -> float:
        key = (
            *config.unit_family,
            "params",
        )
        if key not in self._cache:
            solver = self.solver
            self._cache[key] = sum(
                count * unit_floor(solver.model, u, config).param_numel for u, count in solver.unit_kinds
            )
        return self._cache[key]

    def _pipeline_s(self, config: ParallelConfig, micro_batch_size: int, send: float, back: float) -> float:
        """The pipeline's bound with each unit at its fastest on micro-batches of
        ``micro_batch_size`` and each boundary sending ``send`` forward and ``back``
        backward per micro-batch. What does not depend on the micro-batch count (each
        rank's work, the least largest stage) is kept per pipeline shape."""
        solver, shape = self.solver, self.shape
        pp, v, m = config.pp, config.virtual_stages, config.num_microbatches
        units = self._units(config, micro_batch_size)
        if pp == 1:
            return pipeline_lower_bound_s(units.total_s, config)
        key = (
            *config.unit_family,
            micro_batch_size,
            "pipeline",
            pp,
            v,
            config.schedule,
            send,
            back,
        )
        if v > 1:
            if key not in self._cache:
                self._cache[key] = _interleaved_rank_work(solver, config, units.cumulative_s, send, back)
            return pipeline_time_s(self._cache[key], m, v, schedule=config.schedule)
        sends = (pp - 1) * (send + back)
        if shape is None:
            return pipeline_lower_bound_s(units.total_s + sends, config)
        if key not in self._cache:
            unit_time = {
                u: units.fastest[solver.kind_rep[u]]
                for u in (shape.prologue, shape.block, shape.epilogue)
                if u is not None
            }
            self._cache[key] = _least_largest_stage_s(pp, shape, unit_time, send, back)
        return (m - 1) * self._cache[key] + units.total_s + sends


def _boundary_p2p_s(solver: ConfigSolver, config: ParallelConfig, modes: tuple[Recompute, ...]) -> tuple[float, float]:
    """The least (forward send, backward send) per micro-batch over the model's stage
    boundaries: each unit kind's as the middle of a pipeline would send it."""
    sends, backs = [], []
    n = solver.num_units
    for u, _ in solver.unit_kinds:
        f, b = stage_p2p_s(solver.model, (u,), (solver.options(u, config, modes)[0],), config)
        if u < n - 1:
            sends.append(f)
        if u > 0:
            backs.append(b)
    return min(sends, default=0.0), min(backs, default=0.0)


def _interleaved_rank_work(
    solver: ConfigSolver, config: ParallelConfig, cumulative_s: np.ndarray, send: float, back: float
) -> list[float]:
    """Each pipeline rank's work per micro-batch on the interleaved schedule's even split
    (:meth:`ConfigSolver.even_split`), every unit at its fastest (``cumulative_s``: the
    running sum of their times): a chunk sends forward unless it is the last and back
    unless it is the first."""
    pp, v = config.pp, config.virtual_stages
    bounds = solver.even_split(pp * v, exact=True)
    if bounds is None:
        return [0.0] * pp
    edges = np.asarray(bounds)
    chunk = cumulative_s[edges[1:]] - cumulative_s[edges[:-1]] + send + back
    chunk[0] -= back
    chunk[-1] -= send
    work = [0.0] * pp
    for c, t in enumerate(chunk.tolist()):
        work[config.rank_of_stage(c)] += t
    return work


def _least_largest_stage_s(pp: int, shape: Skeleton, unit_time: dict[int, float], send: float, back: float) -> float:
    """The least possible time of the largest of ``pp`` stages splitting the skeleton in
    order: each middle stage holds at least one block and pays both sends, the first holds
    the prologue (or a block) and sends forward, the last the epilogue (or a block) and
    sends back. Found over the candidate sizes of each stage type by bisection, since
    whether a size limit fits the blocks is monotone in it."""
    block = unit_time[shape.block]
    first = unit_time[shape.prologue] + send if shape.prologue is not None else send
    last = unit_time[shape.epilogue] + back if shape.epilogue is not None else back
    middle = send + back
    need_first = 0 if shape.prologue is not None else 1
    need_last = 0 if shape.epilogue is not None else 1

    if block <= 0:
        return max(first, middle if pp > 2 else 0.0, last)

    def fits(limit: float) -> bool:
        def cap(base: float) -> int:
            room = limit - base
            return math.floor(room / block * (1 + 1e-12) + 1e-12) if room >= 0 else -1

        a, b, c = cap(first), cap(last), cap(middle)
        if a < need_first or b < need_last or (pp > 2 and c < 1):
            return False
        return a + b + max(pp - 2, 0) * c >= shape.count

    best = math.inf
    for base in (first, middle, last):
        lo, hi = 0, shape.count
        if not fits(base + hi * block):
            continue
        while lo < hi:
            mid = (lo + hi) // 2
            if fits(base + mid * block):
                hi = mid
            else:
                lo = mid + 1
        best = min(best, base + lo * block)
    return best


def _least_largest_of(times: np.ndarray, count: int) -> float:
    """A lower bound of the largest stage time over the splits of ``count`` blocks into
    stages priced by ``times[k, c]`` (stage ``k`` holding ``c`` blocks, ``c`` up to the
    last count priced): a limit is taken to fit when every stage has some count within
    it and the fewest and the most such counts (any more, for a stage within it at the
    last count priced) bracket ``count``, a relaxation of the split. Found by bisection
    over the prices, since whether a limit fits is monotone in it."""
    width = times.shape[1] - 1
    counts = np.arange(width + 1)
    candidates = np.unique(times[np.isfinite(times)])

    def fits(limit: float) -> bool:
        within = times <= limit
        if not within.any(axis=1).all():
            return False
        fewest = np.where(within, counts, width + 1).min(axis=1)
        most = np.where(within[:, width], count, np.where(within, counts, -1).max(axis=1))
        return int(fewest.sum()) <= count <= int(most.sum())

    if candidates.size == 0 or not fits(candidates[-1]):
        return math.inf
    lo, hi = 0, candidates.size - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(candidates[mid]):
            hi = mid
        else:
            lo = mid + 1
    return float(candidates[lo])
