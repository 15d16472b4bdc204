"""Context parallelism in the vocabulary and the cost model: a ``cp`` axis that splits
each sequence, whose ranks hold the same weights and exchange keys and values."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import autopar
from autopar.cost.comm import GroupSpan
from autopar.cost.context_parallel import ring_exchange
from autopar.cost.data_parallel import replicate_span, shard_span, unhidden_floor_s
from autopar.cost.memory import config_state_bytes
from autopar.cost.model import CostModel, tp_context
from autopar.errors import ConfigError
from autopar.graph import extract
from autopar.models import GPT, GPTConfig, MLPConfig, MLPStack
from autopar.plan import ParallelConfig, Plan
from autopar.search.constraints import check_constraints
from autopar.search.context_degrees import CP_MIN_TOKENS, check_context_parallel, cp_degrees
from autopar.search.solve import ConfigSolver
from autopar.search.space import enumerate_space
from autopar.vocab import Optimizer, Recompute

from .exact_reference import search_and_brute_force, tiny_cluster


def _config(**kw) -> ParallelConfig:
    base = dict(dp=2, tp=2, pp=2, micro_batch_size=1, num_microbatches=4)
    return ParallelConfig(**{**base, **kw})


def test_cp_multiplies_the_world_and_the_gradient_group_but_not_the_batch():
    c = _config(cp=4, zero_stage=3)
    assert c.world_size == 2 * 4 * 2 * 2
    assert c.dp_cp == 8 and c.state_shards == 8
    assert c.global_batch_size == 2 * 1 * 4
    assert "pp=2 cp=4 " in c.short()
    plain = _config(zero_stage=3)
    assert plain.dp_cp == 2 and plain.state_shards == 2 and "cp=" not in plain.short()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(cp=0), "cp=0 is not allowed: it must be a positive integer"),
        (dict(cp=2.0), "cp=2.0 is not allowed"),
    ],
)
def test_bad_context_parallel_degrees_are_refused_in_one_line(kwargs, message):
    with pytest.raises(ConfigError, match=message) as info:
        _config(**kwargs)
    assert "\n" not in str(info.value)


# ---- the cost model ----------------------------------------------------------------


def _tiny_gpt_graph(seq_len: int):
    return extract(
        GPT(GPTConfig(vocab_size=512, seq_len=seq_len, dim=128, n_layers=2, n_heads=4)),
        seq_len=seq_len,
        dtype="bf16",
    )


@pytest.fixture(scope="module")
def model() -> CostModel:
    cluster = dataclasses.replace(tiny_cluster(64.0), nodes=2)
    return CostModel(graph=_tiny_gpt_graph(4096), cluster=cluster, optimizer=Optimizer.ADAM, global_batch_size=8)


def _block_option(model: CostModel, **kw):
    """The fastest no-recompute option of the first block under ``_config(**kw)``."""
    config = _config(**kw)
    solver = ConfigSolver(model=model, budget_bytes=1e18, micro_batches=(1, 2))
    return min(solver.options(1, config, (Recompute.NONE,)), key=lambda o: o.time_s), tp_context(model, 1, config)


def test_the_graph_records_the_keys_and_values_each_attention_core_reads(model):
    """Per sample: K and V of 4 heads x 32 dims x 4096 tokens in bf16, per block."""
    block = model.graph.profile_of(1)
    assert block.kv_bytes == 2 * 4096 * 128 * 2
    assert model.graph.profile_of(0).kv_bytes == 0  # the embeddings run no attention


def test_a_context_parallel_rank_prices_its_share_of_each_sample(model):
    """cp=2 with two samples per micro-batch is, per rank, one sample's worth of tokens:
    the same compute (attention included: load-balanced ring attention gives each rank
    half of it), the same activations and keys/values; only the exchange is added."""
    with_cp, ctx = _block_option(model, dp=1, tp=2, pp=1, cp=2, micro_batch_size=2, num_microbatches=1)
    without, _ = _block_option(model, dp=1, tp=2, pp=1, cp=1, micro_batch_size=1, num_microbatches=1)
    a, b = with_cp.layout, without.layout
    assert a.styles == b.styles
    assert a.fwd_compute_s == pytest.approx(b.fwd_compute_s, rel=1e-12)
    assert a.attn_fwd_s == pytest.approx(b.attn_fwd_s, rel=1e-12)
    assert a.saved_bytes + a.attn_saved_bytes == pytest.approx(b.saved_bytes + b.attn_saved_bytes, rel=1e-12)
    assert a.kv_bytes == b.kv_bytes == 2 * 4096 * 128 * 2 / 2  # one sample, heads split by tp=2
    ring = ring_exchange(a.kv_bytes, a.attn_fwd_s, ctx)
    assert without.cp_comm_s == 0 and with_cp.cp_comm_s == pytest.approx(ring.fwd_s + ring.bwd_s, rel=1e-12)
    assert with_cp.time_s == pytest.approx(without.time_s + ring.fwd_s + ring.bwd_s, rel=1e-12)


def test_the_ring_exchange_matches_a_hand_calculation(model):
    """Two ranks of a node (50 GB/s, 5 us): the forward all-gathers both ranks' K/V
    (each receives the other's ``kv``), hidden by the first block of attention; the
    backward repeats it and shifts fp32 K/V gradients (twice the bf16 bytes) once per
    block, the last shift exposed."""
    _, ctx = _block_option(model, dp=1, tp=2, pp=1, cp=2, micro_batch_size=1, num_microbatches=1)
    assert (ctx.cp, ctx.cp_span.size, ctx.cp_span.nodes) == (2, 2, 1)
    kv, bw, alpha = 8e6, 50e9, 5e-6
    gather = kv / bw + alpha  # (n-1)/n of the 2 kv gathered, one ring step
    shift = 2 * kv / bw + alpha
    exposed = ring_exchange(kv, 0.0, ctx)  # no attention time to hide anything
    assert exposed.fwd_s == pytest.approx(gather, rel=1e-12)
    assert exposed.bwd_s == pytest.approx(gather + 2 * shift, rel=1e-12)
    assert exposed.transient_bytes == pytest.approx(kv + 2 * 2 * kv, rel=1e-12)
    attn = 2 * (gather + shift)  # each block's forward outlasts the gather; its backward the shift
    hidden = ring_exchange(kv, attn, ctx)
    assert hidden.fwd_s == 0 and hidden.bwd_s == pytest.approx(shift, rel=1e-12)
    assert ring_exchange(kv, attn, dataclasses.replace(ctx, cp=1)).bwd_s == 0


def test_model_states_and_their_collectives_span_dp_times_cp(model):
    """Context-parallel ranks hold the same weights: ZeRO shards state over dp x cp, and
    the tail's collectives run over that group, as with dp alone of the same size."""
    both = _config(dp=2, cp=2, tp=1, pp=2, zero_stage=1)
    dp_only = _config(dp=4, cp=1, tp=1, pp=2, zero_stage=1)
    for zero in (1, 2, 3):
        a = config_state_bytes(dataclasses.replace(both, zero_stage=zero), Optimizer.ADAM, param_numel=1e6)
        b = config_state_bytes(dataclasses.replace(dp_only, zero_stage=zero), Optimizer.ADAM, param_numel=1e6)
        assert a == b
    assert unhidden_floor_s(model, both, 1e6) == pytest.approx(unhidden_floor_s(model, dp_only, 1e6), rel=1e-12)


# ---- the search ------------------------------------------------------------------


@pytest.fixture(scope="module")
def long_graph():
    """A tiny GPT at twice the floor (8K tokens): enough for cp=2 (4K tokens per rank), not for cp=4."""
    return _tiny_gpt_graph(2 * CP_MIN_TOKENS)


def test_cp_is_searched_only_where_each_rank_keeps_enough_tokens(model, long_graph):
    assert cp_degrees(long_graph, 8, {}) == [1, 2]
    assert cp_degrees(model.graph, 8, {}) == [1]  # 4K tokens: tensor and pipeline parallelism hold it
    assert cp_degrees(model.graph, 8, {"cp": 4}) == [4]  # a fixed degree is honoured
    mlp = extract(MLPStack(MLPConfig(in_dim=64, dim=64, ffn_dim=128, n_layers=2)), sample_input=torch.zeros(4, 64))
    assert cp_degrees(mlp, 8, {}) == [1]  # no attention core to ring


def test_a_fixed_cp_is_checked_at_once(model):
    with pytest.raises(
        ConfigError, match="cp=3 is not allowed with seq_len=4096: head-tail load balancing splits each sequence"
    ) as info:
        enumerate_space(model.graph, model.cluster, 8, check_constraints({"cp": 3}))
    assert "\n" not in str(info.value)


def test_cp_on_a_model_without_sdpa_is_refused_in_one_line():
    mlp = extract(MLPStack(MLPConfig(in_dim=64, dim=64, ffn_dim=128, n_layers=2)), sample_input=torch.zeros(4, 64))
    with pytest.raises(ConfigError, match="cp=2 is not allowed for MLPStack: context parallelism replaces"):
        check_context_parallel(mlp, {"cp": 2}, 8)


def test_context_parallel_ranks_alone_shard_the_model_states(long_graph):
    """One sample per step on 4 devices: no data parallelism, but a cp=2 ring holds the
    same weights on 2 ranks, so every ZeRO stage is offered there (FSDP2 over the ring,
    as the runtime applies it); without cp there is nothing to shard over. The space
    offered ZeRO-0 alone wherever dp was 1, and a long-context job on one node whose
    tp x cp filled it lost its sharded plans (Llama 3.1 8B at 128K on 8 H100: 116 s at
    ZeRO-0 for 91 s at ZeRO-3, and with cp=8 fixed "no plan fits")."""
    configs, _ = enumerate_space(long_graph, tiny_cluster(1.0), 1, check_constraints({"micro_batch_size": 1}))
    assert {c.dp for c in configs} == {1}
    assert {c.zero_stage for c in configs if c.cp == 2} == {0, 1, 2, 3}
    assert {c.zero_stage for c in configs if c.cp == 1} == {0}


@pytest.mark.parametrize("memory_gib, winner_cp", [(0.025, None), (0.05, 2), (0.1, 1)])
def test_whole_search_with_context_parallel_candidates_matches_brute_force(long_graph, memory_gib, winner_cp):
    """One node of 4 at 8K tokens: cp=2 and cp=1 candidates, every dp x tp x pp and
    ZeRO stage, searched through the same cost model as a brute force over every
    configuration, split and per-unit option. With little memory nothing fits; with a
    little more only splitting the sequence does (cp=2 wins); with enough, data
    parallelism without the exchange is faster."""
    cluster = tiny_cluster(memory_gib)
    constraints = {"micro_batch_size": 1, "sequence_parallel": False}
    configs, _ = enumerate_space(long_graph, cluster, 4, check_constraints(constraints))
    assert {c.cp for c in configs} == {1, 2}
    result, want = search_and_brute_force(long_graph, cluster, constraints, global_batch_size=4, micro_batch_size=1)
    assert result.best.fits == (not math.isinf(want)) == (winner_cp is not None)
    if result.best.fits:
        assert result.best.step_time_s == pytest.approx(want, rel=1e-9)
        assert result.best.config.cp == winner_cp


def test_a_context_parallel_plan_is_explained_and_round_trips(long_graph):
    """Where only splitting the sequence fits, the plan says so: its degrees and mesh,
    the exchange's exposed time in the step's terms, and the tokens per rank."""
    plan = autopar.plan(
        long_graph,
        tiny_cluster(0.05),
        global_batch_size=4,
        constraints={"micro_batch_size": 1, "sequence_parallel": False},
    )
    c, b = plan.config, plan.prediction.breakdown
    assert c.cp == 2 and b.cp_comm_s > 0
    assert b.total_s == pytest.approx(plan.prediction.step_time_s, rel=1e-9)
    text = autopar.explain(plan)
    assert f"dp={c.dp} x cp=2 x tp={c.tp} x pp={c.pp} (mesh pp, dp, cp, tp)" in text
    assert "Context par.   cp=2: each sample's 8,192 tokens in 2 shards of 4,096 (head-tail balanced)" in text
    assert "| CP comm " in text
    assert Plan.from_json(plan.to_json()) == plan


def test_hsdp_shard_groups_hold_whole_context_parallel_rings():
    """dp=4 in shard groups of 2, cp=2, tp=2 on nodes of 8: a shard group is 2 x 2 = 4
    ranks 2 apart (one node), the two replicate groups' ranks are 2 x 4 = 8 apart (two
    nodes); the states shard over 4."""
    c = _config(dp=4, cp=2, tp=2, pp=1, zero_stage=3, dp_shard=2)
    assert (c.state_shards, c.replicate_size, c.world_size) == (4, 2, 16)
    assert shard_span(c, 8) == GroupSpan(size=4, per_node=4, nodes=1)
    assert replicate_span(c, 8) == GroupSpan(size=2, per_node=1, nodes=2)
    plain = config_state_bytes(
        _config(dp=4, cp=1, tp=2, pp=1, zero_stage=3, dp_shard=4), Optimizer.ADAM, param_numel=1e6
    )
    assert config_state_bytes(c, Optimizer.ADAM, param_numel=1e6) == plain  # 4 shards either way


def test_hsdp_candidates_with_cp_cover_whole_nodes(long_graph):
    """On two nodes of 4 with tp=1 and cp=2, HSDP shard groups of 2 data-parallel ranks
    cover one node (2 x cp 2 = 4 devices) and are candidates beside plain FSDP."""
    cluster = dataclasses.replace(tiny_cluster(1.0), nodes=2)
    fixed = check_constraints({"tp": 1, "cp": 2, "pp": 1, "zero_stage": 3, "micro_batch_size": 1})
    configs, _ = enumerate_space(long_graph, cluster, 8, fixed)
    assert {(c.dp, c.dp_shard) for c in configs} == {(4, None), (4, 2)}


@pytest.mark.parametrize(
    ("window", "ring"), [(4096, False), (16384, False), (32768, True)], ids=["narrower", "equal", "wider"]
)
def test_a_sliding_window_narrower_than_the_sequence_is_not_offered_a_ring(window, ring):
    """A transformers Mistral whose sliding window is no wider than the 16K-token
    sequence builds an attention mask (one as wide masks nothing but the future, yet
    transformers passes it), which the causal ring cannot compute: the trace sees it,
    the search offers no cp and a fixed one is refused in one line, with that reason
    (the runtime refused such plans only at launch; the reason said "narrower than the
    sequence" for a window equal to it). With a window wider than the sequence it is
    plain causal attention, and cp=2 is offered and accepted."""
    transformers = pytest.importorskip("transformers")
    config = transformers.MistralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16384, sliding_window=window, use_cache=False,
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.MistralForCausalLM(config)
    graph = extract(model, seq_len=16384)
    assert graph.ring_attention is ring
    assert (2 in cp_degrees(graph, 8, {})) is ring
    if ring:
        check_context_parallel(graph, {"cp": 2}, 8)
    else:
        with pytest.raises(ConfigError, match=r"cp=2 is not allowed for MistralForCausalLM at seq_len=16384") as err:
            check_context_parallel(graph, {"cp": 2}, 8)
        assert "a sliding window, for which transformers passes a mask unless the window is wider" in str(err.value)


@pytest.mark.parametrize("memory_gib, nodes, cp", [(0.3, 2, 4), (0.2, 4, 8)])
def test_a_sequence_too_long_for_the_node_is_offered_the_nodes_a_wider_ring_needs(memory_gib, nodes, cp):
    """A 64K-token GPT whose activations alone overflow a device at the ring one node
    holds: the refusal offered only a shorter sequence (its node estimate kept the
    activations beside the states as they are, and they alone overflow), where a wider
    ring shrinks them. It names a count and a configuration there that fits with a
    wider ring, and planned on those nodes, it fits."""
    model = GPT(GPTConfig(vocab_size=256, seq_len=65536, dim=256, n_layers=4, n_heads=2))
    cluster = tiny_cluster(memory_gib)
    with pytest.raises(autopar.InfeasiblePlanError) as err:
        autopar.plan(model, cluster, global_batch_size=4, seq_len=65536)
    assert f"Try {nodes} nodes (dp=1 tp=2 pp=1 cp={cp} " in str(err.value), str(err.value)
    plan = autopar.plan(model, dataclasses.replace(cluster, nodes=nodes), global_batch_size=4, seq_len=65536)
    assert plan.prediction.fits and plan.config.cp >= cp


def test_a_plan_says_which_context_parallel_degrees_it_did_not_search():
    """4K tokens on 4 devices: cp=2 and cp=4 split the sequence but leave each rank
    fewer than CP_MIN_TOKENS, so the search skips them; the plan says so and how to
    price one, and fixing it prices it; only degrees the fixed ones leave room for are
    named. Nothing is said where cp is fixed, where the sequence is shorter than the
    floor, or where ring attention cannot run the model (a sliding window narrower than
    the sequence)."""
    model = GPT(GPTConfig(vocab_size=256, seq_len=4096, dim=64, n_layers=2, n_heads=2))
    cluster = tiny_cluster(1.0)
    plan = autopar.plan(model, cluster, global_batch_size=8, seq_len=4096)
    assert 4096 // 2 < CP_MIN_TOKENS and plan.config.cp == 1
    (note,) = [n for n in plan.notes if n.startswith("Context parallelism was searched only")]
    assert f"at least {CP_MIN_TOKENS:,} tokens" in note
    assert "cp=2, 4 would also split these 4,096 tokens: fix one (constraints={'cp': 2}, --set cp=2)" in note
    pinned = autopar.plan(model, cluster, global_batch_size=8, seq_len=4096, constraints={"cp": 2})
    assert pinned.config.cp == 2 and not any(n.startswith("Context parallelism was") for n in pinned.notes)
    # tp=2 fixed leaves 2 of the 4 devices: only cp=2 could run (it listed cp=4, which cannot)
    (note,) = [
        n
        for n in autopar.plan(model, cluster, global_batch_size=8, seq_len=4096, constraints={"tp": 2}).notes
        if n.startswith("Context parallelism was")
    ]
    assert "cp=2 would also split these 4,096 tokens" in note
    # a sequence shorter than the floor itself: nothing to say (it was said of every 2K plan)
    short = GPT(GPTConfig(vocab_size=256, seq_len=2048, dim=64, n_layers=2, n_heads=2))
    assert not any(
        n.startswith("Context parallelism was")
        for n in autopar.plan(short, cluster, global_batch_size=8, seq_len=2048).notes
    )
    transformers = pytest.importorskip("transformers")
    config = transformers.MistralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=4096, sliding_window=1024, use_cache=False,
    )  # fmt: skip
    with torch.device("meta"):
        windowed = autopar.plan(transformers.MistralForCausalLM(config), cluster, global_batch_size=8, seq_len=4096)
    assert not any(n.startswith("Context parallelism was") for n in windowed.notes)
