"""The cost of one configuration: per-unit options, the stage split, the prediction.

:class:`Evaluator` holds what is shared between configurations (the model, the cluster,
the caches of per-unit layouts) and turns a :class:`ParallelConfig` into an
:class:`Outcome`: the fastest split and per-unit choices that fit, with its
:class:`Prediction`, or the reason it does not fit and by how much.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
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
from autopar.search.ilp import make_solver
from autopar.search.intra_op import LayoutSolver
from autopar.search.options import UnitOption, unit_options
from autopar.search.split import best_split
from autopar.search.stage_solver import Priced, StageChoice, homogeneous_times, solve_stage
from autopar.vocab import Optimizer, Recompute, TPStyle

OVERLAP_EFFICIENCY = 0.8
"""Share of the compute time that can hide data-parallel communication. Overlapped
collectives are not free: NCCL's kernels occupy streaming multiprocessors and both
compete for memory bandwidth, so overlapped compute runs slower; 0.8 is a conservative
middle of the 10-30% slowdowns reported for overlapped FSDP/DDP communication."""


@dataclass(frozen=True, kw_only=True)
class StagePlan:
    """A solved stage: its units and the option each took."""

    index: int
    units: tuple[int, ...]
    options: tuple[UnitOption, ...]
    inflight: float
    choice: StageChoice


@dataclass(frozen=True, kw_only=True)
class Timing:
    """Where a step's time goes: per pipeline rank work per micro-batch, per stage
    (forward, backward) point-to-point and (exposed data-parallel, optimizer) tails."""

    rank_work: tuple[float, ...]
    p2p: tuple[tuple[float, float], ...]
    tails: tuple[tuple[float, float], ...]
    pipeline_s: float
    worst_tail: int
    step_s: float


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
    _options: dict = field(default_factory=dict, repr=False)
    _stages: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._layouts = LayoutSolver(solver=self.solver, micro_batches=self.micro_batches)
        self._ilp = make_solver(self.solver)
        n = len(self.graph.units)
        self._keys = tuple((u.profile, i == 0, i == n - 1) for i, u in enumerate(self.graph.units))
        first: dict[tuple, int] = {}
        counts: Counter = Counter()
        for i, key in enumerate(self._keys):
            first.setdefault(key, i)
            counts[key] += 1
        self._kinds = tuple((first[k], counts[k]) for k in first)
        run_end = list(range(n))
        for i in range(n - 2, -1, -1):
            if self._keys[i] == self._keys[i + 1]:
                run_end[i] = run_end[i + 1]
        self._run_end = np.array(run_end + [n], dtype=np.int64)
        kind_ids: dict[tuple, int] = {}
        self._kind_id = np.array([kind_ids.setdefault(key, len(kind_ids)) for key in self._keys] + [0], dtype=np.int64)
        sigs: dict[tuple, int] = {}
        self._range_sig = np.zeros((n + 1, n + 1), dtype=np.int64)
        for i in range(n):
            counts: dict[tuple, int] = {}
            for j in range(i + 1, n + 1):
                key = self._keys[j - 1]
                counts[key] = counts.get(key, 0) + 1
                sig = (tuple(counts.items()), self._keys[i], key)
                self._range_sig[i, j] = sigs.setdefault(sig, len(sigs))

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
                                              solver=self._layouts, recompute_modes=modes)
        return self._options[key]

    # ----- pricing ------------------------------------------------------------------
    def _priced(self, opt: UnitOption, config: ParallelConfig, layout_id: int) -> Priced:
        st = state_bytes(param_numel=opt.layout.param_numel, factored_numel=opt.layout.factored_numel,
                         largest_unit_numel=opt.layout.param_numel, dtype=config.dtype, optimizer=self.optimizer,
                         zero_stage=config.zero_stage, dp=config.dp, pipelined=config.pp > 1)
        return Priced(time_s=opt.time_s, static_bytes=st.params_bytes + st.grads_bytes + st.optimizer_bytes,
                      act_bytes=opt.act_bytes, transient_bytes=opt.transient_bytes + st.transient_bytes,
                      layout=layout_id)

    def priced_options(self, unit: int, config: ParallelConfig,
                       modes: tuple[Recompute, ...]) -> tuple[tuple[UnitOption, ...], tuple[Priced, ...]]:
        """The options of ``unit`` and their prices under ``config`` (identical
        options of different layouts carry different layout ids)."""
        key = ("priced", self._keys[unit], self._config_key(config, modes))
        if key not in self._options:
            opts = self.options(unit, config, modes)
            lay_ids: dict[tuple, int] = {}
            priced = []
            for o in opts:
                lay = lay_ids.setdefault((o.layout.styles, o.layout.output), len(lay_ids))
                priced.append(self._priced(o, config, lay))
            self._options[key] = (opts, tuple(priced))
        return self._options[key]

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
        """Bytes the model may allocate: capacity less the fixed reserve, less the
        allocator's fragmentation on what is allocated."""
        dev = self.cluster.device
        return (dev.memory_bytes - dev.reserved_bytes) / (1 + dev.fragmentation)

    # ----- stages -------------------------------------------------------------------
    def solve_units(self, units: tuple[int, ...], config: ParallelConfig, modes: tuple[Recompute, ...],
                    inflight: float, stage_index: int) -> StagePlan | None:
        """Fastest options for ``units`` as one stage (None if they cannot fit)."""
        found = self._solve_memo(units, config, modes, inflight)
        if found is None:
            return None
        choice, options = found
        return StagePlan(index=stage_index, units=units, options=options, inflight=inflight, choice=choice)

    def _config_key(self, config: ParallelConfig, modes: tuple[Recompute, ...]) -> tuple:
        return (config.tp, config.sequence_parallel, config.micro_batch_size, config.dtype, config.zero_stage,
                config.dp, config.pp > 1, modes)

    def _solve_memo(self, units: tuple[int, ...], config: ParallelConfig, modes: tuple[Recompute, ...],
                    inflight: float) -> tuple[StageChoice, tuple[UnitOption, ...]] | None:
        if units[-1] - units[0] + 1 == len(units):  # contiguous: the precomputed range signature
            content: object = int(self._range_sig[units[0], units[-1] + 1])
        else:
            content = tuple(self._keys[u] for u in units)
        key = (content, self._config_key(config, modes), inflight)
        if key not in self._stages:
            self._stages[key] = self._solve(units, config, modes, inflight)
        return self._stages[key]

    def _solve(self, units: tuple[int, ...], config: ParallelConfig, modes: tuple[Recompute, ...],
               inflight: float) -> tuple[StageChoice, tuple[UnitOption, ...]] | None:
        groups_keys: list[tuple] = []
        members: dict[tuple, list[int]] = {}
        for u in units:
            k = self._keys[u]
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
        budget = self._budget()
        if 0 in units and len(self.graph.units) - 1 in units:
            budget += self._shared_bytes(config)
        choice = solve_stage(groups, budget, inflight, self._ilp)
        if choice is None:
            return None
        chosen: dict[int, UnitOption] = {}
        for k, opts, counts in zip(groups_keys, group_opts, choice.counts):
            picks = [o for o, c in zip(opts, counts) for _ in range(c)]
            for u, o in zip(members[k], picks):
                chosen[u] = o
        return choice, tuple(chosen[u] for u in units)

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
            hidden_bwd = OVERLAP_EFFICIENCY * bwd * (1 - 1 / units)
            hidden_fwd = OVERLAP_EFFICIENCY * fwd * (1 - 1 / units)
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
        share = params / pp
        local = share / config.dp if config.zero_stage >= 1 else share
        tail = optimizer_step_bytes(self.optimizer) * local / rates(self.cluster.device, config.dtype).bytes_per_s
        if config.dp > 1:
            span = group_span(config.dp, config.tp, self.cluster.devices_per_node)
            if config.zero_stage == 1:
                tail += all_gather_s(4.0 * share, span, self.cluster)
            elif config.zero_stage >= 2 and pp > 1:
                tail += reduce_scatter_s(4.0 * share, span, self.cluster)
        return pipe + tail

    # ----- whole configurations -----------------------------------------------------
    def evaluate(self, config: ParallelConfig, modes: tuple[Recompute, ...],
                 bounds: tuple[int, ...] | None = None) -> Outcome:
        """The fastest split and choices of ``config`` (or the given stage ``bounds``)."""
        pp, v = config.pp, config.virtual_stages
        if v > 1:
            stages = self._interleaved(config, modes)
        else:
            inflight = [inflight_microbatches(config.schedule, pp, v, config.num_microbatches, k) for k in range(pp)]
            if bounds is None:
                cutoff = self._split_cutoff(config, modes, inflight)
                found = best_split(self.cost_table(config, modes, inflight, cutoff), config.num_microbatches)
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
            return Outcome(config=config, fits=False, min_memory_bytes=self.cluster.device.memory_bytes,
                           reason="out of memory: no split and per-unit choice fits")
        return Outcome(config=config, fits=True, step_time_s=self.timing(config, stages).step_s, stages=tuple(stages),
                       min_memory_bytes=max(s.choice.memory_bytes for s in stages) + self.cluster.device.reserved_bytes)

    def cost_table(self, config: ParallelConfig, modes: tuple[Recompute, ...], inflight: list[float],
                   cutoff_s: float = math.inf) -> np.ndarray:
        """``table[k, i, j]``: per-micro-batch time of stage ``k`` holding units ``i..j-1``
        (inf where it does not fit or a split cannot put it), priced once per distinct
        range content. A stage's time grows with its range, so ranges are extended only
        while their time is at most ``cutoff_s`` (no better split uses a longer one)."""
        n = len(self.graph.units)
        pp = config.pp
        table = np.full((pp, n + 1, n + 1), np.inf)
        costs: dict[tuple[int, float], float] = {}
        for k in range(pp):
            lo_i, hi_i = (0, 0) if k == 0 else (k, n - (pp - k))
            lo_j, hi_j = (n, n) if k == pp - 1 else (k + 1, n - (pp - k - 1))
            if 0 < lo_i and hi_j < n and self._run_end[lo_i] >= hi_j - 1:
                self._fill_repeated(table[k], lo_i, hi_i, lo_j, hi_j, config, modes, inflight[k], cutoff_s)
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
                homog = jj <= self._run_end[ii] + 1
                if homog.any():
                    hi_idx = np.flatnonzero(homog)
                    kind = self._kind_id[ii[hi_idx]] * 4 + (ii[hi_idx] == 0) * 2 + (jj[hi_idx] == n)
                    kinds, first_at, inv = np.unique(kind, return_index=True, return_inverse=True)
                    vals = np.array([self._homogeneous_cost(int(ii[hi_idx[a]]), w, config, modes, inflight[k])
                                     for a in first_at.tolist()])
                    row[hi_idx] = vals[inv]
                rest = np.flatnonzero(~homog)
                if rest.size:
                    self._fill_general(row, rest, ii, jj, w, k, costs, config, modes, inflight)
                keep = row <= cutoff_s
                table[k, ii[keep], jj[keep]] = row[keep]
                dead = np.flatnonzero(ok)[~keep]
                alive[dead] = False
                if lo_j == hi_j and not keep.any():
                    break  # the last stage's ranges all end at the last unit: longer ones only cost more
        return table

    def _fill_repeated(self, row: np.ndarray, lo_i: int, hi_i: int, lo_j: int, hi_j: int, config: ParallelConfig,
                       modes: tuple[Recompute, ...], inflight: float, cutoff_s: float) -> None:
        """A middle stage inside a run of identical units: the cost depends on the
        range's length only, so price each length once and fill the table at once."""
        for w in range(1, hi_j - lo_i + 1):
            c = self._homogeneous_cost(lo_i, w, config, modes, inflight)
            if c > cutoff_s:
                break
            starts = np.arange(max(lo_i, lo_j - w), min(hi_i, hi_j - w) + 1)
            row[starts, starts + w] = c

    def _fill_general(self, row, rest, ii, jj, w, k, costs, config, modes, inflight) -> None:
        """Price ranges that mix unit kinds, once per distinct content."""
        uniq, first, inverse = np.unique(self._range_sig[ii[rest], jj[rest]], return_index=True,
                                         return_inverse=True)
        values = np.empty(uniq.size)
        for u_idx, (s_id, at) in enumerate(zip(uniq.tolist(), first.tolist())):
            key = (s_id, inflight[k])
            if key not in costs:
                i0 = int(ii[rest[at]])
                plan = self.solve_units(tuple(range(i0, i0 + w)), config, modes, inflight[k], k)
                costs[key] = math.inf if plan is None else self.stage_cost_s(plan, config)
            values[u_idx] = costs[key]
        row[rest] = values[inverse]

    def _homogeneous_cost(self, start: int, count: int, config: ParallelConfig, modes: tuple[Recompute, ...],
                          inflight: float) -> float:
        """Per-micro-batch time of ``count`` identical units from ``start`` as a stage,
        from a table over counts computed once per unit kind and in-flight count."""
        key = ("homog", self._keys[start], self._config_key(config, modes), inflight)
        table = self._stages.get(key)
        if table is None or table.size <= count:
            grow = max(count, 8, 2 * (table.size if table is not None else 0))
            opts, priced = self.priced_options(start, config, modes)
            table = homogeneous_times(priced, grow, self._budget(), inflight)
            self._stages[key] = table
        t = float(table[count])
        if not math.isfinite(t):
            return math.inf
        opts = self.priced_options(start, config, modes)[0]
        units = (start, start + count - 1)
        f, b = self._p2p_s(units, (opts[0],) * 2, config)
        return t + f + b

    def _split_cutoff(self, config: ParallelConfig, modes: tuple[Recompute, ...], inflight: list[float]) -> float:
        """``T_even / m``: in any split no worse than the even one, every stage costs at
        most this, since ``(m - 1) max c + sum c >= m c_k`` for each stage ``k``."""
        bounds = self.even_split(config.pp)
        if bounds is None or config.pp == 1:
            return math.inf
        costs = []
        for k in range(config.pp):
            plan = self.solve_units(tuple(range(bounds[k], bounds[k + 1])), config, modes, inflight[k], k)
            if plan is None:
                return math.inf
            costs.append(self.stage_cost_s(plan, config))
        m = config.num_microbatches
        return ((m - 1) * max(costs) + sum(costs)) / m * (1 + 1e-12)

    def even_split(self, pp: int) -> tuple[int, ...] | None:
        """Blocks spread as evenly as possible over ``pp`` stages (prologue first, epilogue
        last): a feasible split, if any, bounds how long a useful stage can be."""
        n = len(self.graph.units)
        units = self.graph.units
        first = 1 if n > 1 and not units[0].prefix else 0
        last = 1 if n > 2 and not units[-1].prefix else 0
        blocks = n - first - last
        if blocks < pp:
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
            plan = self.solve_units(units, config, modes, infl, r)
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

    # ----- prediction ---------------------------------------------------------------
    def timing(self, config: ParallelConfig, stages: list[StagePlan] | tuple[StagePlan, ...]) -> "Timing":
        """Per-rank work, per-stage point-to-point and tails, and the step time."""
        pp, v, m = config.pp, config.virtual_stages, config.num_microbatches
        rank_work = [0.0] * pp
        p2p = []
        for plan in stages:
            f_p2p, b_p2p = self._p2p_s(plan.units, plan.options, config)
            rank_work[plan.index % pp] += plan.choice.time_s + f_p2p + b_p2p
            p2p.append((f_p2p, b_p2p))
        if v == 1:
            tails = [self.tail_s(plan, config) for plan in stages]
        else:  # tails are per rank: over the union of its chunks
            per_rank = []
            for r in range(pp):
                rank_stages = [p for p in stages if p.index % pp == r]
                merged = StagePlan(index=r, units=tuple(u for p in rank_stages for u in p.units),
                                   options=tuple(o for p in rank_stages for o in p.options),
                                   inflight=rank_stages[0].inflight, choice=rank_stages[0].choice)
                per_rank.append(self.tail_s(merged, config))
            tails = [per_rank[p.index % pp] for p in stages]
        t_pipe = pipeline_time_s(rank_work, m, v)
        worst = max(range(len(tails)), key=lambda i: tails[i][0] + tails[i][1])
        return Timing(rank_work=tuple(rank_work), p2p=tuple(p2p), tails=tuple(tails), pipeline_s=t_pipe,
                      worst_tail=worst, step_s=t_pipe + tails[worst][0] + tails[worst][1])

    def predict(self, config: ParallelConfig, stages: list[StagePlan] | tuple[StagePlan, ...]) -> Prediction:
        """Assemble the prediction of a solved configuration."""
        pp, m = config.pp, config.num_microbatches
        dev = self.cluster.device
        tm = self.timing(config, stages)
        rank_work, t_pipe, step = list(tm.rank_work), tm.pipeline_s, tm.step_s
        tails, worst_tail = tm.tails, tm.worst_tail
        stage_preds = [(plan, f, b, tails[i][0], tails[i][1]) for i, (plan, (f, b)) in enumerate(zip(stages, tm.p2p))]
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

    def _memory(self, plan: StagePlan, config: ParallelConfig, stages: list[StagePlan] | tuple[StagePlan, ...]) -> MemoryBreakdown:
        """The memory of the pipeline rank that runs ``plan``, term by term, priced as
        the stage solver prices it."""
        pp = config.pp
        rank = [(u, o) for p in stages if p.index % pp == plan.index % pp for u, o in zip(p.units, p.options)]
        priced = [self._priced(o, config, 0) for _, o in rank]
        params = sum(o.layout.param_numel for _, o in rank)
        factored = sum(o.layout.factored_numel for _, o in rank)
        st = state_bytes(param_numel=params, factored_numel=factored, largest_unit_numel=0.0, dtype=config.dtype,
                         optimizer=self.optimizer, zero_stage=config.zero_stage, dp=config.dp, pipelined=pp > 1)
        n = len(self.graph.units)
        units = {u for u, _ in rank}
        static = st.params_bytes + st.grads_bytes + st.optimizer_bytes
        shared = self._shared_bytes(config) if 0 in units and n - 1 in units else 0.0
        scale = (static - shared) / static if static else 1.0
        acts = plan.inflight * sum(p.act_bytes for p in priced)
        transient = max(p.transient_bytes for p in priced)
        dev = self.cluster.device
        allocated = static - shared + acts + transient
        return MemoryBreakdown(params_bytes=st.params_bytes * scale, grads_bytes=st.grads_bytes * scale,
                               optimizer_bytes=st.optimizer_bytes * scale, activations_bytes=acts,
                               transient_bytes=transient, buffers_bytes=0.0,
                               reserve_bytes=dev.reserved_bytes + dev.fragmentation * allocated)

    def smallest_footprint_bytes(self, config: ParallelConfig) -> float:
        """Peak memory per device with every unit at its smallest option (fewest
        parameters, full recomputation) on the even split: what a configuration that
        does not fit needs at least, about."""
        modes = (Recompute.FULL,)
        pp, v = config.pp, config.virtual_stages
        chunks = pp * v
        bounds = self.even_split(chunks) if chunks > 1 else (0, len(self.graph.units))
        if bounds is None:
            return math.inf
        dev = self.cluster.device
        worst = 0.0
        for r in range(pp):
            units = [u for c in range(r, chunks, pp) for u in range(bounds[c], bounds[c + 1])]
            inflight = inflight_microbatches(config.schedule, pp, v, config.num_microbatches, r)
            total, transient = 0.0, 0.0
            for u in units:
                smallest = min((self._priced(o, config, 0) for o in self.options(u, config, modes)),
                               key=lambda p: p.static_bytes + inflight * p.act_bytes + p.transient_bytes)
                total += smallest.static_bytes + inflight * smallest.act_bytes
                transient = max(transient, smallest.transient_bytes)
            worst = max(worst, (total + transient) * (1 + dev.fragmentation) + dev.reserved_bytes)
        return worst

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




