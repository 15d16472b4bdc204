"""Gradients reduced in bf16 (``ParallelConfig.reduce_dtype``): FSDP2 reduce-scatters the
bf16 gradients as they come, and under pipelining accumulates them in bf16 until the last
micro-batch, while the sharded gradients and weights the optimizer reads stay fp32."""

import pytest
import torch
from parity import build, make_plan, reference, run, step_collectives, token_loss, train
from test_features import BF16_RTOL

from autopar.runtime.api import parallelize

pytestmark = pytest.mark.multiprocess


def _reduce_scatter_dtype(func, args):
    """The dtype of each reduce-scatter FSDP2 issues (a ``c10d`` op)."""
    if func.namespace == "c10d" and func._opname == "_reduce_scatter_base_":
        return str(args[0].dtype)
    return None


def _reductions(rank, world, plan):
    job = parallelize(build("gpt"), plan, loss_fn=token_loss)
    counts = step_collectives(job, plan, _reduce_scatter_dtype)
    grads = {str(p.grad.dtype) for stage in job.stages for p in stage.parameters() if p.grad is not None}
    return counts, grads


@pytest.mark.parametrize("pp", [1, 2], ids=["fsdp", "pipelined"])
def test_gradients_reduce_in_bf16_into_fp32_shards(pp):
    """ZeRO-2 in bf16 on dp=2 (under pp=2 too): every reduce-scatter of the step runs in
    bf16 with reduce_dtype='bf16' and in fp32 without, and the sharded gradients are fp32
    either way."""
    for reduce_dtype, expected in (("bf16", "torch.bfloat16"), ("fp32", "torch.float32")):
        plan = make_plan("gpt", dp=2, pp=pp, zero_stage=2, dtype="bf16", reduce_dtype=reduce_dtype)
        for counts, grads in run(_reductions, 2 * pp, plan):
            assert set(counts) == {expected} and counts[expected] > 0, (reduce_dtype, counts)
            assert grads == {"torch.float32"}


def test_bf16_reduction_trains_like_one_process():
    """dp=2 ZeRO-3 reducing in bf16: the losses track the fp32 single-process run within
    bf16's precision, and the weights stay fp32."""
    plan = make_plan("gpt", dp=2, zero_stage=3, dtype="bf16", reduce_dtype="bf16")
    ref = reference("gpt", plan, steps=3)
    for res in run(train, 2, "gpt", plan, 3):
        torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(ref.losses), rtol=BF16_RTOL, atol=0)
        assert res.extra["dtypes"] == {"torch.float32"}
