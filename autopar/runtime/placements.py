"""The DTensor placements of the tensor-parallel layouts (:class:`autopar.vocab.Layout`)
of the activations user code sees, for :mod:`autopar.runtime.tensor_parallel` and the
styles of other libraries' layers (:mod:`autopar.runtime.hf`)."""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from autopar.runtime.errors import ShardingError
from autopar.vocab import Layout


def placement(layout: Layout, ndim: int = 3) -> Placement:
    """The DTensor placement of a (non-partial) layout, for an activation of ``ndim`` dims.

    Sequence-sharded (Q) is ``Shard(1)`` of a ``(batch, seq, ...)`` activation and
    ``Shard(0)`` of a 2-D one: OPT's decoder layer flattens its ``(batch, seq, hidden)``
    stream to ``(batch * seq, hidden)`` before its final norm and MLP, and flattens each
    rank's local shard alike, so row ``i`` of the local 2-D tensor is the token at row
    ``i`` of the flattened local 3-D one. The whole 2-D tensor DTensor sees (the ranks'
    shards in rank order) is then the batch's tokens in another order when the batch has
    more than one sample; only per-token ops (norms, linear layers, activations) run on
    it, and every gather there is undone by the slice of the same dim, so each rank gets
    back its own tokens, which the model views as ``(batch, seq / tp, hidden)`` again.
    """
    if layout is Layout.R:
        return Replicate()
    if layout is Layout.F:
        return Shard(-1)
    if layout is Layout.Q:
        if ndim < 2:
            raise ShardingError(
                f"sequence parallelism shards the tokens of (batch, seq, ...) or (tokens, features) "
                f"activations, but a {ndim}-D tensor arrived; use sequence_parallel=False."
            )
        return Shard(1) if ndim >= 3 else Shard(0)
    raise ShardingError(f"layout {layout.value} has no placement the runtime hands to user code.")


def at_rank(placements: tuple[Placement, ...], ndim: int) -> tuple[Placement, ...]:
    """``placements`` made by :func:`placement` for a 3-D activation, for one of ``ndim``
    dims (Q's ``Shard(1)``; F's ``Shard(-1)`` and ``Replicate()`` fit any)."""
    return tuple(placement(Layout.Q, ndim) if p == Shard(1) else p for p in placements)
