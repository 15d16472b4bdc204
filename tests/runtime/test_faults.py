"""A rank that raises, dies or hangs ends the whole job with an error naming it, in
bounded time: the harness fails fast on the first report, and a rank stuck waiting
for a dead or silent peer is released by the process group's timeout."""

import os
import signal
import time

import pytest
import torch
from parity import LR, batches, build, make_plan, token_loss

from autopar.runtime.api import parallelize
from autopar.runtime.spmd import SPMDError, SPMDSettings, run_spmd

SETTINGS = SPMDSettings(timeout_s=60, pg_timeout_s=5)

pytestmark = pytest.mark.multiprocess


def _fail_in_step(rank, world, plan, how):
    job = parallelize(build("gpt"), plan, loss_fn=token_loss)
    opt = job.optimizer(torch.optim.SGD, lr=LR)
    for step, batch in enumerate(job.shard(batches("gpt", 3, plan.config.global_batch_size))):
        if step == 1 and rank == 1:
            if how == "raise":
                raise RuntimeError("data loader broke on purpose")
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(120)  # hang: never join the step's collectives
        job.step(batch)
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize(
    "how,expect",
    [
        ("raise", "rank 1: RuntimeError: data loader broke on purpose"),
        ("kill", "rank 1: died"),
        ("hang", "Timed out waiting"),
    ],
)
def test_a_failing_rank_ends_the_job_with_its_name(how, expect):
    """dp=2 x pp=2 (ranks wait on each other through all-reduces and sends). A hang is
    detected by the peers' process-group timeout (5 s here; ``AUTOPAR_PG_TIMEOUT_S``
    under ``autopar run``)."""
    plan = make_plan("gpt", dp=2, pp=2)
    start = time.monotonic()
    with pytest.raises(SPMDError, match=expect):
        run_spmd(_fail_in_step, 4, plan, how, settings=SETTINGS)
    assert time.monotonic() - start < SETTINGS.timeout_s  # ended by the failure, not by the job's limit
