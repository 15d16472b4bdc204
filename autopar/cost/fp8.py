"""What FP8 matmuls cost: torchao's float8 training of the blocks' linear layers.

A converted linear layer casts its input and its weight to FP8 (e4m3) and its output
gradient to FP8 (e5m2), each with one scale per tensor computed from the tensor's
largest absolute value, and multiplies at the device's FP8 tensor-core rate
(``Roofline.fp8_flops`` at the roofline's matmul efficiency); weights, gradients,
optimizer state and every other op stay in bf16. So:

- its matmul FLOPs run at the FP8 rate (twice bf16's on H100 and H200);
- each cast is two reads of the bf16 tensor (the largest value, then the scaled cast:
  the scale must be known before any element is cast) and a write of one byte per
  element, :data:`CAST_BYTES` per element; compiled, the first read fuses into the
  kernel that made the tensor (:data:`COMPILED_CAST_BYTES`). The forward casts the
  input and the weight; the backward casts the output gradient and copies the saved
  FP8 input and weight in transposed layouts, taken, like its matmuls, as twice the
  forward's work (``BACKWARD_FACTOR``);
- memory is priced as without FP8: the runtime keeps what autograd saves in bf16.
  Priced for Megatron-LM's kernels (sequence-first activations), a converted layer keeps
  its input in FP8 instead, one byte per element, as Transformer Engine's ``Linear`` and
  ``LayerNormLinear`` do under delayed scaling (TE 1.9-1.13 and 2.2 on: the FP8 cast or
  its transpose, never both; with sequence parallelism the local shard, gathered again in
  the backward): one copy per input however many layers read it (Megatron fuses q, k and
  v, and the gated MLP's two input projections, into one layer each), beside whatever
  another op keeps of it in bf16 (the attention kernel keeps its output, which the output
  projection then keeps again in FP8) (:func:`saved_bytes`).

What is converted, as the runtime converts it (:mod:`autopar.runtime.fp8`): linear layers
of the blocks whose local matrix has both sizes divisible by 16 (cuBLAS's FP8 kernels
need it); not the embeddings, the head (the vocabulary projection), nor mixture-of-
experts stacks.
"""

from __future__ import annotations

from autopar.graph.layer_graph import Leaf, LeafKind, UnitProfile
from autopar.vocab import TPStyle

CAST_BYTES = 5.0
"""Bytes moved per element cast to FP8 in eager mode: the bf16 tensor read for its
largest value (2), read again for the scaled cast (2), the FP8 copy written (1)."""
COMPILED_CAST_BYTES = 3.0
"""The same cast compiled: the largest value is taken in the kernel that made the
tensor, so one read of it (2) and the write (1) remain."""
ALIGNMENT = 16
"""Both sizes of an FP8 matmul's local matrix must be multiples of 16 (cuBLAS)."""
FP8_BYTES = 1.0
"""Bytes per element of an FP8 tensor."""


def converted(leaf: Leaf, style: TPStyle, tp: int) -> bool:
    """Whether the runtime runs ``leaf`` in FP8 under ``style`` at ``tp``."""
    if leaf.kind is not LeafKind.LINEAR or leaf.vocab or leaf.experts:
        return False
    rows, cols = leaf.out_features, leaf.in_features
    if style is TPStyle.COLUMN:
        rows //= tp
    elif style is TPStyle.ROW:
        cols //= tp
    return rows > 0 and cols > 0 and rows % ALIGNMENT == 0 and cols % ALIGNMENT == 0


def cast_bytes(leaf: Leaf, activation_bytes: float, weight_numel: float, *, itemsize: int, compiled: bool) -> float:
    """Bytes the forward's casts move for one call of ``leaf``: its input (its share of
    the ``activation_bytes`` the call moves, input and output, in proportion to their
    features) and its ``weight_numel`` local weights, each element at
    :data:`CAST_BYTES` (:data:`COMPILED_CAST_BYTES` when compiled)."""
    per = COMPILED_CAST_BYTES if compiled else CAST_BYTES
    features = leaf.in_features + leaf.out_features
    inputs = activation_bytes / itemsize * leaf.in_features / features if features else 0.0
    return per * (inputs + weight_numel)


def saved_bytes(
    profile: UnitProfile,
    index: int,
    styles: tuple[TPStyle, ...],
    tp: int,
    *,
    compiled: bool,
    itemsize: int,
    inputs_in_fp8: bool,
) -> float:
    """Activation bytes leaf ``index`` keeps for backward per sample under ``styles``:
    what the trace recorded on it, or, where the layer runs in FP8 and keeps its input
    in FP8 (``inputs_in_fp8``: priced for Megatron-LM's Transformer Engine layers; module
    docstring), one byte per element of its input (the largest tensor flowing into it,
    recorded in ``itemsize`` bytes per element), counted on the first converted layer
    reading the same tensors and on no other."""
    leaf = profile.leaves[index]
    if not (inputs_in_fp8 and converted(leaf, styles[index], tp)):
        return leaf.saved(compiled)
    sources = _sources(profile)
    mine = sources.get(index)
    first = next(i for i, s in enumerate(styles) if sources.get(i) == mine and converted(profile.leaves[i], s, tp))
    if first != index:
        return 0.0
    largest = max((f.tensor_bytes for f in profile.flows if f.dst == index), default=0.0)
    return largest / itemsize * FP8_BYTES


def _sources(profile: UnitProfile) -> dict[int, frozenset[int]]:
    """Per leaf, the producers of the tensors flowing into it: leaves with the same
    sources read the same input."""
    out: dict[int, set[int]] = {}
    for f in profile.flows:
        if f.dst >= 0:
            out.setdefault(f.dst, set()).add(f.src)
    return {dst: frozenset(srcs) for dst, srcs in out.items()}
