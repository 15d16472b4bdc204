"""Plan.eager_contrast: the compile alternative is the plan's own choices priced eager
only where the search kept the same degrees, kernels and recomputation; where it picked
recomputation again (eager blocks save more), it is another configuration."""

from dataclasses import replace

from autopar.plan import Alternative
from autopar.vocab import Recompute


def _with_contrast(plan, *, unit_recompute, **config):
    eager = Alternative(
        config=replace(plan.config, compile=False, async_tp=False, **config),
        status="compile",
        step_time_s=plan.prediction.step_time_s * 1.1,
        memory_bytes_per_device=plan.prediction.memory_bytes_per_device * 0.9,
        slower_by=0.1,
        over_memory_bytes=0.0,
        reason="the winner eager: 10.0% slower",
        unit_recompute=unit_recompute,
    )
    compiled = replace(plan, config=replace(plan.config, compile=True))
    others = tuple(a for a in plan.alternatives if a.status != "compile")
    return replace(compiled, alternatives=(*others, eager)), eager


def test_the_same_choices_eager_are_the_contrast(gpt2_plan):
    plan, eager = _with_contrast(gpt2_plan, unit_recompute={})
    assert not plan.layer_strategies.recompute and plan.eager_contrast() is eager


def test_recomputation_picked_again_is_no_contrast(gpt2_plan):
    plan, _ = _with_contrast(gpt2_plan, unit_recompute={Recompute.FULL: 3})
    assert plan.eager_contrast() is None


def test_other_degrees_are_no_contrast(gpt2_plan):
    plan, _ = _with_contrast(gpt2_plan, unit_recompute={}, micro_batch_size=gpt2_plan.config.micro_batch_size * 2)
    assert plan.eager_contrast() is None
