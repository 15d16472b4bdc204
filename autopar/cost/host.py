"""Every cost of running the framework on the host that GPU kernels hide, in one place.

Each effect is a field of :class:`autopar.hardware.HostEffects`: zero (or a share of
one) on the GPU presets, where asynchronous kernel launches and NCCL hide them behind
large kernels; set on CPU processes (the ``local-cpu`` preset's nominal figures, or a
profile's measurements). A profile of a GPU may measure some of them too, and then they
apply there as well: the pricing below never asks what kind of device it prices.
:data:`HOST_EFFECTS` is the table of what each effect prices, where, and on which
devices it is non-zero.

Waiting on peers (:func:`sync_wait_s`): ranks doing the same work do not finish it at
the same moment, and a blocking collective makes every rank of its group wait for the
last one. A rank's time for ``T`` seconds of work deviates by a random walk
(``sigma sqrt(T)``) and a drift in proportion to the work (``delta T``), so ``k``
meetings that split ``W`` seconds of work into equal parts cost
``e_n sqrt(k sigma^2 W + delta^2 W^2)``, with ``e_n`` the expected maximum of ``n``
standard normal variables (Tippett 1925). Equal parts are the dearest split of a given
``W`` and ``k`` (the square root is concave), which suits a planner that must not
promise too much. The measurements behind these terms are in ``docs/cost-model.md``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from autopar.cost.compute import ComputeRates, work_s
from autopar.cost.memory import GRAD_BYTES
from autopar.hardware.device import HostEffects

ACCUMULATE_PASSES = 3
"""Adding a micro-batch's weight gradient into ``.grad`` reads both and writes one."""

FSDP_COPY_PASSES = 2.0
"""Bytes FSDP2 moves around one collective, per byte of the full unsharded size, plus as
many per byte of the shard: an all-gather copies the local shards into the flat send
buffer (read and write ``S / dp``) and then splits the received buffer into the
parameters (read and write ``S``); a reduce-scatter concatenates the gradients into the
flat send buffer (read and write ``S``) and then divides and accumulates the received
shard (about ``S / dp`` each way). PyTorch's
``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py`` (``foreach_all_gather``,
``foreach_all_gather_copy_out``, ``foreach_reduce``)."""


@dataclass(frozen=True, kw_only=True)
class HostEffect:
    """One row of :data:`HOST_EFFECTS`: the ``HostEffects`` field, what it prices and
    where, and its value on CPU processes and on GPUs."""

    field: str
    prices: str
    cpu_processes: str
    gpus: str


HOST_EFFECTS: tuple[HostEffect, ...] = (
    HostEffect(
        field="op_overhead_s",
        prices="framework time per dispatched aten op of every leaf and glue op (dispatch_s)",
        cpu_processes="~5 us nominal; a device profile measures it",
        gpus="0: kernel launches are asynchronous and hide behind large kernels",
    ),
    HostEffect(
        field="tp_overhead_s",
        prices="DTensor's extra time per forward of a tensor-parallel leaf (tp_dispatch_s)",
        cpu_processes="~150 us nominal; a device or network profile measures it",
        gpus="0",
    ),
    HostEffect(
        field="fsdp_overhead_s",
        prices="FSDP2's hooks and dispatch per collective call (fsdp_framework_s)",
        cpu_processes="a network profile measures it",
        gpus="0",
    ),
    HostEffect(
        field="fsdp_tensor_overhead_s",
        prices="FSDP2's per-parameter-tensor copies and views in each call (fsdp_framework_s)",
        cpu_processes="a network profile measures it",
        gpus="0",
    ),
    HostEffect(
        field="fsdp_copy_bytes_per_s",
        prices="the rate of FSDP2's copies into and out of its flat buffers (fsdp_copy_s)",
        cpu_processes="a network profile measures it (many small tensors copy slower than a stream)",
        gpus="0: the streaming bandwidth",
    ),
    HostEffect(
        field="sync_noise_s_per_sqrt_s",
        prices="waits on the slowest rank at blocking collectives, random-walk part (ranks_wait_s)",
        cpu_processes="~10 ms per sqrt(s) nominal; a network profile measures it",
        gpus="0",
    ),
    HostEffect(
        field="sync_speed_spread",
        prices="waits on the slowest rank, the drift in proportion to the work (ranks_wait_s)",
        cpu_processes="a network profile measures it",
        gpus="0",
    ),
    HostEffect(
        field="optimizer_bytes_per_s",
        prices="the optimizer step's rate (optimizer_bytes_per_s)",
        cpu_processes="~7 GB/s nominal (eager AdamW makes a dozen passes); a device profile measures it",
        gpus="0: the streaming bandwidth (fused or foreach optimizers are bandwidth bound)",
    ),
    HostEffect(
        field="time_share",
        prices="a core shared by several processes: every rate and overhead of the device is scaled "
        "(autopar.hardware.device.time_shared)",
        cpu_processes="cores / processes where the processes outnumber the cores",
        gpus="1",
    ),
    HostEffect(
        field="bandwidth_share",
        prices="the node's memory bandwidth shared by processes streaming at once "
        "(autopar.hardware.device.bandwidth_shared)",
        cpu_processes="a network profile measures it",
        gpus="1: each GPU has its own memory",
    ),
    HostEffect(
        field="exposed_weight_traffic",
        prices="weight reads as a pass of their own (kernel_s) and gradient accumulation per micro-batch (accumulate_s)",
        cpu_processes="true: BLAS packs each cold weight, eager autograd accumulates in a pass of its own",
        gpus="false: GEMMs stream weight tiles under the arithmetic, accumulation fuses into the weight-gradient GEMM",
    ),
)


def dispatch_s(host: HostEffects, ops: float) -> float:
    """Framework time of dispatching ``ops`` aten ops."""
    return host.op_overhead_s * ops


def tp_dispatch_s(host: HostEffects, *, sharded: bool) -> float:
    """DTensor's extra framework time for one forward of a leaf, when it is sharded."""
    return host.tp_overhead_s if sharded else 0.0


def kernel_s(
    *,
    matmul_flops: float,
    other_flops: float,
    activation_bytes: float,
    weight_bytes: float,
    r: ComputeRates,
    host: HostEffects,
) -> float:
    """A leaf's kernel time from its work: the roofline with the weight reads inside it,
    or the roofline of the activations plus a pass over the weights where weight traffic
    is exposed. The profiler's layer calibration prices the units it measured with the
    same function."""
    if not host.exposed_weight_traffic:
        return work_s(matmul_flops=matmul_flops, other_flops=other_flops, nbytes=activation_bytes + weight_bytes, r=r)
    return (
        work_s(matmul_flops=matmul_flops, other_flops=other_flops, nbytes=activation_bytes, r=r)
        + weight_bytes / r.bytes_per_s
    )


def accumulate_s(host: HostEffects, *, param_numel: float, bytes_per_s: float) -> float:
    """Time per micro-batch to add the fp32 weight gradient of ``param_numel`` parameters
    into ``.grad`` (autograd's ``AccumulateGrad``) where that is a pass of its own; 0
    where the weight-gradient GEMM accumulates in place. The runtime zeroes gradients
    in place, so every micro-batch accumulates, the first one too."""
    if not host.exposed_weight_traffic:
        return 0.0
    return ACCUMULATE_PASSES * GRAD_BYTES * param_numel / bytes_per_s


def fsdp_framework_s(host: HostEffects, *, calls_per_unit: int, units: int, tensors: int) -> float:
    """FSDP2's framework time in a stage's step: each of its ``units`` issues
    ``calls_per_unit`` collective calls, each paying ``fsdp_overhead_s`` and
    ``fsdp_tensor_overhead_s`` per parameter tensor of its unit (``tensors`` over the
    stage): the copy into the flat buffer, the views out of it and the reduction's
    chunking are dispatched tensor by tensor (torch 2.13's ``_fsdp_collectives``)."""
    return calls_per_unit * (units * host.fsdp_overhead_s + tensors * host.fsdp_tensor_overhead_s)


def fsdp_copy_s(host: HostEffects, nbytes: float, dp: int, *, streaming_bytes_per_s: float) -> float:
    """Seconds of FSDP2's copies around one all-gather or reduce-scatter of ``nbytes``
    (the full unsharded size) over ``dp`` ranks: ``FSDP_COPY_PASSES * nbytes *
    (1 + 1 / dp)`` bytes at the copies' measured rate, or the streaming bandwidth."""
    if dp <= 1 or nbytes <= 0:
        return 0.0
    rate = host.fsdp_copy_bytes_per_s or streaming_bytes_per_s
    return FSDP_COPY_PASSES * nbytes * (1 + 1 / dp) / rate


def optimizer_bytes_per_s(host: HostEffects, *, streaming_bytes_per_s: float) -> float:
    """The rate the optimizer step moves its bytes: measured, or the streaming bandwidth."""
    return host.optimizer_bytes_per_s or streaming_bytes_per_s


def ranks_wait_s(host: HostEffects, ranks: int, meetings: float, work_s: float) -> float:
    """:func:`sync_wait_s` with the device's measured noise and spread."""
    return sync_wait_s(host.sync_noise_s_per_sqrt_s, ranks, meetings, work_s, speed_spread=host.sync_speed_spread)


def sync_wait_s(
    noise_s_per_sqrt_s: float, ranks: int, meetings: float, work_s: float, *, speed_spread: float = 0.0
) -> float:
    """Seconds ``ranks`` ranks wait on each other at ``meetings`` blocking collectives
    that split ``work_s`` seconds of work: ``e_ranks * sqrt(meetings * sigma^2 * W +
    delta^2 * W^2)`` with ``delta`` the ``speed_spread`` (module docstring). 0 for one
    rank, no meetings or no noise."""
    if ranks < 2 or meetings <= 0 or work_s <= 0 or (noise_s_per_sqrt_s <= 0 and speed_spread <= 0):
        return 0.0
    variance = meetings * noise_s_per_sqrt_s**2 * work_s + (speed_spread * work_s) ** 2
    return expected_max_normal(ranks) * math.sqrt(variance)


_GRID_POINTS = 801
_GRID_HALF_WIDTH = 10.0


@functools.lru_cache(maxsize=64)
def expected_max_normal(n: int) -> float:
    """The expected maximum of ``n`` independent standard normal variables (0 for one),
    by Simpson's rule over +-10 standard deviations (error below 1e-9; memoised, since
    the search asks for the same few group sizes for every candidate)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"expected_max_normal needs a rank count >= 1, got {n!r}.")
    if n == 1:
        return 0.0
    h = 2 * _GRID_HALF_WIDTH / (_GRID_POINTS - 1)
    total = 0.0
    for i in range(_GRID_POINTS):
        x = -_GRID_HALF_WIDTH + i * h
        pdf = math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
        cdf = 0.5 * (1 + math.erf(x / math.sqrt(2)))
        weight = 1 if i in (0, _GRID_POINTS - 1) else (4 if i % 2 else 2)
        total += weight * x * n * pdf * cdf ** (n - 1)
    return total * h / 3
