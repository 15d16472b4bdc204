"""Checkpoints: saved under one plan, resumed under another (or one process) with the
next losses equal to an uninterrupted run; a save killed midway leaves the previous
checkpoint intact and loadable."""

import json
import os
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from parity import (
    LOSS_ATOL,
    LR,
    PARAM_ATOL,
    all_params,
    batches,
    build,
    make_plan,
    megatron_styles,
    reference,
    resumable,
    run,
    token_loss,
)
from torch.distributed.checkpoint import FileSystemWriter

import autopar.runtime.checkpoint as ckpt_module
from autopar.runtime.api import parallelize
from autopar.runtime.checkpoint import latest_step
from autopar.runtime.spmd import SPMDError

pytestmark = pytest.mark.multiprocess

MOMENTUM = 0.9  # optimizer state that must survive the move
STEPS, SAVE_AT = 6, 3


def _train(rank, world, plan, path, resume, steps, save_at):
    job = parallelize(build("gpt"), plan, loss_fn=token_loss)
    opt = job.optimizer(torch.optim.SGD, lr=LR, momentum=MOMENTUM)
    losses, start = resumable(job, opt, "gpt", path, resume, steps, save_at)
    return losses, start, job.data_position


@pytest.mark.parametrize("resume_as", ["tp2-pp2", "single"])
def test_resume_under_another_plan(tmp_path, resume_as):
    """Saved by dp=2 x tp=2 (FSDP2 ZeRO-3 over Megatron TP with SP); resumed by tp=2 x
    pp=2 (ZeRO-1) or by one process: the resumed run continues the uninterrupted
    single-process run."""
    saver = make_plan(
        "gpt", dp=2, tp=2, zero_stage=3, sequence_parallel=True, styles=megatron_styles("gpt", sequence_parallel=True)
    )
    if resume_as == "single":
        loader = make_plan("gpt", num_microbatches=4)
    else:
        loader = make_plan("gpt", tp=2, pp=2, num_microbatches=4, zero_stage=1, styles=megatron_styles("gpt"))
    assert saver.config.global_batch_size == loader.config.global_batch_size
    ref = reference("gpt", saver, steps=STEPS, momentum=MOMENTUM)
    first = run(_train, 4, saver, str(tmp_path), False, STEPS, SAVE_AT, timeout_s=120)
    assert latest_step(tmp_path) == SAVE_AT
    second = run(_train, loader.config.world_size, loader, str(tmp_path), True, STEPS, None, timeout_s=120)
    for losses, start, position in second:
        assert start == SAVE_AT and position == STEPS
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref.losses[SAVE_AT:]), rtol=0, atol=LOSS_ATOL)
    for losses, _, _ in first:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref.losses[:SAVE_AT]), rtol=0, atol=LOSS_ATOL)


class _DieMidWrite(FileSystemWriter):
    """Writes half a shard file, then the process is SIGKILLed (as by the OOM killer)."""

    def write_data(self, plan, planner):
        Path(self.path, "__1_0.distcp").write_bytes(b"\0" * 1000)
        os.kill(os.getpid(), signal.SIGKILL)


def _save_twice_die_second(rank, world, plan, path):
    job = parallelize(build("gpt"), plan, loss_fn=token_loss)
    opt = job.optimizer(torch.optim.SGD, lr=LR)
    for step, batch in enumerate(job.shard(batches("gpt", 2, plan.config.global_batch_size))):
        job.step(batch)
        opt.step()
        opt.zero_grad()
        if step == 1 and rank == 1:
            real = dcp.save
            ckpt_module.dcp.save = lambda state, checkpoint_id: real(state, storage_writer=_DieMidWrite(checkpoint_id))
        job.save_checkpoint(path, step=step + 1)


def _load_params(rank, world, plan, path):
    job = parallelize(build("gpt"), plan, loss_fn=token_loss)
    job.optimizer(torch.optim.SGD, lr=LR)
    return job.load_checkpoint(path), all_params(job)


def test_killed_save_keeps_the_previous_checkpoint(tmp_path):
    plan = make_plan("gpt", dp=2, zero_stage=2)
    with pytest.raises(SPMDError, match="rank 1: died"):
        run(_save_twice_die_second, 2, plan, str(tmp_path))
    assert latest_step(tmp_path) == 1
    assert not (tmp_path / "step-00000002").exists()
    assert (tmp_path / ".step-00000002.tmp").exists()  # the half-written attempt, never renamed
    assert json.loads((tmp_path / "step-00000001" / "autopar.json").read_text())["step"] == 1
    ref = reference("gpt", plan, steps=1)
    for step, params in run(_load_params, 2, plan, str(tmp_path)):
        assert step == 1
        for name, value in params.items():
            torch.testing.assert_close(value, ref.params[name], rtol=0, atol=PARAM_ATOL)
