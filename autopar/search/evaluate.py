"""The cost of one configuration: per-unit options, the stage split, the prediction.

:class:`Evaluator` holds what is shared between configurations (the model, the cluster,
the caches of per-unit layouts) and turns a :class:`ParallelConfig` into an
:class:`Outcome`: the fastest split and per-unit choices that fit, with its
:class:`Prediction`, or the reason it does not fit and by how much.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from autopar.cluster import Cluster
from autopar.cost.comm import all_gather_s, all_reduce_s, group_span, p2p_s, reduce_scatter_s
from autopar.cost.compute import rates
from autopar.cost.memory import compute_copy_bytes, optimizer_step_bytes, state_bytes
from autopar.cost.pipeline import inflight_microbatches, pipeline_time_s
from autopar.cost.tensor_parallel import Layout, TPContext
from autopar.graph.layer_graph import LayerGraph
from autopar.plan import (
    LayerStrategies, MemoryBreakdown, ParallelConfig, Prediction, StagePrediction, StepBreakdown,
)
from autopar.search.options import UnitOption, unit_options
from autopar.search.split import best_split, cost_table
from autopar.search.stage_solver import Priced, StageChoice, solve_stage
from autopar.vocab import Optimizer, Recompute, Schedule, TPStyle


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
    prediction: Prediction | None
    stages: tuple[StagePlan, ...] = ()
    min_memory_bytes: float = 0.0
    reason: str = ""

    @property
    def step_time_s(self) -> float:
        """Predicted step time (infinite when nothing fits)."""
        return self.prediction.step_time_s if self.prediction is not None else math.inf


@dataclass
class Evaluator:
    """Evaluates configurations of one model on one cluster (see module docstring)."""

    graph: LayerGraph
    cluster: Cluster
    optimizer: Optimizer
    global_batch_size: int
    solver: str = "highs"
    _options: dict = field(default_factory=dict)

    # ----- per-unit options ---------------------------------------------------------
    def tp_context(self, unit: int, config: ParallelConfig) -> TPContext:
        """The tensor-parallel context of a unit under ``config``."""
        n = len(self.graph.units)
        return TPContext(
            tp=config.tp, span=group_span(config.tp, 1, self.cluster.devices_per_node), cluster=self.cluster,
            rates=rates(self.cluster.device, config.dtype), micro_batch=config.micro_batch_size,
            tokens=self.graph.seq_len, boundary=Layout.Q if config.sequence_parallel else Layout.R,
            first=unit == 0, last=unit == n - 1, loss_parallel=self.graph.vocab_size > 0,
            sequence_parallel=config.sequence_parallel)

    def options(self, unit: int, config: ParallelConfig, modes: tuple[Recompute, ...]) -> tuple[UnitOption, ...]:
        """Options of ``unit`` (cached per distinct profile and position)."""
        n = len(self.graph.units)
        key = (self.graph.units[unit].profile, unit == 0, unit == n - 1, config.tp, config.sequence_parallel,
               config.micro_batch_size, config.dtype, modes)
        if key not in self._options:
            self._options[key] = unit_options(self.graph.profile_of(unit), self.tp_context(unit, config),
                                              solver=self.solver, recompute_modes=modes)
        return self._options[key]

    # ----- pricing ------------------------------------------------------------------
    def _priced(self, opt: UnitOption, config: ParallelConfig, layout_id: int) -> Priced:
        st = state_bytes(param_numel=opt.layout.param_numel, factored_numel=opt.layout.factored_numel,
                         largest_unit_numel=opt.layout.param_numel, dtype=config.dtype, optimizer=self.optimizer,
                         zero_stage=config.zero_stage, dp=config.dp, pipelined=config.pp > 1)
        return Priced(time_s=opt.time_s, static_bytes=st.params_bytes + st.grads_bytes + st.optimizer_bytes,
                      act_bytes=opt.act_bytes, transient_bytes=opt.transient_bytes + st.transient_bytes,
                      layout=layout_id)

    def _shared_bytes(self, config: ParallelConfig) -> float:
        """State bytes of the tied parameters counted twice when both owners share a stage."""
        if not self.graph.shared:
            return 0.0
        numel = sum(s.numel for s in self.graph.shared) / config.tp
        st = state_bytes(param_numel=numel, factored_numel=numel, largest_unit_numel=0.0, dtype=config.dtype,
                         optimizer=self.optimizer, zero_stage=config.zero_stage, dp=config.dp,
                         pipelined=config.pp > 1)
        return st.params_bytes + st.grads_bytes + st.optimizer_bytes

    def _budget(self) -> float:
        dev = self.cluster.device
        return dev.memory_bytes - dev.reserved_bytes

    # ----- stages -------------------------------------------------------------------
    def solve_units(self, units: tuple[int, ...], config: ParallelConfig, modes: tuple[Recompute, ...],
                    inflight: float, stage_index: int, cache: dict) -> StagePlan | None:
        """Fastest options for ``units`` as one stage (None if they cannot fit)."""
        key = (tuple(self._unit_key(u) for u in units), inflight)
        if key in cache:
            found = cache[key]
            return None if found is None else StagePlan(index=stage_index, units=units, options=found[1],
                                                        inflight=inflight, choice=found[0])
        groups_keys: list[tuple] = []
        members: dict[tuple, list[int]] = {}
        for u in units:
            k = self._unit_key(u)
            if k not in members:
                members[k] = []
                groups_keys.append(k)
            members[k].append(u)
        groups = []
        group_opts = []
        for k in groups_keys:
            opts = self.options(members[k][0], config, modes)
            lay_ids = {}
            priced = []
            for o in opts:
                lay_ids.setdefault((o.layout.styles, o.layout.output), len(lay_ids))
                priced.append(self._priced(o, config, lay_ids[(o.layout.styles, o.layout.output)]))
            groups.append((len(members[k]), tuple(priced)))
            group_opts.append(opts)
        budget = self._budget()
        if 0 in units and len(self.graph.units) - 1 in units:
            budget += self._shared_bytes(config)
        choice = solve_stage(groups, budget, inflight, self.solver)
        if choice is None:
            cache[key] = None
            return None
        chosen: dict[int, UnitOption] = {}
        for k, opts, counts in zip(groups_keys, group_opts, choice.counts):
            picks = [o for o, c in zip(opts, counts) for _ in range(c)]
            for u, o in zip(members[k], picks):
                chosen[u] = o
        options = tuple(chosen[u] for u in units)
        cache[key] = (choice, options)
        return StagePlan(index=stage_index, units=units, options=options, inflight=inflight, choice=choice)

    def _unit_key(self, u: int) -> tuple:
        n = len(self.graph.units)
        return (self.graph.units[u].profile, u == 0, u == n - 1)

    def _p2p_s(self, stage_units: tuple[int, ...], options: tuple[UnitOption, ...], config: ParallelConfig) -> tuple[float, float]:
        """(forward, backward) point-to-point seconds per micro-batch of a stage."""
        if config.pp == 1:
            return 0.0, 0.0
        cross = config.tp * config.dp >= self.cluster.devices_per_node
        n = len(self.graph.units)
        fwd = p2p_s(options[-1].layout.output_bytes, cross_node=cross, cluster=self.cluster) if stage_units[-1] < n - 1 else 0.0
        bwd = p2p_s(options[0].layout.input_bytes, cross_node=cross, cluster=self.cluster) if stage_units[0] > 0 else 0.0
        return fwd, bwd

    def stage_cost_s(self, plan: StagePlan, config: ParallelConfig) -> float:
        """Per-micro-batch time of a stage (units and point-to-point)."""
        f, b = self._p2p_s(plan.units, plan.options, config)
        return plan.choice.time_s + f + b

    def tail_s(self, plan: StagePlan, config: ParallelConfig) -> tuple[float, float]:
        """(exposed data-parallel communication, optimizer step) of a stage per step.

        Gradient reduction overlaps the backward of the last micro-batch except its last
        unit (bucketed all-reduce, Li et al. 2020; FSDP2's per-unit reduce-scatter); ZeRO-1
        all-gathers updated parameters after the step; ZeRO-3 gathers parameters before
        each unit's forward and backward, overlapped with the previous unit's compute.
        Tied weights split over the first and last stage are all-reduced between them.
        """
        params = sum(o.layout.param_numel for o in plan.options)
        units = max(len(plan.options), 1)
        bwd = sum(o.bwd_s for o in plan.options)
        fwd = sum(o.fwd_s for o in plan.options)
        span = group_span(config.dp, config.tp, self.cluster.devices_per_node)
        cl = self.cluster
        m = config.num_microbatches
        copy = compute_copy_bytes(config.dtype) or 4.0
        grad_bytes = 4.0 * params
        exposed = 0.0
        if config.dp > 1:
            hidden_bwd = bwd * (1 - 1 / units)
            hidden_fwd = fwd * (1 - 1 / units)
            if config.zero_stage <= 1:
                exposed = max(all_reduce_s(grad_bytes, span, cl) - hidden_bwd, 0.0)
                if config.zero_stage == 1:
                    exposed += all_gather_s(4.0 * params, span, cl)
            elif config.pp > 1:
                rs = reduce_scatter_s(grad_bytes, span, cl)
                ag = all_gather_s(copy * params, span, cl)
                gathers = 1 if config.zero_stage == 2 else m + 1
                exposed = rs + max(gathers * ag - gathers * hidden_fwd, ag / units)
            else:
                rs = reduce_scatter_s(grad_bytes, span, cl)
                ag = all_gather_s(copy * params, span, cl)
                if config.zero_stage == 2:
                    exposed = m * max(rs - hidden_bwd, rs / units) + max(ag - hidden_fwd, ag / units)
                else:
                    exposed = m * (max(ag - hidden_fwd, ag / units) + max(ag + rs - hidden_bwd, (ag + rs) / units))
        n = len(self.graph.units)
        if config.pp > 1 and self.graph.shared and (0 in plan.units or n - 1 in plan.units):
            pair = group_span(2, config.tp * config.dp * (config.pp - 1), self.cluster.devices_per_node)
            exposed += all_reduce_s(4.0 * sum(s.numel for s in self.graph.shared) / config.tp, pair, cl)
        local = params / config.dp if config.zero_stage >= 1 else params
        r = rates(self.cluster.device, config.dtype)
        optimizer = optimizer_step_bytes(self.optimizer) * local / r.bytes_per_s
        return exposed, optimizer

    # ----- whole configurations -----------------------------------------------------
    def evaluate(self, config: ParallelConfig, modes: tuple[Recompute, ...],
                 bounds: tuple[int, ...] | None = None) -> Outcome:
        """The fastest split and choices of ``config`` (or the given stage ``bounds``)."""
        n = len(self.graph.units)
        cache: dict = {}
        pp, v = config.pp, config.virtual_stages
        if v > 1:
            stages = self._interleaved(config, modes, cache)
        else:
            inflight = [inflight_microbatches(config.schedule, pp, v, config.num_microbatches, k) for k in range(pp)]
            if bounds is None:
                def cost(k: int, i: int, j: int) -> float:
                    plan = self.solve_units(tuple(range(i, j)), config, modes, inflight[k], k, cache)
                    return math.inf if plan is None else self.stage_cost_s(plan, config)
                table = cost_table(n, pp, cost)
                found = best_split(table, config.num_microbatches)
                bounds = found[1] if found is not None else None
            stages = None
            if bounds is not None:
                stages = []
                for k in range(pp):
                    plan = self.solve_units(tuple(range(bounds[k], bounds[k + 1])), config, modes, inflight[k], k, cache)
                    if plan is None:
                        stages = None
                        break
                    stages.append(plan)
        if stages is None:
            need = self.min_memory_bytes(config)
            return Outcome(config=config, fits=False, prediction=None, min_memory_bytes=need,
                           reason=f"out of memory: needs at least {_gib(need)} per device, "
                                  f"{_gib(self.cluster.device.memory_bytes)} available")
        return Outcome(config=config, fits=True, prediction=self.predict(config, stages), stages=tuple(stages),
                       min_memory_bytes=max(s.choice.memory_bytes for s in stages) + self.cluster.device.reserved_bytes)

    def _interleaved(self, config: ParallelConfig, modes: tuple[Recompute, ...], cache: dict) -> list[StagePlan] | None:
        """Interleaved 1F1B: blocks split evenly over the pp x v chunks (Megatron-LM's
        rule), the prologue on chunk 0 and the epilogue on the last; each rank's options
        are chosen over the union of its chunks, under its memory."""
        n = len(self.graph.units)
        chunks = config.pp * config.virtual_stages
        bounds = self.even_bounds(chunks)
        if bounds is None:
            return None
        stages: list[StagePlan] = []
        per_rank: dict[int, StagePlan] = {}
        for r in range(config.pp):
            units = tuple(u for c in range(r, chunks, config.pp) for u in range(bounds[c], bounds[c + 1]))
            infl = inflight_microbatches(config.schedule, config.pp, config.virtual_stages, config.num_microbatches, r)
            plan = self.solve_units(units, config, modes, infl, r, cache)
            if plan is None:
                return None
            per_rank[r] = plan
        for c in range(chunks):
            rank_plan = per_rank[c % config.pp]
            idx = [rank_plan.units.index(u) for u in range(bounds[c], bounds[c + 1])]
            opts = tuple(rank_plan.options[i] for i in idx)
            sub = StageChoice(time_s=sum(o.time_s for o in opts), memory_bytes=rank_plan.choice.memory_bytes,
                              counts=rank_plan.choice.counts)
            stages.append(StagePlan(index=c, units=tuple(range(bounds[c], bounds[c + 1])), options=opts,
                                    inflight=rank_plan.inflight, choice=sub))
        del n
        return stages

    def even_bounds(self, chunks: int) -> tuple[int, ...] | None:
        """Boundaries that give each of ``chunks`` chunks the same number of repeated
        blocks (prologue on the first, epilogue on the last), or None if impossible."""
        units = self.graph.units
        n = len(units)
        first = 1 if n > 1 and units[0].prefix == "" and units[0].profile != units[min(1, n - 1)].profile else 0
        last = 1 if n > 2 and units[-1].prefix == "" and units[-1].profile != units[-2].profile else 0
        blocks = n - first - last
        if blocks % chunks or blocks < chunks:
            return None
        per = blocks // chunks
        bounds = [0] + [first + per * c for c in range(1, chunks)] + [n]
        return tuple(bounds)

    def min_memory_bytes(self, config: ParallelConfig) -> float:
        """A lower bound of the peak memory per device: model states of the smallest
        layouts spread evenly over the pipeline, plus fully recomputed activations."""
        n = len(self.graph.units)
        modes = (Recompute.FULL,)
        total_static = 0.0
        total_act = 0.0
        for u in range(n):
            opts = self.options(u, config, modes)
            best = min((self._priced(o, config, 0) for o in opts), key=lambda p: p.static_bytes)
            total_static += best.static_bytes
            total_act += best.act_bytes
        inflight = min(inflight_microbatches(config.schedule, config.pp, config.virtual_stages,
                                             config.num_microbatches, k) for k in range(config.pp))
        return total_static / config.pp + inflight * total_act / config.pp + self.cluster.device.reserved_bytes

    # ----- prediction ---------------------------------------------------------------
    def predict(self, config: ParallelConfig, stages: list[StagePlan]) -> Prediction:
        """Assemble the prediction of a solved configuration."""
        pp, v, m = config.pp, config.virtual_stages, config.num_microbatches
        dev = self.cluster.device
        stage_preds = []
        rank_work = [0.0] * pp
        tails = []
        for plan in stages:
            f_p2p, b_p2p = self._p2p_s(plan.units, plan.options, config)
            exposed, opt_s = self.tail_s(plan, config) if v == 1 else (0.0, 0.0)
            rank_work[plan.index % pp] += plan.choice.time_s + f_p2p + b_p2p
            tails.append((exposed, opt_s))
            stage_preds.append((plan, f_p2p, b_p2p, exposed, opt_s))
        if v > 1:  # tails are per rank: over the union of its chunks
            tails = []
            for r in range(pp):
                rank_stages = [p for p in stages if p.index % pp == r]
                merged = StagePlan(index=r, units=tuple(u for p in rank_stages for u in p.units),
                                   options=tuple(o for p in rank_stages for o in p.options),
                                   inflight=rank_stages[0].inflight, choice=rank_stages[0].choice)
                tails.append(self.tail_s(merged, config))
            stage_preds = [(p, f, b, tails[p.index % pp][0], tails[p.index % pp][1]) for p, f, b, _, _ in stage_preds]
        t_pipe = pipeline_time_s(rank_work, m, v)
        worst_tail = max(range(len(tails)), key=lambda i: tails[i][0] + tails[i][1])
        step = t_pipe + tails[worst_tail][0] + tails[worst_tail][1]
        crit = max(range(pp), key=lambda r: rank_work[r])
        crit_stages = [p for p in stages if p.index % pp == crit]
        comp = sum(o.layout.fwd_compute_s + o.layout.bwd_compute_s for p in crit_stages for o in p.options)
        reco = sum(o.recompute_s for p in crit_stages for o in p.options)
        tpc = sum(o.layout.fwd_comm_s + o.layout.bwd_comm_s for p in crit_stages for o in p.options)
        ppc = sum(sum(self._p2p_s(p.units, p.options, config)) for p in crit_stages)
        bubble = t_pipe - m * rank_work[crit]
        breakdown = StepBreakdown(compute_s=m * comp, recompute_s=m * reco, tp_comm_s=m * tpc, pp_comm_s=m * ppc,
                                  bubble_s=bubble + m * (rank_work[crit] - comp - reco - tpc - ppc),
                                  dp_comm_s=tails[worst_tail][0], optimizer_s=tails[worst_tail][1])
        preds = []
        peak = 0.0
        for plan, f_p2p, b_p2p, exposed, opt_s in stage_preds:
            mem = self._memory(plan, config, stages)
            peak = max(peak, mem.total_bytes)
            preds.append(StagePrediction(
                index=plan.index, pipeline_rank=plan.index % pp,
                units=tuple(mod for u in plan.units for mod in self.graph.units[u].modules),
                forward_s=sum(o.fwd_s for o in plan.options) + f_p2p,
                backward_s=sum(o.bwd_s for o in plan.options) + b_p2p,
                tp_comm_s=sum(o.tp_comm_s for o in plan.options), pp_comm_s=f_p2p + b_p2p,
                recompute_s=sum(o.recompute_s for o in plan.options), dp_comm_s=exposed, optimizer_s=opt_s,
                inflight_microbatches=plan.inflight, memory=mem))
        gb = self.global_batch_size
        model_flops = 3.0 * self.graph.fwd_flops_per_sample * gb
        reco_flops = sum(o.recompute_flops for p in stages for o in p.options) * config.micro_batch_size * m * config.dp
        world = config.world_size
        peak_flops = dev.peak(config.dtype)
        return Prediction(
            step_time_s=step, samples_per_s=gb / step, tokens_per_s=gb * self.graph.seq_len / step,
            tflops_per_device=model_flops / step / world / 1e12, mfu=model_flops / (step * world * peak_flops),
            hfu=(model_flops + reco_flops) / (step * world * peak_flops), memory_bytes_per_device=peak,
            memory_capacity_bytes=dev.memory_bytes, fits=peak <= dev.memory_bytes, breakdown=breakdown,
            stages=tuple(preds))

    def _memory(self, plan: StagePlan, config: ParallelConfig, stages: list[StagePlan]) -> MemoryBreakdown:
        pp = config.pp
        rank_units = [o for p in stages if p.index % pp == plan.index % pp for o in p.options]
        params = sum(o.layout.param_numel for o in rank_units)
        factored = sum(o.layout.factored_numel for o in rank_units)
        largest = max(o.layout.param_numel for o in rank_units)
        st = state_bytes(param_numel=params, factored_numel=factored, largest_unit_numel=largest, dtype=config.dtype,
                         optimizer=self.optimizer, zero_stage=config.zero_stage, dp=config.dp, pipelined=pp > 1)
        n = len(self.graph.units)
        all_units = {u for p in stages if p.index % pp == plan.index % pp for u in p.units}
        shared = 0.0
        if 0 in all_units and n - 1 in all_units:
            shared = self._shared_bytes(config)
        transient = max(o.transient_bytes for o in rank_units) + st.transient_bytes
        acts = plan.inflight * sum(o.act_bytes for o in rank_units)
        scale = params and (st.params_bytes + st.grads_bytes + st.optimizer_bytes - shared) / (
            st.params_bytes + st.grads_bytes + st.optimizer_bytes)
        return MemoryBreakdown(params_bytes=st.params_bytes * scale, grads_bytes=st.grads_bytes * scale,
                               optimizer_bytes=st.optimizer_bytes * scale, activations_bytes=acts,
                               transient_bytes=transient, buffers_bytes=0.0,
                               reserve_bytes=self.cluster.device.reserved_bytes)

    # ----- the plan's per-layer decisions -------------------------------------------
    def strategies(self, stages: tuple[StagePlan, ...], config: ParallelConfig) -> tuple[LayerStrategies, Recompute]:
        """Leaf styles and per-unit recompute overrides, and the default recompute."""
        tp_map: dict[str, TPStyle] = {}
        modes: dict[str, Recompute] = {}
        for plan in stages:
            for u, opt in zip(plan.units, plan.options):
                unit = self.graph.units[u]
                prof = self.graph.profile_of(u)
                for leaf, style in zip(prof.leaves, opt.layout.styles):
                    if style is not TPStyle.REPLICATE:
                        tp_map[unit.leaf_fqn(leaf.name)] = style
                for mod in unit.modules:
                    modes[mod] = opt.recompute
        default = Counter(modes.values()).most_common(1)[0][0] if modes else Recompute.NONE
        overrides = {k: v for k, v in modes.items() if v is not default}
        return LayerStrategies(tp=tp_map, recompute=overrides), default


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB"


__all__ = ["Evaluator", "Outcome", "StagePlan", "Schedule"]
