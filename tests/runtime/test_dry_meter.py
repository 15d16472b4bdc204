"""What the measured dry run counts on fake tensors (autopar.runtime.dry_step.FakeBytesMeter)."""

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
from torch.testing._internal.distributed.fake_pg import FakeStore

from autopar.runtime.dry_step import FakeBytesMeter

TP = 8
ROWS, IN, OUT = 24, 40, TP * 1003
"""Unusual sizes, so that DTensor's cache of propagated shapes (per process) cannot
already hold this op's, whichever test ran before."""


def test_dtensor_shape_propagation_is_not_counted_as_memory():
    """A column-parallel linear on one of 8 ranks, on fake tensors: the only new storage
    is its local output shard (24 x 1003 fp32); DTensor's propagation of the output's
    global shape (24 x 8024, 8 times the shard) runs in the same fake mode and used to
    be counted as an allocation."""
    dist.init_process_group("fake", rank=0, world_size=TP, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (TP,))
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode:
            linear = nn.Linear(IN, OUT, bias=False)
            parallelize_module(linear, mesh, ColwiseParallel(use_local_output=False))
            x = torch.zeros(ROWS, IN)
            meter = FakeBytesMeter(mode, [x, *linear.parameters()])
            before = meter.current_bytes
            with meter:
                out = linear(x)
        assert before == ROWS * IN * 4 + IN * (OUT // TP) * 4  # the input and the weight's shard
        assert out.to_local().shape == (ROWS, OUT // TP)
        assert meter.peak_bytes - before == ROWS * (OUT // TP) * 4, meter.peak_bytes - before
    finally:
        dist.destroy_process_group()
