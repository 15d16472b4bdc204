"""Without pipelining, ``replicate`` (ZeRO-0/1 in bf16, or under tensor parallelism)
all-reduces each unit's gradients as its backward ends, overlapped with the backward of
the units before it, as the planner's time model prices (``autopar.cost.data_parallel``)
and as DDP's buckets did: ``autopar.runtime.pipeline._UnitReductionStage``. torch's
``PipelineStage`` would reduce every unit once the whole backward is over."""

import pytest
import torch.distributed as dist
from parity import batches, build, make_plan, megatron_styles, run

from autopar.runtime.api import parallelize
from autopar.runtime.local import cross_entropy

pytestmark = pytest.mark.multiprocess


def _events(rank, world, plan):
    """What happened, in order, in one step: each all-reduce (its element count) and each
    moment the first block's backward began (once per micro-batch)."""
    job = parallelize(build("gpt"), plan, loss_fn=cross_entropy, measure_memory=False)
    events: list[tuple[str, int]] = []
    real = dist.all_reduce

    def spy(tensor, *args, **kwargs):
        events.append(("all_reduce", tensor.numel()))
        return real(tensor, *args, **kwargs)

    def mark(module, inputs, output):
        output.register_hook(lambda grad: events.append(("layers.0 backward", 0)))

    job.stages[0].get_submodule("layers.0").register_forward_hook(mark)
    dist.all_reduce = spy
    try:
        (batch,) = job.shard(batches("gpt", 1, plan.config.global_batch_size))
        job.step(batch)
    finally:
        dist.all_reduce = real
    return events


@pytest.mark.parametrize(
    "config",
    [
        {"dp": 2, "zero_stage": 0, "dtype": "bf16", "num_microbatches": 2},
        {"dp": 2, "tp": 2, "zero_stage": 1, "styles": megatron_styles("gpt")},
    ],
    ids=["bf16-zero0", "tp2-zero1-fp32"],
)
def test_a_units_gradients_are_all_reduced_before_the_units_before_it_run_their_backward(config):
    """In the last micro-batch the units after the first block (the other block, the
    final norm and the head) are all-reduced before the first block's backward begins;
    nothing is reduced before that in the earlier micro-batches (they accumulate)."""
    plan = make_plan("gpt", **config)
    for events in run(_events, 2 * config.get("tp", 1), plan, timeout_s=300):
        marks = [i for i, (kind, _) in enumerate(events) if kind == "layers.0 backward"]
        assert len(marks) == plan.config.num_microbatches
        reduced = [i for i, (kind, _) in enumerate(events) if kind == "all_reduce"]
        start = marks[-2] if len(marks) > 1 else 0
        assert [i for i in reduced if i < start] == [], events
        assert len([i for i in reduced if start < i < marks[-1]]) >= 3, events
