"""What a compiled block saves for its backward: the trace's model of the partitioner of
``torch.compile`` (``min_cut_rematerialization_partition``, its default in training).

Eager autograd keeps what each op's backward formula asks for, the intermediates of a
chain of element-wise ops included: RMSNorm's fp32 copy of its input and its normalized
product, SwiGLU's SiLU output. The partitioner splits a compiled block into a forward and
a backward graph and chooses what crosses between them: it keeps tensors that are in
memory anyway and recomputes, inside the backward's fused kernels, the element-wise
results that only lived in registers. From the tensors eager mode saves (the trace's
saved-tensor hook, each storage once) and the block's fused kernels
(:mod:`autopar.graph.fusion`):

- a saved tensor that is in memory anyway stays: a matmul's or attention kernel's
  result or input, the block's input, an element-wise result its kernel writes (a matmul
  or the block's output reads it; the partitioner does not recompute a tensor the
  backward needs materialized), and every tensor of the attention core;
- so does the result of a reduction (a norm's mean of squares) or of a random op: the
  partitioner recomputes neither;
- an element-wise result that lived only in registers is recomputed from the nearest
  tensors up its chain of element-wise ops that are kept by the two rules above; they
  are saved in its place, each once, unless they hold more than it does (the
  partitioner cuts where fewer bytes cross).

On autopar's Llama block this saves the block's input, each RMSNorm's input and output
(not their fp32 copies) and SwiGLU's gate, up and product (not the SiLU): about a third
less than eager; a GPT block saves what eager does.
"""

from __future__ import annotations

from collections.abc import Sequence

from autopar.graph.fusion import Fusion


def compiled_saved_deltas(saved: Sequence[tuple[int, float, bool]], fusion: Fusion) -> list[float]:
    """Per tensor eager mode saves, ``(storage key, bytes, in the attention core)`` in the
    order autograd packed them: the bytes compiling adds to what it stands for (minus
    its own where the partitioner recomputes it, plus those of the tensors it is
    recomputed from that nothing else saves; 0 where it stays)."""
    kept = {key for key, _, attn in saved if attn or not _recomputable(key, fusion)}
    deltas = []
    for key, nbytes, _ in saved:
        if key in kept:
            deltas.append(0.0)
            continue
        instead = _frontier(key, fusion) - kept
        extra = sum(fusion.sizes[k] for k in instead)
        if extra > nbytes:
            kept.add(key)
            deltas.append(0.0)
            continue
        kept |= instead
        deltas.append(extra - nbytes)
    return deltas


def _recomputable(key: int, fusion: Fusion) -> bool:
    """Whether ``key`` is an element-wise result that lived only in registers."""
    return key in fusion.sources and key not in fusion.materialized and key not in fusion.never_recomputed


def _frontier(key: int, fusion: Fusion) -> set[int]:
    """The tensors a backward recomputes ``key`` from: up its chain of element-wise ops,
    the first ones that are not recomputable themselves."""
    found: set[int] = set()
    seen = {key}
    stack = [key]
    while stack:
        for source in fusion.sources[stack.pop()]:
            if source in seen:
                continue
            seen.add(source)
            if _recomputable(source, fusion):
                stack.append(source)
            else:
                found.add(source)
    return found
