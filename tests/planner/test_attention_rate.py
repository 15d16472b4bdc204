"""The fused attention kernel's rate: an attention core's time against a hand roofline
(the FLOPs the kernel computes, its 2.5x backward), what the trace counts under a causal
mask, which attention it applies to, and the one-line refusal of a bad value."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import autopar
from autopar.cost.comm import group_span
from autopar.cost.compute import rates
from autopar.cost.leaf import TPContext, attention_backward_extra_s, glue_fwd_s
from autopar.errors import ClusterError
from autopar.graph import extract
from autopar.graph.layer_graph import Flow
from autopar.hardware.device import Roofline
from autopar.models.gpt import GPT, GPTConfig
from autopar.vocab import DType, Layout

H100 = autopar.preset("dgx-h100", nodes=1)
SEQ, DIM = 8192, 4096
# one sample: QK^T and PV, each 2 * seq^2 * dim as the flop counter counts them; a fused
# kernel under a causal mask computes half
ATTN_FLOPS = 2 * 2.0 * SEQ * SEQ * DIM
ATTN_BYTES = 4 * 2.0 * SEQ * DIM  # q, k, v read, the output written, bf16


def _flow(work: float | None = ATTN_FLOPS / 2) -> Flow:
    return Flow(
        src=0,
        dst=1,
        tensor_bytes=2.0 * SEQ * DIM,
        glue_flops=0.0,
        glue_bytes=0.0,
        saved_bytes=0.0,
        attn_flops=ATTN_FLOPS,
        attn_bytes=ATTN_BYTES,
        attn_saved_bytes=ATTN_BYTES,
        attn_work_flops=work,
    )


def _ctx(cluster: autopar.Cluster, *, fused: bool) -> TPContext:
    return TPContext(
        tp=1,
        span=group_span(1, 1, 8),
        cluster=cluster,
        rates=rates(cluster.device, DType.BF16),
        micro_batch=1.0,
        tokens=SEQ,
        boundary=Layout.R,
        first=False,
        last=False,
        loss_parallel=False,
        sequence_parallel=False,
        fused_attention=fused,
    )


def test_a_fused_attention_core_runs_at_the_devices_attention_rate():
    """By hand: on H100 the fused kernel computes half the counted FLOPs under a causal
    mask, at 0.19 x 989 TFLOP/s (its preset's cited FlashAttention-2 figure, forward and backward), and its
    backward is 2.5x that; an unfused (materialized) core's batched matmuls compute all of
    them at the GEMM efficiency 0.8, with the 2x backward of every op. All above their
    bytes through 3.35 TB/s x 0.8."""
    bytes_s = ATTN_BYTES / (3.35e12 * 0.8)
    fused_ctx, unfused_ctx = _ctx(H100, fused=True), _ctx(H100, fused=False)
    fused = glue_fwd_s(_flow(), Layout.R, fused_ctx, attention_only=True)
    unfused = glue_fwd_s(_flow(), Layout.R, unfused_ctx, attention_only=True)
    assert fused == pytest.approx(max(ATTN_FLOPS / 2 / (989e12 * 0.19), bytes_s))
    assert unfused == pytest.approx(max(ATTN_FLOPS / (989e12 * 0.8), bytes_s))
    assert attention_backward_extra_s(_flow(), Layout.R, fused_ctx) == pytest.approx(0.5 * fused)
    assert attention_backward_extra_s(_flow(), Layout.R, unfused_ctx) == 0.0
    # without a mask the kernel computes every counted FLOP
    assert glue_fwd_s(_flow(work=None), Layout.R, fused_ctx, attention_only=True) == pytest.approx(2 * fused)


def test_without_a_stated_attention_efficiency_the_core_runs_as_a_matmul():
    """A device that states none (a profile measured without a base, the CPU presets)
    prices the fused core exactly as before: the counted FLOPs at the matmul efficiency,
    with the backward every op gets."""
    roof = replace(H100.device.roofline, attention_efficiency=None)
    plain = replace(H100, device=replace(H100.device, roofline=roof))
    assert glue_fwd_s(_flow(), Layout.R, _ctx(plain, fused=True), attention_only=True) == pytest.approx(
        glue_fwd_s(_flow(), Layout.R, _ctx(H100, fused=False), attention_only=True)
    )
    assert attention_backward_extra_s(_flow(), Layout.R, _ctx(plain, fused=True)) == 0.0


class _Block(torch.nn.Module):
    def __init__(self, causal: bool):
        super().__init__()
        self.causal = causal
        self.qkv = torch.nn.Linear(64, 3 * 64, bias=False)
        self.o = torch.nn.Linear(64, 64, bias=False)

    def forward(self, x):
        q, k, v = (t.view(x.shape[0], x.shape[1], 4, 16).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return x + self.o(y.transpose(1, 2).reshape(x.shape))


class _Net(torch.nn.Module):
    def __init__(self, causal: bool):
        super().__init__()
        self.layers = torch.nn.ModuleList([_Block(causal), _Block(causal)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize(
    ("attention", "causal", "share"), [("flash", True, 0.5), ("flash", False, 1.0), ("materialized", True, 1.0)]
)
def test_the_trace_records_what_a_fused_kernel_computes(attention, causal, share):
    """A causal flash core computes half the score products the flop counter counts; an
    unmasked one, or a materialized one (which computes the masked scores too), all."""
    graph = extract(_Net(causal), sample_input=torch.zeros(2, 128, 64), attention=attention)
    flows = [f for p in graph.profiles for f in p.flows if f.attn_flops > 0]
    assert flows and all(f.fused_attention_flops == pytest.approx(share * f.attn_flops) for f in flows)


def _gpt() -> torch.nn.Module:
    with torch.device("meta"):
        return GPT(GPTConfig(vocab_size=32000, dim=1024, n_layers=4, n_heads=16, seq_len=4096))


@pytest.mark.parametrize("attention", ["flash", "materialized"])
def test_a_plan_prices_the_kernel_only_under_flash_attention(attention):
    """The device's attention efficiency slows a flash-attention plan's step and leaves
    a materialized one's unchanged (its scores run as batched matmuls)."""
    config = {"tp": 1, "pp": 1, "micro_batch_size": 1, "recompute": "none", "zero_stage": 0}
    faster = replace(H100.device.roofline, attention_efficiency=0.8)
    fast = replace(H100, device=replace(H100.device, roofline=faster))
    steps = [
        autopar.estimate(
            _gpt(), c, config, global_batch_size=8, seq_len=4096, attention=attention
        ).prediction.step_time_s
        for c in (H100, fast)
    ]
    if attention == "flash":
        assert steps[0] > steps[1]
    else:
        assert steps[0] == pytest.approx(steps[1], rel=1e-12)


@pytest.mark.parametrize("value", [0, 1.5, -0.2, "fast", True])
def test_a_bad_attention_efficiency_is_refused_in_one_line(value):
    with pytest.raises(ClusterError, match=r"attention_efficiency=.* is not allowed: it must be in \(0, 1\]") as err:
        Roofline(peak_flops={DType.BF16: 1e15}, memory_bandwidth_bytes_per_s=1e12, attention_efficiency=value)
    assert "\n" not in str(err.value)
