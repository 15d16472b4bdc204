"""A pipeline stage as the cost model sees it: its units, the option each unit runs,
what it sends and receives per micro-batch, and what the schedule holds for it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from autopar.cost.comm import p2p_s
from autopar.cost.model import CostModel
from autopar.cost.pipeline import stage_buffer_bytes
from autopar.cost.recompute import UnitOption
from autopar.cost.tensor_parallel import UnitCost
from autopar.plan import ParallelConfig


@dataclass(frozen=True, kw_only=True)
class PricedStage:
    """One pipeline stage, decided and priced.

    Attributes:
        index: its place in pipeline order; it runs on pipeline rank
            ``config.rank_of_stage(index)``.
        units: the model's units it holds, in order.
        options: the option each unit runs (layout and recomputation, priced).
        inflight: micro-batches of this stage whose activations its rank holds at its
            peak (:func:`autopar.cost.pipeline.stage_inflight_microbatches`).
    """

    index: int
    units: tuple[int, ...]
    options: tuple[UnitOption, ...]
    inflight: float

    @property
    def time_s(self) -> float:
        """Forward plus backward of its units per micro-batch, point-to-point apart."""
        return sum(o.time_s for o in self.options)


def on_rank(config: ParallelConfig, stages: Sequence[PricedStage], rank: int) -> list[PricedStage]:
    """The stages of ``stages`` that pipeline rank ``rank`` runs, in their order (the
    search asks for every rank of every candidate: its stage indices, not a scan asking
    each stage its rank)."""
    held = set(config.stages_of_rank(rank))
    return [p for p in stages if p.index in held]


def stage_p2p_s(
    model: CostModel, units: tuple[int, ...], options: tuple[UnitOption, ...], config: ParallelConfig
) -> tuple[float, float]:
    """(forward, backward) point-to-point seconds per micro-batch of a stage holding
    ``units`` (first and last with ``options[0]`` and ``options[-1]``): it sends its
    output forward unless it ends the model, and its input's gradient back unless it
    starts it. Pipeline neighbours are ``tp * cp * dp`` ranks apart, on another node when
    that is at least a node."""
    if config.pp == 1:
        return 0.0, 0.0
    cluster = model.cluster
    cross = config.tp * config.cp * config.dp >= cluster.devices_per_node
    n = model.num_units
    fwd = p2p_s(options[-1].layout.output_bytes, cross_node=cross, cluster=cluster) if units[-1] < n - 1 else 0.0
    bwd = p2p_s(options[0].layout.input_bytes, cross_node=cross, cluster=cluster) if units[0] > 0 else 0.0
    return fwd, bwd


def rank_buffer_bytes(
    model: CostModel, units: tuple[int, ...], config: ParallelConfig, inflight: float, layout: Callable[[int], UnitCost]
) -> float:
    """What the pipeline schedule holds for ``units`` (one rank's stages: each run of
    consecutive units is one, in order) beyond their activations
    (:func:`autopar.cost.pipeline.stage_buffer_bytes`), with ``layout(u)`` the layout
    unit ``u`` takes (its boundary tensors are the same in every option)."""
    if config.pp == 1:
        return 0.0
    runs = []
    start = 0
    for i in range(1, len(units) + 1):
        if i == len(units) or units[i] != units[i - 1] + 1:
            runs.append((units[start], units[i - 1]))
            start = i
    return runs_buffer_bytes(model, runs, config, inflight, layout)


def runs_buffer_bytes(
    model: CostModel,
    runs: Sequence[tuple[int, int]],
    config: ParallelConfig,
    inflight: float,
    layout: Callable[[int], UnitCost],
) -> float:
    """:func:`rank_buffer_bytes` of a rank whose stages are given as (first unit, last
    unit) pairs."""
    if config.pp == 1:
        return 0.0
    n = model.num_units
    return sum(
        stage_buffer_bytes(
            receives_input=first > 0,
            sends_output=last < n - 1,
            input_bytes=layout(first).input_bytes,
            output_bytes=layout(last).output_bytes,
            inflight=inflight,
        )
        for first, last in runs
    )
