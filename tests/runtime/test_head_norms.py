"""Norms of each attention head (Qwen3's and Gemma 3's q_norm and k_norm) under tensor
parallelism: run on the head shards of their column-parallel projections (style
``heads``) a tiny Qwen3 and a tiny Gemma 3 (one sliding-window layer) match the unsplit
single-process model, and the planner picks that layout; on a projection that writes no
head shards the style is refused."""

import pytest
import torch
from parity import assert_parity, run
from test_models import LAYERS, TINY_DECODER, hf_reference, hf_train, make, megatron

import autopar
from autopar import TPStyle
from autopar.runtime.api import analyse
from autopar.runtime.errors import ShardingError

pytestmark = pytest.mark.multiprocess
transformers = pytest.importorskip("transformers")


def qwen3():
    """A tiny Qwen3 (4 query heads over 2 key/value heads of 8 features); its head norms'
    weights drawn around one, so a norm that mixed heads or a gradient left unsummed over
    the tensor-parallel group would show."""
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**TINY_DECODER, head_dim=8))
    for name, p in model.named_parameters():
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            torch.nn.init.normal_(p, mean=1.0, std=0.3)
    return model


def gemma3():
    """A tiny Gemma 3: its head norms scale by one plus their weight, drawn around zero;
    one sliding-window layer of 4 positions beside one global layer."""
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(
        **TINY_DECODER, head_dim=8, sliding_window=4, layer_types=["sliding_attention", "full_attention"]
    )
    model = transformers.Gemma3ForCausalLM(config)
    for name, p in model.named_parameters():
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            torch.nn.init.normal_(p, std=0.3)
    return model


def _head_norm_styles(sp: bool, norm: str = "heads", gemma: bool = False) -> dict[str, str]:
    """Megatron-LM's layout with the head norms given ``norm``; Gemma 3 normalises before
    and after its MLP too, on sequence shards with sequence parallelism."""
    styles = megatron("llama", sp)
    for i in range(LAYERS):
        styles |= {f"model.layers.{i}.self_attn.{n}": norm for n in ("q_norm", "k_norm")}
        if gemma and sp:
            styles |= {f"model.layers.{i}.{n}_feedforward_layernorm": "sequence" for n in ("pre", "post")}
    return styles


def test_the_planner_runs_head_norms_on_head_shards():
    """Qwen3-8B's shape at tp=8 on an H100 node: q and k column-parallel, their norms on
    the head shards (it split them by rows before, so every rank ran every head)."""
    config = transformers.Qwen3Config(
        hidden_size=4096, intermediate_size=12288, num_hidden_layers=2, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=151936,
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.Qwen3ForCausalLM(config)
    plan = autopar.estimate(model, autopar.preset("dgx-h100", nodes=1), {"tp": 8}, global_batch_size=8, seq_len=4096)
    tp = plan.layer_strategies.tp
    for i in range(2):
        for p in ("q", "k"):
            assert tp[f"model.layers.{i}.self_attn.{p}_proj"] is TPStyle.COLUMN
            assert tp[f"model.layers.{i}.self_attn.{p}_norm"] is TPStyle.HEADS


@pytest.mark.parametrize("build", [qwen3, gemma3], ids=["qwen3", "gemma3"])
def test_head_norms_with_sequence_parallelism(build):
    styles = _head_norm_styles(sp=True, gemma=build is gemma3)
    plan = make(build(), styles, tp=2, sequence_parallel=True)
    assert_parity(run(hf_train, 2, build, plan, timeout_s=120), hf_reference(build, plan))


def test_head_norms_without_sequence_parallelism():
    plan = make(qwen3(), _head_norm_styles(sp=False), tp=2)
    assert_parity(run(hf_train, 2, qwen3, plan, timeout_s=120), hf_reference(qwen3, plan))


def test_a_head_norm_on_head_shards_needs_a_column_projection():
    styles = _head_norm_styles(sp=False)
    styles["model.layers.0.self_attn.q_proj"] = "replicate"  # whole queries: no head shards to run on
    plan = make(qwen3(), styles, tp=2)
    with pytest.raises(
        ShardingError, match=r"'model\.layers\.0\.self_attn\.q_norm' \(style 'heads'\) .* arrives in layout R"
    ):
        analyse(qwen3(), plan)
