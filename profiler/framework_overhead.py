"""Framework time of sharded layers beyond their arithmetic and their transfers.

Both of autopar's sharding engines spend CPU time per layer and micro-batch that no
FLOP or byte count shows, and on CPU processes (gloo, eager dispatch on the same cores)
it is a sizeable part of a step:

- **tensor parallelism**: DTensor propagates shardings, wraps outputs and routes each
  collective through the functional-collectives API (an ``AsyncCollectiveTensor`` and a
  wait). The cost model charges ``tp_overhead_s`` per forward of a tensor-parallel leaf,
  ``1 + BACKWARD_FACTOR`` times per micro-batch
  (:func:`autopar.cost.leaf.leaf_fwd_s`).
- **FSDP2** (ZeRO-2/3): per unit and collective, the pre-/post-hooks and the dispatch of
  the copy into the flat all-gather buffer and out of it into the parameters, the
  gradients' copy into the reduce-scatter buffer and the division. The cost model
  charges ``fsdp_overhead_s`` per FSDP collective call and ``fsdp_tensor_overhead_s``
  per parameter tensor of the unit and call, since the copies, views and chunks are
  dispatched tensor by tensor (:func:`autopar.cost.data_parallel.tail_s`); the bytes those
  copies move at real sizes it prices apart (:func:`autopar.cost.host.fsdp_copy_s`),
  and here they are nothing.

FSDP2's copies also move bytes in proportion to each unit, and on CPU processes they
reach well under the streaming bandwidth (many small parameter tensors, cold caches):
:func:`fsdp_copy_bytes_per_s` measures the rate from the same units at 2.25 MiB each,
where a call costs more than at 16 KiB, and the cost model prices the copies at it
(:func:`autopar.cost.host.fsdp_copy_s`).

Each is measured on a model so small (4 x 64) that its arithmetic is nothing: forward
and backward sharded, less the same model unsharded, less its collectives as the cost
model prices them from the network profile (its measured curves), over the calls the
cost model counts. Measured on a real group the figures hold what a one-rank mesh cannot
show: on a 2-core box, 2 gloo ranks spent 150-850 us per tensor-parallel leaf-forward
over separate runs (160-360 us on a one-rank mesh). What is left once the transfers are
taken out is a few milliseconds at most, so the figures are noisy; where the transfers
are priced above what the sharded model cost beyond the plain one, they clamp to 0.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from autopar.cost.host import FSDP_COPY_PASSES
from autopar.cost.leaf import BACKWARD_FACTOR
from profiler.timing import Repeats, synchronize

ROWS = 4
DIM = 64
"""The probe layers' width; the tensor-parallel probe rounds it up to a multiple of its
group (:func:`tp_width`), so that every rank holds whole columns and rows."""
FSDP_UNITS = 2
FSDP_MANY_LINEARS = 8
"""Linears per unit where the per-tensor cost is measured (16 parameter tensors, against
the 2 of a unit of one linear)."""
FSDP_LARGE_DIM = 768
"""Units of 2.25 MiB, where FSDP2's copies take as long as its fixed framework time."""
FSDP_LARGE_CALLS = 5
CALLS_PER_SAMPLE = 20
"""Fixed, not adapted per rank: every rank must issue the same collectives."""

Cost = Callable[[float], float]
"""``nbytes -> seconds`` the cost model charges for one collective on the group."""


def tp_overhead_s(mesh: DeviceMesh, device: torch.device, repeats: Repeats, all_reduce_s: Cost) -> float:
    """Seconds per tensor-parallel leaf-forward on ``mesh`` (1-D), the slowest rank's;
    call on every rank of the mesh. A column-parallel linear feeds a row-parallel one;
    they issue two all-reduces (the row output's in forward, the column input's gradient
    in backward) and count ``2 x (1 + BACKWARD_FACTOR)`` leaf-forwards. Give
    ``all_reduce_s`` as 0 on a one-rank mesh."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    dim = tp_width(mesh.size())
    plain, sharded = _stack(2, device, dim), _stack(2, device, dim)
    parallelize_module(sharded, mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})
    x = torch.randn(ROWS, dim, device=device, requires_grad=True)
    activation_bytes = ROWS * dim * 4  # the fp32 activation each of the pair's two all-reduces moves
    excess = _excess_s(plain, sharded, x, device, repeats, mesh.get_group()) - 2 * all_reduce_s(activation_bytes)
    return max(excess, 0.0) / (2 * (1 + BACKWARD_FACTOR))


def tp_width(ranks: int) -> int:
    """The tensor-parallel probe's width on ``ranks`` ranks: :data:`DIM` rounded up to a
    multiple of them (3 ranks: 66), as a column split of 64 over 3 leaves ranks
    unequal shards that the row-parallel layer after it cannot take."""
    return -(-DIM // ranks) * ranks


def fsdp_overhead_s(
    mesh: DeviceMesh, device: torch.device, repeats: Repeats, all_gather_s: Cost, reduce_scatter_s: Cost
) -> float:
    """Seconds per FSDP2 collective call on ``mesh`` (1-D), the slowest rank's; call on
    every rank of the mesh. ``FSDP_UNITS`` linears, each its own ``fully_shard`` unit
    under a root that holds nothing, resharded after forward (ZeRO-3): each unit
    all-gathers in forward and again in backward and reduce-scatters its gradients."""
    return max(_fsdp_excess_s(mesh, device, repeats, all_gather_s, reduce_scatter_s, DIM, CALLS_PER_SAMPLE), 0.0)


def fsdp_tensor_overhead_s(
    mesh: DeviceMesh,
    device: torch.device,
    repeats: Repeats,
    all_gather_s: Cost,
    reduce_scatter_s: Cost,
    two_tensor_s: float,
) -> float:
    """Seconds each parameter tensor of a unit adds to an FSDP2 collective call on
    ``mesh`` (1-D); call on every rank of the mesh. The same units as
    :func:`fsdp_overhead_s`, each of ``FSDP_MANY_LINEARS`` linears instead of one: what a
    call costs there beyond the transfers and ``two_tensor_s`` (:func:`fsdp_overhead_s`'s
    figure, for units of 2 tensors), over the tensors added. Measured on 2 gloo ranks:
    18-72 us per tensor and call over four runs, where a call costs 0.35-0.67 ms."""
    many = _fsdp_excess_s(
        mesh, device, repeats, all_gather_s, reduce_scatter_s, DIM, CALLS_PER_SAMPLE, linears=FSDP_MANY_LINEARS
    )
    return max(many - two_tensor_s, 0.0) / (2 * (FSDP_MANY_LINEARS - 1))


def fsdp_copy_bytes_per_s(
    mesh: DeviceMesh, device: torch.device, repeats: Repeats, all_gather_s: Cost, reduce_scatter_s: Cost, fixed_s: float
) -> float:
    """The rate FSDP2's copies around each collective reach on ``mesh`` (1-D), in the
    cost model's terms (:func:`autopar.cost.host.fsdp_copy_s`: ``FSDP_COPY_PASSES * S *
    (1 + 1/n)`` bytes per call of ``S``); call on every rank of the mesh. The same units
    as :func:`fsdp_overhead_s` at ``FSDP_LARGE_DIM`` (units of 2.25 MiB): what a call
    costs there beyond the transfers and ``fixed_s`` grows with the bytes. 0 where it did
    not grow (the cost model then uses the streaming bandwidth)."""
    large = _fsdp_excess_s(mesh, device, repeats, all_gather_s, reduce_scatter_s, FSDP_LARGE_DIM, FSDP_LARGE_CALLS)
    grown = large - fixed_s
    if grown <= 0:
        return 0.0
    n = mesh.size()
    return FSDP_COPY_PASSES * (_unit_bytes(FSDP_LARGE_DIM) - _unit_bytes(DIM)) * (1 + 1 / n) / grown


def _unit_bytes(dim: int, linears: int = 1) -> int:
    """The fp32 parameters of one FSDP unit of ``linears`` linears of width ``dim``: what
    its all-gather returns and its reduce-scatter takes."""
    return linears * (dim * dim + dim) * 4


def _fsdp_excess_s(
    mesh: DeviceMesh,
    device: torch.device,
    repeats: Repeats,
    all_gather_s: Cost,
    reduce_scatter_s: Cost,
    dim: int,
    calls: int,
    linears: int = 1,
) -> float:
    """What a ZeRO-3 collective call costs beyond its transfer, on units of ``linears``
    linears of width ``dim`` (may be negative)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    plain, sharded = (_units(FSDP_UNITS, linears, device, dim) for _ in range(2))
    for unit in sharded:
        fully_shard(unit, mesh=mesh, reshard_after_forward=True)
    fully_shard(sharded, mesh=mesh, reshard_after_forward=True)
    x = torch.randn(ROWS, dim, device=device)
    unit = _unit_bytes(dim, linears)
    transfers = FSDP_UNITS * (2 * all_gather_s(unit) + reduce_scatter_s(unit))
    return (_excess_s(plain, sharded, x, device, repeats, mesh.get_group(), calls) - transfers) / (3 * FSDP_UNITS)


def _units(units: int, linears: int, device: torch.device, dim: int) -> torch.nn.Sequential:
    """``units`` units in a row, each a linear or a row of ``linears`` of them."""
    return torch.nn.Sequential(
        *(_stack(linears, device, dim) if linears > 1 else torch.nn.Linear(dim, dim).to(device) for _ in range(units))
    )


def _stack(layers: int, device: torch.device, dim: int = DIM) -> torch.nn.Sequential:
    return torch.nn.Sequential(*(torch.nn.Linear(dim, dim) for _ in range(layers))).to(device)


def _excess_s(
    plain: torch.nn.Module,
    sharded: torch.nn.Module,
    x: torch.Tensor,
    device: torch.device,
    repeats: Repeats,
    group: dist.ProcessGroup,
    calls: int = CALLS_PER_SAMPLE,
) -> float:
    """Forward and backward of ``sharded`` less those of ``plain``, seconds per step."""
    times = [_mean_s(lambda m=m: m(x).sum().backward(), device, repeats, group, calls) for m in (plain, sharded)]
    return times[1] - times[0]


def _mean_s(
    fn: Callable[[], None], device: torch.device, repeats: Repeats, group: dist.ProcessGroup, calls: int
) -> float:
    """Mean over ``repeats.repeats`` samples of ``calls`` calls, after ``repeats.warmup``
    calls; the slowest rank's. The mean, as the transfers subtracted from it are priced
    (:attr:`autopar.profiles.sections.Timing.per_call_s`): a median here would drop the slow
    repeats the transfers keep, and leave too little framework time."""
    for _ in range(max(repeats.warmup, 1)):
        fn()
    samples = []
    for _ in range(repeats.repeats):
        dist.barrier(group=group)
        synchronize(device)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        synchronize(device)
        samples.append((time.perf_counter() - start) / calls)
    slowest = torch.tensor([statistics.mean(samples)], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return float(slowest[0])
