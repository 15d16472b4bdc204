"""From a solved configuration to its prediction: step time, its breakdown, memory.

``timing`` gives the step time (pipeline formula plus the worst exposed data-parallel
and optimizer tail); ``predict`` the full :class:`~autopar.plan.Prediction`, per stage and
per term; ``smallest_footprint_bytes`` what a configuration that does not fit would need.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from autopar.cluster import Cluster, DeviceSpec
from autopar.cost.comm import GroupSpan, all_gather_s, all_reduce_s, fsdp_copy_s, group_span, reduce_scatter_s
from autopar.cost.compute import optimizer_step_s, rates
from autopar.cost.memory import compute_copy_bytes, state_bytes
from autopar.cost.pipeline import inflight_microbatches, pipeline_time_s
from autopar.cost.sync import sync_wait_s
from autopar.plan import MemoryBreakdown, ParallelConfig, Prediction, StagePrediction, StepBreakdown
from autopar.search.evaluate import StagePlan
from autopar.vocab import Recompute, Schedule

if TYPE_CHECKING:
    from autopar.search.evaluate import Evaluator


@dataclass(frozen=True, kw_only=True)
class Timing:
    """Where a step's time goes: per pipeline rank work per micro-batch, per stage
    (forward, backward) point-to-point, (forward, backward) waits on the slowest rank of
    the tensor-parallel group and (exposed data-parallel, optimizer) tails."""

    rank_work: tuple[float, ...]
    p2p: tuple[tuple[float, float], ...]
    waits: tuple[tuple[float, float], ...]
    tails: tuple[tuple[float, float], ...]
    pipeline_s: float
    worst_tail: int
    step_s: float


def tail_s(ev: Evaluator, plan: StagePlan, config: ParallelConfig) -> tuple[float, float]:
    """(exposed data-parallel communication, optimizer step) of a stage per step.

    Gradient reduction overlaps the backward of the last micro-batch except its last
    unit (bucketed all-reduce, Li et al. 2020; FSDP2's per-unit reduce-scatter), and its
    last bucket makes the ranks wait for the slowest once a step (:mod:`autopar.cost.sync`,
    the whole step's work between meetings); ZeRO-1
    all-gathers updated parameters after the step; ZeRO-3 gathers parameters before
    each unit's forward and backward, overlapped with the previous unit's compute.
    FSDP2 issues ZeRO-2/3's gathers and reductions one per unit, so each unit pays the
    collective's latency (on gloo 0.5-0.7 ms a call; benchmarks/predicted_vs_measured.py),
    the copies into and out of the flat buffers in proportion to their bytes
    (:func:`autopar.cost.comm.fsdp_copy_s`), FSDP2's fixed framework time per call
    (``DeviceSpec.fsdp_overhead_s``: hooks and dispatch, measured by a network profile
    on units so small that their copies move nothing) and per parameter tensor of the
    unit (``fsdp_tensor_overhead_s``), and, where communication does not
    hide them, the wait for the slowest rank at each (:func:`_fsdp_waits_s`).
    Tied weights split over the first and last stage are all-reduced between them.
    """
    n = len(ev.graph.units)
    params = sum(o.layout.param_numel for o in plan.options)
    params -= ev.held_once_numel(config, dict(zip(plan.units, plan.options)))  # one tensor: reduced, stepped once
    units = max(len(plan.options), 1)
    tensors = sum(ev.graph.profile_of(u).param_tensors for u in plan.units)
    bwd = sum(o.bwd_s for o in plan.options)
    fwd = sum(o.fwd_s for o in plan.options)
    span = group_span(config.dp, config.tp, ev.cluster.devices_per_node)
    cl = ev.cluster
    m = config.num_microbatches
    copy = compute_copy_bytes(config.dtype) or 4.0
    grad_bytes = 4.0 * params
    exposed = 0.0
    if config.dp > 1:
        overlap = cl.device.comm_overlap  # share of compute that hides communication
        hidden_bwd = overlap * bwd * (1 - 1 / units)
        hidden_fwd = overlap * fwd * (1 - 1 / units)
        if config.zero_stage <= 1:
            exposed = max(all_reduce_s(grad_bytes, span, cl) - hidden_bwd, 0.0)
            # DDP's last bucket meets once per step, after all of the rank's work
            exposed += _ranks_wait_s(cl.device, config.dp, 1, m * (fwd + bwd))
            if config.zero_stage == 1:
                exposed += all_gather_s(4.0 * params, span, cl)
        elif config.pp > 1:
            rs, ag = _fsdp_collectives_s(grad_bytes, copy * params, span, cl, config, units)
            gathers = 1 if config.zero_stage == 2 else m + 1
            exposed = rs + max(gathers * ag - gathers * hidden_fwd, ag / units)
            per_unit = 1 + gathers
            exposed += _fsdp_framework_s(cl, per_unit, units, tensors) + _fsdp_waits_s(
                cl, config, per_unit * units, m * (fwd + bwd)
            )
        else:
            rs, ag = _fsdp_collectives_s(grad_bytes, copy * params, span, cl, config, units)
            if config.zero_stage == 2:
                exposed = m * max(rs - hidden_bwd, rs / units) + max(ag - hidden_fwd, ag / units)
                per_unit = m + 1
            else:
                exposed = m * (max(ag - hidden_fwd, ag / units) + max(ag + rs - hidden_bwd, (ag + rs) / units))
                per_unit = 3 * m
            exposed += _fsdp_framework_s(cl, per_unit, units, tensors) + _fsdp_waits_s(
                cl, config, per_unit * units, m * (fwd + bwd)
            )
    if config.pp > 1 and ev.graph.shared and (0 in plan.units or n - 1 in plan.units):
        pair = group_span(2, config.tp * config.dp * (config.pp - 1), ev.cluster.devices_per_node)
        exposed += all_reduce_s(4.0 * sum(s.numel for s in ev.graph.shared) / config.tp, pair, cl)
    local = params / config.dp if config.zero_stage >= 1 else params
    return exposed, optimizer_step_s(cl.device, config.dtype, ev.optimizer, local)


def _fsdp_framework_s(cl: Cluster, calls_per_unit: int, units: int, tensors: int) -> float:
    """FSDP2's framework time in a stage's step: each of its ``units`` issues
    ``calls_per_unit`` collective calls, each paying ``fsdp_overhead_s`` and
    ``fsdp_tensor_overhead_s`` per parameter tensor of its unit (``tensors`` over the
    stage): the copy into the flat buffer, the views out of it and the reduction's
    chunking are dispatched tensor by tensor (torch 2.13's ``_fsdp_collectives``)."""
    dev = cl.device
    return calls_per_unit * (units * dev.fsdp_overhead_s + tensors * dev.fsdp_tensor_overhead_s)


def _fsdp_collectives_s(
    grad_bytes: float, param_bytes: float, span: GroupSpan, cl: Cluster, config: ParallelConfig, units: int
) -> tuple[float, float]:
    """(reduce-scatter, all-gather) of a stage's gradients and parameters, one call per
    unit, each with FSDP2's copies around it (:func:`autopar.cost.comm.fsdp_copy_s`)."""
    bytes_per_s = cl.device.fsdp_copy_bytes_per_s or rates(cl.device, config.dtype).bytes_per_s
    rs = reduce_scatter_s(grad_bytes, span, cl, calls=units) + fsdp_copy_s(grad_bytes, config.dp, bytes_per_s)
    ag = all_gather_s(param_bytes, span, cl, calls=units) + fsdp_copy_s(param_bytes, config.dp, bytes_per_s)
    return rs, ag


def _fsdp_waits_s(cl: Cluster, config: ParallelConfig, calls: int, work_s: float) -> float:
    """Seconds the data-parallel group waits on its slowest rank at FSDP2's collectives
    in a step of ``work_s`` seconds (:mod:`autopar.cost.sync`). A collective that
    communication does not hide is a meeting; one hidden under compute is not, so the
    ``calls`` count as ``calls * (1 - comm_overlap)`` meetings: all of them on CPU
    processes (gloo runs FSDP2's gathers inline, a ZeRO-3 step on 2 ranks traced 3.6 ms
    per 3 MiB all-gather against 2.7 ms priced), none where communication fully overlaps."""
    meetings = calls * (1 - cl.device.comm_overlap)
    return _ranks_wait_s(cl.device, config.dp, meetings, work_s)


def _ranks_wait_s(dev: DeviceSpec, ranks: int, meetings: float, work_s: float) -> float:
    """:func:`autopar.cost.sync.sync_wait_s` with the device's measured noise and spread."""
    return sync_wait_s(dev.sync_noise_s_per_sqrt_s, ranks, meetings, work_s, speed_spread=dev.sync_speed_spread)


def sync_waits_s(ev: Evaluator, plan: StagePlan, config: ParallelConfig) -> tuple[float, float]:
    """(forward, backward) seconds per micro-batch that a stage's tensor-parallel group
    waits on its slowest rank at the blocking collectives of its units
    (:mod:`autopar.cost.sync`), split by the collectives of each pass. The work between
    meetings is the stage's compute, recomputation included."""
    meetings = sum(o.syncs for o in plan.options)
    if meetings == 0:
        return 0.0, 0.0
    work = sum(o.layout.fwd_compute_s + o.layout.bwd_compute_s + o.recompute_s for o in plan.options)
    wait = _ranks_wait_s(ev.cluster.device, config.tp, meetings, work)
    forward = sum(o.layout.fwd_syncs for o in plan.options) / meetings
    return wait * forward, wait * (1 - forward)


def timing(ev: Evaluator, config: ParallelConfig, stages: list[StagePlan] | tuple[StagePlan, ...]) -> Timing:
    """Per-rank work, per-stage point-to-point, waits and tails, and the step time."""
    pp, v, m = config.pp, config.virtual_stages, config.num_microbatches
    rank_work = [0.0] * pp
    p2p, waits = [], []
    for plan in stages:
        f_p2p, b_p2p = ev.stage_p2p_s(plan.units, plan.options, config)
        f_wait, b_wait = sync_waits_s(ev, plan, config)
        rank_work[plan.index % pp] += plan.choice.time_s + f_p2p + b_p2p + f_wait + b_wait
        p2p.append((f_p2p, b_p2p))
        waits.append((f_wait, b_wait))
    if v == 1:
        tails = [tail_s(ev, plan, config) for plan in stages]
    else:  # tails are per rank: over the union of its chunks
        per_rank = []
        for r in range(pp):
            rank_stages = [p for p in stages if p.index % pp == r]
            merged = StagePlan(
                index=r,
                units=tuple(u for p in rank_stages for u in p.units),
                options=tuple(o for p in rank_stages for o in p.options),
                inflight=rank_stages[0].inflight,
                choice=rank_stages[0].choice,
            )
            per_rank.append(tail_s(ev, merged, config))
        tails = [per_rank[p.index % pp] for p in stages]
    t_pipe = pipeline_time_s(rank_work, m, v)
    worst = max(range(len(tails)), key=lambda i: tails[i][0] + tails[i][1])
    return Timing(
        rank_work=tuple(rank_work),
        p2p=tuple(p2p),
        waits=tuple(waits),
        tails=tuple(tails),
        pipeline_s=t_pipe,
        worst_tail=worst,
        step_s=t_pipe + tails[worst][0] + tails[worst][1],
    )


def predict(ev: Evaluator, config: ParallelConfig, stages: list[StagePlan] | tuple[StagePlan, ...]) -> Prediction:
    """Assemble the prediction of a solved configuration."""
    pp, m = config.pp, config.num_microbatches
    dev = ev.cluster.device
    tm = timing(ev, config, stages)
    rank_work, t_pipe, step = list(tm.rank_work), tm.pipeline_s, tm.step_s
    tails, worst_tail = tm.tails, tm.worst_tail
    stage_preds = [(plan, *tm.p2p[i], *tails[i], tm.waits[i]) for i, plan in enumerate(stages)]
    crit = max(range(pp), key=lambda r: rank_work[r])
    crit_stages = [p for p in stages if p.index % pp == crit]
    comp = sum(o.layout.fwd_compute_s + o.layout.bwd_compute_s for p in crit_stages for o in p.options)
    reco = sum(o.recompute_s for p in crit_stages for o in p.options)
    tpc = sum(o.layout.fwd_comm_s + o.layout.bwd_comm_s for p in crit_stages for o in p.options)
    tpc += sum(sum(tm.waits[i]) for i, p in enumerate(stages) if p.index % pp == crit)
    ppc = sum(sum(ev.stage_p2p_s(p.units, p.options, config)) for p in crit_stages)
    bubble = t_pipe - m * rank_work[crit]
    breakdown = StepBreakdown(
        compute_s=m * comp,
        recompute_s=m * reco,
        tp_comm_s=m * tpc,
        pp_comm_s=m * ppc,
        bubble_s=bubble + m * (rank_work[crit] - comp - reco - tpc - ppc),
        dp_comm_s=tails[worst_tail][0],
        optimizer_s=tails[worst_tail][1],
    )
    preds = []
    peak = 0.0
    for plan, f_p2p, b_p2p, exposed, opt_s, (f_wait, b_wait) in stage_preds:
        mem = stage_memory(ev, plan, config, stages)
        peak = max(peak, mem.total_bytes)
        preds.append(
            StagePrediction(
                index=plan.index,
                pipeline_rank=plan.index % pp,
                units=tuple(mod for u in plan.units for mod in ev.graph.units[u].modules),
                forward_s=sum(o.fwd_s for o in plan.options) + f_p2p + f_wait,
                backward_s=sum(o.bwd_s for o in plan.options) + b_p2p + b_wait,
                tp_comm_s=sum(o.tp_comm_s for o in plan.options) + f_wait + b_wait,
                pp_comm_s=f_p2p + b_p2p,
                recompute_s=sum(o.recompute_s for o in plan.options),
                dp_comm_s=exposed,
                optimizer_s=opt_s,
                inflight_microbatches=plan.inflight,
                memory=mem,
            )
        )
    gb = ev.global_batch_size
    model_flops = 3.0 * ev.graph.fwd_flops_per_sample * gb
    reco_flops = sum(o.recompute_flops for p in stages for o in p.options) * config.micro_batch_size * m * config.dp
    world = config.world_size
    peak_flops = dev.peak(config.dtype)
    return Prediction(
        step_time_s=step,
        samples_per_s=gb / step,
        tokens_per_s=gb * ev.graph.seq_len / step,
        tflops_per_device=model_flops / step / world / 1e12,
        mfu=model_flops / (step * world * peak_flops),
        hfu=(model_flops + reco_flops) / (step * world * peak_flops),
        memory_bytes_per_device=peak,
        memory_capacity_bytes=dev.memory_bytes,
        fits=peak <= dev.memory_bytes,
        breakdown=breakdown,
        stages=tuple(preds),
    )


def stage_memory(
    ev: Evaluator, plan: StagePlan, config: ParallelConfig, stages: list[StagePlan] | tuple[StagePlan, ...]
) -> MemoryBreakdown:
    """The memory of the pipeline rank that runs ``plan`` at its peak, term by term.

    The stage solver bounds it by ``static + inflight x activations + max transient``
    (DDP's bucket rebuild apart); the prediction follows the backward unit by unit
    (:func:`_backward_peak`): a unit's transient meets only the activations of the units
    before it in its own micro-batch, and where this rank runs every micro-batch's
    forward before its first backward (no pipelining with one micro-batch, GPipe, 1F1B
    with no more micro-batches than stages after this one) and no gradient outlives a
    step (anything but DDP, whose buckets hold them), ``zero_grad`` left no gradient, so
    they grow as that backward frees the activations. Interleaved schedules keep the
    bound. The solver keeps the bound, so what it accepts fits; the prediction is the
    peak. Under pipelining the schedule's receive buffers and held outputs come on top
    (:func:`autopar.cost.pipeline.stage_buffer_bytes`), in the solver's budget too.
    Measured on one process (the benchmark GPT, 4 samples): one micro-batch peaked at
    91.6 MiB, four at 105.8, 14.2 MiB (the gradients) apart; on 2 ZeRO-3 ranks with two
    micro-batches the bound was 6% over the measured peak, the sweep 2%.
    """
    pp = config.pp
    rank = [(u, o) for p in stages if p.index % pp == plan.index % pp for u, o in zip(p.units, p.options)]
    priced = [ev.price(o, config, 0) for _, o in rank]
    params = sum(o.layout.param_numel for _, o in rank)
    factored = sum(o.layout.factored_numel for _, o in rank)
    st = state_bytes(
        param_numel=params,
        factored_numel=factored,
        largest_unit_numel=0.0,
        dtype=config.dtype,
        optimizer=ev.optimizer,
        zero_stage=config.zero_stage,
        dp=config.dp,
        pipelined=pp > 1,
        tp=config.tp,
    )
    static = st.params_bytes + st.grads_bytes + st.optimizer_bytes
    shared = ev.shared_state_bytes(config, ev.held_once_numel(config, dict(rank)))
    scale = (static - shared) / static if static else 1.0
    grads = st.grads_bytes * scale
    if pp > 1 and config.schedule is Schedule.INTERLEAVED_1F1B:
        acts, transient = plan.inflight * sum(p.act_bytes for p in priced), max(p.transient_bytes for p in priced)
    else:
        share = [o.layout.param_numel / params if params else 0.0 for _, o in rank]
        fresh = plan.inflight >= config.num_microbatches and not st.rebuild_bytes
        last = [o.layout.held_output_bytes for u, o in rank if u == len(ev.graph.units) - 1]
        acts, grads, transient = _backward_peak(
            [p.act_bytes for p in priced],
            [p.transient_bytes for p in priced],
            [grads * f for f in share],
            plan.inflight,
            fresh_gradients=fresh,
            held_to_end=sum(last),
        )
    # DDP's bucket rebuild happens with no activation alive: it raises the peak only
    # by what it holds beyond them (``autopar.cost.memory``)
    transient = max(transient, st.rebuild_bytes * scale - acts)
    chosen = dict(rank)
    buffers = ev.pipeline_buffer_bytes(tuple(chosen), config, plan.inflight, lambda u: chosen[u].layout)
    dev = ev.cluster.device
    allocated = st.params_bytes * scale + grads + st.optimizer_bytes * scale + acts + transient + buffers
    return MemoryBreakdown(
        params_bytes=st.params_bytes * scale,
        grads_bytes=grads,
        optimizer_bytes=st.optimizer_bytes * scale,
        activations_bytes=acts,
        transient_bytes=transient,
        buffers_bytes=buffers,
        reserve_bytes=dev.reserved_bytes + dev.fragmentation * allocated,
    )


def _backward_peak(
    acts: list[float],
    transients: list[float],
    grads: list[float],
    inflight: float,
    *,
    fresh_gradients: bool,
    held_to_end: float = 0.0,
) -> tuple[float, float, float]:
    """(activations, gradients, transient) alive at the peak of a rank's backward, its
    units in forward order, ``inflight`` micro-batches' activations held at most.

    While unit ``k`` runs its backward, the micro-batch it works on still holds the
    activations of units up to ``k``, the other micro-batches in flight all theirs, and
    ``k`` its transient. Gradients: all of them, except with ``fresh_gradients`` (every
    forward runs before the first backward and ``zero_grad`` left none), where the first
    micro-batch's backward at ``k`` has only those of the units after ``k``, and every one
    exists from the second micro-batch on, one micro-batch's activations fewer.
    ``held_to_end``: of the last unit's activations, what stays until the micro-batch's
    backward is over (the logits, which ``PipelineStage`` keeps as the output it runs
    backward from): measured on 4 ZeRO-3 ranks, a 4 MiB logits tensor was alive while
    the blocks' backward ran."""
    whole = sum(acts)
    best = (0.0, sum(grads, 0.0), 0.0)  # after the last backward, nothing but the gradients
    for k in range(len(acts)):
        held = (inflight - 1) * whole + sum(acts[: k + 1]) + (held_to_end if k < len(acts) - 1 else 0.0)
        moments = [(held, sum(grads[k + 1 :] if fresh_gradients else grads, 0.0), transients[k])]
        if fresh_gradients and inflight >= 2:
            moments.append((held - whole, sum(grads, 0.0), transients[k]))
        for moment in moments:
            if sum(moment) > sum(best):
                best = moment
    return best


def smallest_footprint_bytes(ev: Evaluator, config: ParallelConfig) -> float:
    """Peak memory per device with every unit at its smallest option (fewest
    parameters, full recomputation) on the even split: what a configuration that
    does not fit needs at least, about."""
    modes = (Recompute.FULL,)
    pp, v = config.pp, config.virtual_stages
    chunks = pp * v
    bounds = ev.even_split(chunks) if chunks > 1 else (0, len(ev.graph.units))
    if bounds is None:
        return math.inf
    dev = ev.cluster.device
    worst = 0.0
    for r in range(pp):
        units = [u for c in range(r, chunks, pp) for u in range(bounds[c], bounds[c + 1])]
        inflight = inflight_microbatches(config.schedule, pp, v, config.num_microbatches, r)
        static, acts, transient, rebuild = 0.0, 0.0, 0.0, 0.0
        for u in units:
            smallest = min(
                (ev.price(o, config, 0) for o in ev.options(u, config, modes)),
                key=lambda p: p.static_bytes + inflight * p.act_bytes + p.transient_bytes,
            )
            static += smallest.static_bytes
            acts += inflight * smallest.act_bytes
            transient = max(transient, smallest.transient_bytes)
            rebuild += smallest.rebuild_bytes
        peak = static + max(acts + transient, rebuild)
        worst = max(worst, peak * (1 + dev.fragmentation) + dev.reserved_bytes)
    return worst
