"""The fork harness: results come back, failures and hangs are reported, not hung on."""

import time

import pytest
import torch
import torch.distributed as dist

from autopar.runtime.spmd import SPMDError, SPMDSettings, run_spmd

FAIL = SPMDSettings(timeout_s=60, pg_timeout_s=10)

pytestmark = pytest.mark.multiprocess


def _all_reduce_rank(rank, world):
    x = torch.tensor([float(rank)])
    dist.all_reduce(x)
    return x.item()


def _raise_on_one(rank, world):
    if rank == 1:
        raise ValueError("boom on purpose")
    dist.barrier()
    return rank


def _hang_on_zero(rank, world):
    if rank == 0:
        time.sleep(60)
    return rank


def test_results_in_rank_order():
    assert run_spmd(_all_reduce_rank, 4) == [6.0, 6.0, 6.0, 6.0]


def test_failure_names_the_rank_quickly():
    start = time.monotonic()
    with pytest.raises(SPMDError, match="rank 1: ValueError: boom on purpose"):
        run_spmd(_raise_on_one, 3, settings=FAIL)
    assert time.monotonic() - start < FAIL.timeout_s  # ended by the failure, not by the job's limit


def test_hang_is_bounded():
    start = time.monotonic()
    with pytest.raises(SPMDError, match="timed out|rank"):
        run_spmd(_hang_on_zero, 2, settings=SPMDSettings(timeout_s=5, pg_timeout_s=3))
    assert time.monotonic() - start < 15
