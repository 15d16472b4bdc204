"""Gradient accumulation over micro-batches holds what the planner budgets for each
ZeRO stage (``autopar.cost.memory``): between two micro-batches, ZeRO-2/3 hold sharded
gradients only (a reduce-scatter per micro-batch), ZeRO-3 its sharded parameters only,
ZeRO-2 its gathered parameters; DDP accumulates into its communication buckets, so
gradients exist once. Values are checked against the single-process run in
test_features.py::test_zero_stages."""

import pytest
import torch
from parity import batches, build, make_plan, run, token_loss
from torch.distributed.fsdp import FSDPModule

from autopar.runtime.api import parallelize

pytestmark = pytest.mark.multiprocess


def _fsdp_params(stage, prefix):
    """FSDP2's records of the parameters of the units whose FQN starts with ``prefix``."""
    out = []
    for name, module in stage.named_modules():
        if isinstance(module, FSDPModule) and name.startswith(prefix):
            for group in module._get_fsdp_state()._fsdp_param_groups:
                out.extend(group.fsdp_params)
    return out


def _between_microbatches(rank, world, plan):
    job = parallelize(build("gpt"), plan, loss_fn=token_loss, measure_memory=False)
    opt = job.optimizer(torch.optim.SGD, lr=0.1)
    stage = job.stages[0]
    blocks = _fsdp_params(stage, "layers.")
    seen = []

    def record(_module, _args):
        unsharded = [getattr(p, "_unsharded_param", None) for p in blocks]  # made at the first all-gather
        seen.append(
            {
                "unsharded_grad_numel": sum(u.grad.numel() for u in unsharded if u is not None and u.grad is not None)
                + sum(p.unsharded_accumulated_grad.numel() for p in blocks if p.unsharded_accumulated_grad is not None),
                "sharded_grads": sum(p.sharded_param.grad is not None for p in blocks),
                "gathered_bytes": sum(t.untyped_storage().nbytes() for p in blocks for t in p.all_gather_outputs),
            }
        )

    stage.register_forward_pre_hook(record, prepend=True)  # before FSDP2 gathers anything
    for batch in job.shard(batches("gpt", 2, plan.config.global_batch_size)):
        seen.clear()
        job.step(batch)
        opt.step()
        opt.zero_grad()
    full_bytes = sum(p.numel() for n, p in build("gpt").named_parameters() if n.startswith("layers.")) * 4
    return seen, len(blocks), full_bytes


@pytest.mark.parametrize("zero", [2, 3])
def test_sharded_gradients_between_microbatches(zero):
    plan = make_plan("gpt", dp=2, zero_stage=zero, num_microbatches=2)
    for seen, n_params, full_bytes in run(_between_microbatches, 2, plan):
        first, second = seen[-2:]  # the second step's two micro-batches
        assert first == {"unsharded_grad_numel": 0, "sharded_grads": 0, "gathered_bytes": 0}
        assert second["unsharded_grad_numel"] == 0  # reduce-scattered after micro-batch 1
        assert second["sharded_grads"] == n_params
        assert second["gathered_bytes"] == (full_bytes if zero == 2 else 0)  # ZeRO-3 resharded after backward


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
