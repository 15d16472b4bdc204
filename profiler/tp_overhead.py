"""Framework time of a tensor-parallel layer beyond its arithmetic and its transfers.

DTensor propagates shardings, wraps outputs and routes each collective through the
functional-collectives API (an ``AsyncCollectiveTensor`` and a wait) for every sharded
layer, every micro-batch. The cost model charges that as ``tp_overhead_s`` per forward
of a tensor-parallel leaf, ``1 + BACKWARD_FACTOR`` times per micro-batch
(:func:`autopar.cost.tensor_parallel.leaf_fwd_s`).

It is measured on a Megatron pair, a column-parallel linear feeding a row-parallel one,
so small (4 x 64) that the arithmetic is nothing: the pair's forward and backward under
tensor parallelism, less the same pair unsharded, less the two all-reduces it issues
(the row output's in forward, the column input's gradient in backward) as the cost model
prices them from the network fit, over the ``2 x (1 + BACKWARD_FACTOR)`` leaf-forwards
it counts. Measured this way on a real group the figure holds what a one-rank mesh
cannot show: on a 2-core box, 400-550 us per leaf-forward on 2 gloo ranks against
160-360 us on a one-rank mesh.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from autopar.cost.tensor_parallel import BACKWARD_FACTOR
from profiler.timing import Repeats, synchronize

PAIR_ROWS = 4
PAIR_DIM = 64
PAIR_BYTES = PAIR_ROWS * PAIR_DIM * 4
"""The fp32 activation each of the pair's two all-reduces moves."""
CALLS_PER_SAMPLE = 20
"""Fixed, not adapted per rank: every rank must issue the same collectives."""


def tp_overhead_s(mesh: DeviceMesh, device: torch.device, repeats: Repeats,
                  all_reduce_s: Callable[[float], float]) -> float:
    """Seconds per tensor-parallel leaf-forward on ``mesh`` (1-D), the slowest rank's;
    call on every rank of the mesh. ``all_reduce_s(nbytes)``: what the cost model
    charges for one all-reduce on this group (0 for a one-rank mesh)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    plain, sharded = _pair(device), _pair(device)
    parallelize_module(sharded, mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})
    x = torch.randn(PAIR_ROWS, PAIR_DIM, device=device, requires_grad=True)
    group = mesh.get_group()
    times = {}
    for name, pair in (("plain", plain), ("sharded", sharded)):
        times[name] = _median_s(lambda pair=pair: pair(x).sum().backward(), device, repeats, group)
    excess = times["sharded"] - times["plain"] - 2 * all_reduce_s(PAIR_BYTES)
    return max(excess, 0.0) / (2 * (1 + BACKWARD_FACTOR))


def _pair(device: torch.device) -> torch.nn.Sequential:
    return torch.nn.Sequential(torch.nn.Linear(PAIR_DIM, PAIR_DIM), torch.nn.Linear(PAIR_DIM, PAIR_DIM)).to(device)


def _median_s(fn: Callable[[], None], device: torch.device, repeats: Repeats, group: dist.ProcessGroup) -> float:
    """Median over ``repeats.repeats`` samples of ``CALLS_PER_SAMPLE`` calls, after
    ``repeats.warmup`` calls; the slowest rank's."""
    for _ in range(max(repeats.warmup, 1)):
        fn()
    samples = []
    for _ in range(repeats.repeats):
        dist.barrier(group=group)
        synchronize(device)
        start = time.perf_counter()
        for _ in range(CALLS_PER_SAMPLE):
            fn()
        synchronize(device)
        samples.append((time.perf_counter() - start) / CALLS_PER_SAMPLE)
    slowest = torch.tensor([statistics.median(samples)], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return float(slowest[0])
