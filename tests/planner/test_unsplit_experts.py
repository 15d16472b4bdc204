"""The planner offers expert parallelism exactly where the runtime can split the experts:
a module taking routed tokens (transformers' Mixtral and GPT-OSS) or autopar's
MoEFeedForward, not transformers' Llama 4 experts (every expert runs on every token),
whose stacked weights the trace once took for splittable experts, so ``plan`` priced
ep > 1 for Llama 4, which the runtime refuses."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autopar
from autopar.errors import ConfigError
from autopar.graph import extract
from autopar.models import build_named_model
from autopar.models.experts import experts_modules, unsplit_experts
from autopar.search.constraints import check_constraints
from autopar.search.experts import model_experts
from autopar.search.space import enumerate_space

transformers = pytest.importorskip("transformers")

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=100,
    max_position_embeddings=64,
    num_local_experts=4,
    num_experts_per_tok=2,
)


def _tiny(kind: str) -> nn.Module:
    if kind == "moe-tiny":
        return build_named_model("moe-tiny")
    if kind == "llama4":
        cfg, cls = transformers.Llama4TextConfig(**TINY, intermediate_size_mlp=128, head_dim=16), "Llama4ForCausalLM"
    elif kind == "gpt-oss":
        cfg, cls = transformers.GptOssConfig(**TINY, head_dim=16), "GptOssForCausalLM"
    else:
        cfg, cls = transformers.MixtralConfig(**TINY), "MixtralForCausalLM"
    with torch.device("meta"):
        return getattr(transformers, cls)(cfg)


@pytest.mark.parametrize(
    ("kind", "experts", "unsplit"),
    [
        ("mixtral", 4, ()),
        ("moe-tiny", 8, ()),
        ("llama4", 0, ("Llama4TextExperts",)),
        ("gpt-oss", 4, ()),
    ],
)
def test_the_planner_sees_the_experts_the_runtime_splits(kind, experts, unsplit):
    model = _tiny(kind)
    graph = extract(model, seq_len=32)
    assert model_experts(graph) == experts
    assert bool(model_experts(graph)) == bool(experts_modules(model))  # the runtime's own test
    assert graph.unsplit_experts == unsplit == unsplit_experts(model)
    configs, _ = enumerate_space(graph, autopar.preset("dgx-h100", nodes=1), 8, check_constraints({}))
    assert (max(c.ep for c in configs) > 1) == bool(experts)


def test_unsplit_experts_plan_with_ep_1_and_say_why():
    model = _tiny("llama4")
    plan = autopar.plan(model, "dgx-h100:1", global_batch_size=8, seq_len=32, top=0)
    assert plan.config.ep == 1
    (note,) = [n for n in plan.notes if "run whole on every rank" in n]
    assert unsplit_experts(model)[0] in note and "forward(hidden_states, top_k_index, top_k_weights)" in note
    with pytest.raises(ConfigError, match=r"^ep=2 is not allowed for .*cannot split them; use ep=1\.$"):
        autopar.estimate(model, "dgx-h100:1", {"ep": 2}, global_batch_size=8, seq_len=32)


@pytest.mark.parametrize(("kind", "eager"), [("gpt-oss", True), ("mixtral", False)])
def test_an_attention_without_sdpa_is_said_to_ignore_the_attention_setting(kind, eager):
    """transformers runs gpt-oss's attention (with sinks) eagerly, not through
    scaled_dot_product_attention: flash or materialized, it is priced as the trace runs
    it, identically, and the plan says so; Mixtral's goes through SDPA and is not noted."""
    model = _tiny(kind)
    plans = [
        autopar.estimate(model, "dgx-h100:1", {"dp": 8}, global_batch_size=8, seq_len=32, attention=a)
        for a in ("flash", "materialized")
    ]
    noted = [any("No unit calls scaled_dot_product_attention" in n for n in p.notes) for p in plans]
    assert noted == [eager, eager]
    same = plans[0].prediction.step_time_s == plans[1].prediction.step_time_s
    assert same == eager


def test_unrouted_expert_work_is_hardware_not_model_flops():
    """transformers' Llama 4 experts run every expert on every token (the tokens not routed
    to one weighted zero): their matmuls, 2 x E x T x H x 2I up and 2 x E x T x I x H down
    per layer by hand, are what the hardware runs, but only top-k / E of them is model
    work. MFU counts that share, HFU all of it (no recomputation here: their ratio is the
    hardware's FLOPs over the model's); a model whose experts take routed tokens has no
    unrouted work."""
    model = _tiny("llama4")
    graph = extract(model, seq_len=32)
    experts, tokens, hidden, width, layers = 4, 32, 64, 128, 2
    matmuls = layers * (2 * experts * tokens * hidden * 2 * width + 2 * experts * tokens * width * hidden)
    assert graph.unrouted_flops == pytest.approx((1 - 2 / experts) * matmuls, rel=1e-9)
    plan = autopar.estimate(model, "dgx-h100:1", {"dp": 8, "recompute": "none"}, global_batch_size=8, seq_len=32)
    p = plan.prediction
    ratio = graph.fwd_flops_per_sample / (graph.fwd_flops_per_sample - graph.unrouted_flops)
    assert p.hfu / p.mfu == pytest.approx(ratio, rel=1e-9) and ratio > 1.3
    assert plan.model.flops_per_sample == pytest.approx(3 * graph.model_fwd_flops_per_sample, rel=1e-12)
    assert extract(_tiny("mixtral"), seq_len=32).unrouted_flops == 0.0


def test_a_routing_imbalance_for_experts_that_run_every_token_is_refused_for_what_they_are():
    """Llama 4's experts run every token whatever the router picks: a routing imbalance
    would change nothing, and the refusal says so (it said the model had no experts)."""
    with pytest.raises(ConfigError, match=r"this model has experts that run every token \(Llama4TextExperts\)"):
        autopar.plan(_tiny("llama4"), "dgx-h100:1", global_batch_size=8, seq_len=32, routing_imbalance=1.5)
