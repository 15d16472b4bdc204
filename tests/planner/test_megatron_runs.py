"""A plan priced for Megatron-LM's kernels (``activations="sequence-first"``) is one to run
in Megatron-LM, so the search offers only what Megatron-LM runs: no zero-bubble schedule
(it has 1F1B and interleaved 1F1B) and no ZeRO-3 under a pipeline (Megatron-FSDP does not
pipeline). Fixed, they are refused in one line; searched, they are left out and nothing
else is."""

from __future__ import annotations

import pytest

import autopar
from autopar.errors import ConfigError
from autopar.export import export
from autopar.graph import extract
from autopar.models import build_named_model
from autopar.search.constraints import check_constraints
from autopar.search.space import enumerate_space
from autopar.vocab import Recompute


def _megatron_runs(config) -> bool:
    return not config.schedule.zero_bubble and not (config.zero_stage == 3 and config.pp > 1)


def test_the_space_priced_for_megatron_is_the_rest_of_the_space():
    """GPT-2 small on 16 H100: the batch-first space holds zero-bubble schedules and
    pipelined ZeRO-3 (else this test proves nothing); the sequence-first space is the
    batch-first one without exactly those."""
    graph = extract(build_named_model("gpt2-small"), seq_len=1024)
    cluster = autopar.preset("dgx-h100", nodes=2)
    fixed = check_constraints({"tp": 1, "recompute": "none"})
    everything, _ = enumerate_space(graph, cluster, 64, fixed)
    megatron, _ = enumerate_space(graph, cluster, 64, fixed, megatron_kernels=True)
    assert any(c.schedule.zero_bubble for c in everything)
    assert any(c.zero_stage == 3 and c.pp > 1 for c in everything)
    assert set(megatron) == {c for c in everything if _megatron_runs(c)}


def test_a_plan_priced_for_megatron_runs_there():
    """Llama 2 7B on 16 H100 in eager blocks, 32 sequences over 4 pipeline stages: priced
    for autopar's runtime the search picks interleaved zero-bubble; priced for Megatron-LM
    neither the plan nor any configuration it names is one Megatron-LM lacks, and its
    export to Megatron-LM notes no schedule or ZeRO stage written otherwise."""
    kw = dict(global_batch_size=32, seq_len=4096, constraints={"pp": 4, "compile": False, "fp8": False})
    model = build_named_model("llama2-7b")
    assert autopar.plan(model, "dgx-h100:2", **kw).config.schedule.zero_bubble
    plan = autopar.plan(model, "dgx-h100:2", activations="sequence-first", **kw)
    assert _megatron_runs(plan.config)
    assert all(_megatron_runs(alt.config) for alt in plan.alternatives)
    notes = export(plan, to="megatron").notes
    assert not any("zero-bubble" in n or "ZeRO" in n for n in notes), notes


@pytest.mark.parametrize(
    ("fixed", "said"),
    [
        ({"pp": 2, "schedule": "zbv", "virtual_stages": 2}, "schedule='zbv' is not allowed with activations="),
        ({"pp": 2, "schedule": "interleaved-zb"}, "no zero-bubble schedule; use schedule='1f1b'"),
        ({"pp": 2, "zero_stage": 3}, "zero_stage=3 with pp=2 is not allowed with activations='sequence-first'"),
    ],
)
@pytest.mark.parametrize("entry", ["plan", "estimate"])
def test_what_megatron_cannot_run_is_refused_when_fixed(fixed, said, entry):
    """Llama 2 7B (untied weights, which a V-shaped schedule needs) on 16 H100."""
    model = build_named_model("llama2-7b")
    kw = dict(global_batch_size=64, seq_len=1024, activations="sequence-first")
    with pytest.raises(ConfigError, match=said) as err:
        if entry == "plan":
            autopar.plan(model, "dgx-h100:2", constraints=fixed, **kw)
        else:
            autopar.estimate(model, "dgx-h100:2", {"tp": 1, "dp": 8, **fixed}, **kw)
    assert "\n" not in str(err.value)
    # the same choices priced for autopar's runtime are taken
    if entry == "estimate" and fixed.get("zero_stage") != 3:
        autopar.estimate(model, "dgx-h100:2", {"tp": 1, "dp": 8, **fixed}, global_batch_size=64, seq_len=1024)


def test_megatron_sequence_parallelism_keeps_the_shards_of_its_gathers():
    """Megatron-LM's sequence-parallel layers save their input shard and gather it again
    in the backward: a plan priced for them does so wherever it is sequence-parallel
    (searched: every candidate; estimated: by default), and holding the gathers is
    refused. Priced for autopar's runtime, the search tries both."""
    graph = extract(build_named_model("llama2-7b"), seq_len=4096)
    cluster = autopar.preset("dgx-h100", nodes=2)
    fixed = check_constraints({"pp": 2, "compile": False, "tp": 4, "micro_batch_size": 1})
    everything, _ = enumerate_space(graph, cluster, 32, fixed)
    megatron, _ = enumerate_space(graph, cluster, 32, fixed, megatron_kernels=True)
    assert {c.regather for c in everything if c.sequence_parallel} == {False, True}
    assert all(c.regather == c.sequence_parallel for c in megatron)
    assert set(megatron) == {c for c in everything if _megatron_runs(c) and c.regather == c.sequence_parallel}
    model = build_named_model("llama2-7b")
    kw = dict(global_batch_size=32, seq_len=4096)
    config = {"tp": 4, "pp": 2, "sequence_parallel": True}
    assert autopar.estimate(model, "dgx-h100:2", config, activations="sequence-first", **kw).config.regather
    assert not autopar.estimate(model, "dgx-h100:2", config, **kw).config.regather
    with pytest.raises(ConfigError, match="regather=False with sequence_parallel=True is not allowed with activ"):
        autopar.estimate(model, "dgx-h100:2", {**config, "regather": False}, activations="sequence-first", **kw)


def test_no_unit_recomputes_per_operator_for_megatron():
    """Llama 2 7B on 8 H100, eager, micro-batches of 8 at tp=2: priced for autopar's
    runtime some units recompute per operator (torchtitan's selective recomputation);
    priced for Megatron-LM, which has none, no unit does, and fixing it is refused."""
    model = build_named_model("llama2-7b")
    kw = dict(global_batch_size=64, seq_len=4096)
    fixed = {"compile": False, "fp8": False, "tp": 2, "pp": 1, "micro_batch_size": 8}

    def modes(plan):
        return {plan.config.recompute, *plan.layer_strategies.recompute.values()}

    assert Recompute.OP in modes(autopar.plan(model, "dgx-h100:1", constraints=fixed, **kw))
    assert Recompute.OP not in modes(
        autopar.plan(model, "dgx-h100:1", constraints=fixed, activations="sequence-first", **kw)
    )
    with pytest.raises(ConfigError, match="recompute='op' is not allowed with activations='sequence-first'"):
        autopar.plan(model, "dgx-h100:1", constraints={**fixed, "recompute": "op"}, activations="sequence-first", **kw)
