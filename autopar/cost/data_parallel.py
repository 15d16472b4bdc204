"""The end of a step: data-parallel communication the backward does not hide, and the
optimizer step.

Gradient reduction overlaps the backward of the last micro-batch except its last bucket
(bucketed all-reduce, Li et al. 2020; FSDP2's per-unit reduce-scatter): the stage's first
unit, whose gradients are ready last, is reduced after all of its compute, so its own
collective is exposed in full (an embedding of a large vocabulary weighs far more than an
average unit); ZeRO-2/3's first gather of a forward (and ZeRO-3's first of a backward,
of the last unit) likewise waits with nothing to hide behind. The last bucket also makes
the ranks wait for the slowest once a step
(:func:`autopar.cost.host.ranks_wait_s`, the whole step's work between meetings). Hiding
is not free: the compute beside a collective runs slower while it runs
(:func:`overlapped_s`). ZeRO-1 all-gathers updated parameters after the step; ZeRO-3
gathers parameters before each unit's forward and backward, overlapped with the previous
unit's compute. FSDP2 issues ZeRO-2/3's gathers and reductions one per unit, so each
unit pays the collective's latency, the copies into and out of the flat buffers
(:func:`autopar.cost.host.fsdp_copy_s`), FSDP2's framework time per call and per
parameter tensor, and, where communication does not hide them, the wait for the slowest
rank at each. Under pipelining ``PipelineStage`` defers ZeRO-2/3's reduction to the last
micro-batch and keeps parameters gathered (:mod:`autopar.cost.memory`). Tied weights
split over the first and last stage are all-reduced between them.

HSDP (``ParallelConfig.dp_shard``) runs ZeRO-2/3's collectives on two levels, as FSDP2 on
a (replicate, shard) mesh does (Zhao et al. 2023, "PyTorch FSDP", section 3.2.2): the
all-gather and the reduce-scatter run over the shard group only (``dp_shard`` ranks,
stride ``tp``: inside a node when ``tp * dp_shard`` fits, :func:`shard_span`), and each
unit's reduced ``1/dp_shard`` gradient slice is then all-reduced over its replicate group
(``dp / dp_shard`` ranks, stride ``tp * dp_shard``, :func:`replicate_span`), on the same
stream, so it is priced as part of the reduction (:func:`hsdp_reduce_s`).

Under expert parallelism (``ParallelConfig.ep``) the expert parameters a rank holds are
reduced, gathered and sharded over the ranks holding the same experts
(``dp * cp / ep`` ranks, stride ``tp * ep``; within each HSDP shard group, ``1 / ep`` of
it), the dense ones as above: each collective is priced twice, once per group, with the
same overlap.
"""

from __future__ import annotations

from collections.abc import Collection

from autopar.cost.comm import GroupSpan, all_gather_s, all_reduce_s, group_span, reduce_scatter_s
from autopar.cost.compute import rates
from autopar.cost.host import fsdp_copy_s, fsdp_framework_s, optimizer_bytes_per_s, ranks_wait_s
from autopar.cost.memory import GRAD_BYTES, compute_copy_bytes, optimizer_step_bytes
from autopar.cost.model import CostModel
from autopar.cost.peak import held_once_numel
from autopar.cost.pipeline import RankSlack
from autopar.cost.recompute import UnitOption
from autopar.cost.stage import PricedStage
from autopar.hardware.cluster import Cluster
from autopar.hardware.device import DeviceSpec
from autopar.plan import ParallelConfig
from autopar.vocab import DType, Optimizer


def optimizer_step_s(device: DeviceSpec, dtype: DType, optimizer: Optimizer, numel: float) -> float:
    """Time of the optimizer step over ``numel`` local parameters: its memory traffic
    (:func:`autopar.cost.memory.optimizer_step_bytes`) at the device's optimizer rate."""
    rate = optimizer_bytes_per_s(device.host, streaming_bytes_per_s=rates(device, dtype).bytes_per_s)
    return optimizer_step_bytes(optimizer) * numel / rate


def finite_check_s(model: CostModel, config: ParallelConfig, grad_numel: float) -> float:
    """The check before each optimizer step that every rank's loss and gradients are
    finite (:mod:`autopar.runtime.finite`): one read of the rank's ``grad_numel`` local
    gradients (a read and a write under fp16, whose unscale divides them in place) at
    the device's streaming rate, and an all-reduce of two numbers over the world."""
    cl = model.cluster
    passes = 2 if config.dtype is DType.FP16 else 1
    read_s = passes * GRAD_BYTES * grad_numel / rates(cl.device, config.dtype).bytes_per_s
    world = group_span(config.world_size, 1, cl.devices_per_node)
    return read_s + all_reduce_s(2 * 4.0, world, cl)


def tail_s(model: CostModel, stage: PricedStage, config: ParallelConfig, slack: RankSlack) -> tuple[float, float]:
    """(exposed data-parallel communication, optimizer step with its finite check) of a
    stage per step (module docstring). Under pipelining the stage's rank idles
    ``slack.lead_s`` before its first forward, where the first gather of ZeRO-2/3 runs
    too, and ``slack.trail_s`` after its last backward, where DDP's reduction runs on
    (:func:`autopar.cost.pipeline.rank_slack_s`); ``slack.own_share`` of its own compute
    hides them."""
    params = sum(o.layout.param_numel for o in stage.options)
    params -= held_once_numel(model, config, dict(zip(stage.units, stage.options)))  # one tensor: reduced, stepped once
    experts = sum(o.layout.expert_numel for o in stage.options)
    groups = ((params - experts, False), (experts, True))  # (parameters, expert group)
    units = max(len(stage.options), 1)
    tensors = sum(model.graph.profile_of(u).param_tensors for u in stage.units)
    bwd = sum(o.bwd_s for o in stage.options)
    fwd = sum(o.fwd_s for o in stage.options)
    cl = model.cluster
    host = cl.device.host
    m = config.num_microbatches
    copy = compute_copy_bytes(config.dtype) or 4.0
    exposed = 0.0
    if config.dp_cp > 1:
        slowdown = 1 - cl.device.comm_overlap
        window_bwd = slack.own_share * bwd * (1 - 1 / units)  # the compute that can hide it
        window_fwd = slack.own_share * fwd * (1 - 1 / units)

        def bwd_cost(comm_s: float) -> float:
            return overlapped_s(comm_s, window_bwd, slowdown)

        def fwd_cost(comm_s: float) -> float:
            return overlapped_s(comm_s, window_fwd, slowdown)

        first, last = _unit_groups(stage.options[0]), _unit_groups(stage.options[-1])
        if config.zero_stage <= 1:
            reduce, reduce0 = (
                sum(all_reduce_s(4.0 * n, replicas_span(config, cl.devices_per_node, e), cl) for n, e in g)
                for g in (groups, first)
            )
            reduce0 = min(reduce0, reduce)
            exposed = max(bwd_cost(reduce - reduce0) + reduce0 - slack.trail_s, 0.0)
            # DDP's last bucket meets once per step, after all of the rank's work
            exposed += ranks_wait_s(host, config.dp_cp, 1, m * (fwd + bwd))
            if config.zero_stage == 1:
                exposed += sum(
                    all_gather_s(4.0 * n, replicas_span(config, cl.devices_per_node, e), cl) for n, e in groups
                )
        elif config.pp > 1:
            rs, ag = _fsdp_collectives_s(model, groups, copy, config, units)
            _, ag0 = _fsdp_collectives_s(model, first, copy, config, 1)
            gathers = 1 if config.zero_stage == 2 else m + 1
            exposed = rs + max(gathers * fwd_cost(ag) - slack.lead_s, min(ag0, ag))
            per_unit = 1 + gathers
            exposed += fsdp_framework_s(host, calls_per_unit=per_unit, units=units, tensors=tensors) + _fsdp_waits_s(
                model, config, per_unit * units, m * (fwd + bwd)
            )
        else:
            rs, ag = _fsdp_collectives_s(model, groups, copy, config, units)
            rs0, ag0 = (min(x, total) for x, total in zip(_fsdp_collectives_s(model, first, copy, config, 1), (rs, ag)))
            # the first unit's reduction, after each micro-batch's backward, hides behind the next forward
            tail = rs0 + (m - 1) * slowdown * rs0
            if config.zero_stage == 2:
                exposed = m * bwd_cost(rs - rs0) + tail + fwd_cost(ag - ag0) + ag0
                per_unit = m + 1
            else:
                agl = min(_fsdp_collectives_s(model, last, copy, config, 1)[1], ag)
                exposed = m * (fwd_cost(ag - ag0) + ag0 + bwd_cost(ag - agl + rs - rs0) + agl) + tail
                per_unit = 3 * m
            exposed += fsdp_framework_s(host, calls_per_unit=per_unit, units=units, tensors=tensors) + _fsdp_waits_s(
                model, config, per_unit * units, m * (fwd + bwd)
            )
    exposed += tied_exposed_s(model, stage.units, config)
    sharded = (params + experts * (config.ep - 1)) / config.state_shards  # every expert of the shard group's
    local = sharded if config.zero_stage >= 1 else params
    grads = sharded if config.zero_stage >= 2 else params
    return exposed, optimizer_step_s(cl.device, config.dtype, model.optimizer, local) + finite_check_s(
        model, config, grads
    )


def overlapped_s(comm_s: float, window_s: float, slowdown: float) -> float:
    """What a collective of ``comm_s`` seconds adds to a rank's time beside ``window_s``
    seconds of compute that can hide it: the part beyond the window in full, and the
    part within it ``slowdown`` of its time, as the compute beside it runs that much
    slower while NCCL's kernels hold streaming multiprocessors and memory bandwidth
    (``1 - DeviceSpec.comm_overlap``). A collective shorter than the compute still costs:
    hiding it slows the compute."""
    return max(comm_s - window_s, 0.0) + slowdown * min(comm_s, window_s)


def tied_exposed_s(model: CostModel, units: Collection[int], config: ParallelConfig) -> float:
    """The all-reduce of tied weights' gradients (:func:`tied_all_reduce_s`) in the tail
    of a pipeline rank holding ``units``: where it holds the first or the last unit of a
    pipelined model with tied weights; else 0. Communication between pipeline stages,
    which a step's breakdown counts as such."""
    if config.pp > 1 and model.graph.shared and (0 in units or model.num_units - 1 in units):
        return tied_all_reduce_s(model, config)
    return 0.0


def tied_all_reduce_s(model: CostModel, config: ParallelConfig) -> float:
    """The all-reduce of tied weights' gradients between the first and the last pipeline
    stage, which hold a copy each."""
    pair = group_span(2, config.tp * config.dp_cp * (config.pp - 1), model.cluster.devices_per_node)
    return all_reduce_s(4.0 * sum(s.numel for s in model.graph.shared) / config.tp, pair, model.cluster)


def unhidden_floor_s(model: CostModel, config: ParallelConfig, local_params: float) -> float:
    """What no schedule hides of a stage holding ``local_params`` parameters: the
    optimizer step and its finite check, ZeRO-1's all-gather of the updated parameters, and under pipelining
    ZeRO-2/3's reduce-scatter (deferred to the last micro-batch): a lower bound of
    :func:`tail_s`'s sum for any stage of at least that many parameters."""
    cl = model.cluster
    local = local_params / config.state_shards if config.zero_stage >= 1 else local_params
    grads = local_params / config.state_shards if config.zero_stage >= 2 else local_params
    floor = optimizer_step_s(cl.device, config.dtype, model.optimizer, local) + finite_check_s(model, config, grads)
    if config.dp_cp > 1 and config.ep == 1:  # experts' collectives run over other groups: no floor taken
        span = group_span(config.dp_cp, config.tp, cl.devices_per_node)
        if config.zero_stage == 1:
            floor += all_gather_s(4.0 * local_params, span, cl)
        elif config.zero_stage >= 2 and config.pp > 1:
            floor += hsdp_reduce_s(config.reduce_dtype.itemsize * local_params, config, cl)
    return floor


def shard_span(config: ParallelConfig, devices_per_node: int, experts: bool = False) -> GroupSpan:
    """Where an FSDP shard group lies: ``state_shards`` ranks, ``tp`` apart (the whole
    data- and context-parallel group without HSDP); for expert parameters, the
    ``expert_state_shards`` ranks of it holding the same experts, ``tp * ep`` apart."""
    if experts:
        return group_span(config.expert_state_shards, config.tp * config.ep, devices_per_node)
    return group_span(config.state_shards, config.tp, devices_per_node)


def replicas_span(config: ParallelConfig, devices_per_node: int, experts: bool = False) -> GroupSpan:
    """Where the ranks holding the same parameters lie: all ``dp * cp`` ranks, ``tp``
    apart; for expert parameters, the ``dp * cp / ep`` holding the same experts,
    ``tp * ep`` apart."""
    if experts:
        return group_span(config.expert_replicas, config.tp * config.ep, devices_per_node)
    return group_span(config.dp_cp, config.tp, devices_per_node)


def replicate_span(config: ParallelConfig, devices_per_node: int) -> GroupSpan:
    """Where an HSDP replicate group lies: ``dp / dp_shard`` ranks, ``tp * dp_shard * cp``
    apart (one rank, no communication, without HSDP)."""
    return group_span(config.replicate_size, config.tp * config.state_shards, devices_per_node)


def hsdp_reduce_s(
    grad_bytes: float, config: ParallelConfig, cluster: Cluster, *, calls: int = 1, experts: bool = False
) -> float:
    """FSDP2's gradient reduction of ``grad_bytes`` (unsharded gradients in
    ``ParallelConfig.reduce_dtype``) in
    ``calls`` collectives: a reduce-scatter over the shard group (of ``experts``: the
    ranks of it holding the same experts), then, under HSDP, an all-reduce of each
    rank's slice over its replicate group (module docstring). Without HSDP it is the
    reduce-scatter alone."""
    dpn = cluster.devices_per_node
    span = shard_span(config, dpn, experts)
    rs = reduce_scatter_s(grad_bytes, span, cluster, calls=calls)
    return rs + all_reduce_s(grad_bytes / span.size, replicate_span(config, dpn), cluster, calls=calls)


def _fsdp_collectives_s(
    model: CostModel, groups: tuple[tuple[float, bool], ...], copy: float, config: ParallelConfig, units: int
) -> tuple[float, float]:
    """(reduction, all-gather) of a stage's gradients (in ``config.reduce_dtype``) and
    parameters (``copy`` bytes each), one call per unit and shard group, each with FSDP2's copies around it;
    ``groups`` lists (parameters, whether they are experts): dense parameters over the
    shard group, expert ones over its ranks holding the same experts. The reduction
    is :func:`hsdp_reduce_s` (two levels under HSDP)."""
    cl = model.cluster
    streaming = rates(cl.device, config.dtype).bytes_per_s
    rs = ag = 0.0
    for numel, experts in groups:
        if experts and not numel:
            continue
        span = shard_span(config, cl.devices_per_node, experts)
        grad_bytes, param_bytes = config.reduce_dtype.itemsize * numel, copy * numel
        rs += hsdp_reduce_s(grad_bytes, config, cl, calls=units, experts=experts) + fsdp_copy_s(
            cl.device.host, grad_bytes, span.size, streaming_bytes_per_s=streaming
        )
        ag += all_gather_s(param_bytes, span, cl, calls=units) + fsdp_copy_s(
            cl.device.host, param_bytes, span.size, streaming_bytes_per_s=streaming
        )
    return rs, ag


def _unit_groups(option: UnitOption) -> tuple[tuple[float, bool], ...]:
    """One unit's (parameters, whether they are experts), as ``tail_s`` groups a stage's."""
    experts = option.layout.expert_numel
    return ((option.layout.param_numel - experts, False), (experts, True))


def _fsdp_waits_s(model: CostModel, config: ParallelConfig, calls: int, work_s: float) -> float:
    """Seconds the data-parallel group waits on its slowest rank at FSDP2's collectives
    in a step of ``work_s`` seconds. A collective that communication does not hide is a
    meeting; one hidden under compute is not, so the ``calls`` count as
    ``calls * (1 - comm_overlap)`` meetings."""
    device = model.cluster.device
    meetings = calls * (1 - device.comm_overlap)
    return ranks_wait_s(device.host, config.dp_cp, meetings, work_s)
