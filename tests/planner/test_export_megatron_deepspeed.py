"""The Megatron-DeepSpeed launch line of a DeepSpeed export (``tp`` or ``pp`` above 1),
read back by an argparse parser declaring each flag as Megatron-DeepSpeed's
``megatron/arguments.py`` does (commit 4efb479): an undeclared flag or a bad value
raises, the four sizes it requires are there, and the values are the transformers
config's."""

import argparse
import json
import shlex

import pytest
import torch

import autopar
from autopar.export import export
from autopar.models import build_named_model
from autopar.vocab import Recompute

from .test_export import variant
from .test_export_ep import _mixtral

MEGATRON_DEEPSPEED_FLAGS = {
    # (type, choices, nargs); a type of None is a store_true/store_false switch
    "--tensor-model-parallel-size": (int, None, None),
    "--pipeline-model-parallel-size": (int, None, None),
    "--sequence-parallel": (None, None, None),
    "--no-pipeline-parallel": (None, None, None),
    "--micro-batch-size": (int, None, None),
    "--global-batch-size": (int, None, None),
    "--num-layers": (int, None, None),
    "--seq-length": (int, None, None),
    "--hidden-size": (int, None, None),
    "--num-attention-heads": (int, None, None),
    "--num-key-value-heads": (int, None, None),
    "--kv-channels": (int, None, None),
    "--ffn-hidden-size": (int, None, None),
    "--max-position-embeddings": (int, None, None),
    "--recompute-granularity": (str, ["full", "selective"], None),
    "--recompute-method": (str, ["uniform", "block"], None),
    "--recompute-num-layers": (int, None, None),
    "--bf16": (None, None, None),
    "--fp16": (None, None, None),
    "--normalization": (str, ["layernorm", "rmsnorm"], None),
    "--layernorm-epsilon": (float, None, None),
    "--swiglu": (None, None, None),
    "--use-rotary-position-embeddings": (None, None, None),
    "--no-position-embedding": (None, None, None),
    "--rotary-position-embeddings-theta": (int, None, None),
    "--rotary-percent": (float, None, None),
    "--untie-embeddings-and-output-weights": (None, None, None),
    "--disable-bias-linear": (None, None, None),
    "--num-experts": (int, None, "+"),
    "--topk": (int, None, None),
    "--expert-interval": (int, None, None),
    "--create-moe-param-group": (None, None, None),
    "--disable-moe-token-dropping": (None, None, None),
    "--disable-moe-top2-2nd-expert-sampling": (None, None, None),
    "--moe-train-capacity-factor": (float, None, None),
    "--zero-stage": (int, None, None),
    # DeepSpeed's own (deepspeed.add_config_arguments)
    "--deepspeed": (None, None, None),
    "--deepspeed_config": (str, None, None),
}
REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "max_position_embeddings")
"""What Megatron-DeepSpeed's ``validate_args`` asserts is given."""


def _parsed(plan, model=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(allow_abbrev=False, exit_on_error=False)
    for flag, (kind, choices, nargs) in MEGATRON_DEEPSPEED_FLAGS.items():
        if kind is None:
            parser.add_argument(flag, action="store_true")
        else:
            parser.add_argument(flag, type=kind, choices=choices, nargs=nargs)
    words = shlex.split(export(plan, to="deepspeed", model=model).launch)
    args = parser.parse_args(words[words.index("pretrain_gpt.py") + 1 :])
    assert all(getattr(args, name) is not None for name in REQUIRED)
    assert args.max_position_embeddings >= args.seq_length  # validate_args asserts it
    return args


def _on_meta(cls, config):
    with torch.device("meta"):
        return cls(config)


def _on_8(model, seq_len: int, **config):
    return autopar.estimate(
        model, autopar.preset("dgx-a100-80gb", nodes=1), {"pp": 1, **config}, global_batch_size=16, seq_len=seq_len
    )


def test_llama_sizes_and_architecture():
    model = build_named_model("llama3-8b")
    args = _parsed(_on_8(model, 2048, tp=8), model)
    assert (args.hidden_size, args.num_attention_heads, args.num_key_value_heads) == (4096, 32, 8)
    assert (args.ffn_hidden_size, args.num_layers, args.seq_length) == (14336, 32, 2048)
    assert (args.normalization, args.rotary_position_embeddings_theta, args.layernorm_epsilon) == (
        "rmsnorm",
        500000,
        1e-5,
    )
    assert args.swiglu and args.use_rotary_position_embeddings
    # its Embedding adds learned positions unless told not to, whatever the rotary flag says
    assert args.no_position_embedding
    assert args.untie_embeddings_and_output_weights and args.disable_bias_linear
    assert args.kv_channels is None and args.num_experts is None


def test_a_plan_without_its_model_names_the_required_sizes():
    plan = _on_8(build_named_model("llama3-8b"), 2048, tp=8)
    result = export(plan, to="deepspeed")
    assert "--hidden-size" not in result.launch
    assert any("Megatron-DeepSpeed requires: add --hidden-size, --num-attention-heads" in n for n in result.notes)


def test_gpt2_learned_positions_and_biases():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_embd=64, n_layer=4, n_head=4, n_positions=256, vocab_size=256)
    model = _on_meta(transformers.GPT2LMHeadModel, config)
    args = _parsed(_on_8(model, 128, tp=2), model)
    # GPT-2's config leaves the MLP width to 4 x hidden, Megatron-DeepSpeed's default too
    assert (args.hidden_size, args.num_attention_heads, args.ffn_hidden_size or 4 * args.hidden_size) == (64, 4, 256)
    assert args.max_position_embeddings == 256 and not args.use_rotary_position_embeddings
    assert not args.no_position_embedding
    assert not (args.swiglu or args.disable_bias_linear or args.untie_embeddings_and_output_weights)
    assert args.normalization is None  # Megatron-DeepSpeed's default, layernorm


def test_mixtral_experts_every_layer_dropless():
    model = _mixtral()
    args = _parsed(_on_8(model, 128, tp=2), model)
    # every block holds experts: DeepSpeed-MoE's layer_num % interval == 0 on all of them
    assert (args.num_experts, args.topk, args.expert_interval) == ([4], 2, 1)
    assert args.create_moe_param_group and args.disable_moe_token_dropping
    # top-2 by argmax, as the model routes (DeepSpeed-MoE samples the second with noise by default)
    assert args.disable_moe_top2_2nd_expert_sampling
    assert (args.max_position_embeddings, args.ffn_hidden_size) == (128, 128)


def test_deepseek_dense_first_layers_have_no_interval():
    transformers = pytest.importorskip("transformers")
    config = transformers.DeepseekV3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        max_position_embeddings=256,
    )
    model = _on_meta(transformers.DeepseekV3ForCausalLM, config)
    result = export(_on_8(model, 128, tp=1, pp=2), to="deepspeed", model=model)
    assert "--expert-interval 1" in result.launch
    assert any("sit on blocks 1, 2, 3, which no --expert-interval" in n for n in result.notes)
    built = next(n for n in result.notes if n.startswith("Megatron-DeepSpeed's flags do not build"))
    assert "multi-latent attention" in built and "shared experts" in built and "router" in built


@pytest.mark.parametrize("config, stage", [({"tp": 2, "zero_stage": 3}, 3), ({"tp": 2, "pp": 2, "zero_stage": 2}, 1)])
def test_the_launch_line_names_the_configs_zero_stage(config, stage):
    """Megatron-DeepSpeed reads its own --zero-stage (default 1) to build a ZeRO-3 model
    already partitioned; the pipeline engine runs stage 1 at most."""
    model = build_named_model("llama3-8b")
    plan = _on_8(model, 2048, **config)
    result = export(plan, to="deepspeed", model=model)
    assert json.loads(result.text)["zero_optimization"]["stage"] == stage
    assert _parsed(plan, model).zero_stage == stage


def test_a_pipelined_plan_recomputes_by_the_uniform_method_only():
    """DeepSpeed's pipeline engine (GPTModelPipe) recomputes only by the uniform method:
    the first blocks of each stage in full are written as every layer in full, noted."""
    model = build_named_model("llama3-8b")
    plan = _on_8(model, 2048, tp=4, pp=2)
    first3 = {f"layers.{i}": Recompute.FULL for s in (0, 16) for i in range(s, s + 3)}
    mixed = variant(plan, overrides=first3)
    args = _parsed(mixed, model)
    assert (args.recompute_granularity, args.recompute_method, args.recompute_num_layers) == ("full", "uniform", 1)
    notes = export(mixed, to="deepspeed", model=model).notes
    assert any("6 full" in n and "uniform method" in n for n in notes)
    # without a pipeline the script's own model takes Megatron's block method
    flat = variant(_on_8(model, 2048, tp=8), overrides={f"layers.{i}": Recompute.FULL for i in range(3)})
    assert _parsed(flat, model).recompute_method == "block"


def test_a_saved_config_quotes_the_launch_line_of_its_own_path(tmp_path):
    model = build_named_model("llama3-8b")
    result = export(_on_8(model, 2048, tp=8), to="deepspeed", model=model)
    path = tmp_path / "my ds.json"
    result.save(path)
    quoted = json.loads(path.read_text())["autopar"]["launch"]
    assert quoted == result.launch_for(path) and shlex.split(quoted)[-1] == str(path)
    assert json.loads(result.text)["autopar"]["launch"] == result.launch  # unsaved: the default name
