"""A dry run measures attention whose value heads are narrower than its query heads
(multi-latent attention, DeepSeek-V2/V3) as a GPU runs it, in torch's memory-efficient
kernel: on CPU, torch's math path keeps every score, and the dry run of a small
DeepSeek-V3 measured 8 times the plan's peak (autopar.runtime.dry_attention)."""

import contextlib
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import Shard

import autopar
from autopar.cost.model import CostModel, tp_context
from autopar.cost.price import Decided, UnitChoice, price
from autopar.cost.tensor_parallel import model_output_layout
from autopar.graph.extract import extract
from autopar.plan import LayerStrategies
from autopar.runtime.data_parallel import even_placement
from autopar.runtime.dry_attention import gpu_attention
from autopar.runtime.dry_run import dry_run
from autopar.runtime.dry_step import FakeBytesMeter
from autopar.search.plan_inputs import as_cluster
from autopar.vocab import TPStyle

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


def _latent_attention_plan(tp: int):
    """A small DeepSeek-V3 whose latent attention dominates its activations, and the
    planner's plan for it at ``tp``."""
    model = _deepseek_v3(
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=2,
        first_k_dense_replace=2,
        max_position_embeddings=4096,
    )
    fixed = {"tp": tp, "micro_batch_size": 2, "compile": False, "fp8": False, "zero_stage": 0}
    return model, autopar.estimate(model(), "dgx-h100:1", fixed, global_batch_size=8, seq_len=4096)


TP4_NORM_BACKWARD = pytest.mark.xfail(
    strict=True,
    reason="at tp=4 the step peaks in the final RMSNorm's backward, whose five fp32 temporaries of its "
    "replicated input (84 MB here) the cost model's working memory does not count: 1.080, and 1.069 with "
    "the row layout forced, 1.084 for a Llama of the same sizes; not the attention's accounting",
)


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=TP4_NORM_BACKWARD)])
def test_latent_attention_split_by_heads_measures_its_predicted_peak(tp):
    """The planner splits the latent attention by heads (q_b_proj and kv_b_proj
    column-parallel, o_proj row-parallel), beside the replicated kv_a_proj_with_mqa whose
    rotary key part reaches every head shard broadcast. The rotary tables the block is
    handed meet q and k in the attention too: the attention core keeps their share of
    what it saves on head shards, and o_proj reads the core's output as it is, with no
    conversion. Both were priced as if the tables' replicated layout decided the glue's:
    0.971 at tp=2 and 1.038 at tp=4 before."""
    model, plan = _latent_attention_plan(tp)
    styles = {k.rpartition(".")[2]: v.value for k, v in plan.layer_strategies.tp.items() if "self_attn" in k}
    assert styles == {"q_b_proj": "column", "kv_b_proj": "column", "o_proj": "row"}
    assert _measured_over_predicted(model, plan) == pytest.approx(1.0, abs=0.01)


def test_row_parallel_latent_attention_measures_its_repriced_peak():
    """q_b_proj and o_proj split by rows beside a replicated key/value projection (the
    planner's choice before it could split the attention by heads): q_b_proj's partial
    output is then reduced to the replicated layout its sibling has, so the attention
    core runs whole and keeps whole tensors, and o_proj slices the core's output into a
    new tensor that it keeps beside the core's (autopar.cost.kept_layouts). Forced onto
    the planner's plan and priced again by the cost model's entry point, it measures
    that price: it was 2.4% above it (1.024) when priced as if the core ran on head
    shards and o_proj shared its output."""
    model, plan = _latent_attention_plan(2)
    graph = extract(model(), seq_len=4096, dtype=plan.config.dtype, attention=plan.settings.attention)
    cost = CostModel(
        graph=graph, cluster=as_cluster("dgx-h100:1"), optimizer=plan.settings.optimizer, global_batch_size=8
    )
    row = {"q_b_proj": TPStyle.ROW, "kv_b_proj": TPStyle.REPLICATE, "o_proj": TPStyle.ROW}

    def decided(forced: bool) -> tuple[Decided, dict[str, TPStyle]]:
        tp, units = {}, []
        for u, unit in enumerate(graph.units):
            profile = graph.profile_of(u)
            styles = []
            for leaf in profile.leaves:
                fqn = unit.leaf_fqn(leaf.name)
                style = plan.layer_strategies.tp_style(fqn)
                if forced and "self_attn" in fqn:
                    style = row.get(leaf.name.rpartition(".")[2], style)
                styles.append(style)
                if style is not TPStyle.REPLICATE:
                    tp[fqn] = style
            ctx = tp_context(cost, u, plan.config)
            output = model_output_layout(profile, tuple(styles), ctx) if ctx.last else ctx.boundary
            units.append(UnitChoice(styles=tuple(styles), output=output, recompute=plan.config.recompute))
        return Decided(config=plan.config, stages=(tuple(range(len(graph.units))),), units=tuple(units)), tp

    own, tp = decided(forced=False)
    assert tp == dict(plan.layer_strategies.tp)  # the planner's own plan, rebuilt, prices as it did
    assert price(cost, own).memory_bytes_per_device == pytest.approx(plan.prediction.memory_bytes_per_device)
    forced, tp = decided(forced=True)
    rows = replace(plan, layer_strategies=LayerStrategies(tp=tp), prediction=price(cost, forced))
    assert _measured_over_predicted(model, rows) == pytest.approx(1.0, abs=0.01)
