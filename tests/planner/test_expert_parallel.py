"""Expert parallelism in the vocabulary, the layer graph, the cost model and the search:
an ``ep`` degree folded into the data- and context-parallel ranks that splits every
mixture-of-experts layer's experts, whose tokens travel by all-to-all."""

from __future__ import annotations

import dataclasses
import math

import pytest

import autopar
from autopar.cost.comm import GroupSpan, all_to_all_s
from autopar.cost.data_parallel import replicas_span, shard_span
from autopar.cost.expert_parallel import expert_exchange
from autopar.cost.memory import config_state_bytes
from autopar.cost.model import CostModel, tp_context
from autopar.errors import ConfigError
from autopar.graph import extract
from autopar.models import GPT, GPTConfig, MoEConfig, MoELlama
from autopar.plan import ParallelConfig, Plan
from autopar.search.constraints import check_constraints
from autopar.search.experts import check_expert_parallel, ep_degrees
from autopar.search.solve import ConfigSolver
from autopar.search.space import enumerate_space
from autopar.vocab import Optimizer, Recompute

from .exact_reference import search_and_brute_force, tiny_cluster
from .test_moe import _mixtral

# a tiny MoE Llama: hidden D, expert width F, E experts of which K per token, S tokens
D, F, E, K, S = 64, 512, 4, 2, 128
ROWS = E * math.ceil(S * K / E)  # capacity buffers: E experts x ceil(S K / E) slots per sample
EXPERT_NUMEL = 3 * E * D * F  # w1, w3 (E, D, F) and w2 (E, F, D)


def _config(**kw) -> ParallelConfig:
    base = dict(dp=4, tp=1, pp=1, micro_batch_size=1, num_microbatches=1)
    return ParallelConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def graph():
    cfg = MoEConfig(
        vocab_size=256, seq_len=S, dim=D, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=F, n_experts=E, top_k=K
    )
    return extract(MoELlama(cfg), seq_len=S, dtype="bf16")


@pytest.fixture(scope="module")
def model(graph) -> CostModel:
    return CostModel(graph=graph, cluster=tiny_cluster(64.0), optimizer=Optimizer.ADAM, global_batch_size=8)


def _block_option(model: CostModel, mode: Recompute = Recompute.NONE, **kw):
    """The first block's fastest option under ``_config(**kw)``, and its context."""
    config = _config(**kw)
    solver = ConfigSolver(model=model, budget_bytes=1e18, micro_batches=(1, 2))
    return min(solver.options(1, config, (mode,)), key=lambda o: o.time_s), tp_context(model, 1, config)


# ---- the vocabulary ----------------------------------------------------------------


def test_ep_is_folded_into_the_data_and_context_parallel_ranks():
    c = _config(dp=4, cp=2, tp=2, ep=4, zero_stage=3)
    assert c.world_size == 4 * 2 * 2 and c.dp_cp == 8
    assert (c.expert_replicas, c.expert_state_shards) == (2, 2)
    assert "cp=2 ep=4 " in c.short() and "ep=" not in _config().short()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(ep=0), "ep=0 is not allowed: it must be a positive integer"),
        (dict(dp=3, ep=2), r"ep=2 is not allowed with dp x cp = 3 x 1 = 3: .* use one of \[1, 3\]"),
        (dict(ep=4, dp_shard=2, zero_stage=3), "ep=4 is not allowed with HSDP's shard group of 2 ranks"),
    ],
)
def test_bad_expert_parallel_degrees_are_refused_in_one_line(kwargs, message):
    with pytest.raises(ConfigError, match=message) as info:
        _config(**kwargs)
    assert "\n" not in str(info.value)


# ---- the layer graph ---------------------------------------------------------------


def test_the_graph_finds_each_expert_stack_and_the_rows_it_routes(graph):
    """autopar's MoE: E stacked SwiGLU experts run by batched matmuls over capacity
    buffers, ROWS rows of D bf16 features per sample; the router is not an expert."""
    block = graph.profile_of(1)
    (leaf,) = [leaf for leaf in block.leaves if leaf.experts]
    assert (leaf.experts, leaf.expert_numel, block.experts) == (E, EXPERT_NUMEL, E)
    assert leaf.param_numel == EXPERT_NUMEL + E * D  # and the router's E x D
    assert leaf.expert_flops == 2 * ROWS * 3 * D * F
    assert leaf.routed_bytes == ROWS * D * 2
    assert not leaf.dropless
    assert graph.profile_of(0).experts == 0  # the embeddings


def test_a_transformers_mixtral_routes_top_k_rows_per_token_dropless():
    """transformers' experts run every routed row through grouped matmuls: seq x top-k
    rows of the hidden size per sample, and no buffer bounds the busiest expert."""
    from .test_moe import E as ME
    from .test_moe import H
    from .test_moe import K as MK

    g = extract(_mixtral(), seq_len=32, dtype="bf16")
    (leaf,) = [leaf for leaf in g.profile_of(1).leaves if leaf.experts]
    assert leaf.experts == ME and leaf.dropless
    assert leaf.routed_bytes == 32 * MK * H * 2


# ---- the cost model ----------------------------------------------------------------


def test_an_expert_parallel_rank_holds_half_the_experts_and_pays_four_all_to_alls(model):
    """ep=2 on two ranks of a node (50 GB/s, 5 us): the block holds half of the stack,
    and each micro-batch sends its routed rows four times: half of them leave the rank,
    one latency each."""
    with_ep, ctx = _block_option(model, ep=2)
    without, _ = _block_option(model, ep=1)
    assert ctx.ep_span == GroupSpan(size=2, per_node=2, nodes=1)
    assert without.layout.param_numel - with_ep.layout.param_numel == EXPERT_NUMEL / 2
    assert with_ep.layout.expert_numel == EXPERT_NUMEL / 2 and without.layout.expert_numel == EXPERT_NUMEL
    one = ROWS * D * 2 / 2 / 50e9 + 5e-6
    assert all_to_all_s(ROWS * D * 2, ctx.ep_span, ctx.cluster) == pytest.approx(one, rel=1e-12)
    assert without.ep_comm_s == 0 and with_ep.ep_comm_s == pytest.approx(4 * one, rel=1e-12)
    assert with_ep.fwd_s == pytest.approx(with_ep.layout.fwd_s + 2 * one, rel=1e-12)
    full, _ = _block_option(model, Recompute.FULL, ep=2)
    lay = full.layout
    assert full.recompute_s == pytest.approx(lay.fwd_compute_s + lay.fwd_comm_s + 2 * one, rel=1e-12)


def test_dropless_experts_pace_at_the_routing_imbalance():
    """A skewed router: the busiest rank sends and computes 1.5 x the mean of the routed
    rows; fixed-capacity experts are balanced by construction. Before its dispatch a
    dropless layer exchanges its row counts (2 int64 per rank: one latency)."""
    g = extract(_mixtral(), seq_len=32, dtype="bf16")
    config = _config(dp=2, ep=2)
    skewed = CostModel(graph=g, cluster=tiny_cluster(64.0), optimizer=Optimizer.ADAM, global_batch_size=2)
    balanced = expert_exchange(g.profile_of(1), tp_context(skewed, 1, config))
    skew = expert_exchange(g.profile_of(1), tp_context(dataclasses.replace(skewed, routing_imbalance=1.5), 1, config))
    (leaf,) = [leaf for leaf in g.profile_of(1).leaves if leaf.experts]
    one = leaf.routed_bytes / 2 / 50e9
    counts = 8 * 2 / 2 / 50e9 + 5e-6
    assert balanced.fwd_s == pytest.approx(2 * (one + 5e-6) + counts, rel=1e-12)
    assert skew.fwd_s == pytest.approx(2 * (1.5 * one + 5e-6) + counts, rel=1e-12)
    assert skew.bwd_s == pytest.approx(2 * (1.5 * one + 5e-6), rel=1e-12)


def test_the_busiest_rank_keeps_its_skewed_rows_activations():
    """A skewed router: the busiest expert-parallel rank keeps the activations of 1.5 x
    the mean of the routed rows for backward, so a block's kept bytes grow by half of
    what its expert stack saves (the graph's measurement, per sample); without expert
    parallelism every rank runs its own rows, whatever the routing."""
    g = extract(_mixtral(), seq_len=32, dtype="bf16")
    (leaf,) = [leaf for leaf in g.profile_of(1).leaves if leaf.experts]
    assert leaf.dropless and leaf.saved_bytes > 0
    balanced = CostModel(graph=g, cluster=tiny_cluster(64.0), optimizer=Optimizer.ADAM, global_batch_size=2)
    skewed = dataclasses.replace(balanced, routing_imbalance=1.5)
    kept = {}
    for ep in (1, 2):
        for name, cost in (("balanced", balanced), ("skewed", skewed)):
            solver = ConfigSolver(model=cost, budget_bytes=1e18, micro_batches=(1,))
            options = solver.options(1, _config(dp=2, ep=ep), (Recompute.NONE,))
            kept[name, ep] = min(options, key=lambda o: o.time_s).act_bytes
    assert kept["skewed", 2] - kept["balanced", 2] == pytest.approx(0.5 * leaf.saved_bytes, rel=1e-9)
    assert kept["skewed", 1] == kept["balanced", 1]


def test_expert_state_shards_over_the_shard_group_and_reduces_over_expert_replicas():
    """dp=4, ep=2: a rank holds half the experts; ZeRO shards every expert's state over
    the 4 ranks as before (the two ep groups divide it), so sharded state is what ep=1
    holds, and only what a rank holds whole (its gathered or replicated copy) halves.
    Expert collectives run over the 2 ranks holding the same experts, 2 apart."""
    dense, experts = 1e6, 8e6
    for zero in (0, 1, 2, 3):
        one = config_state_bytes(_config(ep=1, zero_stage=zero), Optimizer.ADAM, param_numel=dense + experts)
        two = config_state_bytes(
            _config(ep=2, zero_stage=zero), Optimizer.ADAM, param_numel=dense + experts / 2, expert_numel=experts / 2
        )
        held = dense + experts / 2
        if zero == 0:
            assert two.optimizer_bytes == held * 8 and two.grads_bytes == held * 4
        else:
            assert two.optimizer_bytes == pytest.approx(one.optimizer_bytes, rel=1e-12)
        if zero >= 2:
            assert two.grads_bytes == pytest.approx(one.grads_bytes, rel=1e-12)
        if zero == 3:
            assert two.params_bytes == pytest.approx(one.params_bytes, rel=1e-12)  # fp32 master shards only
    c = _config(ep=2, zero_stage=3)
    assert shard_span(c, 4, experts=True) == replicas_span(c, 4, experts=True) == GroupSpan(size=2, per_node=2, nodes=1)
    assert shard_span(c, 4).size == replicas_span(c, 4).size == 4


# ---- the search --------------------------------------------------------------------


def test_ep_is_searched_where_it_divides_the_experts_and_the_shard_group(graph):
    assert ep_degrees(graph, 4, 4, {}) == [1, 2, 4]
    assert ep_degrees(graph, 8, 2, {}) == [1, 2]  # HSDP: inside a shard group of 2
    assert ep_degrees(graph, 6, 6, {}) == [1, 2]  # 4 experts: gcd(4, 6)
    assert ep_degrees(graph, 4, 4, {"ep": 2}) == [2] and ep_degrees(graph, 3, 3, {"ep": 2}) == []
    gpt = extract(GPT(GPTConfig(vocab_size=64, seq_len=16, dim=32, n_layers=1, n_heads=2)), seq_len=16)
    assert ep_degrees(gpt, 8, 8, {}) == [1]


def test_a_fixed_ep_is_checked_against_the_model_at_once(graph):
    gpt = extract(GPT(GPTConfig(vocab_size=64, seq_len=16, dim=32, n_layers=1, n_heads=2)), seq_len=16)
    with pytest.raises(ConfigError, match="ep=2 is not allowed for GPT: expert parallelism splits") as info:
        check_expert_parallel(gpt, {"ep": 2})
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match=r"its layers have 4 experts, which ep must divide; use one of \[1, 2, 4\]"):
        enumerate_space(graph, dataclasses.replace(tiny_cluster(1.0), nodes=2), 8, check_constraints({"ep": 8}))
    with pytest.raises(ConfigError, match="constraint ep=0 is not allowed"):
        check_constraints({"ep": 0})


@pytest.mark.parametrize("memory_gib, winner_ep", [(0.006, None), (0.01, 2), (1.0, 1)])
def test_whole_search_with_expert_parallel_candidates_matches_brute_force(graph, memory_gib, winner_ep):
    """One node of 4: ep 1, 2 and 4 beside every dp x tp x pp and ZeRO stage, searched
    through the same cost model as a brute force over every configuration, split and
    per-unit option. With little memory nothing fits; with a little more, splitting the
    experts fits where replicating them does not (ep=2 wins); with enough, no
    all-to-all is faster."""
    cluster = tiny_cluster(memory_gib)
    constraints = {"micro_batch_size": 1, "sequence_parallel": False}
    configs, _ = enumerate_space(graph, cluster, 4, check_constraints(constraints))
    assert {c.ep for c in configs} == {1, 2, 4}
    result, want = search_and_brute_force(graph, cluster, constraints, global_batch_size=4, micro_batch_size=1)
    assert result.best.fits == (not math.isinf(want)) == (winner_ep is not None)
    if result.best.fits:
        assert result.best.step_time_s == pytest.approx(want, rel=1e-9)
        assert result.best.config.ep == winner_ep


def test_an_expert_parallel_plan_is_explained_and_round_trips(graph):
    plan = autopar.plan(
        graph, tiny_cluster(0.01), global_batch_size=4, constraints={"micro_batch_size": 1, "sequence_parallel": False}
    )
    c, b = plan.config, plan.prediction.breakdown
    assert c.ep == 2 and b.ep_comm_s > 0
    assert b.total_s == pytest.approx(plan.prediction.step_time_s, rel=1e-9)
    text = autopar.explain(plan)
    assert f"dp={c.dp} x tp={c.tp} x pp={c.pp}, ep=2 (mesh pp, dp, tp; ep groups of 2 inside dp)" in text
    assert "Expert par.    ep=2: each mixture-of-experts layer's experts split over 2 of the 2 ranks" in text
    assert "| EP comm " in text
    assert Plan.from_json(plan.to_json()) == plan


def test_the_plan_of_a_model_without_experts_never_names_ep():
    gpt = extract(GPT(GPTConfig(vocab_size=64, seq_len=16, dim=32, n_layers=1, n_heads=2)), seq_len=16)
    plan = autopar.plan(gpt, tiny_cluster(1.0), global_batch_size=4)
    assert plan.config.ep == 1 and all(a.config.ep == 1 for a in plan.alternatives)
    assert "Expert par." not in autopar.explain(plan)


def test_a_routing_imbalance_without_dropless_experts_is_refused(graph):
    """A stated routing imbalance only moves dropless experts; for a dense model, or one
    of fixed-capacity buffers (``graph``: autopar's MoE), it would be ignored without a
    word, so it is refused in one line naming what the model has."""
    gpt = extract(GPT(GPTConfig(vocab_size=64, seq_len=16, dim=32, n_layers=1, n_heads=2)), seq_len=16)
    for model, has in ((gpt, "no mixture-of-experts layers"), (graph, "fixed-capacity expert buffers")):
        with pytest.raises(ConfigError, match=f"routing_imbalance=1.3 is not allowed .* this model has {has}") as info:
            autopar.plan(model, tiny_cluster(1.0), global_batch_size=4, routing_imbalance=1.3)
        assert "\n" not in str(info.value)
    autopar.plan(gpt, tiny_cluster(1.0), global_batch_size=4, routing_imbalance=1.0)  # the default: nothing to say


def test_a_stated_routing_imbalance_prices_dropless_plans_and_is_recorded():
    """The same Mixtral plan at a balanced and a skewed router: the skewed one pays more
    all-to-all, says so, and keeps the factor in its file; a factor below 1 is refused."""
    g = extract(_mixtral(), seq_len=32, dtype="bf16")
    fixed = {"dp": 4, "tp": 1, "pp": 1, "ep": 2, "micro_batch_size": 1, "zero_stage": 0, "recompute": "none"}
    even = autopar.estimate(g, tiny_cluster(1.0), fixed, global_batch_size=4)
    skew = autopar.estimate(g, tiny_cluster(1.0), fixed, global_batch_size=4, routing_imbalance=1.5)
    assert skew.prediction.breakdown.ep_comm_s > even.prediction.breakdown.ep_comm_s > 0
    assert (even.settings.routing_imbalance, skew.settings.routing_imbalance) == (1.0, 1.5)
    assert "dropless experts priced at 1.5x the mean rows" in autopar.explain(skew)
    assert Plan.from_json(skew.to_json()) == skew
    with pytest.raises(ConfigError, match="routing_imbalance=0.5 is not allowed") as info:
        autopar.plan(g, tiny_cluster(1.0), global_batch_size=4, routing_imbalance=0.5)
    assert "\n" not in str(info.value)


def test_context_parallelism_is_not_offered_to_capacity_bounded_experts(graph):
    """Capacity buffers fill in token order over a whole sample, which a rank holding
    1/cp of it cannot do: cp is not searched, and a fixed cp is refused in one line
    (dropless experts route each token on its own and may be split)."""
    from autopar.search.context_degrees import CP_MIN_TOKENS, check_context_parallel, cp_degrees

    long = dataclasses.replace(graph, seq_len=4 * CP_MIN_TOKENS)
    assert cp_degrees(long, 8, {}) == [1]
    with pytest.raises(ConfigError, match="cp=2 is not allowed for MoELlama: its capacity-bounded experts") as info:
        check_context_parallel(long, {"cp": 2}, 8)
    assert "\n" not in str(info.value)
    mixtral = dataclasses.replace(extract(_mixtral(), seq_len=32, dtype="bf16"), seq_len=4 * CP_MIN_TOKENS)
    assert cp_degrees(mixtral, 8, {}) == [1, 2, 4]


def test_a_plan_with_tensor_parallelism_says_it_does_not_split_experts(graph):
    """tp=2 on a mixture of experts: the experts stay whole on each tensor-parallel rank,
    which the plan says (a pinned tp made Mixtral 8x22B run at 7% MFU with no word of
    why); at tp=1 it says nothing of it, and a dense model never."""
    cluster = tiny_cluster(64.0)
    tp2 = autopar.estimate(graph, cluster, {"tp": 2, "dp": 2}, global_batch_size=8)
    (note,) = [n for n in tp2.notes if n.startswith("Tensor parallelism does not split experts")]
    assert "under tp=2 each rank runs its experts whole" in note
    tp1 = autopar.estimate(graph, cluster, {"dp": 4}, global_batch_size=8)
    dense = autopar.estimate(
        GPT(GPTConfig(vocab_size=256, seq_len=S, dim=D, n_layers=2, n_heads=4)),
        cluster,
        {"tp": 2},
        global_batch_size=8,
        seq_len=S,
    )
    assert not any("does not split experts" in n for n in (*tp1.notes, *dense.notes))


def test_the_imbalance_is_at_most_every_row_on_one_rank():
    """Under ep=2 the busiest rank receives at most every routed row, twice the mean: an
    imbalance of 4 is priced as 2 (it was priced as given, past what any router can do),
    and one above the model's expert count, which no ep reaches, is refused in one line
    (1e300 ended in a NaN inside the search)."""
    g = extract(_mixtral(), seq_len=32, dtype="bf16")
    base = CostModel(graph=g, cluster=tiny_cluster(64.0), optimizer=Optimizer.ADAM, global_batch_size=2)
    config = _config(dp=2, ep=2)
    at = {
        r: expert_exchange(g.profile_of(1), tp_context(dataclasses.replace(base, routing_imbalance=r), 1, config))
        for r in (2.0, 4.0)
    }
    assert at[4.0] == at[2.0]
    experts = max(p.experts for p in g.profiles)
    with pytest.raises(
        ConfigError, match=rf"routing_imbalance=1e\+300 is not allowed .* give a number from 1 to {experts}\."
    ):
        autopar.plan(g, tiny_cluster(64.0), global_batch_size=8, routing_imbalance=1e300)
