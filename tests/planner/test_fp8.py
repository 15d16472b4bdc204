"""FP8 matmuls: one linear layer's time against a hand roofline, which layers convert,
and the plan choice (refusals, explain's contrast)."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.cost.comm import group_span
from autopar.cost.compute import rates
from autopar.cost.leaf import TPContext, leaf_fwd_s
from autopar.errors import ConfigError
from autopar.graph.layer_graph import Leaf, LeafKind
from autopar.models.llama import Llama, LlamaConfig
from autopar.vocab import DType, Layout, TPStyle

H100 = autopar.preset("dgx-h100", nodes=1)
TOKENS, DIM = 16384, 4096


def _linear(rows: int = DIM, cols: int = DIM, **kw) -> Leaf:
    """A bias-free linear layer of ``rows x cols`` over one sample of TOKENS tokens."""
    flops = 2.0 * rows * cols * TOKENS
    return Leaf(
        name="proj",
        kind=LeafKind.LINEAR,
        param_numel=rows * cols,
        weight_numel=rows * cols,
        in_features=cols,
        out_features=rows,
        in_heads=0,
        out_heads=0,
        vocab=kw.pop("vocab", False),
        fwd_flops=flops,
        matmul_flops=flops,
        fwd_bytes=2.0 * (rows + cols) * TOKENS,
        saved_bytes=2.0 * cols * TOKENS,
        weight_bytes=2.0 * rows * cols,
        fwd_ops=1,
        **kw,
    )


def _ctx(*, fp8: bool, compile: bool = False, tp: int = 1) -> TPContext:
    return TPContext(
        tp=tp,
        span=group_span(tp, 1, 8),
        cluster=H100,
        rates=rates(H100.device, DType.BF16),
        micro_batch=1.0,
        tokens=TOKENS,
        boundary=Layout.R,
        first=False,
        last=False,
        loss_parallel=False,
        sequence_parallel=False,
        fp8=fp8,
        compile=compile,
    )


@pytest.mark.parametrize("compile", [False, True])
def test_an_fp8_linear_runs_at_the_fp8_peak_and_pays_its_casts(compile):
    """The roofline by hand: the matmul at 0.709 x 1979 TFLOP/s (the FP8 GEMM efficiency
    the H100 preset cites, below bf16's) against the bytes through 3.35 TB/s x 0.8, which
    gain the input's and the weight's casts (5 bytes per element each, 3 compiled); bf16
    runs at 0.8 x 989 TFLOP/s without them."""
    leaf = _linear()
    flops = 2.0 * DIM * DIM * TOKENS
    moved = 2.0 * (2 * DIM * TOKENS) + 2.0 * DIM * DIM
    bandwidth = 3.35e12 * 0.8
    per_element = 3.0 if compile else 5.0
    casts = per_element * (DIM * TOKENS + DIM * DIM)
    fp8 = max(flops / (1979e12 * 0.709), (moved + casts) / bandwidth)
    bf16 = max(flops / (989e12 * 0.8), moved / bandwidth)
    assert leaf_fwd_s(leaf, TPStyle.REPLICATE, _ctx(fp8=True, compile=compile)) == pytest.approx(fp8)
    assert leaf_fwd_s(leaf, TPStyle.REPLICATE, _ctx(fp8=False, compile=compile)) == pytest.approx(bf16)
    assert bf16 / fp8 == pytest.approx(1979 * 0.709 / (989 * 0.8))  # compute bound with its casts: the rates' ratio


def test_heads_experts_and_unaligned_matrices_stay_in_bf16():
    """The vocabulary projection, expert stacks and a matrix with a side not divisible by
    16 (after its tensor-parallel split) are not converted, as the runtime leaves them."""
    ctx = _ctx(fp8=True)
    plain = _ctx(fp8=False)
    for leaf in (_linear(vocab=True), _linear(experts=8, expert_numel=DIM * DIM), _linear(rows=DIM + 8)):
        assert leaf_fwd_s(leaf, TPStyle.REPLICATE, ctx) == leaf_fwd_s(leaf, TPStyle.REPLICATE, plain)
    split = _linear(rows=48 * 8)  # 384 rows: 48 per rank at tp=8 (converted), 24 at tp=16 (not)
    at = {tp: [leaf_fwd_s(split, TPStyle.COLUMN, _ctx(fp8=f, tp=tp)) for f in (True, False)] for tp in (8, 16)}
    assert at[8][0] != at[8][1] and at[16][0] == at[16][1]


def _llama(dim: int = 4096, ffn_dim: int = 14336, n_heads: int = 32):
    with torch.device("meta"):
        return Llama(LlamaConfig(dim=dim, n_layers=2, n_heads=n_heads, n_kv_heads=8, ffn_dim=ffn_dim, vocab_size=32000))


def test_fp8_is_searched_on_h100_and_refused_where_it_cannot_run():
    """An 8B-wide Llama's matmuls are worth FP8 on H100, so the plan takes it and explain
    prices bf16 beside it; a 512-wide one's are not (the casts of its weights cost more
    than the matmuls save), so it stays in bf16. Either way the plan is the faster of the
    two plans pinned each way."""
    for llama, wins in ((_llama(), True), (_llama(dim=512, ffn_dim=1792, n_heads=8), False)):
        plan = autopar.plan(llama, H100, global_batch_size=16, seq_len=2048)
        assert plan.config.fp8 is wins
        (other,) = [a for a in plan.alternatives if a.status == "fp8"]
        assert other.config.fp8 is not wins and other.slower_by > 0
        line = next(x for x in autopar.explain(plan).splitlines() if x.startswith("FP8 matmuls"))
        assert f"{100 * other.slower_by:+.1f}%" in line
        assert ("this configuration in bf16" if wins else "this configuration in FP8") in line
        header, predicted = (
            next(x for x in autopar.explain(plan).splitlines() if x.lstrip().startswith(k))
            for k in ("batch 16", "Predicted")
        )
        assert ("bf16 with FP8 matmuls" in header) is wins and ("of the bf16 peak" in predicted) is wins
        if wins:  # and of the FP8 peak (1979 of H100's 989 TFLOP/s bf16), where an HFU may pass 100% of bf16's
            p, share = plan.prediction, 989e12 / 1979e12
            assert f"; {100 * p.mfu * share:.1f}% ({100 * p.hfu * share:.1f}%) of the FP8 peak" in predicted
        pinned = [
            autopar.plan(llama, H100, global_batch_size=16, seq_len=2048, constraints={"fp8": f}).prediction.step_time_s
            for f in (False, True)
        ]
        assert plan.prediction.step_time_s == pytest.approx(min(pinned), rel=1e-9)
        assert max(pinned) > min(pinned)
    a100 = autopar.preset("dgx-a100-80gb", nodes=1)
    assert not [
        a for a in autopar.plan(_llama(), a100, global_batch_size=16, seq_len=2048).alternatives if a.status == "fp8"
    ]
    with pytest.raises(ConfigError, match=r"fp8=True needs FP8 tensor cores, which A100-SXM4-80GB does not have"):
        autopar.plan(_llama(), a100, global_batch_size=16, seq_len=2048, constraints={"fp8": True})
    with pytest.raises(ConfigError, match=r"fp8=True needs FP8 tensor cores"):
        autopar.estimate(_llama(), a100, {"fp8": True}, global_batch_size=16, seq_len=2048)
    with pytest.raises(ConfigError, match=r"fp8=True needs dtype='bf16' \(got 'fp16'\)"):
        autopar.estimate(_llama(), H100, {"fp8": True, "dtype": "fp16"}, global_batch_size=16, seq_len=2048)
