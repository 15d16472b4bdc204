"""A checkpoint's config names the dtype its weights were saved in (``torch_dtype``,
bfloat16 for nearly every recent model); autopar trains fp32 master weights and computes
in the plan's precision, so a model built from such a config holds fp32 parameters, and
the runtime refuses a model whose parameters are not fp32 rather than train weights and
optimizer state in bf16 while the plan prices fp32."""

import json

import pytest
import torch

import autopar
from autopar.models.hf_config import load_hf_model
from autopar.runtime.api import analyse
from autopar.runtime.errors import PlanMismatchError

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "torch_dtype": "bfloat16",
}


def test_a_bf16_checkpoint_config_builds_fp32_master_weights(tmp_path):
    pytest.importorskip("transformers")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA))
    model = load_hf_model(str(path)).build()
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    plan = autopar.plan(model, "local-cpu:1", global_batch_size=2, seq_len=16)
    analyse(model, plan)  # accepted as built
    with pytest.raises(PlanMismatchError, match=r"^parameter model\.embed_tokens\.weight is bfloat16; .* float32"):
        analyse(model.to(torch.bfloat16), plan)
