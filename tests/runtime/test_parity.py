"""Parity: a parallel run's losses and parameters after 5 SGD steps equal a
single-process run of the same model, data and seed (tolerances in parity.py)."""

import pytest
from parity import LLAMA_CFG, assert_parity, make_plan, megatron_styles, reference, run, train

pytestmark = pytest.mark.multiprocess

CASES = {
    # one axis
    "dp2": dict(dp=2),
    "tp2": dict(tp=2, tp_styles=True),
    "pp2": dict(pp=2),
    # pairs
    "dp2-tp2": dict(dp=2, tp=2, tp_styles=True),
    "dp2-pp2": dict(dp=2, pp=2),
    "tp2-pp2-sp": dict(tp=2, pp=2, tp_styles=True, sequence_parallel=True),
}


def _plan(name, spec):
    spec = dict(spec)
    styles = (
        megatron_styles(name, sequence_parallel=spec.get("sequence_parallel", False))
        if spec.pop("tp_styles", False)
        else None
    )
    return make_plan(name, styles=styles, **spec)


@pytest.mark.parametrize("case", sorted(CASES))
def test_gpt(case):
    plan = _plan("gpt", CASES[case])
    assert_parity(run(train, plan.config.world_size, "gpt", plan), reference("gpt", plan))


@pytest.mark.parametrize("case", ["dp2-tp2", "tp2-pp2-sp"])
def test_llama(case):
    plan = _plan("llama", CASES[case])
    assert_parity(run(train, plan.config.world_size, "llama", plan), reference("llama", plan))


@pytest.mark.parametrize("case", ["dp2", "pp2", "tp2", "tp2-sp"])
def test_moe(case):
    """The mixture-of-experts Llama: routing is per sample, so data parallelism and
    micro-batches route every token as one process does; under tensor parallelism the
    planner leaves the router and the experts replicated and shards the attention."""
    cases = {**CASES, "tp2-sp": dict(tp=2, tp_styles=True, sequence_parallel=True)}
    plan = _plan("moe", cases[case])
    assert_parity(run(train, plan.config.world_size, "moe", plan), reference("moe", plan))


@pytest.mark.parametrize("case", ["tp2", "dp2-pp2"])
def test_mlp(case):
    plan = _plan("mlp", CASES[case])
    assert_parity(run(train, plan.config.world_size, "mlp", plan), reference("mlp", plan))


def test_gpt_3d_zero3_interleaved_sp():
    """The 2x2x2 mesh with everything on: FSDP2 (ZeRO-3), Megatron TP with sequence
    parallelism, interleaved 1F1B over 4 stages, tied embedding and head split across
    the first and last pipeline rank."""
    plan = make_plan(
        "gpt",
        dp=2,
        tp=2,
        pp=2,
        zero_stage=3,
        schedule="interleaved-1f1b",
        virtual_stages=2,
        num_microbatches=2,
        sequence_parallel=True,
        styles=megatron_styles("gpt", sequence_parallel=True),
    )
    assert_parity(run(train, 8, "gpt", plan, timeout_s=120), reference("gpt", plan))


@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["sp", "no-sp"])
def test_row_parallel_keys_and_values_beside_column_parallel_queries(sequence_parallel):
    """k and v row-parallel (their outputs reduced into head shards) beside a
    column-parallel q: the planner's layout for Llama-3-405B on 2048 H100 at tp=4, whose
    8 key/value heads make k and v small. With sequence parallelism the three need the
    attention's sequence-sharded input in two layouts; its dry run failed in ``wo`` until
    that input was gathered at the attention module, where the model reads its sizes."""
    styles = megatron_styles("llama", sequence_parallel=sequence_parallel)
    for i in range(LLAMA_CFG.n_layers):
        styles[f"layers.{i}.attention.wk"] = styles[f"layers.{i}.attention.wv"] = "row"
    plan = make_plan("llama", tp=2, styles=styles, sequence_parallel=sequence_parallel)
    assert_parity(run(train, 2, "llama", plan), reference("llama", plan))


def test_vocabulary_that_does_not_divide():
    """67 vocabulary rows over tp=2: DTensor shards them 34 + 33 (Megatron-LM would pad
    to a multiple of 128 x tp); the vocabulary-parallel embedding, the column head and
    the loss run on uneven shards."""
    plan = make_plan("gpt-odd-vocab", tp=2, styles=megatron_styles("gpt-odd-vocab"))
    assert_parity(run(train, 2, "gpt-odd-vocab", plan), reference("gpt-odd-vocab", plan))


@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["sp", "no-sp"])
@pytest.mark.parametrize(
    "tok,pos", [("vocab", "vocab"), ("vocab", "replicate"), ("replicate", "vocab"), ("replicate", "replicate")]
)
def test_embedding_styles(tok, pos, sequence_parallel):
    """Every style the planner can give a GPT's two embeddings. The position table is
    looked up with ``arange(seq)``, so its output is ``(seq, dim)``, broadcast onto the
    ``(batch, seq, dim)`` token embeddings: sequence-sharded, it must split dim 0, not
    dim 1 (a vocab-parallel ``pos_embeddings`` with sequence parallelism once failed in
    ``GPT.forward`` with 'size of tensor a (256) must match ... b (64)' at dim 256, tp=4)."""
    styles = {
        **megatron_styles("gpt", sequence_parallel=sequence_parallel),
        "tok_embeddings": tok,
        "pos_embeddings": pos,
    }
    plan = make_plan("gpt", tp=2, styles=styles, sequence_parallel=sequence_parallel)
    assert_parity(run(train, 2, "gpt", plan), reference("gpt", plan))


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "interleaved-zb"])
def test_llama_interleaved_one_unit_per_stage(schedule):
    """An interleaved schedule with as many stages as units (pp=2 x v=3 for 6), as Llama 3
    405B split its pipeline: the first stage runs the embedding alone, the last the final
    norm, the head and the loss alone; under the zero-bubble schedule their backwards split
    in two as every other stage's."""
    plan = make_plan("llama", pp=2, schedule=schedule, virtual_stages=3)
    assert plan.stages[0] == ("tok_embeddings",)
    assert plan.stages[-1] == ("norm", "output")
    assert_parity(run(train, 2, "llama", plan), reference("llama", plan))
