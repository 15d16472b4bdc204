"""Achieved FLOP/s of the fused attention kernel on this GPU.

The planner prices every attention core at one rate where the device states it
(``Roofline.attention_efficiency``), and a preset's value is a citation: torch's
``scaled_dot_product_attention`` on another machine, another torch, another shape. A GPU
profile measures it instead, the way a training step runs it: causal SDPA forward and
backward over Llama-like heads (32 of 128 dimensions) at a fixed number of tokens per
call, over a few sequence lengths, in the half precisions the fused kernels take. The
FLOPs follow the FlashAttention benchmarks' convention (:func:`attention_step_flops`),
the one the planner's rate is stated in, so the profile's cluster file
(:mod:`autopar.profiles.to_cluster`) gets the measured fraction of the peak.

CPU profiles do not measure it: the planner prices attention on a CPU by the flop
counter at no kernel rate.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from autopar.cost.leaf import FUSED_ATTENTION_BACKWARD_FACTOR
from autopar.profiles.sections import AttentionPoint
from profiler.timing import Repeats, time_calls

HEADS = 32
HEAD_DIM = 128
"""Llama 3 8B's attention heads (and most models' head size): a shape the kernels are tuned for."""

TOKENS = 16384
"""Tokens per call (batch x sequence length): the batch shrinks as the sequence grows."""

SEQ_LENS = (2048, 4096, 8192)
"""The sequence lengths a GPU profile measures."""

HALF_PRECISIONS = ("bf16", "fp16")
"""The precisions fused attention kernels take (fp32 falls back to the unfused math path)."""


def attention_step_flops(batch: int, heads: int, seq_len: int, head_dim: int) -> float:
    """FLOPs of one causal fused attention forward and backward in the FlashAttention
    convention: the forward's ``4 b h s^2 d`` score and value products, half of them
    under the causal mask, and a backward of 2.5 times the forward."""
    forward = 4.0 * batch * heads * seq_len**2 * head_dim / 2
    return forward * (1 + FUSED_ATTENTION_BACKWARD_FACTOR)


def measure_attention(
    seq_lens: Sequence[int],
    dtype: torch.dtype,
    dtype_name: str,
    device: torch.device,
    repeats: Repeats,
    *,
    heads: int = HEADS,
    head_dim: int = HEAD_DIM,
    tokens: int = TOKENS,
) -> list[AttentionPoint]:
    """Time causal SDPA forward and backward (the gradients of query, key and value, as
    a training step computes them) at each sequence length, interleaved
    (:func:`profiler.timing.time_calls`)."""
    calls, shapes = [], []
    for seq_len in seq_lens:
        batch = max(1, tokens // seq_len)
        q, k, v = (
            torch.randn(batch, heads, seq_len, head_dim, device=device, dtype=dtype, requires_grad=True)
            for _ in range(3)
        )
        grad = torch.randn(batch, heads, seq_len, head_dim, device=device, dtype=dtype)
        calls.append(functools.partial(_step, q, k, v, grad))
        shapes.append((batch, seq_len))
    timings = time_calls(calls, device=device, settings=repeats)
    return [
        AttentionPoint(
            dtype=dtype_name,
            batch=batch,
            heads=heads,
            seq_len=seq_len,
            head_dim=head_dim,
            flops=attention_step_flops(batch, heads, seq_len, head_dim),
            time=t,
        )
        for (batch, seq_len), t in zip(shapes, timings)
    ]


def _step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor) -> None:
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.autograd.grad(out, (q, k, v), grad)
