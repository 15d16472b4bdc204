"""Per-step metrics: the tensor-bytes meter counts exactly, and every step of a job
records its wall time, loss and peak memory."""

import pytest
import torch
from parity import LR, batches, build, make_plan, run, token_loss

from autopar.runtime.api import parallelize
from autopar.runtime.metrics import TensorBytesMeter


def test_meter_counts_live_storages_and_their_peak():
    base = torch.zeros(256)  # alive before: 1 KiB
    with TensorBytesMeter(torch.device("cpu"), [base]) as meter:
        a = torch.ones(1000)  # +4000
        b = a.view(10, 100)  # a view: no new storage
        c = torch.ones(2000, dtype=torch.float64)  # +16000 -> peak 21024
        del a, b, c  # freed
        d = torch.ones(100)  # +400
        assert meter.current_bytes == 1024 + 400
    assert meter.peak_bytes == 1024 + 4000 + 16000
    del d


def test_meter_follows_storage_resizes():
    """FSDP2 frees unsharded parameters by resizing their storage to 0 and regrows the
    same storage for the next all-gather; no op the dispatch mode sees does either."""
    gathered = torch.empty(1000)
    gathered.untyped_storage().resize_(0)  # freed before the step
    with TensorBytesMeter(torch.device("cpu")) as meter:
        gathered.untyped_storage().resize_(4000)  # all-gathered: +4000
        out = gathered * 2  # +4000; reads the regrown storage
        gathered.untyped_storage().resize_(0)  # resharded: -4000
        assert meter.current_bytes == 4000
        gathered.untyped_storage().resize_(4000)  # gathered again (new data pointer): +4000
        assert meter.current_bytes == 8000
        gathered.untyped_storage().resize_(0)
        assert meter.current_bytes == 4000
    assert meter.peak_bytes == 8000
    assert "resize_" not in torch.UntypedStorage.__dict__  # the hook is gone after the step
    del out


def _metered(rank, world, plan):
    job = parallelize(build("gpt"), plan, loss_fn=token_loss)
    opt = job.optimizer(torch.optim.SGD, lr=LR, momentum=0.9)
    losses = []
    for batch in job.shard(batches("gpt", 3, plan.config.global_batch_size)):
        losses.append(job.step(batch))
        opt.step()
        opt.zero_grad()
    held = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in job.parameters()) * 4
    return losses, job.metrics, held


@pytest.mark.multiprocess
def test_every_step_is_recorded_on_every_rank():
    plan = make_plan("gpt", dp=2, zero_stage=3)
    for losses, metrics, held in run(_metered, 2, plan):
        assert [m.step for m in metrics] == [0, 1, 2]
        assert [m.loss for m in metrics] == losses
        assert all(m.wall_time_s > 0 for m in metrics)
        # parameters, their gradients and (after the first step) momentum are live at once
        assert all(m.peak_memory_bytes >= 2 * held for m in metrics)
        assert metrics[2].peak_memory_bytes >= 3 * held
