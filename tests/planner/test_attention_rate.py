"""The fused attention kernel's rate: an attention core's time against a hand roofline,
which attention it applies to, and the one-line refusal of a bad value."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import autopar
from autopar.cost.comm import group_span
from autopar.cost.compute import rates
from autopar.cost.leaf import TPContext, glue_fwd_s
from autopar.errors import ClusterError
from autopar.graph.layer_graph import Flow
from autopar.hardware.device import Roofline
from autopar.models.gpt import GPT, GPTConfig
from autopar.vocab import DType, Layout

H100 = autopar.preset("dgx-h100", nodes=1)
SEQ, DIM = 8192, 4096
# causal attention of one sample: QK^T and PV, each 2 * seq^2 * dim, halved by the mask
ATTN_FLOPS = 2 * 2.0 * SEQ * SEQ * DIM / 2
ATTN_BYTES = 4 * 2.0 * SEQ * DIM  # q, k, v read, the output written, bf16


def _flow() -> Flow:
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
    """By hand: on H100 the fused kernel runs at 0.35 x 989 TFLOP/s (its preset's cited
    FlashAttention-2 figure), an unfused (materialized) core's batched matmuls at the GEMM
    efficiency 0.8; both above their bytes through 3.35 TB/s x 0.8."""
    bytes_s = ATTN_BYTES / (3.35e12 * 0.8)
    fused = glue_fwd_s(_flow(), Layout.R, _ctx(H100, fused=True), attention_only=True)
    unfused = glue_fwd_s(_flow(), Layout.R, _ctx(H100, fused=False), attention_only=True)
    assert fused == pytest.approx(max(ATTN_FLOPS / (989e12 * 0.35), bytes_s))
    assert unfused == pytest.approx(max(ATTN_FLOPS / (989e12 * 0.8), bytes_s))
    assert fused / unfused == pytest.approx(0.8 / 0.35)  # compute bound: the efficiencies' ratio


def test_without_a_stated_attention_efficiency_the_core_runs_as_a_matmul():
    """A device that states none (a profile measured without a base, the CPU presets)
    prices the fused core exactly as before: at the matmul efficiency."""
    roof = replace(H100.device.roofline, attention_efficiency=None)
    plain = replace(H100, device=replace(H100.device, roofline=roof))
    assert glue_fwd_s(_flow(), Layout.R, _ctx(plain, fused=True), attention_only=True) == pytest.approx(
        glue_fwd_s(_flow(), Layout.R, _ctx(H100, fused=False), attention_only=True)
    )


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
