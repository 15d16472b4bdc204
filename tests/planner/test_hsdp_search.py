"""HSDP as a searched choice: the search weighs plain FSDP against HSDP shard groups
through the same cost model, ``explain`` says which won and what the other costs, and a
pinned ``dp_shard`` is honoured."""

import pytest

import autopar
from autopar.models import build_named_model
from autopar.search.space import shard_sizes


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
