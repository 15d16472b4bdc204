"""Which of a leaf's output features the trace saw cut apart, and by whom they are read:
a split by attention heads must keep each head's parts together (GPT-NeoX's fused q/k/v,
DeepSeek-V3's key and value parts of each head, :func:`note_parts`), and of a leaf output
cut into pieces (:func:`note_pieces`) the range no other leaf reads (:func:`read_by_leaf`)
is what reaches an attention only broadcast over its heads (DeepSeek-V3's rotary key
part, :func:`unread_features`). Also how many heads a projection's features hold
(:func:`head_count`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from autopar.graph.tensor_info import nbytes_of

if TYPE_CHECKING:
    from autopar.graph.segment import LeafAcc, Segment


def head_count(features: int, head_dim: int, parts: int, heads: int) -> int:
    """Attention heads a projection of ``features`` features feeds (``parts`` of q, k and
    v, each ``head_dim`` wide per head) or reads: ``features / head_dim / parts`` where
    that is whole, else, for a projection feeding one or two of them, the attention's
    ``heads`` where they divide the features. Multi-latent attention (DeepSeek-V2/V3) is
    that case: its key/value projection packs each head's key part and value part,
    narrower than a query head (which adds a rotary part), and its output projection
    reads value heads of that width. A fused q/k/v of a multi-query attention (Falcon's,
    GPTBigCode's: one key/value head beside the query heads) keeps the first rule."""
    per_head = head_dim * max(parts, 1)
    if features % per_head == 0 or parts > 2 or not heads or features % heads:
        return features // per_head
    return heads


def note_parts(seg: Segment, t: Any, dim: int, whole: bool) -> None:
    """Mark the linear leaf whose output ``t`` is, if the op took parts of its
    features (its last dimension); or, if ``t`` is the whole output viewed with its
    features as (heads, per head) and the op cut each head's features (GPT-NeoX's
    q/k/v, DeepSeek-V3's key and value parts of each head), that its parts lie within
    heads, so a split by whole heads keeps each head's parts together."""
    if not isinstance(t, torch.Tensor) or whole or dim % max(t.dim(), 1) != t.dim() - 1:
        return
    found = seg.leaf_outputs.get(id(t))
    if found is not None and found[1] is t:
        seg.leaves[found[0]].output_in_parts = True
        seg.leaves[found[0]].cut = True
        return
    info = seg.info.get(id(t))
    if info is None or info.pending or len(info.origins) != 1:
        return
    (origin,) = info.origins
    acc = seg.leaves[origin] if origin >= 0 else None
    width = int(t.shape[-1])
    if (
        acc is not None
        and acc.out_features > width > 0
        and acc.out_features % width == 0
        and t.stride(-1) == 1
        and float(nbytes_of(t)) == acc.out_bytes
    ):
        acc.parts_in_heads = True


def note_pieces(seg: Segment, t: Any, pieces: list[torch.Tensor]) -> None:
    """Remember which features of a leaf's output ``t`` each piece cut from its last
    dimension holds (``(leaf, start, stop)``), from where the piece starts in it."""
    found = seg.leaf_outputs.get(id(t)) if isinstance(t, torch.Tensor) else None
    if found is None or found[1] is not t or not t.is_contiguous():
        return
    width = int(t.shape[-1])
    for piece in pieces:
        if piece.dim() != t.dim() or piece.shape[:-1] != t.shape[:-1] or piece.stride(-1) != 1:
            continue
        start = piece.storage_offset() - t.storage_offset()
        if 0 <= start < width:
            seg.pieces[id(piece)] = (found[0], start, start + int(piece.shape[-1]))


def read_by_leaf(seg: Segment, tensors: Iterable[torch.Tensor]) -> None:
    """A leaf reads ``tensors``: note the features of a leaf output that are pieces of it."""
    for t in tensors:
        piece = seg.pieces.get(id(t))
        if piece is not None:
            seg.leaves[piece[0]].leaf_read.add(piece[1:])


def unread_features(acc: LeafAcc) -> tuple[int, int] | None:
    """The one range of a cut leaf output's features that no other leaf reads: what
    reaches the attention broadcast over its heads (:attr:`Leaf.broadcast_features`)."""
    if not acc.cut or not acc.leaf_read:
        return None
    edges = sorted(acc.leaf_read)
    gaps, at = [], 0
    for start, stop in edges:
        if start > at:
            gaps.append((at, start))
        at = max(at, stop)
    if at < acc.out_features:
        gaps.append((at, acc.out_features))
    return gaps[0] if len(gaps) == 1 else None
