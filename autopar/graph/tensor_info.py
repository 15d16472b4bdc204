"""What the trace knows of each tensor it sees: the leaves and glue it came from
(:class:`Info`), which of those reach it only broadcast over an attention's heads, its
storage's identity (views and in-place writes share it) and its size. Shared by
:mod:`autopar.graph.segment`, which keeps this per tensor, and :mod:`autopar.graph.trace`,
which records it op by op."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten


@dataclass
class Info:
    """What a tensor carries: the leaves it came from (``origins``), the glue ops since
    not yet charged to a flow (``pending``), the attention heads it was computed over,
    and of its origins those that reach it only broadcast over the attention's heads
    (``broadcast``: a tensor with one head expanded to all of them, DeepSeek-V3's
    rotary key part shared by every head), which any head shard can read whole."""

    origins: frozenset[int]
    pending: frozenset[int]
    attn_heads: int
    broadcast: frozenset[int] = frozenset()


def broadcast_of(infos: list[Info]) -> frozenset[int]:
    """The origins that reach an op's output only broadcast over heads: broadcast in
    every input that carries them."""
    broadcast = frozenset().union(*(i.broadcast for i in infos)) if infos else frozenset()
    whole = frozenset().union(*(i.origins - i.broadcast for i in infos)) if infos else frozenset()
    return broadcast - whole


def expands_heads(func: Any, args: tuple, outs: list[torch.Tensor]) -> bool:
    """Whether ``func`` expands a tensor of one attention head to several: an ``expand``
    of dim 1 of a ``(batch, heads, seq, head_dim)`` tensor from 1 (DeepSeek-V3's rotary
    key part, computed once and shared by every head). Not transformers' ``repeat_kv``,
    which expands a ``(batch, kv_heads, 1, seq, head_dim)`` view: each key/value head's
    copies for its group of query heads, split by heads like the query heads."""
    if func._overloadpacket is not torch.ops.aten.expand or not args or len(outs) != 1:
        return False
    src, dst = args[0], outs[0]
    return isinstance(src, torch.Tensor) and src.dim() == dst.dim() == 4 and src.shape[-3] == 1 and dst.shape[-3] > 1


def storage_key(t: torch.Tensor) -> int | None:
    """The identity of ``t``'s storage (shared by its views), None where it has none."""
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


def nbytes_of(t: torch.Tensor) -> int:
    """Bytes of ``t``'s elements (not of its storage)."""
    return t.numel() * t.element_size()


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """The tensors in a nest of arguments."""
    flat, _ = tree_flatten(obj)
    return [x for x in flat if isinstance(x, torch.Tensor)]


def keyed(tensors: Iterable[torch.Tensor]) -> list[tuple[int, float]]:
    """(storage key, bytes) of each tensor whose storage can be named."""
    out = []
    for t in tensors:
        key = storage_key(t)
        if key is not None:
            out.append((key, float(nbytes_of(t))))
    return out
