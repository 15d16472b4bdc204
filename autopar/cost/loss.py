"""What a model's loss costs and holds on a tensor-parallel rank: the reductions of a
vocabulary-parallel cross-entropy, the working memory of the loss's backward and the
output the pipeline keeps until the micro-batch's backward is over."""

from __future__ import annotations

from autopar.cost.comm import all_reduce_s
from autopar.cost.leaf import SHARDED, TPContext
from autopar.graph.layer_graph import Flow
from autopar.vocab import DType, Layout

LOSS_PARALLEL_REDUCTIONS = 3
"""A vocabulary-parallel cross-entropy all-reduces the max, the sum of exponentials and
the target logit."""


LOSS_PARALLEL_WORKING_COPIES = 1
"""Gradients of the logits (shards, in the loss's precision) a vocabulary-parallel
cross-entropy's backward (torch's ``loss_parallel``) holds beyond a plain one's
(measured: ``docs/cost-model.md``)."""


LOSS_GRADIENTS = 2
"""Gradients of the logits' size a cross-entropy's backward holds at its peak, beside the
log-probabilities it saved: the log-probabilities' gradient (``nll_loss_backward``) and
the gradient of its input (``_log_softmax_backward_data``). The cast back to the logits'
dtype comes after, once the first and the log-probabilities are freed."""


CROSS_ENTROPY_DTYPE = DType.FP32
"""The precision a token model's cross-entropy runs in: it upcasts the logits before
``log_softmax``, as Megatron-LM and Hugging Face do (the loss the planner traces,
:mod:`autopar.graph.extract`, and the runtime's, :func:`autopar.runtime.local.cross_entropy`)."""


def loss_working_bytes(input_bytes: float, ctx: TPContext, *, vocab_parallel: bool) -> float:
    """What the loss's backward holds at its peak beyond the gradient it returns (one of
    ``input_bytes``, the logits as the loss takes them, in the compute precision): a
    token model's cross-entropy holds :data:`LOSS_GRADIENTS` gradients of the logits in
    :data:`CROSS_ENTROPY_DTYPE` (twice the bf16 logits each), a vocabulary-parallel one
    :data:`LOSS_PARALLEL_WORKING_COPIES` more; another loss is taken to hold the one it
    returns."""
    if not ctx.loss_parallel:
        return input_bytes
    copies = LOSS_GRADIENTS + (LOSS_PARALLEL_WORKING_COPIES if vocab_parallel else 0)
    return copies * input_bytes * CROSS_ENTROPY_DTYPE.itemsize / ctx.dtype.itemsize - input_bytes


REDUCED_OUTPUT_COPIES = 2
"""Extra copies of a model output that a row-parallel leaf all-reduces (partial -> replicated)
before the loss, held as long as the output: DTensor's functional all-reduce clones the
partial sums into a fresh buffer and wraps the result for autograd, and all three storages
live while the output does; inside a unit they are freed once a consumer has used the
output, so a row leaf there costs nothing lasting (measured: ``docs/cost-model.md``)."""


def held_output_bytes(flow: Flow, a: Layout, need: Layout, ctx: TPContext) -> float:
    """Bytes the model's output (``flow``, into the last unit's output, from a producer in
    layout ``a``) holds per micro-batch beyond what autograd saves: the pipeline schedule
    keeps each stage's output until that micro-batch's backward is over, and a
    cross-entropy saves its log-probabilities, not the logits. The output in the layout
    the loss takes (a vocabulary-sharded one in shards), with a row-parallel head's
    copies (:data:`REDUCED_OUTPUT_COPIES`). A loss that saves the output itself (a mean
    squared error) has it counted twice, a small output in practice."""
    nbytes = flow.tensor_bytes * ctx.micro_batch
    copies = REDUCED_OUTPUT_COPIES if a is Layout.P and need is Layout.R else 0
    return (nbytes / ctx.tp if need in SHARDED else nbytes) + copies * nbytes


def loss_parallel_s(ctx: TPContext) -> float:
    """Forward+backward seconds of a vocabulary-parallel cross-entropy's reductions:
    max, sum of exponentials and the target logit, one fp32 per token each."""
    per = ctx.micro_batch * ctx.tokens * 4
    return LOSS_PARALLEL_REDUCTIONS * all_reduce_s(per, ctx.span, ctx.cluster)
