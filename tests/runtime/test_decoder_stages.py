"""Pipeline stages of transformers decoder-only causal LMs of ten families, cut by one
generic mechanism (autopar.runtime.decoder_stages): each split against the unsplit
single-process model, pp=2 alone and with tensor parallelism; the planner offers them
pipelines."""

import functools

import pytest
import torch
from hf_decoders import FAMILIES, build_decoder, build_opt, megatron_styles
from parity import SEQ, assert_parity, run
from test_models import as_reference_shapes, hf_reference, hf_train, make

import autopar
from autopar.graph import extract

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case", ["pp2", "tp2-pp2"])
def test_a_transformers_decoder_pipelined_matches_one_process(family, case):
    """Stage 0 holds the embeddings and two blocks, stage 1 two blocks, the final norm
    and the head (and, tied, the embedding's weight); each runs the model's own forward
    for its share. With tp=2, Megatron-LM's layout (hf_decoders.megatron_styles). Losses
    and every parameter after three SGD steps match one process."""
    model = build_decoder(family)
    styles = megatron_styles(family, model) if case == "tp2-pp2" else None
    plan = make(model, styles, **{"pp2": dict(pp=2), "tp2-pp2": dict(tp=2, pp=2)}[case])
    assert plan.config.pp == 2 and len(plan.stages) == 2
    if styles:
        sharded = {k: v.value for k, v in plan.layer_strategies.tp.items() if v.value != "replicate"}
        assert "column" in sharded.values() and "vocab" in sharded.values(), sharded
    build = functools.partial(build_decoder, family)
    ref = hf_reference(build, plan, steps=3)
    results = run(hf_train, plan.config.world_size, build, plan, 3, timeout_s=180)
    assert_parity(as_reference_shapes(results, ref), ref)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_planner_offers_every_family_a_pipeline(family):
    """Every family is cuttable, so the search keeps pp > 1 in its space and a plan
    asked for pp=2 has no note that the runtime cannot run it."""
    model = build_decoder(family)
    assert extract(model, seq_len=16).cuttable
    plan = autopar.plan(
        model, autopar.preset("local-cpu", devices_per_node=2), global_batch_size=8, seq_len=16, constraints={"pp": 2}
    )
    assert plan.config.pp == 2 and not any("cannot cut" in n or "left out" in n for n in plan.notes)


PLANNER_SPLITS = {"falcon": {"self_attention.query_key_value": "row", "self_attention.dense": "row"}}
"""Splits autopar.plan picks at tp=2 for a wider model of the family beyond Megatron-LM's
layout (Falcon's fused q, k and v may only be split by rows)."""


@pytest.mark.parametrize("family", ["opt", "falcon"])
def test_tensor_parallel_alone_matches_one_process(family):
    """tp=2 alone, Megatron-LM's layout and the planner's splits. OPT views q, k and v
    by the head count its attention stores (``view(bsz, -1, self.num_heads, ...)``), so
    with the global count each rank's half-width projections were folded over the
    sequence: the runtime makes it count the heads on the rank. Falcon adds the attention
    output into the row-parallel MLP's output in place, which autograd refused on the
    view ``DTensor.to_local`` returns. Losses and every parameter after three SGD steps
    match one process."""
    model = build_decoder(family)
    styles = megatron_styles(family, model)
    for name, _ in model.named_modules():
        for leaf, style in PLANNER_SPLITS.get(family, {}).items():
            if name.endswith("." + leaf):
                styles[name] = style
    plan = make(model, styles, tp=2)
    build = functools.partial(build_decoder, family)
    ref = hf_reference(build, plan, steps=3)
    assert_parity(as_reference_shapes(run(hf_train, plan.config.world_size, build, plan, 3, timeout_s=180), ref), ref)


def _planned_with_sequence_parallelism(model) -> autopar.Plan:
    """The planner's plan for ``model`` at tp=2 with sequence parallelism, in fp32 and eager."""
    return autopar.plan(
        model,
        autopar.preset("local-cpu", devices_per_node=2),
        global_batch_size=4,
        seq_len=SEQ,
        constraints={"tp": 2, "pp": 1, "dp": 1, "sequence_parallel": True, "dtype": "fp32", "compile": False},
    )


@pytest.mark.parametrize("final_norm", ["sequence", "replicate"])
def test_the_planners_sequence_parallel_opt_matches_one_process(final_norm):
    """OPT's decoder layer flattens its (batch, seq, hidden) stream to (batch * seq,
    hidden) before its final norm and MLP; the sequence shard of a 3-D activation
    (Shard(1)) split the features of that view (the norm failed on the shape; a
    conversion there refused the 2-D tensor). The runtime shards the tokens of a 2-D
    activation (Shard(0)), so the planner's own plan at tp=2 with sequence parallelism,
    micro-batches of several samples, runs: the final norm sequence-sharded as planned,
    or replicated (gathered before it, the MLP's output scattered over the tokens).
    Losses and every parameter after three SGD steps match one process."""
    build = functools.partial(build_opt, 512)
    plan = _planned_with_sequence_parallelism(build())
    styles = {k: v.value for k, v in plan.layer_strategies.tp.items()}
    assert plan.config.sequence_parallel and plan.config.micro_batch_size > 1
    norm = "model.decoder.layers.0.final_layer_norm"
    assert styles[norm] == "sequence" and styles["model.decoder.layers.0.fc1"] == "column", styles
    if final_norm == "replicate":
        plan = make(build(), {**styles, norm: "replicate"}, tp=2, sequence_parallel=True)
    ref = hf_reference(build, plan, steps=3)
    assert_parity(run(hf_train, plan.config.world_size, build, plan, 3, timeout_s=180), ref)


def test_the_planners_sequence_parallel_opt_with_a_replicated_attention_matches_one_process():
    """At hidden 384 the planner keeps OPT's attention replicated under sequence
    parallelism and splits only the MLP. ``out_proj`` handed its whole (batch, seq,
    hidden) output to the residual add, whose stream held only the rank's sequence shard
    ("The size of tensor a (8) must match the size of tensor b (16)"): the layout check
    let the leaves' outputs decide where they met the unit's input. The runtime now
    slices a replicated addend of the sequence-sharded residual stream to its sequence
    shard, as the planner prices it (R -> Q at the unit's output). Losses and every
    parameter after three SGD steps match one process."""
    build = functools.partial(build_opt, 384)
    plan = _planned_with_sequence_parallelism(build())
    styles = {k: v.value for k, v in plan.layer_strategies.tp.items()}
    layer = "model.decoder.layers.0"
    assert plan.config.sequence_parallel, plan.config
    assert styles.get(f"{layer}.self_attn.out_proj", "replicate") == "replicate", styles
    assert styles[f"{layer}.fc1"] == "column" and styles[f"{layer}.fc2"] == "row", styles
    ref = hf_reference(build, plan, steps=3)
    assert_parity(run(hf_train, plan.config.world_size, build, plan, 3, timeout_s=180), ref)


FUSED = {
    "phi3": {"self_attn.qkv_proj", "mlp.gate_up_proj"},
    "falcon": {"self_attention.query_key_value"},
}
"""Leaves that compute several projections in one matrix, as the trace finds them
(BLOOM's query_key_value, viewed by heads before its parts are taken, is not found).
GPT-NeoX's query_key_value is viewed as (heads, 3 x head_dim) before its q, k and v are
cut within each head, so a column split keeps whole heads and it is not marked (its
column-parallel split was checked to train as one process does)."""


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2", "gpt_neox", *FUSED])
def test_fused_projections_are_never_column_split(family):
    """A leaf feeding several of q, k and v, or whose output's features the forward
    takes parts of, is marked fused: a column split would not cut it where its parts
    meet, so only replicate and row remain (GPT-2's c_attn, split by heads by the
    runtime, is not marked; nor is any separate q, k, v, gate or up projection)."""
    graph = extract(build_decoder(family), seq_len=16)
    block = graph.profiles[graph.units[1].profile]
    fused = {leaf.name for leaf in block.leaves if leaf.fused}
    assert fused == FUSED.get(family, set())
    for leaf in block.leaves:
        if leaf.fused:
            assert autopar.TPStyle.COLUMN not in leaf.styles(sequence_parallel=False)


BF16_RTOL = 2e-2
"""bf16 keeps 8 bits of mantissa; a few steps' losses accumulate several roundings per
matmul (as tests/runtime/test_features.py)."""


def test_a_decoder_built_in_fp32_runs_pipelined_in_bf16():
    """A model built in fp32 (a config without torch_dtype), trained in bf16 with pp=2
    and dp=2: mixed precision casts the weights, so stage 0's embedding gives bf16, and
    stage 1 derives its rotary tables from stand-in embeddings of the received states'
    dtype (fp32 ones made attention's query and key fp32 beside a bf16 value, which SDPA
    refuses). Losses track the fp32 single process within bf16 precision and differ from
    it (bf16 really ran)."""
    build = functools.partial(build_decoder, "llama")
    plan = make(build(), pp=2, dp=2, dtype="bf16")
    ref = hf_reference(build, plan, steps=3)
    for res in run(hf_train, plan.config.world_size, build, plan, 3, timeout_s=180):
        torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(ref.losses), rtol=BF16_RTOL, atol=0)
        assert res.losses != ref.losses


def test_gpt_neox_fused_qkv_splits_by_heads():
    """GPT-NeoX's query_key_value holds each head's q, k and v together (head-major):
    column-parallel, each rank its heads' q, k and v, it trains as one process does."""
    model = build_decoder("gpt_neox")
    styles = megatron_styles("gpt_neox", model)
    for name, _ in model.named_modules():
        if name.endswith(("attention.query_key_value", "attention.dense")):
            styles[name] = "column" if name.endswith("query_key_value") else "row"
    plan = make(model, styles, tp=2)
    build = functools.partial(build_decoder, "gpt_neox")
    ref = hf_reference(build, plan, steps=3)
    assert_parity(run(hf_train, 2, build, plan, 3, timeout_s=180), ref)
