"""Solving one configuration: the stage split and each unit's option, fastest under a
memory budget.

:class:`ConfigSolver` holds what configurations of one model on one cluster share (the
unit structure, the caches of per-unit options and stage solutions) and turns a
:class:`~autopar.plan.ParallelConfig` into an :class:`Outcome`: the fastest split and
per-unit choices that fit the budget, as priced stages, or the reason nothing fits.
Every number it decides on comes from :mod:`autopar.cost`.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from autopar.cost.model import CostModel, tp_context
from autopar.cost.peak import (
    Footprint,
    fits_bucket_rebuild,
    footprint,
    held_once_numel,
    shared_state_bytes,
)
from autopar.cost.pipeline import inflight_microbatches, stage_inflight_microbatches
from autopar.cost.recompute import UnitOption
from autopar.cost.stage import PricedStage, rank_buffer_bytes, stage_p2p_s
from autopar.cost.step import timing
from autopar.cost.tensor_parallel import UnitCost
from autopar.plan import ParallelConfig, Prediction
from autopar.search.ilp import check_solver
from autopar.search.intra_op import LayoutSolver
from autopar.search.options import unit_options
from autopar.search.schedules import allowed_modes
from autopar.search.split import best_split, even_bounds_of
from autopar.search.split_table import cost_band, split_cutoff
from autopar.search.split_weights import TwoWeights
from autopar.search.stage_solver import Priced, StageChoice, solve_stage
from autopar.search.two_kinds_band import two_kinds_of
from autopar.vocab import Recompute


@dataclass(frozen=True, kw_only=True)
class Outcome:
    """The result of solving one configuration.

    Attributes:
        config: the configuration.
        fits: whether some split and choice fits the budget.
        step_time_s: its step time (inf when it does not fit).
        stages: the stages, priced (empty when it does not fit).
        min_memory_bytes: the memory per device it needs at least (its bound when it
            fits; the capacity or a bound above it when it does not).
        reason: why it does not fit.
        prediction: the cost model's prediction, for the configurations the search
            keeps.
    """

    config: ParallelConfig
    fits: bool
    step_time_s: float = math.inf
    stages: tuple[PricedStage, ...] = ()
    min_memory_bytes: float = 0.0
    reason: str = ""
    prediction: Prediction | None = None


@dataclass(frozen=True, kw_only=True)
class Skeleton:
    """A model as ``[prologue] block x count [epilogue]``: unit indices of the prologue and
    the epilogue (None where absent) and of the first block."""

    prologue: int | None
    block: int
    count: int
    epilogue: int | None


@dataclass
class ConfigSolver:
    """Solves configurations of one model on one cluster (see the module docstring).

    Attributes:
        model: the cost model's inputs.
        budget_bytes: the memory a device may allocate for the model (the capacity less
            the reserve and fragmentation, ``autopar.cost.peak.budget_bytes``; infinite to
            price a configuration whatever its memory).
        solver: ``highs`` or ``cbc``, for the integer programs.
        micro_batches: the micro-batch sizes the search will ask about (the layout ILP
            solves the ends of the range once and reuses them between).
    """

    model: CostModel
    budget_bytes: float
    solver: str = "highs"
    micro_batches: tuple[int, ...] = ()
    _options: dict = field(default_factory=dict, repr=False)
    _memo: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._layouts = LayoutSolver(solver=self.solver, micro_batches=self.micro_batches)
        check_solver(self.solver)
        graph = self.model.graph
        n = len(graph.units)
        self.unit_keys = tuple((u.profile, i == 0, i == n - 1) for i, u in enumerate(graph.units))
        first: dict[tuple, int] = {}
        counts: Counter = Counter()
        for i, key in enumerate(self.unit_keys):
            first.setdefault(key, i)
            counts[key] += 1
        self.unit_kinds = tuple((first[k], counts[k]) for k in first)
        """One representative unit per distinct (profile, position) and how many there are."""
        self.kind_rep = tuple(first[k] for k in self.unit_keys)
        """Each unit's representative: the first unit of its kind."""
        run_end = list(range(n))
        for i in range(n - 2, -1, -1):
            if self.unit_keys[i] == self.unit_keys[i + 1]:
                run_end[i] = run_end[i + 1]
        self.run_end = np.array([*run_end, n], dtype=np.int64)
        kind_ids: dict[tuple, int] = {}
        self.kind_ids = np.array(
            [kind_ids.setdefault(key, len(kind_ids)) for key in self.unit_keys] + [0], dtype=np.int64
        )
        self.skeleton = self._skeleton()
        """The model as a run of identical blocks between at most one unit on each side,
        or None where it is not (a CNN of mixed blocks): splits of a skeleton depend on
        block counts only."""
        self.two_kinds = None if self.skeleton is not None else two_kinds_of(self.unit_keys, graph)
        """The model as blocks of two kinds between its first and last unit (Gemma 3),
        or None: its splits depend on the counts of each kind."""
        sigs: dict[tuple, int] = {}
        self.range_signature = np.zeros((n + 1, n + 1), dtype=np.int64)
        for i in range(n):
            seen: dict[tuple, int] = {}
            for j in range(i + 1, n + 1):
                key = self.unit_keys[j - 1]
                seen[key] = seen.get(key, 0) + 1
                sig = (tuple(seen.items()), self.unit_keys[i], key)
                self.range_signature[i, j] = sigs.setdefault(sig, len(sigs))

    def _skeleton(self) -> Skeleton | None:
        n = len(self.unit_keys)
        start = 1 if n > 1 and self.unit_keys[0] != self.unit_keys[1] else 0
        after = int(self.run_end[start]) + 1
        if after < n - 1:
            return None
        epilogue = n - 1 if after == n - 1 else None
        return Skeleton(prologue=0 if start == 1 else None, block=start, count=after - start, epilogue=epilogue)

    @property
    def num_units(self) -> int:
        """Units of the model."""
        return len(self.model.graph.units)

    @property
    def layout_solves(self) -> int:
        """Layout ILP solves so far (for benchmarks)."""
        return self._layouts.solves

    # ----- per-unit options ---------------------------------------------------------
    def options(self, unit: int, config: ParallelConfig, modes: tuple[Recompute, ...]) -> tuple[UnitOption, ...]:
        """Options of ``unit`` (cached per distinct profile and position), in the
        recompute modes of ``modes`` its configuration allows (:func:`allowed_modes`)."""
        modes = allowed_modes(config, modes)
        n = self.num_units
        key = (
            self.model.graph.units[unit].profile,
            unit == 0,
            unit == n - 1,
            *config.unit_family,
            config.micro_batch_size,
            modes,
        )
        if key not in self._options:
            ctx = tp_context(self.model, unit, config)
            self._options[key] = unit_options(
                self.model.graph.profile_of(unit), ctx, solver=self._layouts, recompute_modes=modes
            )
        return self._options[key]

    def priced_options(
        self, unit: int, config: ParallelConfig, modes: tuple[Recompute, ...]
    ) -> tuple[tuple[UnitOption, ...], tuple[Priced, ...]]:
        """The options of ``unit`` and their knapsack items under ``config`` (identical
        options of different layouts carry different layout ids)."""
        key = ("priced", self.unit_keys[unit], self.config_key(config, modes))
        if key not in self._options:
            opts = self.options(unit, config, modes)
            lay_ids: dict[tuple, int] = {}
            priced = []
            for o in opts:
                lay = lay_ids.setdefault((o.layout.styles, o.layout.output), len(lay_ids))
                priced.append(_item(footprint(self.model, o, config), lay))
            self._options[key] = (opts, tuple(priced))
        return self._options[key]

    def any_layout(self, config: ParallelConfig, modes: tuple[Recompute, ...]) -> Callable[[int], UnitCost]:
        """A unit's first option's layout: its boundary tensors, before options are chosen
        (looked up once per kind of unit)."""
        found: dict[int, UnitCost] = {}

        def layout(u: int) -> UnitCost:
            rep = self.kind_rep[u]
            if rep not in found:
                found[rep] = self.options(rep, config, modes)[0].layout
            return found[rep]

        return layout

    def config_key(self, config: ParallelConfig, modes: tuple[Recompute, ...]) -> tuple:
        """What a unit's priced options depend on."""
        return (
            *config.unit_family,
            config.micro_batch_size,
            config.zero_stage,
            config.dp,
            config.dp_shard,
            config.pp > 1,
            config.pp > 1 and config.schedule.zero_bubble,  # deferred weight gradients (cost.peak.footprint)
            modes,
        )

    # ----- stages -------------------------------------------------------------------
    def solve_units(
        self,
        units: tuple[int, ...],
        config: ParallelConfig,
        modes: tuple[Recompute, ...],
        inflight: float,
        index: int,
        *,
        held: tuple[float, ...] | None = None,
        allowance: float = 0.0,
    ) -> tuple[PricedStage, float] | None:
        """The fastest options for ``units`` as one stage and the memory bound they take
        (None if they cannot fit). ``held``: the micro-batches each unit's stage keeps at
        the rank's peak, where they differ from ``inflight`` (a V's two stages).
        ``allowance``: bytes the bound may take beyond the budget, where the rank's peak
        is known to stay below its bound by that much (:mod:`autopar.search.walk_room`)."""
        if units[-1] - units[0] + 1 == len(units):  # contiguous: the precomputed range signature
            content: object = int(self.range_signature[units[0], units[-1] + 1])
        else:  # a rank's stages: its units' kinds in order, and where one stage ends
            content = (tuple(self.unit_keys[u] for u in units), tuple(b > a + 1 for a, b in itertools.pairwise(units)))
        pipeline = (config.num_microbatches, config.virtual_stages) if config.pp > 1 else ()
        key = (content, self.config_key(config, modes), inflight, pipeline, held, allowance)
        if key not in self._memo:
            self._memo[key] = self._solve(units, config, modes, inflight, held, allowance)
        found = self._memo[key]
        if found is None:
            return None
        # the same content may order its kinds otherwise (Gemma 3's global layers): each
        # kind's options go to this stage's own units of that kind
        choice, picks = found
        chosen = {u: o for k, group in self._members(units, inflight, held).items() for u, o in zip(group, picks[k])}
        options = tuple(chosen[u] for u in units)
        return PricedStage(index=index, units=units, options=options, inflight=inflight), choice.memory_bytes

    def _members(
        self, units: tuple[int, ...], inflight: float, held: tuple[float, ...] | None
    ) -> dict[tuple, list[int]]:
        """A stage's units by kind, each kind's in the order its options are handed out:
        as they come, the heavier first where their stages hold unequal micro-batches
        (a V's rank)."""
        members: dict[tuple, list[int]] = {}
        for u in units:
            members.setdefault(self.unit_keys[u], []).append(u)
        if held is not None:
            weight = dict(zip(units, held))
            for group in members.values():
                group.sort(key=lambda u: -weight[u])
        return members

    def _solve(
        self,
        units: tuple[int, ...],
        config: ParallelConfig,
        modes: tuple[Recompute, ...],
        inflight: float,
        held: tuple[float, ...] | None,
        allowance: float,
    ) -> tuple[StageChoice, dict[tuple, tuple[UnitOption, ...]]] | None:
        """The choice for ``units`` and, per kind, the options its units take, in the
        order of :meth:`_members`."""
        members = self._members(units, inflight, held)
        groups_keys = list(members)
        # a unit whose stage holds h micro-batches weighs its activations h / inflight times
        weight = {} if held is None else {u: h / inflight for u, h in zip(units, held)}
        groups, group_opts, weights = [], [], []
        for k in groups_keys:
            opts, priced = self.priced_options(members[k][0], config, modes)
            two = None
            if held is not None:  # the heavier first
                heavy, light = weight[members[k][0]], weight[members[k][-1]]
                if heavy != light:  # a V's kind in both of the rank's stages
                    two = TwoWeights(heavy_units=sum(weight[u] == heavy for u in members[k]), heavy=heavy, light=light)
                elif heavy != 1.0:
                    priced = tuple(replace(p, act_bytes=p.act_bytes * heavy) for p in priced)
            groups.append((len(members[k]), priced))
            group_opts.append(opts)
            weights.append(two)

        def assign(choice: StageChoice) -> dict[tuple, tuple[UnitOption, ...]]:
            picks = {}
            for k, opts, (_, priced), counts in zip(groups_keys, group_opts, groups, choice.counts):
                order = list(range(len(opts)))
                if held is not None:  # smallest activations first, to the heavier units
                    order.sort(key=lambda i: priced[i].act_bytes)
                picks[k] = tuple(opts[i] for i in order for _ in range(counts[i]))
            return picks

        budget = (
            self.budget_bytes
            + allowance
            - rank_buffer_bytes(self.model, units, config, inflight, self.any_layout(config, modes))
        )
        # a tied weight both of whose owners are here is held once where their layouts
        # split it alike (autopar.runtime.tied.retie): the stage may count that saving only
        # with such layouts, so each pair of them is solved with its saving, beside the
        # choice without it, and the fastest that fits is taken
        choice, shared = solve_stage(groups, budget, inflight, self.solver, weights), 0.0
        for restricted, picked, saving in self._tied_layouts(units, config, groups, group_opts, groups_keys):
            if choice is not None and sum(k * min(p.time_s for p in o) for k, o in restricted) >= choice.time_s:
                continue  # not even its fastest options would be faster
            found = solve_stage(restricted, budget + saving, inflight, self.solver, weights)
            if found is not None and (choice is None or found.time_s < choice.time_s - 1e-15):
                counts = tuple(
                    tuple(c[idx.index(i)] if i in idx else 0 for i in range(len(opts)))
                    for (_, opts), c, idx in zip(groups, found.counts, picked)
                )
                choice, shared = replace(found, counts=counts), saving
        if choice is None:
            return None
        taken = [(p, c) for (_, opts), cs in zip(groups, choice.counts) for p, c in zip(opts, cs) if c]
        if not fits_bucket_rebuild(taken, shared, self.budget_bytes + allowance):
            return None
        return choice, assign(choice)

    def _tied_layouts(self, units, config, groups, group_opts, groups_keys):
        """Per tied weight whose two owners are single units of this stage, per pair of
        their layouts that holds it once: the groups with the owners' options cut to that
        pair, the option indices kept per group, and the bytes holding it once saves."""
        model = self.model
        for s in model.graph.shared:
            if s.first_unit not in units or s.second_unit not in units:
                continue
            ga, gb = (groups_keys.index(self.unit_keys[u]) for u in (s.first_unit, s.second_unit))
            if ga == gb or groups[ga][0] != 1 or groups[gb][0] != 1:
                continue  # an owner among identical units: no saving counted
            for la in sorted({p.layout for p in groups[ga][1]}):
                for lb in sorted({p.layout for p in groups[gb][1]}):
                    picked = [tuple(range(len(opts))) for _, opts in groups]
                    picked[ga] = tuple(i for i, p in enumerate(groups[ga][1]) if p.layout == la)
                    picked[gb] = tuple(i for i, p in enumerate(groups[gb][1]) if p.layout == lb)
                    pair = {s.first_unit: group_opts[ga][picked[ga][0]], s.second_unit: group_opts[gb][picked[gb][0]]}
                    numel = held_once_numel(model, config, pair)
                    if numel:
                        restricted = [(k, tuple(opts[i] for i in idx)) for (k, opts), idx in zip(groups, picked)]
                        yield restricted, picked, shared_state_bytes(model, config, numel)

    def stage_cost_s(self, stage: PricedStage, config: ParallelConfig) -> float:
        """Per-micro-batch time of a stage (units and point-to-point)."""
        f, b = stage_p2p_s(self.model, stage.units, stage.options, config)
        return stage.time_s + f + b

    # ----- whole configurations -----------------------------------------------------
    def evaluate(self, config: ParallelConfig, modes: tuple[Recompute, ...]) -> Outcome:
        """The fastest split and choices of ``config`` within the budget."""
        pp, v = config.pp, config.virtual_stages
        solved: list[tuple[PricedStage, float]] | None
        if v > 1:
            solved = self.interleaved(config, modes)
        else:
            inflight = [inflight_microbatches(config.schedule, pp, v, config.num_microbatches, k) for k in range(pp)]
            cutoff = split_cutoff(self, config, modes, inflight)
            found = best_split(cost_band(self, config, modes, inflight, cutoff), config.num_microbatches)
            solved = None
            if found is not None:
                bounds = found[1]
                solved = []
                for k in range(pp):
                    stage = self.solve_units(tuple(range(bounds[k], bounds[k + 1])), config, modes, inflight[k], k)
                    if stage is None:
                        solved = None
                        break
                    solved.append(stage)
        if solved is None:
            return Outcome(
                config=config,
                fits=False,
                min_memory_bytes=self.model.cluster.device.memory.capacity_bytes,
                reason="out of memory: no split and per-unit choice fits",
            )
        stages = tuple(s for s, _ in solved)
        return Outcome(
            config=config,
            fits=True,
            step_time_s=timing(self.model, config, stages).step_s,
            stages=stages,
            min_memory_bytes=max(m for _, m in solved) + self.model.cluster.device.memory.reserved_bytes,
        )

    def even_split(self, pp: int, *, exact: bool = False) -> tuple[int, ...] | None:
        """Blocks spread as evenly as possible over ``pp`` stages (prologue first, epilogue
        last), or None if there are fewer blocks than stages; with ``exact``, the rule for
        interleaved stages (:func:`autopar.search.split.even_bounds`)."""
        key = ("even", pp, exact)
        if key not in self._memo:
            self._memo[key] = self._even_split(pp, exact)
        return self._memo[key]

    def _even_split(self, pp: int, exact: bool) -> tuple[int, ...] | None:
        return even_bounds_of(self.model.graph.units, pp, exact=exact)

    def interleaved(
        self, config: ParallelConfig, modes: tuple[Recompute, ...], allowances: Sequence[float] = ()
    ) -> list[tuple[PricedStage, float]] | None:
        """Interleaved 1F1B: blocks split evenly over the pp x v chunks (Megatron-LM's
        rule), the prologue on chunk 0 and the epilogue on the last, or the units evenly
        where only they divide (:func:`autopar.search.split.even_bounds`); each rank's options
        are chosen over the union of its chunks, under its memory (and its entry of
        ``allowances`` beyond the budget, where given). Each chunk's stage carries its own
        units and its rank's memory bound (the rank is what memory binds)."""
        chunks = config.pp * config.virtual_stages
        bounds = self.even_split(chunks, exact=True)
        if bounds is None:
            return None
        per_rank: dict[int, tuple[PricedStage, float]] = {}
        pp, v, m = config.pp, config.virtual_stages, config.num_microbatches
        stage_held = [stage_inflight_microbatches(config.schedule, pp, v, m, c) for c in range(chunks)]
        for r in range(config.pp):
            mine = config.stages_of_rank(r)
            units = tuple(u for c in mine for u in range(bounds[c], bounds[c + 1]))
            infl = inflight_microbatches(config.schedule, pp, v, m, r)
            held = tuple(stage_held[c] for c in mine for _ in range(bounds[c], bounds[c + 1]))
            unequal = len(set(held)) > 1  # a V's stages, interleaved 1F1B's first and last chunks
            extra = allowances[r] if allowances else 0.0
            found = self.solve_units(units, config, modes, infl, r, held=held if unequal else None, allowance=extra)
            if found is None:
                return None
            per_rank[r] = found
        out = []
        for c in range(chunks):
            rank_stage, memory = per_rank[config.rank_of_stage(c)]
            idx = [rank_stage.units.index(u) for u in range(bounds[c], bounds[c + 1])]
            options = tuple(rank_stage.options[i] for i in idx)
            stage = PricedStage(
                index=c, units=tuple(range(bounds[c], bounds[c + 1])), options=options, inflight=stage_held[c]
            )
            out.append((stage, memory))
        return out


def _item(print_: Footprint, layout: int) -> Priced:
    """A knapsack item from an option's footprint."""
    return Priced(
        time_s=print_.time_s,
        static_bytes=print_.static_bytes,
        act_bytes=print_.act_bytes,
        transient_bytes=print_.transient_bytes,
        layout=layout,
        rebuild_bytes=print_.rebuild_bytes,
    )
