"""Kept shards of sequence-parallel gathers (``ParallelConfig.regather``) in the exports:
Megatron-LM and Megatron-DeepSpeed keep them with every ``--sequence-parallel`` run, so a
plan that holds the gathers gets a note there; torchtitan and Accelerate hold them, so a
plan that keeps shards gets a note there. Where they agree, no note."""

import pytest

from autopar.export import export

from .test_export import variant


@pytest.mark.parametrize("target, name", [("megatron", "Megatron-LM"), ("deepspeed", "Megatron-DeepSpeed")])
def test_megatron_keeps_shards_with_sequence_parallelism(pipelined_plan, target, name):
    held = [n for n in export(pipelined_plan, to=target).notes if "regather" in n]
    assert held == [
        f"{name}'s sequence parallelism keeps the shards of its all-gathers and gathers again in the backward, "
        f"which the plan does not (regather=False): activation memory is lower, and the backward's communication "
        f"higher, than predicted"
    ]
    assert not [n for n in export(variant(pipelined_plan, regather=True), to=target).notes if "regather" in n]


@pytest.mark.parametrize("target, name", [("torchtitan", "torchtitan"), ("accelerate", "Accelerate")])
def test_torchtitan_and_accelerate_hold_the_gathers(pipelined_plan, target, name):
    plan = variant(pipelined_plan, pp=1, dp=4) if target == "accelerate" else pipelined_plan
    kept = [n for n in export(variant(plan, regather=True), to=target).notes if "regather" in n]
    assert len(kept) == 1 and kept[0].startswith("the plan keeps the shards of its sequence-parallel all-gathers")
    assert f"which {name} does not" in kept[0] and f"plan with regather=False for {name}" in kept[0]
    assert not [n for n in export(plan, to=target).notes if "regather" in n]
