"""What a configuration's cost depends on besides the configuration itself.

A :class:`CostModel` is plain data: the model's layer graph, the cluster, the optimizer,
the global batch and a profile's corrections. Every function of :mod:`autopar.cost`
takes it with the decisions to price; none keeps state between calls.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from autopar.cost.comm import group_span
from autopar.cost.compute import rates
from autopar.cost.leaf import TPContext
from autopar.graph.layer_graph import LayerGraph
from autopar.hardware.cluster import Cluster
from autopar.plan import ParallelConfig
from autopar.vocab import Attention, Layout, Optimizer

ROUTING_IMBALANCE = 1.0
"""Dropless experts' default load factor: a router trained with a load-balancing loss
(Fedus et al. 2022; Mixtral and DeepSeek-V3 train with one) spreads each step's rows
evenly in expectation. Set :attr:`CostModel.routing_imbalance` from a measured router
(the largest expert-parallel rank's rows over the mean) to price a skewed one."""


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """The inputs of the cost model other than a configuration.

    Attributes:
        graph: the model as the planner sees it.
        cluster: where it runs.
        optimizer: which optimizer (its state and its step).
        global_batch_size: samples per optimizer step.
        calibration: unit profile signature -> measured over predicted compute time,
            from a layer profile (1 where absent).
        recompute_fractions: unit profile signature -> what full recomputation reruns,
            as a fraction of the recorded forward, from a layer profile (1 where absent).
        routing_imbalance: under expert parallelism, the busiest rank's routed rows
            over the mean for dropless experts (:data:`ROUTING_IMBALANCE`); experts with
            fixed capacity buffers are balanced by construction. Under ``ep`` ranks it
            is at most ``ep`` (one rank receiving every row), which a configuration's
            pricing takes where it is given more.
        batch_first: activations are laid out ``(batch, sequence, features)``, as
            autopar's runtime lays them, so sequence-parallel collectives copy around
            their transfers (:mod:`autopar.cost.layout_copies`); False prices Megatron-LM's
            sequence-first layout (:class:`autopar.vocab.ActivationLayout`).
    """

    graph: LayerGraph
    cluster: Cluster
    optimizer: Optimizer
    global_batch_size: int
    calibration: Mapping[str, float] = field(default_factory=dict)
    recompute_fractions: Mapping[str, float] = field(default_factory=dict)
    routing_imbalance: float = ROUTING_IMBALANCE
    batch_first: bool = True

    @property
    def num_units(self) -> int:
        """Units of the model."""
        return len(self.graph.units)


def tp_context(model: CostModel, unit: int, config: ParallelConfig) -> TPContext:
    """The tensor-parallel context of ``unit`` under ``config``: its group, the device's
    rates and host effects, its place in the model, a profile's corrections, and its
    share of each sample under context parallelism (the cp ring: ``cp`` ranks, ``tp``
    apart, :class:`autopar.vocab.MeshAxis`), and its expert-parallel group (``ep``
    ranks, ``tp`` apart). Compiled plans compile the blocks only, as the runtime does
    (:mod:`autopar.runtime.compile`): the prologue and epilogue stay eager, and so do
    their tensor-parallel collectives under asynchronous TP."""
    signature = model.graph.profile_of(unit).signature
    device = model.cluster.device
    return TPContext(
        tp=config.tp,
        span=group_span(config.tp, 1, model.cluster.devices_per_node),
        cluster=model.cluster,
        rates=rates(device, config.dtype),
        micro_batch=config.micro_batch_size / config.cp,
        tokens=model.graph.seq_len,
        boundary=Layout.Q if config.sequence_parallel else Layout.R,
        first=unit == 0,
        last=unit == model.num_units - 1,
        loss_parallel=model.graph.vocab_size > 0,
        sequence_parallel=config.sequence_parallel,
        compute_scale=model.calibration.get(signature, 1.0),
        recompute_fraction=model.recompute_fractions.get(signature, 1.0),
        host=device.host,
        cp=config.cp,
        cp_span=group_span(config.cp, config.tp, model.cluster.devices_per_node),
        dtype=config.dtype,
        ep=config.ep,
        ep_span=group_span(config.ep, config.tp, model.cluster.devices_per_node),
        routing_imbalance=min(model.routing_imbalance, config.ep),  # at most every row on one of ep ranks
        compile=config.compile and model.graph.units[unit].is_block,
        fp8=config.fp8 and model.graph.units[unit].is_block,
        fused_attention=model.graph.attention is Attention.FLASH,
        async_tp=config.async_tp and model.graph.units[unit].is_block,
        regather=config.regather,
        batch_first=model.batch_first,
    )
