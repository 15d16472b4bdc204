"""Floors: what a configuration costs at least, before any decision is made, so the
search can rule it out without solving it.

A unit's floor takes each leaf at its fewest parameters and keeps only the unit's
input (full recomputation); a configuration's memory floor spreads the model's floor
evenly over the pipeline ranks and takes the least loaded rank's activations, so it
never exceeds the peak of any split and choice.

Time scales too: on the analytic device model a unit's time per sample never grows
with the micro-batch size (:func:`micro_batch_scaling_holds`), so the time of a larger
micro-batch bounds every smaller one's from below, down to
:func:`smallest_scaled_micro_batch`.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.cost.layout_copies import collectives_copy
from autopar.cost.leaf import allowed_styles, leaf_param_numel
from autopar.cost.memory import config_state_bytes
from autopar.cost.model import CostModel, tp_context
from autopar.cost.pipeline import least_stage_inflight
from autopar.hardware.device import HostEffects
from autopar.plan import ParallelConfig
from autopar.vocab import Optimizer


@dataclass(frozen=True, kw_only=True)
class UnitFloor:
    """The least one unit holds on a device: its parameters at each leaf's fewest, and
    its input per micro-batch (all full recomputation keeps)."""

    param_numel: float
    input_bytes: float


def unit_floor(model: CostModel, unit: int, config: ParallelConfig) -> UnitFloor:
    """The floor of ``unit`` under ``config`` (module docstring)."""
    ctx = tp_context(model, unit, config)
    profile = model.graph.profile_of(unit)
    params = 0.0
    for leaf in profile.leaves:
        params += min(leaf_param_numel(leaf, s, config.tp, config.ep) for s in allowed_styles(leaf, ctx))
    shard = config.tp if config.sequence_parallel and unit > 0 else 1
    return UnitFloor(param_numel=params, input_bytes=profile.input_bytes * config.micro_batch_size / config.cp / shard)


def states_floor_bytes(model: CostModel, config: ParallelConfig, param_numel: float) -> float:
    """The model states (parameters, gradients, optimizer state) of a model holding
    ``param_numel`` parameters per tensor-parallel rank, under ``config``'s precision,
    ZeRO stage and data parallelism, before the pipeline spreads them (Adafactor's
    factored state is left out: it depends on the layout). Reads ``tp``, ``dtype``,
    ``zero_stage``, ``dp`` and whether ``pp > 1``."""
    st = config_state_bytes(config, model.optimizer, param_numel=param_numel)
    return st.params_bytes + st.grads_bytes + (st.optimizer_bytes if model.optimizer is not Optimizer.ADAFACTOR else 0)


def memory_floor_bytes(model: CostModel, config: ParallelConfig, states_bytes: float, input_bytes: float) -> float:
    """The peak memory per device any split and choice of ``config`` reaches at least,
    for a model whose states take ``states_bytes`` (:func:`states_floor_bytes`) and whose
    units' inputs sum to ``input_bytes``: the states and the least loaded rank's
    in-flight inputs, spread evenly over the pipeline ranks, plus the device's reserve."""
    pp, m = config.pp, config.num_microbatches
    # monotone in the rank (inflight_microbatches), so the least loaded rank is the first or the last;
    # a V's stages hold unequal counts, bounded by the fewer (least_stage_inflight)
    inflight = min(least_stage_inflight(config.schedule, pp, config.virtual_stages, m, r) for r in {0, pp - 1})
    return (states_bytes + inflight * input_bytes) / pp + model.cluster.device.memory.reserved_bytes


def smallest_scaled_micro_batch(model: CostModel, config: ParallelConfig) -> int:
    """The smallest micro-batch size whose time :func:`micro_batch_scaling_holds` bounds
    by a larger one's: 2 where sequence-parallel gathers of batch-first activations copy
    (:mod:`autopar.cost.layout_copies`), which one sequence per micro-batch gathers
    without, so its time per sample can be the smaller; else 1."""
    copies = config.sequence_parallel and collectives_copy(batch_first=model.batch_first, tp=config.tp)
    return 2 if copies else 1


def micro_batch_scaling_holds(model: CostModel) -> bool:
    """Whether a unit's time on ``b`` samples is at least ``b / B`` of its time on ``B``
    samples (``smallest_scaled_micro_batch <= b <= B``), for every layout and
    recomputation: every term of the analytic
    model is a fixed part plus a part linear in the batch, or the larger of such (a
    roofline reads the weights once and the activations per sample; a collective is
    latency plus bytes over bandwidth), so its time per sample never grows with the
    batch. Measured matmul or collective curves need not keep that, nor do a CPU host's
    effects: the search then prices every micro-batch size itself."""
    cluster = model.cluster
    device = cluster.device
    links = (cluster.intra_node, cluster.inter_node)
    return (
        not device.roofline.matmul_curves
        and device.host == HostEffects.none()
        and not any(fit.curve is not None for link in links for fit in link.per_op)
    )
