"""Which expert-parallel degrees the search tries, and the checks of a fixed one.

Expert parallelism only changes a model with mixture-of-experts layers (leaves whose
stacked 3-D weights run its routed rows, :attr:`autopar.graph.layer_graph.Leaf.experts`).
Its degree splits every such layer's experts, so it divides their count, and it is
folded into the ranks holding the same weights (``dp * cp``; under HSDP the shard group,
:class:`autopar.parallel_config.ParallelConfig`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from autopar.errors import ConfigError
from autopar.graph.layer_graph import LayerGraph
from autopar.models.experts import ROUTED_FORM
from autopar.search.integers import divisors


def model_experts(graph: LayerGraph) -> int:
    """The experts of the model's mixture-of-experts layers (their greatest common
    divisor where layers differ; 0 without any)."""
    return math.gcd(*(p.experts for p in graph.profiles if p.experts))


def ep_degrees(graph: LayerGraph, weight_replicas: int, shard_group: int, constraints: Mapping[str, Any]) -> list[int]:
    """Expert-parallel degrees to try with ``weight_replicas`` ranks holding the same
    weights (``dp * cp``) whose state shards over ``shard_group`` of them: 1, and every
    divisor of the experts that divides both. A fixed ``ep`` is tried alone where it
    divides them (:func:`check_expert_parallel` has refused what no layout allows)."""
    experts = model_experts(graph)
    fixed = constraints.get("ep")
    if fixed is not None:
        return [fixed] if fixed == 1 or (weight_replicas % fixed == 0 and shard_group % fixed == 0) else []
    if not experts:
        return [1]
    return divisors(math.gcd(experts, weight_replicas, shard_group))


def capacity_experts(graph: LayerGraph) -> bool:
    """Whether the model routes into fixed-capacity expert buffers (autopar's
    ``MoEFeedForward``): they fill in token order over a whole sample, which context
    parallelism cannot split."""
    return any(leaf.experts and not leaf.dropless for p in graph.profiles for leaf in p.leaves)


def check_expert_parallel(graph: LayerGraph, constraints: Mapping[str, Any]) -> None:
    """A fixed ``ep > 1`` needs a model with mixture-of-experts layers whose expert
    count it divides; said at once, in one line."""
    ep = constraints.get("ep", 1)
    if ep == 1:
        return
    experts = model_experts(graph)
    if not experts and graph.unsplit_experts:
        raise ConfigError(
            f"ep={ep} is not allowed for {graph.name}: its {', '.join(graph.unsplit_experts)} stack weights over "
            f"experts but do not take routed tokens, {ROUTED_FORM}, so expert parallelism cannot split them; use ep=1."
        )
    if not experts:
        raise ConfigError(
            f"ep={ep} is not allowed for {graph.name}: expert parallelism splits mixture-of-experts layers "
            f"(experts stacked in 3-D weights), and this model has none; use ep=1."
        )
    if experts % ep:
        raise ConfigError(
            f"ep={ep} is not allowed for {graph.name}: its layers have {experts} experts, which ep must divide; "
            f"use one of {divisors(experts)}."
        )


def check_routing_imbalance(graph: LayerGraph, routing_imbalance: float) -> None:
    """A routing imbalance other than 1 moves only dropless experts (the busiest
    expert-parallel rank runs that many times its even share of routed rows); given for
    a model without them, it would be silently ignored, so it is refused in one line."""
    if any(leaf.experts and leaf.dropless for p in graph.profiles for leaf in p.leaves):
        experts = model_experts(graph)
        if routing_imbalance > experts:
            raise ConfigError(
                f"routing_imbalance={routing_imbalance:g} is not allowed for {graph.name}: the busiest rank receives "
                f"at most every routed row, {experts} times the mean when each of its {experts} experts has its "
                f"own rank; give a number from 1 to {experts}."
            )
        return
    if routing_imbalance == 1.0:
        return
    if capacity_experts(graph):
        has = "fixed-capacity expert buffers, whose work does not depend on the routing"
    elif graph.unsplit_experts:
        has = f"experts that run every token ({', '.join(graph.unsplit_experts)}), whatever the routing"
    else:
        has = "no mixture-of-experts layers"
    raise ConfigError(
        f"routing_imbalance={routing_imbalance:g} is not allowed for {graph.name}: it prices dropless experts, and "
        f"this model has {has}; leave it at 1."
    )
