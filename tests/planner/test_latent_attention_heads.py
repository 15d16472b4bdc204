"""Multi-latent attention (DeepSeek-V2/V3) splits by its heads: the key/value projection
packs each head's key part and value part, narrower than a query head (which adds a
rotary part), so its heads are not its width over the query head's; they were counted
that way (DeepSeek-V3's 128 heads as 85), and no tensor-parallel degree was allowed."""

import pytest
import torch

import autopar
from autopar.graph import extract
from autopar.graph.head_features import head_count
from autopar.search.space import layer_misfit, tp_degrees

transformers = pytest.importorskip("transformers")

HEADS, NOPE, ROPE, V = 4, 8, 4, 8


def tiny_deepseek_v3():
    return transformers.DeepseekV3ForCausalLM(
        transformers.DeepseekV3Config(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            moe_intermediate_size=16,
            num_hidden_layers=2,
            first_k_dense_replace=1,
            num_attention_heads=HEADS,
            num_key_value_heads=HEADS,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            q_lora_rank=24,
            kv_lora_rank=16,
            qk_nope_head_dim=NOPE,
            qk_rope_head_dim=ROPE,
            v_head_dim=V,
            max_position_embeddings=64,
            use_cache=False,
        )
    )


def test_every_projection_of_the_latent_attention_counts_its_heads():
    with torch.device("meta"):
        graph = extract(tiny_deepseek_v3(), seq_len=16)
    for unit in (1, 2):  # the dense block and the mixture-of-experts block
        leaves = {leaf.name: leaf for leaf in graph.profile_of(unit).leaves}
        q, kv, o = (leaves[f"self_attn.{n}"] for n in ("q_b_proj", "kv_b_proj", "o_proj"))
        assert (q.out_features, kv.out_features, o.in_features) == (
            HEADS * (NOPE + ROPE),
            HEADS * (NOPE + V),
            HEADS * V,
        )
        assert (q.out_heads, kv.out_heads, o.in_heads) == (HEADS, HEADS, HEADS)
    assert tp_degrees(graph, 8) == [1, 2, 4]  # whatever divides the 4 heads and the devices


def test_the_count_is_the_width_over_the_head_where_that_is_whole():
    """A grouped-query key projection: 8 key heads of 128 under 64 query heads; a fused
    q/k/v (3 parts) of 16 heads of 64; the latent key/value of 128 heads of 128 + 128
    under query heads of 192 (DeepSeek-V3's sizes); a multi-query fused q/k/v as before
    (its tensor-parallel runs are not checked)."""
    assert head_count(8 * 128, 128, 1, 64) == 8
    assert head_count(3 * 16 * 64, 64, 3, 16) == 16
    assert head_count(128 * 256, 192, 2, 128) == 128
    assert head_count(128 * 128, 192, 1, 128) == 128  # its output projection's input
    # a multi-query fused q/k/v (8 query heads and one key/value head of 4) keeps the width rule
    assert head_count((8 + 2) * 4, 4, 3, 8) == 3


def test_deepseek_v3_splits_over_tensor_parallel_ranks():
    """DeepSeek-V3's sizes (four of its blocks): tp=2 was refused, "kv_b_proj splits by
    whole attention heads and has 85"; its 128 heads allow every degree within a node."""
    config = transformers.DeepseekV3Config(num_hidden_layers=4, first_k_dense_replace=1, n_routed_experts=16)
    with torch.device("meta"):
        graph = extract(transformers.DeepseekV3ForCausalLM(config), seq_len=4096)
    assert layer_misfit(graph, 2) is None
    assert tp_degrees(graph, 8) == [1, 2, 4, 8]


def test_the_latent_attention_splits_by_heads_as_megatron_does():
    """The key/value up-projection packs each head's key and value parts and is cut
    within each head (viewed as heads first), so a column split keeps heads whole: it
    is no fused q/k/v. The rotary key part, one head's worth from kv_a_proj_with_mqa
    expanded to every head and copied into the keys, reaches the attention broadcast
    over its heads (features 16:20 of that projection's output), so head shards read it
    replicated; the planner, at DeepSeek-V3's sizes and tp=8, splits the attention by
    heads (q_b_proj and kv_b_proj column-parallel, o_proj row-parallel)."""
    with torch.device("meta"):
        graph = extract(tiny_deepseek_v3(), seq_len=16)
    profile = graph.profile_of(1)
    index = {leaf.name: i for i, leaf in enumerate(profile.leaves)}
    kv_a, kv_b, o = (index[f"self_attn.{n}"] for n in ("kv_a_proj_with_mqa", "kv_b_proj", "o_proj"))
    assert not profile.leaves[kv_b].fused and profile.leaves[kv_a].fused
    assert profile.leaves[kv_a].broadcast_features == (16, 20)  # kv_lora_rank .. + qk_rope_head_dim
    broadcast = {(f.src, f.dst) for f in profile.flows if f.head_broadcast}
    assert broadcast == {(kv_a, o)}
    assert not any(f.src == kv_b and f.dst < 0 for f in profile.flows)  # its keys reach the attention

    config = transformers.DeepseekV3Config(num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=16)
    with torch.device("meta"):
        graph = extract(transformers.DeepseekV3ForCausalLM(config), seq_len=4096)
    config = {"dp": 1, "tp": 8, "pp": 1, "micro_batch_size": 1, "num_microbatches": 8, "dtype": "bf16"}
    plan = autopar.estimate(graph, autopar.preset("dgx-h100"), config, global_batch_size=8)
    styles = {k.rpartition(".")[2]: v.value for k, v in plan.layer_strategies.tp.items() if ".1.self_attn." in k}
    assert (styles["q_b_proj"], styles["kv_b_proj"], styles["o_proj"]) == ("column", "column", "row")
