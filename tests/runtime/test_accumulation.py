"""Gradient accumulation over micro-batches holds what the planner budgets for each
ZeRO stage (``autopar.cost.memory``): DDP accumulates into its communication buckets,
so gradients exist once. Values are checked against the single-process run in
test_features.py::test_zero_stages."""

import pytest
import torch

from autopar.runtime.api import parallelize
from parity import batches, build, make_plan, run, token_loss

pytestmark = pytest.mark.multiprocess


def _bucket_storages(rank, world, plan):
    job = parallelize(build("gpt"), plan, loss_fn=token_loss, measure_memory=False)
    opt = job.optimizer(torch.optim.SGD, lr=0.1)
    storages = []
    for batch in job.shard(batches("gpt", 4, plan.config.global_batch_size)):
        job.step(batch)
        storages.append({p.grad.untyped_storage()._cdata for p in job.parameters()})
        opt.step()
        opt.zero_grad()
        zeroed = all(p.grad is not None and not p.grad.any() for p in job.parameters())
    return storages, zeroed


def test_ddp_accumulates_into_its_buckets():
    """``opt.zero_grad()`` zeroes DDP's bucket views in place: set to None, the next
    step's first micro-batch would make fresh gradients beside the buckets."""
    plan = make_plan("gpt", dp=2, zero_stage=0, num_microbatches=2)
    for storages, zeroed in run(_bucket_storages, 2, plan):
        assert zeroed
        assert storages[1] == storages[2] == storages[3]  # DDP builds its buckets once (first steps)
