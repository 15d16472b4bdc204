"""The cost of one configuration: per-unit options, the stage split, the prediction.

:class:`Evaluator` holds what is shared between configurations (the model, the cluster,
the caches of per-unit layouts) and turns a :class:`ParallelConfig` into an
:class:`Outcome`: the fastest split and per-unit choices that fit, with its
:class:`Prediction`, or the reason it does not fit and by how much.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from autopar.cluster import Cluster
from autopar.cost.comm import all_gather_s, group_span, p2p_s, reduce_scatter_s
from autopar.cost.compute import optimizer_step_s, rates
from autopar.cost.memory import state_bytes
from autopar.cost.pipeline import inflight_microbatches, stage_buffer_bytes
from autopar.cost.tensor_parallel import Layout, TPContext, UnitCost
from autopar.graph.layer_graph import LayerGraph
from autopar.plan import LayerStrategies, ParallelConfig, Prediction
from autopar.search.ilp import make_solver
from autopar.search.intra_op import LayoutSolver
from autopar.search.options import UnitOption, unit_options
from autopar.search.split import best_split
from autopar.search.stage_solver import Priced, StageChoice, solve_stage
from autopar.vocab import Optimizer, Recompute, TPStyle

WEIGHT_SPLIT: dict[TPStyle, int | None] = {
    TPStyle.REPLICATE: None,
    TPStyle.SEQUENCE: None,
    TPStyle.COLUMN: 0,
    TPStyle.VOCAB: 0,
    TPStyle.ROW: 1,
}
"""The dimension of a leaf's weight its style splits (a Linear's ``(out, in)``, an
Embedding's ``(vocabulary, dim)``, as torch's ``ColwiseParallel``/``RowwiseParallel``
place them), None where it stays whole."""


@dataclass(frozen=True, kw_only=True)
class StagePlan:
    """A solved stage: its units and the option each took."""

    index: int
    units: tuple[int, ...]
    options: tuple[UnitOption, ...]
    inflight: float
    choice: StageChoice


@dataclass(frozen=True, kw_only=True)
class Outcome:
    """The result of evaluating one configuration."""

    config: ParallelConfig
    fits: bool
    step_time_s: float = math.inf
    stages: tuple[StagePlan, ...] = ()
    min_memory_bytes: float = 0.0
    reason: str = ""
    prediction: Prediction | None = None


@dataclass
class Evaluator:
    """Evaluates configurations of one model on one cluster (see module docstring)."""

    graph: LayerGraph
    cluster: Cluster
    optimizer: Optimizer
    global_batch_size: int
    solver: str = "highs"
    micro_batches: tuple[int, ...] = ()
    calibration: Mapping[str, float] = field(default_factory=dict)
    """Unit profile signature -> measured / predicted compute time, from a profile."""
    recompute_fractions: Mapping[str, float] = field(default_factory=dict)
    """Unit profile signature -> recomputed over recorded forward time, from a profile."""
    _options: dict = field(default_factory=dict, repr=False)
    memo: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._layouts = LayoutSolver(solver=self.solver, micro_batches=self.micro_batches)
        self._ilp = make_solver(self.solver)
        n = len(self.graph.units)
        self.unit_keys = tuple((u.profile, i == 0, i == n - 1) for i, u in enumerate(self.graph.units))
        first: dict[tuple, int] = {}
        counts: Counter = Counter()
        for i, key in enumerate(self.unit_keys):
            first.setdefault(key, i)
            counts[key] += 1
        self._kinds = tuple((first[k], counts[k]) for k in first)
        run_end = list(range(n))
        for i in range(n - 2, -1, -1):
            if self.unit_keys[i] == self.unit_keys[i + 1]:
                run_end[i] = run_end[i + 1]
        self.run_end = np.array([*run_end, n], dtype=np.int64)
        kind_ids: dict[tuple, int] = {}
        self.kind_ids = np.array(
            [kind_ids.setdefault(key, len(kind_ids)) for key in self.unit_keys] + [0], dtype=np.int64
        )
        sigs: dict[tuple, int] = {}
        self.range_signature = np.zeros((n + 1, n + 1), dtype=np.int64)
        for i in range(n):
            counts: dict[tuple, int] = {}
            for j in range(i + 1, n + 1):
                key = self.unit_keys[j - 1]
                counts[key] = counts.get(key, 0) + 1
                sig = (tuple(counts.items()), self.unit_keys[i], key)
                self.range_signature[i, j] = sigs.setdefault(sig, len(sigs))

    @property
    def unit_kinds(self) -> tuple[tuple[int, int], ...]:
        """One representative unit per distinct (profile, position) and how many there are."""
        return self._kinds

    @property
    def layout_solves(self) -> int:
        """ILP solves so far (for benchmarks)."""
        return self._layouts.solves

    # ----- per-unit options ---------------------------------------------------------
    def tp_context(self, unit: int, config: ParallelConfig) -> TPContext:
        """The tensor-parallel context of a unit under ``config``."""
        n = len(self.graph.units)
        signature = self.graph.profile_of(unit).signature
        return TPContext(
            tp=config.tp,
            span=group_span(config.tp, 1, self.cluster.devices_per_node),
            cluster=self.cluster,
            rates=rates(self.cluster.device, config.dtype),
            micro_batch=config.micro_batch_size,
            tokens=self.graph.seq_len,
            boundary=Layout.Q if config.sequence_parallel else Layout.R,
            first=unit == 0,
            last=unit == n - 1,
            loss_parallel=self.graph.vocab_size > 0,
            sequence_parallel=config.sequence_parallel,
            compute_scale=self.calibration.get(signature, 1.0),
            recompute_fraction=self.recompute_fractions.get(signature, 1.0),
            op_overhead_s=self.cluster.device.op_overhead_s,
            tp_overhead_s=self.cluster.device.tp_overhead_s,
            exposed_weight_traffic=self.cluster.device.exposed_weight_traffic,
        )

    def options(self, unit: int, config: ParallelConfig, modes: tuple[Recompute, ...]) -> tuple[UnitOption, ...]:
        """Options of ``unit`` (cached per distinct profile and position)."""
        n = len(self.graph.units)
        key = (
            self.graph.units[unit].profile,
            unit == 0,
            unit == n - 1,
            config.tp,
            config.sequence_parallel,
            config.micro_batch_size,
            config.dtype,
            modes,
        )
        if key not in self._options:
            self._options[key] = unit_options(
                self.graph.profile_of(unit), self.tp_context(unit, config), solver=self._layouts, recompute_modes=modes
            )
        return self._options[key]

    # ----- pricing ------------------------------------------------------------------
    def price(self, opt: UnitOption, config: ParallelConfig, layout_id: int) -> Priced:
        st = state_bytes(
            param_numel=opt.layout.param_numel,
            factored_numel=opt.layout.factored_numel,
            largest_unit_numel=opt.layout.param_numel,
            dtype=config.dtype,
            optimizer=self.optimizer,
            zero_stage=config.zero_stage,
            dp=config.dp,
            pipelined=config.pp > 1,
            tp=config.tp,
        )
        # the loss's backward is over, and what it kept but the logits freed, before the
        # unit's gathers and reductions begin (fully recomputed, those stay activations)
        lay = opt.layout
        freed = lay.loss_working_bytes + (
            lay.loss_saved_bytes - lay.held_output_bytes if opt.recompute is not Recompute.FULL else 0.0
        )
        transient = max(opt.transient_bytes, opt.transient_bytes - freed + st.transient_bytes)
        return Priced(
            time_s=opt.time_s,
            static_bytes=st.params_bytes + st.grads_bytes + st.optimizer_bytes,
            act_bytes=opt.act_bytes,
            transient_bytes=transient,
            layout=layout_id,
            rebuild_bytes=st.rebuild_bytes,
        )

    def priced_options(
        self, unit: int, config: ParallelConfig, modes: tuple[Recompute, ...]
    ) -> tuple[tuple[UnitOption, ...], tuple[Priced, ...]]:
        """The options of ``unit`` and their prices under ``config`` (identical
        options of different layouts carry different layout ids)."""
        key = ("priced", self.unit_keys[unit], self.config_key(config, modes))
        if key not in self._options:
            opts = self.options(unit, config, modes)
            lay_ids: dict[tuple, int] = {}
            priced = []
            for o in opts:
                lay = lay_ids.setdefault((o.layout.styles, o.layout.output), len(lay_ids))
                priced.append(self.price(o, config, lay))
            self._options[key] = (opts, tuple(priced))
        return self._options[key]

    def held_once_numel(self, config: ParallelConfig, options: Mapping[int, UnitOption]) -> float:
        """Elements of tied parameters that both owners' ``options`` (unit -> option)
        count but one rank holds as one tensor: both owners on the rank, splitting the
        weight alike (``autopar.runtime.tied.retie``). A replicated embedding and a
        column-parallel head are two tensors: measured on 2 tensor-parallel ranks (the
        benchmark GPT), parameters and AdamW state took 3 MiB more than with the
        tied weight counted once."""
        numel = 0.0
        for s in self.graph.shared:
            if s.first_unit not in options or s.second_unit not in options:
                continue
            splits = {
                WEIGHT_SPLIT[self._owner_style(options[u], u, m)]
                for u, m in ((s.first_unit, s.first_module), (s.second_unit, s.second_module))
            }
            if len(splits) == 1:
                numel += s.numel / (config.tp if splits != {None} else 1)
        return numel

    def _owner_style(self, option: UnitOption, unit: int, module: str) -> TPStyle:
        """The style ``option`` gives the leaf ``module`` of ``unit`` (replicate if no leaf is it)."""
        u = self.graph.units[unit]
        for leaf, style in zip(self.graph.profile_of(unit).leaves, option.layout.styles):
            if u.leaf_fqn(leaf.name) == module:
                return style
        return TPStyle.REPLICATE

    def shared_state_bytes(self, config: ParallelConfig, numel: float) -> float:
        """State bytes of ``numel`` tied elements counted twice."""
        st = state_bytes(
            param_numel=numel,
            factored_numel=numel,
            largest_unit_numel=0.0,
            dtype=config.dtype,
            optimizer=self.optimizer,
            zero_stage=config.zero_stage,
            dp=config.dp,
            pipelined=config.pp > 1,
            tp=config.tp,
        )
        return st.params_bytes + st.grads_bytes + st.optimizer_bytes

    def pipeline_buffer_bytes(
        self, units: tuple[int, ...], config: ParallelConfig, inflight: float, layout: Callable[[int], UnitCost]
    ) -> float:
        """What the pipeline schedule holds for ``units`` (one rank's stages: each run of
        consecutive units is one, in order) beyond their activations
        (:func:`stage_buffer_bytes`), with ``layout(u)`` the layout unit ``u`` takes (its
        boundary tensors are the same in every option)."""
        if config.pp == 1:
            return 0.0
        n = len(self.graph.units)
        total = 0.0
        start = 0
        for i in range(1, len(units) + 1):
            if i == len(units) or units[i] != units[i - 1] + 1:
                first, last = units[start], units[i - 1]
                total += stage_buffer_bytes(
                    receives_input=first > 0,
                    sends_output=last < n - 1,
                    input_bytes=layout(first).input_bytes,
                    output_bytes=layout(last).output_bytes,
                    num_microbatches=config.num_microbatches,
                    inflight=inflight,
                )
                start = i
        return total

    def any_layout(self, config: ParallelConfig, modes: tuple[Recompute, ...]) -> Callable[[int], UnitCost]:
        """A unit's first option's layout: its boundary tensors, before options are chosen."""
        return lambda u: self.options(u, config, modes)[0].layout

    def budget(self) -> float:
        """Bytes the model may allocate: capacity less the fixed reserve, less the
        allocator's fragmentation on what is allocated."""
        dev = self.cluster.device
        return (dev.memory_bytes - dev.reserved_bytes) / (1 + dev.fragmentation)

    # ----- stages -------------------------------------------------------------------
    def solve_units(
        self,
        units: tuple[int, ...],
        config: ParallelConfig,
        modes: tuple[Recompute, ...],
        inflight: float,
        stage_index: int,
    ) -> StagePlan | None:
        """Fastest options for ``units`` as one stage (None if they cannot fit)."""
        found = self._solve_memo(units, config, modes, inflight)
        if found is None:
            return None
        choice, options = found
        return StagePlan(index=stage_index, units=units, options=options, inflight=inflight, choice=choice)

    def config_key(self, config: ParallelConfig, modes: tuple[Recompute, ...]) -> tuple:
        return (
            config.tp,
            config.sequence_parallel,
            config.micro_batch_size,
            config.dtype,
            config.zero_stage,
            config.dp,
            config.pp > 1,
            modes,
        )

    def _solve_memo(
        self, units: tuple[int, ...], config: ParallelConfig, modes: tuple[Recompute, ...], inflight: float
    ) -> tuple[StageChoice, tuple[UnitOption, ...]] | None:
        if units[-1] - units[0] + 1 == len(units):  # contiguous: the precomputed range signature
            content: object = int(self.range_signature[units[0], units[-1] + 1])
        else:
            content = tuple(self.unit_keys[u] for u in units)
        pipeline = (config.num_microbatches, config.virtual_stages) if config.pp > 1 else ()
        key = (content, self.config_key(config, modes), inflight, pipeline)
        if key not in self.memo:
            self.memo[key] = self._solve(units, config, modes, inflight)
        return self.memo[key]

    def _solve(
        self, units: tuple[int, ...], config: ParallelConfig, modes: tuple[Recompute, ...], inflight: float
    ) -> tuple[StageChoice, tuple[UnitOption, ...]] | None:
        groups_keys: list[tuple] = []
        members: dict[tuple, list[int]] = {}
        for u in units:
            k = self.unit_keys[u]
            if k not in members:
                members[k] = []
                groups_keys.append(k)
            members[k].append(u)
        groups = []
        group_opts = []
        for k in groups_keys:
            opts, priced = self.priced_options(members[k][0], config, modes)
            groups.append((len(members[k]), priced))
            group_opts.append(opts)

        def assign(choice: StageChoice) -> dict[int, UnitOption]:
            chosen: dict[int, UnitOption] = {}
            for k, opts, counts in zip(groups_keys, group_opts, choice.counts):
                picks = [o for o, c in zip(opts, counts) for _ in range(c)]
                for u, o in zip(members[k], picks):
                    chosen[u] = o
            return chosen

        # tied weights held once at most (both owners replicated); if the options taken
        # keep them apart, the stage must fit with what they save, else solve without
        bound = sum(s.numel for s in self.graph.shared if s.first_unit in units and s.second_unit in units)
        shared = self.shared_state_bytes(config, bound) if bound else 0.0
        budget = self.budget() - self.pipeline_buffer_bytes(units, config, inflight, self.any_layout(config, modes))
        choice = solve_stage(groups, budget + shared, inflight, self._ilp)
        chosen = assign(choice) if choice is not None else {}
        if choice is not None and shared:
            shared = self.shared_state_bytes(config, self.held_once_numel(config, chosen))
            if choice.memory_bytes > budget + shared:
                shared = 0.0
                choice = solve_stage(groups, budget, inflight, self._ilp)
                chosen = assign(choice) if choice is not None else {}
        if choice is None or not self._fits_bucket_rebuild(groups, choice, shared):
            return None
        return choice, tuple(chosen[u] for u in units)

    def _fits_bucket_rebuild(
        self, groups: list[tuple[int, tuple[Priced, ...]]], choice: StageChoice, shared: float
    ) -> bool:
        """Whether the stage also fits DDP's one-time bucket rebuild: its model states
        plus a second copy of its gradients (``autopar.cost.memory``), tied parameters
        (``shared`` bytes of state, counted by both owners) once. Only DDP (tp = 1)
        rebuilds, where every option of a unit holds the same states, so the check
        cannot prefer another choice."""
        chosen = [(o, c) for (_, opts), cs in zip(groups, choice.counts) for o, c in zip(opts, cs) if c]
        static = sum(c * o.static_bytes for o, c in chosen)
        rebuild = sum(c * o.rebuild_bytes for o, c in chosen)
        if rebuild == 0.0:
            return True
        return (static - shared) * (1 + rebuild / static) <= self.budget()

    def stage_p2p_s(
        self, stage_units: tuple[int, ...], options: tuple[UnitOption, ...], config: ParallelConfig
    ) -> tuple[float, float]:
        """(forward, backward) point-to-point seconds per micro-batch of a stage."""
        if config.pp == 1:
            return 0.0, 0.0
        cross = config.tp * config.dp >= self.cluster.devices_per_node
        n = len(self.graph.units)
        fwd = (
            p2p_s(options[-1].layout.output_bytes, cross_node=cross, cluster=self.cluster)
            if stage_units[-1] < n - 1
            else 0.0
        )
        bwd = (
            p2p_s(options[0].layout.input_bytes, cross_node=cross, cluster=self.cluster) if stage_units[0] > 0 else 0.0
        )
        return fwd, bwd

    def stage_cost_s(self, plan: StagePlan, config: ParallelConfig) -> float:
        """Per-micro-batch time of a stage (units and point-to-point)."""
        f, b = self.stage_p2p_s(plan.units, plan.options, config)
        return plan.choice.time_s + f + b

    def bound_s(self, config: ParallelConfig, modes: tuple[Recompute, ...]) -> float:
        """A lower bound of the step time: every unit at its fastest option, the pipeline
        perfectly balanced, plus the optimizer step and the data-parallel traffic that
        no schedule hides, on a stage holding an even share of the parameters."""
        total = 0.0
        params = 0.0
        for unit, count in self.unit_kinds:
            opts = self.options(unit, config, modes)
            total += count * min(o.time_s for o in opts)
            params += count * min(o.layout.param_numel for o in opts)
        pp, m, v = config.pp, config.num_microbatches, config.virtual_stages
        pipe = (m - 1 + pp) / pp * total if v == 1 else (m + (pp - 1) / v) * total / pp
        share = (params - sum(s.numel for s in self.graph.shared) / config.tp) / pp  # tied weights once
        local = share / config.dp if config.zero_stage >= 1 else share
        tail = optimizer_step_s(self.cluster.device, config.dtype, self.optimizer, local)
        if config.dp > 1:
            span = group_span(config.dp, config.tp, self.cluster.devices_per_node)
            if config.zero_stage == 1:
                tail += all_gather_s(4.0 * share, span, self.cluster)
            elif config.zero_stage >= 2 and pp > 1:
                tail += reduce_scatter_s(4.0 * share, span, self.cluster)
        return pipe + tail

    # ----- whole configurations -----------------------------------------------------
    def evaluate(
        self, config: ParallelConfig, modes: tuple[Recompute, ...], bounds: tuple[int, ...] | None = None
    ) -> Outcome:
        """The fastest split and choices of ``config`` (or the given stage ``bounds``)."""
        pp, v = config.pp, config.virtual_stages
        if v > 1:
            stages = self._interleaved(config, modes)
        else:
            inflight = [inflight_microbatches(config.schedule, pp, v, config.num_microbatches, k) for k in range(pp)]
            if bounds is None:
                from autopar.search.split_table import cost_table, split_cutoff

                cutoff = split_cutoff(self, config, modes, inflight)
                found = best_split(cost_table(self, config, modes, inflight, cutoff), config.num_microbatches)
                bounds = found[1] if found is not None else None
            stages = None
            if bounds is not None:
                stages = []
                for k in range(pp):
                    plan = self.solve_units(tuple(range(bounds[k], bounds[k + 1])), config, modes, inflight[k], k)
                    if plan is None:
                        stages = None
                        break
                    stages.append(plan)
        if stages is None:
            return Outcome(
                config=config,
                fits=False,
                min_memory_bytes=self.cluster.device.memory_bytes,
                reason="out of memory: no split and per-unit choice fits",
            )
        from autopar.search.predict import timing

        return Outcome(
            config=config,
            fits=True,
            step_time_s=timing(self, config, stages).step_s,
            stages=tuple(stages),
            min_memory_bytes=max(s.choice.memory_bytes for s in stages) + self.cluster.device.reserved_bytes,
        )

    def even_split(self, pp: int, *, exact: bool = False) -> tuple[int, ...] | None:
        """Blocks spread as evenly as possible over ``pp`` stages (prologue first, epilogue
        last), or None if there are fewer blocks than stages (or, with ``exact``, if the
        blocks do not divide evenly, Megatron-LM's rule for interleaved stages)."""
        n = len(self.graph.units)
        units = self.graph.units
        first = 1 if n > 1 and not units[0].prefix else 0
        last = 1 if n > 2 and not units[-1].prefix else 0
        blocks = n - first - last
        if blocks < pp or (exact and blocks % pp):
            return None
        sizes = [blocks // pp + (1 if k < blocks % pp else 0) for k in range(pp)]
        bounds = [0]
        for k, size in enumerate(sizes):
            bounds.append(bounds[-1] + size + (first if k == 0 else 0))
        bounds[-1] = n
        return tuple(bounds)

    def _interleaved(self, config: ParallelConfig, modes: tuple[Recompute, ...]) -> list[StagePlan] | None:
        """Interleaved 1F1B: blocks split evenly over the pp x v chunks (Megatron-LM's
        rule), the prologue on chunk 0 and the epilogue on the last; each rank's options
        are chosen over the union of its chunks, under its memory. Each chunk's stage
        carries its own time and its rank's memory (the rank is what memory binds)."""
        chunks = config.pp * config.virtual_stages
        bounds = self.even_split(chunks, exact=True)
        if bounds is None:
            return None
        stages: list[StagePlan] = []
        per_rank: dict[int, StagePlan] = {}
        for r in range(config.pp):
            units = tuple(u for c in range(r, chunks, config.pp) for u in range(bounds[c], bounds[c + 1]))
            infl = inflight_microbatches(config.schedule, config.pp, config.virtual_stages, config.num_microbatches, r)
            plan = self.solve_units(units, config, modes, infl, r)
            if plan is None:
                return None
            per_rank[r] = plan
        for c in range(chunks):
            rank_plan = per_rank[c % config.pp]
            idx = [rank_plan.units.index(u) for u in range(bounds[c], bounds[c + 1])]
            opts = tuple(rank_plan.options[i] for i in idx)
            chunk = StageChoice(
                time_s=sum(o.time_s for o in opts), memory_bytes=rank_plan.choice.memory_bytes, counts=()
            )
            stages.append(
                StagePlan(
                    index=c,
                    units=tuple(range(bounds[c], bounds[c + 1])),
                    options=opts,
                    inflight=rank_plan.inflight,
                    choice=chunk,
                )
            )
        return stages

    def strategies(self, stages: tuple[StagePlan, ...], config: ParallelConfig) -> tuple[LayerStrategies, Recompute]:
        """Leaf styles and per-unit recompute overrides, and the default recompute."""
        tp_map: dict[str, TPStyle] = {}
        modes: dict[str, Recompute] = {}
        # the default is the mode most units take (counting modules, an embedding unit of
        # two modules would outvote a block)
        per_unit: Counter = Counter()
        for plan in stages:
            for u, opt in zip(plan.units, plan.options):
                unit = self.graph.units[u]
                prof = self.graph.profile_of(u)
                for leaf, style in zip(prof.leaves, opt.layout.styles):
                    if style is not TPStyle.REPLICATE:
                        tp_map[unit.leaf_fqn(leaf.name)] = style
                for mod in unit.modules:
                    modes[mod] = opt.recompute
                per_unit[opt.recompute] += 1
        default = per_unit.most_common(1)[0][0] if per_unit else Recompute.NONE
        overrides = {k: v for k, v in modes.items() if v is not default}
        return LayerStrategies(tp=tp_map, recompute=overrides), default
