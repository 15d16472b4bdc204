"""One training step of a decided configuration: its time, term by term, and the
:class:`~autopar.plan.Prediction`.

The step is the pipeline (:func:`autopar.cost.pipeline.pipeline_time_s` over each
rank's work per micro-batch: its stages' units, point-to-point and the waits of its
tensor-parallel group) plus the slowest stage's tail (data-parallel communication the
backward does not hide and the optimizer step, :mod:`autopar.cost.data_parallel`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autopar.cost.data_parallel import tail_s, tied_exposed_s
from autopar.cost.host import ranks_wait_s
from autopar.cost.model import CostModel
from autopar.cost.peak import rank_memory
from autopar.cost.pipeline import pipeline_time_s, rank_slack_s, weight_grad_s
from autopar.cost.recompute import regathered
from autopar.cost.stage import PricedStage, on_rank, stage_p2p_s
from autopar.plan import MemoryBreakdown, ParallelConfig, Prediction, StagePrediction, StepBreakdown


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


def tp_waits_s(model: CostModel, stage: PricedStage, config: ParallelConfig) -> tuple[float, float]:
    """(forward, backward) seconds per micro-batch that a stage's tensor-parallel group
    waits on its slowest rank at the blocking collectives of its units
    (:func:`autopar.cost.host.ranks_wait_s`), split by the collectives of each pass. The
    work between meetings is the stage's compute, recomputation included."""
    meetings = sum(o.syncs for o in stage.options)
    if meetings == 0:
        return 0.0, 0.0
    work = sum(o.layout.fwd_compute_s + o.layout.bwd_compute_s + o.recompute_s for o in stage.options)
    wait = ranks_wait_s(model.cluster.device.host, config.tp, meetings, work)
    forward = sum(o.layout.fwd_syncs for o in stage.options) / meetings
    return wait * forward, wait * (1 - forward)


def timing(model: CostModel, config: ParallelConfig, stages: Sequence[PricedStage]) -> Timing:
    """Per-rank work, per-stage point-to-point, waits and tails, and the step time."""
    pp, v, m = config.pp, config.virtual_stages, config.num_microbatches
    rank_work, rank_forward, rank_weight_grad = [0.0] * pp, [0.0] * pp, [0.0] * pp
    p2p, waits = [], []
    for stage in stages:
        f_p2p, b_p2p = stage_p2p_s(model, stage.units, stage.options, config)
        f_wait, b_wait = tp_waits_s(model, stage, config)
        r = config.rank_of_stage(stage.index)
        rank_work[r] += stage.time_s + f_p2p + b_p2p + f_wait + b_wait
        rank_forward[r] += sum(o.fwd_s for o in stage.options) + f_p2p + f_wait
        rank_weight_grad[r] += sum(weight_grad_s(o.layout.fwd_compute_s, o.layout.attn_fwd_s) for o in stage.options)
        p2p.append((f_p2p, b_p2p))
        waits.append((f_wait, b_wait))
    t_pipe = pipeline_time_s(
        rank_work, m, v, schedule=config.schedule, rank_forward_s=rank_forward, rank_weight_grad_s=rank_weight_grad
    )
    slack = rank_slack_s(rank_work, rank_forward, rank_weight_grad, m, v, schedule=config.schedule, step_s=t_pipe)
    if v == 1:
        tails = [tail_s(model, stage, config, slack[config.rank_of_stage(stage.index)]) for stage in stages]
    else:  # tails are per rank: over the union of its chunks
        per_rank = []
        for r in range(pp):
            mine = on_rank(config, stages, r)
            merged = PricedStage(
                index=r,
                units=tuple(u for p in mine for u in p.units),
                options=tuple(o for p in mine for o in p.options),
                inflight=mine[0].inflight,
            )
            per_rank.append(tail_s(model, merged, config, slack[r]))
        tails = [per_rank[config.rank_of_stage(p.index)] for p in stages]
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


def predict(model: CostModel, config: ParallelConfig, stages: Sequence[PricedStage]) -> Prediction:
    """The prediction of a decided configuration: step time and its terms, throughput,
    MFU and HFU, per-stage times and the peak memory of every rank."""
    pp, m = config.pp, config.num_microbatches
    device = model.cluster.device
    tm = timing(model, config, stages)
    rank_work, t_pipe, step = list(tm.rank_work), tm.pipeline_s, tm.step_s
    tails, worst_tail = tm.tails, tm.worst_tail
    crit = max(range(pp), key=lambda r: rank_work[r])
    crit_stages = [i for i, p in enumerate(stages) if config.rank_of_stage(p.index) == crit]
    options = [o for i in crit_stages for o in stages[i].options]
    comp = sum(o.layout.fwd_compute_s + o.layout.bwd_compute_s for o in options)
    reco = sum(o.recompute_s for o in options)
    # the backward's gathers of kept shards are TP communication (a recomputed forward's is in reco)
    tpc = sum(o.layout.fwd_comm_s + o.layout.bwd_comm_s + regathered(o.layout, o.recompute)[0] for o in options)
    tpc += sum(sum(tm.waits[i]) for i in crit_stages)
    cpc = sum(o.cp_comm_s for o in options)
    epc = sum(o.ep_comm_s for o in options)
    ppc = sum(sum(tm.p2p[i]) for i in crit_stages)
    bubble = t_pipe - m * rank_work[crit]
    # the tail's all-reduce of tied weights runs between pipeline stages: PP, not DP, communication
    tail_rank = config.rank_of_stage(stages[worst_tail].index)
    tail_units = [u for p in stages if config.rank_of_stage(p.index) == tail_rank for u in p.units]
    tied = tied_exposed_s(model, tail_units, config)
    breakdown = StepBreakdown(
        compute_s=m * comp,
        recompute_s=m * reco,
        tp_comm_s=m * tpc,
        cp_comm_s=m * cpc,
        ep_comm_s=m * epc,
        pp_comm_s=m * ppc + tied,
        bubble_s=bubble + m * (rank_work[crit] - comp - reco - tpc - cpc - epc - ppc),
        dp_comm_s=tails[worst_tail][0] - tied,
        optimizer_s=tails[worst_tail][1],
    )
    preds = []
    peak = 0.0
    rank_memories: dict[int, MemoryBreakdown] = {}  # a rank's memory is all of its stages'
    for i, stage in enumerate(stages):
        (f_p2p, b_p2p), (f_wait, b_wait), (exposed, opt_s) = tm.p2p[i], tm.waits[i], tails[i]
        rank = config.rank_of_stage(stage.index)
        if rank not in rank_memories:
            rank_memories[rank] = rank_memory(model, stage, config, stages)
        memory = rank_memories[rank]
        peak = max(peak, memory.total_bytes)
        preds.append(
            StagePrediction(
                index=stage.index,
                pipeline_rank=rank,
                units=tuple(mod for u in stage.units for mod in model.graph.units[u].modules),
                forward_s=sum(o.fwd_s for o in stage.options) + f_p2p + f_wait,
                backward_s=sum(o.bwd_s for o in stage.options) + b_p2p + b_wait,
                tp_comm_s=sum(o.tp_comm_s for o in stage.options) + f_wait + b_wait,
                pp_comm_s=f_p2p + b_p2p,
                recompute_s=sum(o.recompute_s for o in stage.options),
                dp_comm_s=exposed,
                optimizer_s=opt_s,
                inflight_microbatches=stage.inflight,
                memory=memory,
            )
        )
    gb = model.global_batch_size
    model_flops = 3.0 * model.graph.model_fwd_flops_per_sample * gb
    hardware_flops = 3.0 * model.graph.fwd_flops_per_sample * gb
    reco_flops = sum(o.recompute_flops for p in stages for o in p.options) * config.micro_batch_size * m * config.dp
    world = config.world_size
    peak_flops = device.peak(config.dtype)
    capacity = device.memory.capacity_bytes
    return Prediction(
        step_time_s=step,
        samples_per_s=gb / step,
        tokens_per_s=gb * model.graph.seq_len / step,
        tflops_per_device=model_flops / step / world / 1e12,
        mfu=model_flops / (step * world * peak_flops),
        hfu=(hardware_flops + reco_flops) / (step * world * peak_flops),
        memory_bytes_per_device=peak,
        memory_capacity_bytes=capacity,
        fits=peak <= capacity,
        breakdown=breakdown,
        stages=tuple(preds),
    )
