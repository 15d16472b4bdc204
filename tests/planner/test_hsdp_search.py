"""HSDP as a searched choice: the search weighs plain FSDP against HSDP shard groups
through the same cost model, ``explain`` says which won and what the other costs, and a
pinned ``dp_shard`` is honoured."""

import dataclasses
import math

import pytest

import autopar
from autopar.cost.model import CostModel
from autopar.cost.peak import budget_bytes
from autopar.errors import ConfigError
from autopar.graph import extract
from autopar.models import GPT, GPTConfig, build_named_model
from autopar.search.constraints import check_constraints
from autopar.search.scan import search
from autopar.search.solve import ConfigSolver
from autopar.search.space import enumerate_space, shard_sizes
from autopar.vocab import Optimizer

from .exact_reference import brute_force_search, tiny_cluster


@pytest.fixture(scope="module")
def zero3_plan():
    """GPT-2 on two 8-GPU nodes, ZeRO-3 without TP or PP: dp=16, so plain FSDP over 16
    and HSDP with node-sized shard groups of 8 are both candidates."""
    return autopar.plan(
        build_named_model("gpt2-small"),
        autopar.preset("dgx-a100-80gb", nodes=2),
        global_batch_size=64,
        seq_len=1024,
        constraints={"zero_stage": 3, "tp": 1, "pp": 1},
    )


def test_shard_groups_searched_are_whole_nodes_in_powers_of_two():
    assert shard_sizes(128, 1, 8) == [8, 16, 32, 64]
    assert shard_sizes(64, 2, 8) == [4, 8, 16, 32]
    assert shard_sizes(16, 8, 8) == [2, 4, 8]
    assert shard_sizes(48, 1, 8) == [8, 16]  # 24 ranks would be 3 nodes
    assert shard_sizes(4, 1, 8) == []  # one node: nothing to save across nodes


def test_explain_shows_the_sharding_and_what_the_other_one_costs(zero3_plan):
    """The winner's sharding is on its own line with the other sharding of the same
    configuration, priced exactly as ``estimate`` prices that configuration alone."""
    plan = zero3_plan
    (other,) = [a for a in plan.alternatives if a.status == "sharding"]
    assert (plan.config.dp_shard is None) != (other.config.dp_shard is None)
    assert other.config.dp == plan.config.dp == 16 and {plan.config.shard_size, other.config.shard_size} == {8, 16}
    assert other.slower_by >= 0 and other.step_time_s == pytest.approx(
        plan.prediction.step_time_s * (1 + other.slower_by), rel=1e-12
    )
    c = other.config
    fixed = {"zero_stage": 3, "tp": 1, "pp": 1, "micro_batch_size": c.micro_batch_size, "dp_shard": c.dp_shard}
    alone = autopar.estimate(build_named_model("gpt2-small"), plan.cluster, fixed, global_batch_size=64, seq_len=1024)
    assert alone.config.dp_shard == c.dp_shard
    assert alone.prediction.step_time_s == pytest.approx(other.step_time_s, rel=1e-9)
    line = next(line for line in autopar.explain(plan).splitlines() if line.startswith("Data parallel"))
    if plan.config.dp_shard is None:
        assert "plain FSDP" in line and f"best HSDP (shard groups of {c.dp_shard})" in line
    else:
        assert f"groups of {plan.config.dp_shard} ranks" in line and "; plain FSDP:" in line


def test_a_pinned_shard_group_is_the_plan_and_is_explained():
    plan = autopar.plan(
        build_named_model("gpt2-small"),
        autopar.preset("dgx-a100-80gb", nodes=2),
        global_batch_size=64,
        seq_len=1024,
        constraints={"dp_shard": 8},
    )
    c = plan.config
    assert c.dp_shard == 8 and c.zero_stage >= 2 and c.dp == 16
    assert not [a for a in plan.alternatives if a.status == "sharding"]  # fixed: nothing to weigh it against
    text = autopar.explain(plan)
    assert "mesh pp, dp_replicate=2, dp_shard=8, tp" in text
    assert f"HSDP: ZeRO-{c.zero_stage} sharded over groups of 8 ranks, replicated across 2 groups" in text


def test_estimate_without_dp_shard_is_plain_fsdp():
    """``estimate`` fills unset fields with defaults: a ZeRO-3 estimate on two nodes is
    plain FSDP, though HSDP shard groups of a node would be candidates of a search."""
    plan = autopar.estimate(
        build_named_model("gpt2-small"),
        autopar.preset("dgx-a100-80gb", nodes=2),
        {"zero_stage": 3},
        global_batch_size=64,
        seq_len=1024,
    )
    assert plan.config.dp == 16 and plan.config.dp_shard is None
    assert not [a for a in plan.alternatives if a.status == "sharding"]


@pytest.mark.parametrize("memory_gib", [0.012, 0.03])
def test_whole_search_with_hsdp_candidates_matches_brute_force(memory_gib):
    """Two nodes of 4: data-parallel groups of 8 split into node-sized HSDP shard groups,
    searched through the same cost model as every other choice."""
    graph = extract(
        GPT(GPTConfig(vocab_size=512, seq_len=256, dim=256, n_layers=2, n_heads=8)), seq_len=256, dtype="bf16"
    )
    cluster = dataclasses.replace(tiny_cluster(memory_gib), nodes=2)
    constraints = {"micro_batch_size": 1, "tp": 1, "zero_stage": 3}
    model = CostModel(graph=graph, cluster=cluster, optimizer=Optimizer.ADAM, global_batch_size=8)

    def solver() -> ConfigSolver:
        return ConfigSolver(model=model, budget_bytes=budget_bytes(cluster.device.memory), micro_batches=(1,))

    configs, _ = enumerate_space(graph, cluster, 8, check_constraints(constraints))
    assert {(c.dp, c.dp_shard) for c in configs} >= {(8, None), (8, 4), (4, None)}
    want = brute_force_search(solver(), constraints)
    result = search(solver(), check_constraints(constraints), top=3)
    assert result.best.fits == (not math.isinf(want))
    if result.best.fits:
        assert result.best.step_time_s == pytest.approx(want, rel=1e-9)


def test_a_fixed_shard_group_is_searched_alone():
    graph = extract(
        GPT(GPTConfig(vocab_size=512, seq_len=256, dim=256, n_layers=2, n_heads=8)), seq_len=256, dtype="bf16"
    )
    cluster = dataclasses.replace(tiny_cluster(1.0), nodes=2)
    configs, rejected = enumerate_space(graph, cluster, 8, check_constraints({"dp_shard": 4}))
    assert {c.dp for c in configs} == {4, 8}
    assert all(c.shard_size == 4 and c.zero_stage >= 2 for c in configs)
    assert any("shard group does not divide dp=2" in r.reason for r in rejected)
    plain, _ = enumerate_space(graph, cluster, 8, check_constraints({"dp_shard": None}))
    assert plain and all(c.dp_shard is None for c in plain)
    with pytest.raises(ConfigError, match="constraint dp_shard=1 is not allowed"):
        check_constraints({"dp_shard": 1})


def test_the_hsdp_contrast_of_an_expert_parallel_winner_keeps_expert_groups_whole():
    """moe-tiny's 8 experts over 8 ranks on two nodes of 4: a node-sized shard group of 4
    cannot hold an expert group, so the search never tries one, and the explanation's
    HSDP contrast must not either (it raised a ConfigError from ``plan`` before)."""
    cluster = dataclasses.replace(tiny_cluster(1.0), nodes=2)
    assert shard_sizes(8, 1, cluster.devices_per_node) == [4]
    fixed = {"tp": 1, "pp": 1, "ep": 8, "zero_stage": 2}
    plan = autopar.plan(build_named_model("moe-tiny"), cluster, global_batch_size=8, seq_len=128, constraints=fixed)
    assert (plan.config.dp, plan.config.ep, plan.config.dp_shard) == (8, 8, None)
    assert not [a for a in plan.alternatives if a.status == "sharding"]  # no shard group allows ep=8
    pinned = {**fixed, "dp_shard": 4}
    with pytest.raises(
        ConfigError, match="an expert group of 8 ranks must lie inside one shard group of dp_shard x cp = 4"
    ):
        autopar.estimate(build_named_model("moe-tiny"), cluster, pinned, global_batch_size=8, seq_len=128)


@pytest.mark.parametrize("zero", [0, 1])
def test_a_shard_group_with_a_zero_stage_that_does_not_shard_is_refused_as_a_contradiction(zero):
    """dp_shard with ZeRO-0/1 is the constraints' own contradiction: one line naming both,
    before any search, not a search that finds no candidate."""
    with pytest.raises(ConfigError) as err:
        check_constraints({"dp": 16, "dp_shard": 4, "zero_stage": zero})
    message = str(err.value)
    assert message == (
        f"constraint dp_shard=4 with zero_stage={zero} is not allowed: HSDP shards through FSDP2, which needs "
        f"zero_stage 2 or 3; set zero_stage=2 or 3, or drop dp_shard."
    )
