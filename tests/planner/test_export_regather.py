"""Sequence parallelism's conventions in the exports. Kept shards of its gathers
(``ParallelConfig.regather``): Megatron-LM and Megatron-DeepSpeed keep them with every
``--sequence-parallel`` run, so a plan that holds the gathers gets a note there;
torchtitan and Accelerate hold them, so a plan that keeps shards gets a note there. The
activation layout a plan was priced for (``PlanSettings.activations``): Megatron's is
sequence-first, torchtitan's and Accelerate's batch-first. Where they agree, no note."""

import dataclasses

import pytest

from autopar.export import export
from autopar.vocab import ActivationLayout

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


def _priced(plan, layout: ActivationLayout):
    return dataclasses.replace(plan, settings=dataclasses.replace(plan.settings, activations=layout))


@pytest.mark.parametrize(
    "target, name, megatron",
    [
        ("megatron", "Megatron-LM", True),
        ("deepspeed", "Megatron-DeepSpeed", True),
        ("torchtitan", "torchtitan", False),
        ("accelerate", "Accelerate", False),
    ],
)
def test_a_plan_priced_for_another_activation_layout_says_which_way_the_step_moves(
    pipelined_plan, target, name, megatron
):
    plan = variant(pipelined_plan, pp=1, dp=4) if target == "accelerate" else pipelined_plan

    def layout_notes(layout: ActivationLayout) -> list[str]:
        return [n for n in export(_priced(plan, layout), to=target).notes if "-first" in n]

    own, other = (
        (ActivationLayout.SEQUENCE_FIRST, ActivationLayout.BATCH_FIRST)
        if megatron
        else (ActivationLayout.BATCH_FIRST, ActivationLayout.SEQUENCE_FIRST)
    )
    assert layout_notes(own) == []
    [note] = layout_notes(other)
    assert name in note and f"plan with --activations {own.value} " in note
    assert ("expect a faster step" in note) is megatron and ("expect a slower step" in note) is not megatron
    without_sp = _priced(variant(plan, sequence_parallel=False), other)
    assert not [n for n in export(without_sp, to=target).notes if "-first" in n]
