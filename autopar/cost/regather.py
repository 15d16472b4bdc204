"""What keeping the shards of sequence-parallel gathers costs and saves
(``ParallelConfig.regather``, Megatron-LM's sequence parallelism).

With sequence parallelism a column-parallel matmul reads a tensor all-gathered from
sequence shards, and autograd keeps what it reads for its weight gradient: the whole
gathered tensor, ``tp`` times the shard. Under ``regather`` a unit that keeps its
activations keeps the shard instead and all-gathers it again when its backward first
needs it (:mod:`autopar.runtime.regather`), once however many column-parallel matmuls
read it (q, k and v share one). Per gathered input, that saves ``1 - 1 / tp`` of what
its readers saved, holds the gathered tensor again while its readers' backward runs, and
costs one all-gather of the whole tensor in the backward. The gather runs while the
first reader to run its backward computes its input gradient (a matmul the size of its
forward, which does not read the input), as Megatron-LM overlaps it; which reader runs
first is autograd's order, so the smallest reader's is what surely hides it.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.cost.comm import all_gather_s
from autopar.cost.leaf import TPContext, leaf_fwd_s
from autopar.graph.layer_graph import UnitProfile
from autopar.vocab import TPStyle


@dataclass(frozen=True)
class Regather:
    """Per micro-batch, per TP rank.

    Attributes:
        saved_bytes: activations no longer kept (the gathered copies less their shards).
        held_bytes: the largest gathered tensor, made again during the unit's backward.
        backward_s: what the backward waits for of the all-gathers.
        syncs: how many all-gathers.
    """

    saved_bytes: float = 0.0
    held_bytes: float = 0.0
    backward_s: float = 0.0
    syncs: int = 0


NO_REGATHER = Regather()


def regather_terms(
    profile: UnitProfile,
    styles: tuple[TPStyle, ...],
    gathers: list[tuple[float, tuple[int, ...]]],
    ctx: TPContext,
) -> Regather:
    """The terms of a layout (leaf ``styles``) whose forward all-gathers ``gathers`` (each
    conversion of a sequence-sharded tensor into a replicated one: the whole tensor's
    bytes per micro-batch, and the column-parallel leaves reading it) under ``ctx``;
    nothing unless ``ctx.regather``. What a gather's readers saved is what the trace
    recorded on them (a tensor saved by several is recorded once), in FP8 where they keep
    their inputs so (:meth:`TPContext.leaf_saved_bytes`); the gathers themselves are
    priced in the compute precision. Each gather hides behind the smallest reader's
    input-gradient matmul (module docstring)."""
    if not ctx.regather or ctx.tp == 1:
        return NO_REGATHER
    saved = held = seconds = 0.0
    syncs = 0
    for whole, readers in gathers:
        kept = sum(ctx.leaf_saved_bytes(profile, d, styles) for d in readers) * ctx.micro_batch
        if kept <= 0:
            continue
        saved += kept * (1 - 1 / ctx.tp)
        held = max(held, whole)
        gather = all_gather_s(whole, ctx.span, ctx.cluster)
        hiding = min(leaf_fwd_s(profile.leaves[d], TPStyle.COLUMN, ctx) for d in readers)
        seconds += max(0.0, gather - hiding)
        syncs += 1
    return Regather(saved_bytes=saved, held_bytes=held, backward_s=seconds, syncs=syncs)
