"""What an aten op does to the data it reads, as the trace sorts ops: views and copies
that move nothing, lookups and joins that do no arithmetic, ops that take parts of a
tensor, and the output shape of an op on tensors without data."""

from __future__ import annotations

from typing import Any

import torch

FREE_OPS = {torch.ops.aten._unsafe_view, torch.ops.aten.lift_fresh}
"""Ops that move no data although PyTorch does not tag them as views."""
MOVE_OPS = {
    torch.ops.aten.embedding,
    torch.ops.aten.embedding_dense_backward,
    torch.ops.aten.index,
    torch.ops.aten.index_select,
    torch.ops.aten.gather,
    torch.ops.aten.scatter,
    torch.ops.aten.index_put,
    torch.ops.aten.cat,
    torch.ops.aten.stack,
    torch.ops.aten._to_copy,
    torch.ops.aten.clone,
    torch.ops.aten.copy_,
}
"""Ops that select, join or copy values (a lookup in a weight matrix, a learned class
token joined to the patches): no arithmetic, so no FLOP formula is expected."""
PARTS_OPS = {
    torch.ops.aten.split,
    torch.ops.aten.split_with_sizes,
    torch.ops.aten.unbind,
    torch.ops.aten.slice,
    torch.ops.aten.narrow,
}
"""Ops that take parts of a tensor: on the features of a linear layer's output, they
mark a fused projection (q, k and v, or gate and up, in one matrix)."""


def shaped(func: Any, args: tuple, kwargs: dict) -> Any:
    """``func``'s output on tensors without data. torch 2.13's shape function of
    ``aten._grouped_mm`` accepts only bf16 where its CPU kernel also runs fp32 (a
    transformers MoE model planned in fp32): the shape does not depend on the precision,
    so it is taken in bf16 and the output cast back."""
    a = args[0] if args else None
    if func._overloadpacket is torch.ops.aten._grouped_mm and a.dtype is not torch.bfloat16:
        low = tuple(t.to(torch.bfloat16) for t in args[:2])
        return func(*low, *args[2:], **kwargs).to(a.dtype)
    return func(*args, **kwargs)


def may_compute(func: Any) -> bool:
    """Whether an op without a FLOP formula may hide a matmul: not elementwise, not a
    lookup, join or copy."""
    return torch.Tag.pointwise not in func.tags and func._overloadpacket not in MOVE_OPS


def parts_dim(func: Any, args: tuple, kwargs: dict) -> int:
    packet = func._overloadpacket
    if packet in (torch.ops.aten.split, torch.ops.aten.split_with_sizes):
        return int(kwargs.get("dim", args[2] if len(args) > 2 else 0))
    return int(kwargs.get("dim", args[1] if len(args) > 1 else 0))


def whole_slice(func: Any, args: tuple) -> bool:
    """A ``slice`` that keeps the whole dimension (``x[:, :]``) takes no part."""
    if func._overloadpacket is not torch.ops.aten.slice:
        return False
    t, dim = args[0], int(args[1]) if len(args) > 1 else 0
    start = args[2] if len(args) > 2 and args[2] is not None else 0
    end = args[3] if len(args) > 3 and args[3] is not None else t.shape[dim]
    step = args[4] if len(args) > 4 else 1
    return start == 0 and end >= t.shape[dim] and step == 1
