"""Attention as a GPU runs it, for a dry run on fake CPU tensors.

``F.scaled_dot_product_attention`` on CPU runs a fused kernel only where the query, key
and value heads are equally wide; otherwise it falls back to its math path, which keeps
every score and probability for the backward. Multi-latent attention (DeepSeek-V2/V3)
has value heads narrower than its query and key heads (which carry a rotary part), so a
dry run measured its scores: 8-11 times the plan's peak for a small DeepSeek-V3. On a
GPU, torch runs those shapes in its memory-efficient kernel, which keeps the output and
the log-sum-exp only, as the plan prices them. :func:`gpu_attention` routes such calls
to that kernel's op, which fake tensors run by its meta function, for the dry step's
duration; calls the CPU kernel fuses go through untouched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

_efficient = torch.ops.aten._scaled_dot_product_efficient_attention.default


def _attention(sdpa):
    def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if query.shape[-1] == value.shape[-1]:  # the CPU's fused kernel takes it
            return sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        if query.shape[-3] != key.shape[-3]:  # grouped key and value heads, repeated as the kernel needs
            repeat = query.shape[-3] // key.shape[-3]
            key, value = (t.repeat_interleave(repeat, dim=-3) for t in (key, value))
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill(~attn_mask, float("-inf"))
        return _efficient(query, key, value, attn_mask, True, dropout_p, is_causal, scale=scale)[0]

    return attention


@contextlib.contextmanager
def gpu_attention() -> Iterator[None]:
    """Within: ``F.scaled_dot_product_attention`` calls whose value heads differ in width
    from the query's run torch's memory-efficient kernel's op (module docstring)."""
    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = _attention(original)
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original
