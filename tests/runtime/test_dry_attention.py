"""A dry run measures attention whose value heads are narrower than its query heads
(multi-latent attention, DeepSeek-V2/V3) as a GPU runs it, in torch's memory-efficient
kernel: on CPU, torch's math path keeps every score, and the dry run of a small
DeepSeek-V3 measured 8 times the plan's peak (autopar.runtime.dry_attention)."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import Shard

import autopar
from autopar.runtime.data_parallel import even_placement
from autopar.runtime.dry_attention import gpu_attention
from autopar.runtime.dry_run import dry_run
from autopar.runtime.dry_step import FakeBytesMeter

transformers = pytest.importorskip("transformers")

B, H, S, QK, V = 2, 4, 512, 24, 16


def _attention_peak(wrapped: bool) -> tuple[int, tuple[int, ...]]:
    """Bytes one causal attention of query/key heads of 24 and value heads of 16 holds
    at its peak through forward and backward, on fake tensors, and its output's shape."""
    mode = FakeTensorMode()
    with mode:
        q, k = (torch.zeros(B, H, S, QK, requires_grad=True) for _ in range(2))
        v = torch.zeros(B, H, S, V, requires_grad=True)
        meter = FakeBytesMeter(mode, [q, k, v])
        with meter, gpu_attention() if wrapped else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.sum().backward()
    return meter.peak_bytes - meter.current_bytes, tuple(out.shape)


def test_narrow_value_heads_keep_no_scores():
    scores = B * H * S * S * 4  # one fp32 score per query and key
    kept, shape = _attention_peak(wrapped=True)
    assert shape == (B, H, S, V) and kept < scores / 4
    materialized, _ = _attention_peak(wrapped=False)
    assert materialized >= scores  # torch's CPU math path, which the dry run used to measure


def test_equal_heads_go_through_untouched():
    """Heads of one width reach torch's own function, which the CPU fuses."""
    called = []
    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = lambda *a, **kw: called.append(a[0].shape) or original(*a, **kw)
    try:
        with gpu_attention():
            q = torch.zeros(1, 2, 8, 4)
            F.scaled_dot_product_attention(q, q, q, is_causal=True)
    finally:
        F.scaled_dot_product_attention = original
    assert called == [torch.Size([1, 2, 8, 4])] and F.scaled_dot_product_attention is original


def test_even_placement_shards_a_dimension_the_ranks_divide():
    """16 experts over 128 ranks shard along the experts' rows, not their count; a first
    dimension the ranks divide, a vector, and no dimension that divides keep FSDP2's own."""
    place = even_placement(128)
    assert place(torch.nn.Parameter(torch.zeros(16, 256, 8))) == Shard(1)
    assert place(torch.nn.Parameter(torch.zeros(256, 16))) is None
    assert place(torch.nn.Parameter(torch.zeros(16))) is None
    assert place(torch.nn.Parameter(torch.zeros(16, 24, 8))) is None


def _deepseek_v3(**sizes):
    """A small DeepSeek-V3 on the meta device, built anew at each call: 8 heads whose
    latent attention has the real model's proportions, with ``sizes`` on top."""
    config = transformers.DeepseekV3Config(
        vocab_size=1024,
        num_attention_heads=8,
        num_key_value_heads=8,
        q_lora_rank=96,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        **sizes,
    )

    def model():
        with torch.device("meta"):
            return transformers.DeepseekV3ForCausalLM(config)

    return model


def _measured_over_predicted(model, plan) -> float:
    report = dry_run(model, plan, ranks=[0], measure=True)
    assert report.ok, report.problems
    rank = report.ranks[0]
    return rank.measured.peak_bytes / rank.predicted_allocated_bytes


def test_a_small_deepseek_v3_dry_run_measures_its_predicted_peak():
    model = _deepseek_v3(
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        max_position_embeddings=2048,
    )
    fixed = {"tp": 1, "micro_batch_size": 2, "compile": False, "fp8": False, "zero_stage": 2}
    # on one node, and over 128 data-parallel ranks, more than its 8 experts: FSDP2 padded
    # the expert stacks' first dimension to 128 rows (autopar.runtime.data_parallel.even_placement)
    for cluster, batch in (("dgx-h100:1", 16), ("dgx-h100:16", 256)):
        plan = autopar.estimate(model(), cluster, fixed, global_batch_size=batch, seq_len=2048)
        assert _measured_over_predicted(model, plan) == pytest.approx(1.0, abs=0.03), cluster


def test_row_parallel_latent_attention_measures_its_predicted_peak():
    """The planner splits q_b_proj and o_proj by rows beside a replicated key/value
    projection: q_b_proj's partial output is then reduced to the replicated layout its
    sibling has, so the attention core runs whole and keeps whole tensors, and o_proj
    slices the core's output into a new tensor that it keeps beside the core's. Both were
    priced as if the core ran on head shards and o_proj shared its output: 2.4% above the
    plan (1.024) before."""
    model = _deepseek_v3(
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=2,
        first_k_dense_replace=2,
        max_position_embeddings=4096,
    )
    fixed = {"tp": 2, "micro_batch_size": 2, "compile": False, "fp8": False, "zero_stage": 0}
    plan = autopar.estimate(model(), "dgx-h100:1", fixed, global_batch_size=8, seq_len=4096)
    rows = {k.rpartition(".")[2] for k, v in plan.layer_strategies.tp.items() if "self_attn" in k and v.value == "row"}
    assert rows == {"q_b_proj", "o_proj"}
    assert _measured_over_predicted(model, plan) == pytest.approx(1.0, abs=0.01)
