"""What expert parallelism adds to a unit: the all-to-all exchange of routed tokens.

Under expert parallelism each of the ``ep`` ranks of a group holds ``1 / ep`` of every
expert stack. A mixture-of-experts layer routes its tokens locally, then (Lepikhin et
al. 2021, "GShard"; torchtitan's and Megatron-LM's all-to-all dispatcher):

- forward: an all-to-all sends each routed row to the rank holding its expert
  (dispatch), the experts run, and a second all-to-all returns the rows (combine);
- backward: the two transposed all-to-alls, combine's gradient then dispatch's.

That is four all-to-alls per layer and micro-batch, each of the rows the rank routes
(``Leaf.routed_bytes`` per sample), six under full recomputation, which reruns the
forward pair. None is hidden: the experts need the dispatched rows before they start
and the next op needs the combined ones. Overlapping them needs a schedule that runs one
micro-batch's computation while another's all-to-all is in flight, as DeepSeek's
DualPipe does; autopar's ``dualpipev`` runs DualPipe's order of micro-batches (its
bubble), one action at a time, so its all-to-alls stay exposed as well.

Dropless experts send the rows their router picked: the busiest rank's share sets the
pace, ``routing_imbalance`` times the mean (:data:`autopar.cost.model.ROUTING_IMBALANCE`),
and the ranks first exchange how many rows each sends each expert (one more all-to-all
of ``ep`` counts per layer and forward, latency-bound, without a backward).
Fixed-capacity experts send their whole buffers, the same on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.cost.comm import all_to_all_s
from autopar.cost.leaf import TPContext
from autopar.graph.layer_graph import UnitProfile

FORWARD_ALL_TO_ALLS = 2
"""Dispatch and combine; the backward runs their two transposes."""

COUNT_BYTES = 8
"""A row count exchanged before a dropless dispatch (int64)."""


@dataclass(frozen=True, kw_only=True)
class ExpertExchange:
    """A unit's expert-parallel exchange per micro-batch on one rank.

    Attributes:
        fwd_s: the forward all-to-alls (dispatch and combine), exposed.
        bwd_s: the backward all-to-alls, exposed.
        transient_bytes: the largest receive buffer (one layer's routed rows), held
            while its all-to-all runs.
    """

    fwd_s: float = 0.0
    bwd_s: float = 0.0
    transient_bytes: float = 0.0


NO_ALL_TO_ALL = ExpertExchange()


def routed_bytes(profile: UnitProfile, ctx: TPContext) -> list[float]:
    """Bytes each mixture-of-experts layer of the unit sends per all-to-all and
    micro-batch on the busiest rank (module docstring)."""
    return [leaf.routed_bytes * ctx.micro_batch * ctx.row_skew(leaf) for leaf in profile.leaves if leaf.experts]


def expert_exchange(profile: UnitProfile, ctx: TPContext) -> ExpertExchange:
    """The exchange of a unit under ``ctx``'s expert-parallel group (none at ``ep = 1``)."""
    if ctx.ep == 1:
        return NO_ALL_TO_ALL
    sizes = routed_bytes(profile, ctx)
    if not sizes:
        return NO_ALL_TO_ALL
    one_way = sum(all_to_all_s(nbytes, ctx.ep_span, ctx.cluster) for nbytes in sizes)
    dropless = sum(1 for leaf in profile.leaves if leaf.experts and leaf.dropless)
    counts = dropless * all_to_all_s(COUNT_BYTES * ctx.ep, ctx.ep_span, ctx.cluster)
    return ExpertExchange(
        fwd_s=FORWARD_ALL_TO_ALLS * one_way + counts,
        bwd_s=FORWARD_ALL_TO_ALLS * one_way,
        transient_bytes=max(sizes),
    )
