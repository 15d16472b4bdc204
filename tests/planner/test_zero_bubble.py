"""Zero-bubble schedules in the plan: their validation, their stage placement and the
plan file round trip."""

import dataclasses

import pytest

from autopar import ConfigError, Plan
from autopar.plan import ParallelConfig
from autopar.vocab import Schedule

BASE = dict(dp=1, tp=1, pp=4, micro_batch_size=1, num_microbatches=8)


@pytest.mark.parametrize(
    "schedule, v, message",
    [
        ("zbv", 3, "schedule='zbv' runs exactly 2 stages per pipeline rank.*virtual_stages=3"),
        ("zbv", 1, "schedule='zbv' needs virtual_stages >= 2"),
        ("interleaved-zb", 1, "schedule='interleaved-zb' needs virtual_stages >= 2"),
        ("1f1b", 2, "virtual_stages=2 needs schedule 'interleaved-1f1b', 'interleaved-zb' or 'zbv'"),
    ],
)
def test_virtual_stages_checked(schedule, v, message):
    with pytest.raises(ConfigError, match=message):
        ParallelConfig(**BASE, schedule=schedule, virtual_stages=v)


def test_zero_bubble_needs_a_pipeline():
    with pytest.raises(ConfigError, match="schedule='zbv' needs pp >= 2"):
        ParallelConfig(**{**BASE, "pp": 1}, schedule="zbv", virtual_stages=2)


def test_v_placement():
    """ZB-V: rank r holds stages r and 2p - 1 - r (Qi et al. 2023, section 6); the other
    schedules place stage i on rank i mod p."""
    assert [Schedule.ZBV.rank_of_stage(i, 4) for i in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [Schedule.INTERLEAVED_ZB.rank_of_stage(i, 4) for i in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]


@pytest.mark.parametrize("schedule", ["interleaved-zb", "zbv"])
def test_round_trip(pipelined_plan, schedule):
    config = dataclasses.replace(pipelined_plan.config, schedule=Schedule(schedule), virtual_stages=2)
    stages = pipelined_plan.stages
    cut = (stages[0][: len(stages[0]) // 2], stages[0][len(stages[0]) // 2 :])
    cut2 = (stages[1][: len(stages[1]) // 2], stages[1][len(stages[1]) // 2 :])
    plan = dataclasses.replace(pipelined_plan, config=config, stages=(*cut, *cut2))
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.config.schedule is Schedule(schedule)
    expected = ((0, 3), (1, 2)) if schedule == "zbv" else ((0, 2), (1, 3))
    assert (again.stage_of_rank(0), again.stage_of_rank(1)) == expected
