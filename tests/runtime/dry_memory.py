"""The check the memory tests share: rank 0 of a plan, one step on fake tensors at the
plan's full world size (``autopar.runtime.dry_run``), against the planner's allocation."""

from collections.abc import Callable

import pytest
from torch import nn

import autopar
from autopar.runtime.dry_run import dry_run


def rank0_peak_and_allocation(build: Callable[[], nn.Module], plan: autopar.Plan) -> tuple[int, float]:
    """The measured peak of rank 0's dry-run step and the planner's allocation (its peak
    less the device's reserve)."""
    report = dry_run(build, plan, ranks=[0], measure=True)
    assert report.ok, report.problems
    rank = report.ranks[0]
    return rank.measured.peak_bytes, rank.predicted_allocated_bytes


def assert_rank0_allocation_measured(build: Callable[[], nn.Module], plan: autopar.Plan, rel: float = 0.03) -> None:
    """The measured peak of rank 0's dry-run step is the planner's allocation within ``rel``."""
    measured, predicted = rank0_peak_and_allocation(build, plan)
    assert measured == pytest.approx(predicted, rel=rel), (measured, predicted)
