"""What plan(), estimate() and the what-if helpers take, and what they refuse: the same
checks and defaults on every path, and configurations the runtime could not run."""

import pytest
import torch

import autopar
from autopar import ConfigError, Recompute
from autopar.graph import extract
from autopar.models import GPT, GPTConfig, build_named_model
from autopar.present.whatif import fewest_nodes
from autopar.runtime.api import check_plan
from autopar.search.plan_inputs import MAX_GLOBAL_BATCH


def test_sequence_parallelism_is_refused_where_no_layer_is_split():
    """A tiny transformers Llama at tp=2 runs fastest with every layer replicated: pinned
    to sequence parallelism, nothing gathers the sharded sequence back, and the plan the
    search emitted failed at its first step (a residual add of 32 tokens to 64). It is
    refused in one line (an estimate of it says so in a note); without the pin the plan
    replicates and does not shard."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    cluster = autopar.preset("local-cpu", devices_per_node=2)  # nominal rates: the same on any machine of 2+ cores
    plan = autopar.plan(model, cluster, global_batch_size=8, seq_len=64, constraints={"tp": 2})
    assert not plan.layer_strategies.tp and not plan.config.sequence_parallel
    with pytest.raises(ConfigError, match=r"^sequence_parallel=True with tp=2 is not allowed for LlamaForCausalLM: "):
        autopar.plan(model, cluster, global_batch_size=8, seq_len=64, constraints={"tp": 2, "sequence_parallel": True})
    # an estimate prices what it is given, and says the runtime cannot run it
    priced = autopar.estimate(model, cluster, {"tp": 2, "sequence_parallel": True}, global_batch_size=8, seq_len=64)
    assert any(n.startswith("sequence_parallel=True with tp=2 is not allowed") for n in priced.notes)
    # and the runtime refuses it before any rank starts (autopar run, parallelize), as the search does; it
    # failed in the first forward's residual add
    with pytest.raises(ConfigError, match=r"^sequence_parallel=True with tp=2 is not allowed for LlamaForCausalLM: "):
        check_plan(priced)


def test_fewest_nodes_checks_and_defaults_the_model_as_plan_does():
    """fewest_nodes extracted the graph itself: a sequence longer than the model's
    positions was planned where plan() refuses it, and a token model without seq_len was
    refused where plan() takes its longest length with a warning."""
    model = GPT(GPTConfig(vocab_size=256, seq_len=256, dim=64, n_layers=2, n_heads=2))
    cluster = autopar.preset("dgx-h100")
    with pytest.raises(ConfigError, match=r"seq_len=512") as plain:
        autopar.plan(model, cluster.with_nodes(1), global_batch_size=8, seq_len=512)
    with pytest.raises(ConfigError) as fewest:
        fewest_nodes(model, cluster, global_batch_size=8, seq_len=512)
    assert str(fewest.value) == str(plain.value)
    with pytest.warns(UserWarning, match="256"):
        assert fewest_nodes(model, cluster, global_batch_size=8).model.seq_len == 256


def test_a_layer_graph_prices_the_length_it_was_extracted_at_only():
    """A graph extracted at 128 tokens and planned with seq_len=512 was priced at 128,
    without a word."""
    graph = extract(GPT(GPTConfig(vocab_size=256, seq_len=512, dim=64, n_layers=2, n_heads=2)), seq_len=128)
    cluster = autopar.preset("dgx-h100", nodes=1)
    assert autopar.plan(graph, cluster, global_batch_size=8, seq_len=128).model.seq_len == 128
    with pytest.raises(ConfigError, match=r"^seq_len=512 is not allowed with a LayerGraph: .* extracted at 128 tokens"):
        autopar.plan(graph, cluster, global_batch_size=8, seq_len=512)
    with pytest.raises(ConfigError, match=r"^sample_input= is not allowed with a LayerGraph"):
        autopar.estimate(graph, cluster, {"tp": 1}, global_batch_size=8, sample_input=torch.zeros(8, 128).long())


def test_numpy_integers_are_integers():
    """A batch and length from numpy (a sweep over np.arange) plan as the ints they are,
    and the plan file holds plain ints; they were refused as "not a positive integer"."""
    np = pytest.importorskip("numpy")
    model = GPT(GPTConfig(vocab_size=256, seq_len=256, dim=64, n_layers=2, n_heads=2))
    plan = autopar.plan(model, "dgx-h100:1", global_batch_size=np.int64(64), seq_len=np.int32(128))
    assert (plan.model.global_batch_size, plan.model.seq_len) == (64, 128)
    assert autopar.Plan.from_json(plan.to_json()) == plan


def test_out_of_memory_alternatives_carry_the_recomputation_they_were_sized_with():
    """An alternative that does not fit is sized at its most frugal: with full
    recomputation where the search may choose it, with the pinned mode where it may not.
    Its config said recompute=none beside a reason saying full recomputation, and a
    plan pinned to none was sized with full recomputation all the same."""
    model = build_named_model("gpt3-13b")
    cluster = autopar.preset("dgx-a100-40gb", nodes=1)
    for pins, mode, words in (
        (None, Recompute.FULL, "full recomputation"),
        ({"recompute": "none"}, Recompute.NONE, "recompute='none'"),
    ):
        plan = autopar.plan(model, cluster, global_batch_size=64, seq_len=2048, constraints=pins)
        oom = [a for a in plan.alternatives if a.status == "out-of-memory"]
        assert oom, pins
        for a in oom:
            assert a.config.recompute is mode and f"even with {words} (" in a.reason, (pins, a.reason)


def test_a_batch_past_a_million_samples_is_refused_in_one_line():
    """10 million samples per step (tokens given as samples, or an exponent) built an
    interleaved pipeline's schedule for 67 s and 8.4 GB; 10**30 was planned at "step
    3946759259259259060224 d". Both are refused, by plan and estimate alike, and the
    bound itself plans."""
    model = GPT(GPTConfig(vocab_size=128, seq_len=32, dim=64, n_layers=2, n_heads=2))
    for batch in (MAX_GLOBAL_BATCH + 1, 10**30):
        with pytest.raises(ConfigError, match=rf"^global_batch_size={batch:,} is not allowed: .* at most 1,048,576"):
            autopar.plan(model, "dgx-h100:1", global_batch_size=batch, seq_len=32)
        with pytest.raises(ConfigError, match=r"give the batch in samples, not tokens\.$"):
            autopar.estimate(model, "dgx-h100:1", {"dp": 8}, global_batch_size=batch, seq_len=32)
    assert autopar.plan(model, "dgx-h100:1", global_batch_size=MAX_GLOBAL_BATCH, seq_len=32).prediction.fits
