"""The copies that sequence-parallel collectives make around a batch-first activation.

NCCL gathers and scatters along a tensor's first dimension. autopar's runtime lays
activations out ``(batch, sequence, features)``, as torchtitan and transformers do, and
shards the sequence, dimension 1 (``Shard(1)``), so torch 2.13's functional collectives
(``torch.distributed._functional_collectives``, which DTensor's redistribution calls)
reorder the data around the collective:

- an all-gather along the sequence returns the ranks' shards stacked on dimension 0 and
  concatenates them along the sequence again (``torch._utils._maybe_view_chunk_cat``):
  a view when the dimensions before the sequence hold one element (a micro-batch of
  one sequence), else a copy of the whole gathered tensor;
- a reduce-scatter along the sequence first concatenates the input's sequence chunks
  along dimension 0 (``torch._utils._chunk_or_narrow_cat``): a copy of the whole input,
  whatever the micro-batch.

Each copy reads and writes its bytes at the device's memory bandwidth, and the
collective's caller waits for it as for the transfer, so it is priced as part of the
collective. Slicing a replicated tensor into its sequence shard copies the shard alone
(``1 / tp`` of it), which is left out. Megatron-LM lays activations out ``(sequence,
batch, features)`` and gathers and scatters the leading dimension, so a plan priced for
it (:attr:`autopar.vocab.ActivationLayout.SEQUENCE_FIRST`) pays none.

Under asynchronous TP (:func:`autopar.cost.tensor_parallel.fused_hidden_s`) a fused
reduce-scatter makes no copy: inductor's micro-pipeline pass has the producer of the
matmul's input write the stride order the chunked matmul reads
(``restride_A_for_fused_matmul_reduce_scatter``). A fused all-gather keeps its copy: the
fused op returns the gathered tensor in the shards' order (``movedim`` of its flat
buffer), and the rest of the graph, traced before the fusion, reads it batch-first (the
column-parallel weight gradients flatten it), so it is copied all the same.
"""

from __future__ import annotations

from autopar.cost.leaf import TPContext
from autopar.vocab import Layout

READ_AND_WRITE = 2
"""A copy reads its bytes once and writes them once."""


def copy_s(nbytes: float, ctx: TPContext) -> float:
    """Seconds to copy ``nbytes`` on the device."""
    return READ_AND_WRITE * nbytes / ctx.rates.bytes_per_s


def collectives_copy(*, batch_first: bool, tp: int) -> bool:
    """Whether sequence-parallel collectives copy around their transfer: batch-first
    activations sharded over more than one rank (module docstring)."""
    return batch_first and tp > 1


def _copies(ctx: TPContext) -> bool:
    return collectives_copy(batch_first=ctx.batch_first, tp=ctx.tp)


def _batched(ctx: TPContext) -> bool:
    """More than one sequence per micro-batch on the rank: the dimension before the
    sequence holds more than one element (context parallelism shards the sequence, not
    the batch)."""
    return ctx.micro_batch * ctx.cp > 1


def gather_copy_s(nbytes: float, ctx: TPContext) -> float:
    """The copy after all-gathering a sequence-sharded tensor of ``nbytes`` (whole)."""
    return copy_s(nbytes, ctx) if _copies(ctx) and _batched(ctx) else 0.0


def scatter_copy_s(nbytes: float, ctx: TPContext) -> float:
    """The copy before reduce-scattering a tensor of ``nbytes`` along the sequence."""
    return copy_s(nbytes, ctx) if _copies(ctx) else 0.0


def conversion_copy_s(a: Layout, b: Layout, nbytes: float, ctx: TPContext) -> tuple[float, float]:
    """(forward, backward) seconds of the copies around the collectives that turn a
    tensor of ``nbytes`` (whole) from layout ``a`` into ``b``
    (:func:`autopar.cost.tensor_parallel.conversion_s` prices them with the transfer)."""
    if a is b:
        return 0.0, 0.0
    if a is Layout.Q and b is Layout.R:
        return gather_copy_s(nbytes, ctx), 0.0  # gather; the gradient is sliced
    if a is Layout.R and b is Layout.Q:
        return 0.0, gather_copy_s(nbytes, ctx)  # slice; the gradient is gathered
    if a is Layout.P and b is Layout.Q:
        return scatter_copy_s(nbytes, ctx), gather_copy_s(nbytes, ctx)
    return 0.0, 0.0


def reduction_copy_s(a: Layout, nbytes: float, ctx: TPContext) -> float:
    """The copy before reduce-scattering the partial input gradient of a
    sequence-sharded producer's column-parallel readers (``a`` is Q); nothing for an
    all-reduce."""
    return scatter_copy_s(nbytes, ctx) if a is Layout.Q else 0.0
