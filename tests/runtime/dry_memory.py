"""The check the memory tests share: rank 0 of a plan, one step on fake tensors at the
plan's full world size (``autopar.runtime.dry_run``), against the planner's allocation."""

from collections.abc import Callable

import pytest
from torch import nn

import autopar
from autopar.runtime.dry_run import dry_run


def assert_rank0_allocation_measured(build: Callable[[], nn.Module], plan: autopar.Plan, rel: float = 0.03) -> None:
    """The measured peak of rank 0's dry-run step is the planner's allocation (its peak
    less the device's reserve) within ``rel``."""
    report = dry_run(build, plan, ranks=[0], measure=True)
    assert report.ok, report.problems
    rank = report.ranks[0]
    assert rank.measured.peak_bytes == pytest.approx(rank.predicted_allocated_bytes, rel=rel), (
        rank.measured.peak_bytes,
        rank.predicted_allocated_bytes,
    )
