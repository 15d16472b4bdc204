"""What context parallelism adds to a unit: the key/value exchange of ring attention.

Each of the ``cp`` ranks of a context-parallel group holds ``1 / cp`` of every sample's
tokens; its queries must meet every rank's keys and values. The exchange is priced as
torch's implementation runs it (``torch.distributed.tensor.experimental``'s ring
attention with its default all-gather rotation, the one torchtitan uses):

- forward: one all-gather of the local keys and values over the group, issued before
  the first block of attention (the rank's own keys) and awaited after it, so that
  block hides it;
- backward: the same all-gather, hidden by the first block's backward, then ``cp``
  ring shifts of the key and value gradients, accumulated in fp32 (torch's
  ``convert_to_f32``): shift ``i`` hides under block ``i + 1``'s backward, the last
  one is awaited after the loop.

With head-tail load balancing (each rank holds two chunks, one from each end of the
sequence: Brandon et al. 2023, "Striped Attention"; torch's default for causal
attention), every one of the ``cp`` blocks is the same ``1 / cp`` of the rank's
attention work, so a block's time is the rank's attention core time over ``cp``.
Recomputation reruns the forward exchange with the attention core.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.cost.comm import all_gather_s, p2p_s
from autopar.cost.leaf import TPContext, attention_backward_factor

ACCUMULATOR_BYTES = 4
"""Key and value gradients travel the ring in fp32 (torch's ``convert_to_f32``)."""


@dataclass(frozen=True, kw_only=True)
class RingExchange:
    """A unit's context-parallel exchange per micro-batch on one rank.

    Attributes:
        fwd_s: forward communication not hidden by attention compute.
        bwd_s: backward communication not hidden by attention compute.
        transient_bytes: what the exchange holds while the attention core runs: the
            gathered keys and values of the other ranks, and the fp32 key and value
            gradients being accumulated and in flight.
    """

    fwd_s: float = 0.0
    bwd_s: float = 0.0
    transient_bytes: float = 0.0


NO_EXCHANGE = RingExchange()


def ring_exchange(kv_bytes: float, attn_fwd_s: float, ctx: TPContext) -> RingExchange:
    """The exchange of a unit whose attention cores hold ``kv_bytes`` of local keys and
    values per micro-batch and take ``attn_fwd_s`` forward on this rank (module
    docstring)."""
    n = ctx.cp
    if n == 1 or kv_bytes <= 0:
        return NO_EXCHANGE
    block_fwd = attn_fwd_s / n
    block_bwd = attention_backward_factor(ctx) * attn_fwd_s / n
    gather = all_gather_s(n * kv_bytes, ctx.cp_span, ctx.cluster)
    grads = kv_bytes * ACCUMULATOR_BYTES / ctx.dtype.itemsize
    shift = p2p_s(grads, cross_node=ctx.cp_span.crosses_nodes, cluster=ctx.cluster)
    return RingExchange(
        fwd_s=max(gather - block_fwd, 0.0),
        bwd_s=max(gather - block_bwd, 0.0) + (n - 1) * max(shift - block_bwd, 0.0) + shift,
        transient_bytes=(n - 1) * kv_bytes + 2 * grads,
    )
