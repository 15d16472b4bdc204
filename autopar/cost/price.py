"""The cost model's one entry point: price a fully decided configuration.

A :class:`Decided` configuration says everything: the parallel degrees, batch split,
schedule and sharding (a :class:`~autopar.plan.ParallelConfig`), which units each
pipeline stage holds, and for every unit its tensor-parallel layout and recomputation.
:func:`price` returns its :class:`~autopar.plan.Prediction`: step time with every
compute, communication and bubble term, and memory by term on every rank. The search
decides; this prices.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.cost.model import CostModel, tp_context
from autopar.cost.pipeline import stage_inflight_microbatches
from autopar.cost.recompute import UnitOption, price_option
from autopar.cost.stage import PricedStage
from autopar.cost.step import predict
from autopar.cost.tensor_parallel import evaluate_layout
from autopar.errors import ConfigError
from autopar.plan import ParallelConfig, Prediction
from autopar.vocab import Layout, Recompute, TPStyle


@dataclass(frozen=True, kw_only=True)
class UnitChoice:
    """How one unit runs.

    Attributes:
        styles: the tensor-parallel style of each of its leaves, in the order of its
            profile's leaves.
        output: the layout of its output (the boundary layout between units; for the
            last unit, vocabulary-sharded logits under ``loss_parallel`` or replicated).
        recompute: its activation recomputation.
    """

    styles: tuple[TPStyle, ...]
    output: Layout
    recompute: Recompute


@dataclass(frozen=True, kw_only=True)
class Decided:
    """A configuration with every decision made.

    Attributes:
        config: degrees, batch split, schedule, sharding, precision.
        stages: the units of each pipeline stage, in pipeline order (stage ``i`` runs
            on pipeline rank ``config.rank_of_stage(i)``); together every unit once, in order.
        units: how each unit of the model runs.
    """

    config: ParallelConfig
    stages: tuple[tuple[int, ...], ...]
    units: tuple[UnitChoice, ...]


def price(model: CostModel, decided: Decided) -> Prediction:
    """The prediction of ``decided`` (module docstring)."""
    return predict(model, decided.config, priced_stages(model, decided))


def priced_stages(model: CostModel, decided: Decided) -> tuple[PricedStage, ...]:
    """Every stage of ``decided`` with its units' options priced."""
    config = decided.config
    n = model.num_units
    if len(decided.units) != n:
        raise ConfigError(
            f"a decided configuration needs a choice for each of the model's {n} units, got {len(decided.units)}."
        )
    listed = [u for stage in decided.stages for u in stage]
    if listed != list(range(n)) or len(decided.stages) != config.num_stages:
        raise ConfigError(
            f"a decided configuration's stages must hold the model's {n} units once each, in order, over "
            f"pp x virtual_stages = {config.num_stages} stages; got {len(decided.stages)} stages holding {len(listed)}."
        )
    stages = []
    priced: dict[tuple, UnitOption] = {}  # identical units that run alike cost alike
    for index, units in enumerate(decided.stages):
        options = []
        for u in units:
            choice = decided.units[u]
            key = (model.graph.units[u].profile, u == 0, u == n - 1, choice)
            if key not in priced:
                priced[key] = _price_unit(model, u, choice, config)
            options.append(priced[key])
        inflight = stage_inflight_microbatches(
            config.schedule, config.pp, config.virtual_stages, config.num_microbatches, index
        )
        stages.append(PricedStage(index=index, units=tuple(units), options=tuple(options), inflight=inflight))
    return tuple(stages)


def _price_unit(model: CostModel, unit: int, choice: UnitChoice, config: ParallelConfig) -> UnitOption:
    """One unit's layout and recomputation, priced."""
    ctx = tp_context(model, unit, config)
    profile = model.graph.profile_of(unit)
    if len(choice.styles) != len(profile.leaves):
        raise ConfigError(
            f"unit {model.graph.units[unit].fqn!r} has {len(profile.leaves)} leaves but its choice gives "
            f"{len(choice.styles)} styles."
        )
    layout = evaluate_layout(profile, choice.styles, choice.output, ctx)
    return price_option(profile, layout, choice.recompute, ctx)
