"""A plan names the fastest configuration of the next mixes of degrees (dp, cp, tp, pp,
ep) beside its own: its runners-up may all share the winner's degrees (GPT-3 175B's five
differed only in stages per rank and shard groups), which left "why not tp=8 pp=8?" to a
second run with the degrees pinned."""

import pytest

import autopar
from autopar.graph import extract
from autopar.models import build_named_model
from autopar.present.explain import explain
from autopar.search.scan import degrees_of


@pytest.fixture(scope="module")
def gpt2():
    return extract(build_named_model("gpt2-medium"), seq_len=1024)


@pytest.mark.parametrize("nodes", [1, 2])
def test_the_fastest_of_each_other_mix_is_the_one_every_candidate_gives(gpt2, nodes):
    """Against the search keeping every configuration that fits (no candidate pruned):
    the fastest of each mix the winner and its runners-up do not have, in order. A line
    marked 'best found' is one the scan stopped before settling; here each is the fastest
    of its mix all the same."""
    cluster = autopar.preset("dgx-a100-80gb", nodes=nodes)
    plan = autopar.plan(gpt2, cluster, global_batch_size=64)
    everything = autopar.plan(gpt2, cluster, global_batch_size=64, top=100_000)
    assert everything.config == plan.config
    runners = [a for a in plan.alternatives if a.status == "runner-up"]
    fastest: dict = {degrees_of(c): None for c in (plan.config, *(a.config for a in runners))}
    for candidate in sorted(
        (a for a in everything.alternatives if a.status == "runner-up"), key=lambda a: a.step_time_s
    ):
        fastest.setdefault(degrees_of(candidate.config), candidate)
    want = [a for a in fastest.values() if a is not None][:3]
    got = [a for a in plan.alternatives if a.status == "degrees"]
    assert len(want) == 3 and [a.config for a in got] == [a.config for a in want]
    assert [a.step_time_s for a in got] == pytest.approx([a.step_time_s for a in want], rel=1e-9)
    assert not {degrees_of(a.config) for a in got} & {degrees_of(a.config) for a in runners}
    text = explain(plan)
    assert "  other degrees (the fastest of each mix the runners-up do not show" in text
    for a in got:
        line = next(line for line in text.splitlines() if line.startswith(f"    {a.short()}"))
        assert line.endswith("(best found)") == ("found" in a.reason)
    assert [a.status for a in autopar.Plan.from_json(plan.to_json()).alternatives].count("degrees") == 3


def test_gpt3_175b_says_what_tp8_pp8_costs():
    """The README's plan: dp=32 tp=4 pp=8, and Megatron-LM's degrees for it among the
    others. The scan stops its hunt for them after as many solves again as the plan
    took, and marks what it did not settle."""
    plan = autopar.plan(
        extract(build_named_model("gpt3-175b"), seq_len=2048), "dgx-a100-80gb:128", global_batch_size=1536
    )
    others = {(a.config.tp, a.config.pp): a for a in plan.alternatives if a.status == "degrees"}
    assert (plan.config.tp, plan.config.pp) == (4, 8) and (8, 8) in others
    assert others[8, 8].step_time_s > plan.prediction.step_time_s
    assert not others[4, 16].reason.startswith("the fastest of its degrees found")  # settled: the next mix
    assert others[8, 8].short() in explain(plan)
