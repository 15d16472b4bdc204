"""What the trace does at an attention core besides counting: the additive mask torch
makes of a boolean one, the attention an unfused kernel runs (scores and probabilities
stored), and the projections that feed its heads through a norm."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from autopar.graph.layer_graph import LeafKind
from autopar.graph.segment import Segment


def through_norm(seg: Segment, leaf: int, t: torch.Tensor) -> None:
    """Where a norm sits between a projection and the attention (Qwen3's and Gemma 3's
    q_norm and k_norm over each head, OLMo 2's over the whole projection), the
    projection feeds the attention's heads too; a norm whose weight spans one head's
    features (``t``'s last dim) runs on any whole heads, so it is marked per-head."""
    acc = seg.leaves[leaf]
    if acc.kind is not LeafKind.NORM:
        return
    projections = [seg.leaves[src] for src, dst in list(seg.flows) if dst == leaf and src >= 0]
    if not acc.credited:  # once: a norm shared by q and k is seen twice, its projections each feed once
        acc.credited = True
        for projection in projections:
            projection.out_heads += 1
    head_dim = int(t.shape[-1])
    if acc.param_numel and acc.param_numel == head_dim * acc.param_tensors:
        # the projection's heads (the attention may see key heads repeated for its queries)
        acc.head_norm_heads = max((p.out_features // head_dim for p in projections), default=0)


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What ``F.scaled_dot_product_attention`` makes of a boolean mask before any kernel
    runs: an additive mask in the query's dtype (0 where attended, -inf elsewhere), a new
    tensor at every call, which the kernels keep for their backward (torch dispatches
    ``aten.where`` on the mask, then the kernel). A sliding window's ``(b, 1, s, s)``
    mask so costs every such layer 2 bytes per score in bf16."""
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    return torch.where(mask, zero, torch.full((), float("-inf"), dtype=dtype, device=mask.device))


def materialized_attention(q, k, v, attn_mask, dropout_p, is_causal, scale):
    """Attention that stores its scores and probabilities, as an unfused kernel does."""
    if q.shape[-3] != k.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k = k.repeat_interleave(rep, dim=-3)
        v = v.repeat_interleave(rep, dim=-3)
    s = torch.matmul(q, k.transpose(-2, -1)) * (scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]))
    if is_causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~mask, float("-inf"))
    elif attn_mask is not None:
        s = s + attn_mask if attn_mask.dtype != torch.bool else s.masked_fill(~attn_mask, float("-inf"))
    p = torch.softmax(s, dim=-1)
    if dropout_p > 0:
        p = F.dropout(p, dropout_p)
    return torch.matmul(p, v)
