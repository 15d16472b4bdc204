"""FLOP formulas per aten op: PyTorch's own, and those it lacks.

``torch.utils.flop_counter`` (the table ``FlopCounterMode`` uses) has formulas for
``mm``, ``bmm``, convolution and attention, but none for ``aten._grouped_mm``, the
kernel that runs mixture-of-experts layers (transformers 5's Mixtral, Qwen2-MoE and
Qwen3-MoE experts, and autopar's own MoE model): without it every expert's matmuls
count as free. :data:`EXTRA_FLOP_FORMULAS` holds the missing formulas in
``FlopCounterMode``'s convention (they take shapes; pass the table as its
``custom_mapping``), and :func:`op_flops` is the one lookup the graph trace and the
profiler's census both use, so nothing is registered in PyTorch's global table.

A grouped matmul's count depends only on how many rows are routed in total, not on how
they are split between the experts (the offsets): ``tokens x top_k`` rows through
``d_in x d_out`` weights is ``2 x tokens x top_k x d_in x d_out`` FLOPs whatever the
router chose, which is the expected cost of a routed layer on meta or fake tensors
whose routing is arbitrary. Its backward runs two grouped matmuls of the same size
(the input's gradient, and the weights' gradient as a ``2-D x 2-D`` grouped product),
both counted by the same formula.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry, shape_wrapper


def grouped_mm_flops(
    a_shape: tuple[int, ...], b_shape: tuple[int, ...], *args: Any, out_shape: tuple[int, ...], **kwargs: Any
) -> int:
    """FLOPs of ``aten._grouped_mm(a, b, offs)``: two per multiply-add.

    ``2-D x 3-D`` (routed rows through each expert's weights), ``3-D x 3-D`` (one
    product per group) and ``3-D x 2-D``: every output element is a dot product over
    ``a``'s last dimension, so ``2 x out.numel() x k``. ``2-D x 2-D`` (the weights'
    gradient, ``(k, rows) x (rows, n)`` cut into groups along the rows): the groups
    share the rows, so ``2 x k x rows x n`` in all, whatever the offsets.
    """
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    return 2 * _numel(out_shape) * a_shape[-1]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


EXTRA_FLOP_FORMULAS: Mapping[Any, Callable[..., int]] = MappingProxyType({torch.ops.aten._grouped_mm: grouped_mm_flops})
"""Formulas PyTorch's table lacks, by op packet, taking shapes (``FlopCounterMode``'s
``custom_mapping`` convention)."""

_WRAPPED = MappingProxyType({op: shape_wrapper(f) for op, f in EXTRA_FLOP_FORMULAS.items()})

MATMUL_OPS = frozenset(
    {
        torch.ops.aten.mm,
        torch.ops.aten.addmm,
        torch.ops.aten.bmm,
        torch.ops.aten.baddbmm,
        torch.ops.aten._grouped_mm,
        torch.ops.aten.convolution,
        torch.ops.aten._scaled_dot_product_flash_attention,
        torch.ops.aten._scaled_dot_product_efficient_attention,
    }
)
"""Ops that run on the matrix units (their FLOPs are matmul FLOPs)."""

EXPERT_MATMULS = frozenset(
    {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.baddbmm, torch.ops.aten._grouped_mm}
)
"""Matmuls that may run a mixture of experts' stacked weights: batched over a fixed
capacity (``bmm``), grouped by expert (``_grouped_mm``) or one expert at a time (``mm``
on a slice of the stack)."""


def flop_formula(packet: Any) -> Callable[..., Any] | None:
    """The formula of an op packet, called as ``formula(*args, **kwargs, out_val=out)``
    with tensors: autopar's own first, then PyTorch's; None when neither has one."""
    return _WRAPPED.get(packet) or flop_registry.get(packet)


def op_flops(func: Any, args: tuple, kwargs: dict, out: Any) -> float | None:
    """FLOPs of one dispatched aten op, or None when no formula is known for it."""
    formula = flop_formula(func._overloadpacket)
    if formula is None:
        return None
    return float(formula(*args, **kwargs, out_val=out))
