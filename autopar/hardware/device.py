"""One device (a GPU, or one CPU process) as numbers, by concern.

- :class:`Roofline`: what the device computes and streams: peak FLOP/s per precision,
  memory bandwidth, the fractions of them real kernels reach, measured matmul curves;
- :class:`DeviceMemory`: what the framework may allocate and what it cannot use;
- :class:`HostEffects`: costs of running the framework on the host that GPU kernels
  hide (dispatch, framework time per collective, time-sliced cores, shared memory
  bandwidth, unevenly finishing ranks). All zero on GPUs (:meth:`HostEffects.none`);
  CPU processes have them, and a profile measures them. What each one prices and
  where it applies: :mod:`autopar.cost.host`.

Units: bytes, seconds, FLOP/s.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from autopar.errors import ClusterError, check_positive_float
from autopar.hardware.magnitudes import (
    MAX_FLOP_PER_S,
    MAX_MEMORY_BYTES,
    MIN_FLOP_PER_S,
    MIN_MEMORY_BYTES,
    MIN_MEMORY_BYTES_PER_S,
    sci,
    too_small,
)
from autopar.vocab import DType

CPU_PROCESS = "cpu-process"
"""How a CPU process is named as a device: the preset's name, and the start of a measured
one (which adds the CPU model and its threads)."""


def device_kind(name: str) -> Literal["cpu", "cuda"]:
    """The kind of device ``name`` is, as a profile records it (``cpu`` for a CPU
    process, preset or measured; else ``cuda``), so that a measurement can be checked
    against the cluster it is applied to."""
    return "cpu" if name.startswith(CPU_PROCESS) else "cuda"


_SHARE_NOTE = "; time share: "


def _fraction(owner: str, name: str, value: object, *, zero_ok: bool, one_ok: bool, unit: str = "") -> float:
    """``value`` as a float in [0 or (0, 1] or 1), else ClusterError naming it."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = ok and (value >= 0 if zero_ok else value > 0) and (value <= 1 if one_ok else value < 1)
    if not ok:
        interval = f"{'[' if zero_ok else '('}0, 1{']' if one_ok else ')'}"
        raise ClusterError(f"{owner} {name}={value!r} is not allowed: it must be in {interval}{unit}.")
    return float(value)


def _rate(owner: str, name: str, value: object) -> float:
    """``value`` as bytes per second >= 0 (0: the streaming bandwidth)."""
    if isinstance(value, bool) or not (isinstance(value, (int, float)) and value >= 0):
        raise ClusterError(
            f"{owner} {name}={value!r} is not allowed: it must be bytes per second >= 0 (0: the streaming bandwidth)."
        )
    return float(value)


def dtype_of(key: object, where: str) -> DType:
    """``key`` as a DType, else ClusterError listing the precisions."""
    try:
        return DType(key)
    except ValueError:
        allowed = ", ".join(d.value for d in DType)
        raise ClusterError(f"{where}: unknown precision {key!r}; allowed: {allowed}.") from None


@dataclass(frozen=True, kw_only=True)
class Roofline:
    """What the device computes and streams.

    Attributes:
        peak_flops: dense peak FLOP/s per precision; a precision missing here is not
            supported by the device (V100 has no bf16).
        memory_bandwidth_bytes_per_s: peak memory bandwidth.
        matmul_efficiency: fraction of ``peak_flops`` a large matrix multiply reaches.
        memory_efficiency: fraction of the bandwidth a streaming kernel reaches.
        matmul_curves: measured achieved FLOP/s against the FLOPs of one matmul call,
            per precision (from a device profile); where present the cost model
            interpolates it instead of using ``matmul_efficiency``.
        fp8_flops: dense FP8 tensor-core peak FLOP/s; 0 on a device without FP8
            matmuls (A100, V100, CPU processes), which plans with ``fp8=True`` refuse.
        fp8_matmul_efficiency: fraction of ``fp8_flops`` a large FP8 matrix multiply
            reaches (None: ``matmul_efficiency``); FP8 GEMMs stay further below their
            peak than bf16 ones (the presets' sources say by how much).
        attention_efficiency: fraction of the compute-precision peak the fused (flash)
            attention kernel of the runtime's ``scaled_dot_product_attention`` reaches,
            in the FlashAttention benchmarks' convention: on the FLOPs it computes (a
            causal mask halves the score products, whose masked tiles it skips), with
            a backward of 2.5 times the forward's FLOPs. None: the core is priced as
            matmuls of the flop counter's (full) products, at ``matmul_efficiency`` or
            a measured matmul curve, with the backward every op gets. Its softmax runs
            between the two matmuls of every tile, so it stays below a GEMM, by how much
            depends on the kernel; materialized attention runs ordinary batched matmuls
            and ignores it.
    """

    peak_flops: Mapping[DType, float]
    memory_bandwidth_bytes_per_s: float
    matmul_efficiency: float = 0.8
    memory_efficiency: float = 0.8
    matmul_curves: Mapping[DType, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    fp8_flops: float = 0.0
    fp8_matmul_efficiency: float | None = None
    attention_efficiency: float | None = None

    def __post_init__(self) -> None:
        owner = "roofline"
        for name in ("fp8_matmul_efficiency", "attention_efficiency"):
            if getattr(self, name) is not None:
                value = _fraction(owner, name, getattr(self, name), zero_ok=False, one_ok=True, unit=" (or null)")
                object.__setattr__(self, name, value)
        if isinstance(self.fp8_flops, bool) or not isinstance(self.fp8_flops, (int, float)) or self.fp8_flops < 0:
            raise ClusterError(
                f"roofline fp8_flops={self.fp8_flops!r} is not allowed: give the dense FP8 peak in FLOP/s, or 0 "
                f"for a device without FP8 matmuls."
            )
        object.__setattr__(self, "fp8_flops", float(self.fp8_flops))
        bandwidth = check_positive_float(
            f"{owner} memory_bandwidth_bytes_per_s", self.memory_bandwidth_bytes_per_s, error=ClusterError
        )
        object.__setattr__(self, "memory_bandwidth_bytes_per_s", bandwidth)
        for name in ("matmul_efficiency", "memory_efficiency"):
            object.__setattr__(self, name, _fraction(owner, name, getattr(self, name), zero_ok=False, one_ok=True))
        if not self.peak_flops:
            raise ClusterError("roofline has no peak_flops: give at least one precision, e.g. {'bf16': 3.12e14}.")
        peaks = {
            dtype_of(k, "peak_flops"): check_positive_float(f"peak_flops[{k}]", v, error=ClusterError)
            for k, v in self.peak_flops.items()
        }
        object.__setattr__(self, "peak_flops", peaks)
        curves = {}
        for key, points in self.matmul_curves.items():
            pts = tuple(sorted((float(f), float(r)) for f, r in points))
            if not pts or any(f <= 0 or r <= 0 for f, r in pts):
                raise ClusterError(f"matmul_curves[{key}] must be non-empty (flops, flop/s) pairs > 0, got {points!r}.")
            curves[dtype_of(key, "matmul_curves")] = pts
        object.__setattr__(self, "matmul_curves", curves)


@dataclass(frozen=True, kw_only=True)
class DeviceMemory:
    """What the framework may allocate on one device.

    Attributes:
        capacity_bytes: memory the framework can allocate on the device.
        reserved_bytes: memory the model cannot use: runtime context, communication
            buffers.
        fragmentation: fraction of the allocated bytes lost to allocator fragmentation.
    """

    capacity_bytes: float
    reserved_bytes: float = 0.0
    fragmentation: float = 0.0

    def __post_init__(self) -> None:
        capacity = check_positive_float("memory capacity_bytes", self.capacity_bytes, error=ClusterError)
        if capacity > MAX_MEMORY_BYTES:
            raise ClusterError(
                f"memory capacity_bytes={self.capacity_bytes!r} is above {sci(MAX_MEMORY_BYTES)} (32 TiB), more than "
                f"any device holds: the field is in bytes (80 GiB is {sci(80 * 2**30)}); fix the cluster file."
            )
        if capacity < MIN_MEMORY_BYTES:
            raise ClusterError(
                f"memory capacity_bytes={self.capacity_bytes!r} is below {MIN_MEMORY_BYTES} (1 MiB), smaller than any "
                f"device: the field is in bytes ({capacity:g} GiB is {sci(capacity * 2**30)}); fix the cluster file."
            )
        object.__setattr__(self, "capacity_bytes", capacity)
        reserved = self.reserved_bytes
        if isinstance(reserved, bool) or not (isinstance(reserved, (int, float)) and 0 <= reserved < capacity):
            raise ClusterError(
                f"memory reserved_bytes={reserved!r} is not allowed: it must be >= 0 and below capacity_bytes={capacity!r}."
            )
        object.__setattr__(self, "reserved_bytes", float(reserved))
        object.__setattr__(
            self, "fragmentation", _fraction("memory", "fragmentation", self.fragmentation, zero_ok=True, one_ok=False)
        )


@dataclass(frozen=True, kw_only=True)
class HostEffects:
    """What running the framework costs on the host, beyond the roofline: all zero (and
    shares of one) on GPUs, whose asynchronous kernels and NCCL hide them; CPU
    processes have them. Each is priced in :mod:`autopar.cost.host`, whose table says
    where each applies.

    Attributes:
        op_overhead_s: framework time per dispatched op (eager dispatch, autograd).
        tp_overhead_s: extra framework time per forward of a tensor-parallel leaf
            (DTensor dispatch).
        fsdp_overhead_s: framework time per FSDP2 collective call beyond its transfer
            and copies (hooks, dispatch).
        fsdp_tensor_overhead_s: framework time per parameter tensor of the unit in each
            FSDP2 collective call (each copied and viewed apart).
        fsdp_copy_bytes_per_s: the rate FSDP2's copies into and out of its flat buffers
            reach; 0 means the streaming bandwidth.
        sync_noise_s_per_sqrt_s, sync_speed_spread: how unevenly the ranks of a group
            finish the same work: ``T`` seconds of it deviate by
            ``sqrt(sigma^2 T + (delta T)^2)`` (one standard deviation), and blocking
            collectives wait for the last rank.
        optimizer_bytes_per_s: the rate the optimizer step moves its bytes; 0 means the
            streaming bandwidth (a fused or foreach GPU optimizer is bandwidth bound).
        time_share: the share of the device one process gets (CPU processes that
            outnumber the cores are time-sliced); the roofline and the overheads of the
            device already include it (:func:`time_shared`).
        bandwidth_share: the share of the streaming bandwidth a process keeps while the
            node's other processes stream too, beyond ``time_share``; the bandwidth and
            the optimizer rate already include it (:func:`bandwidth_shared`).
        exposed_weight_traffic: a layer's weights cost memory passes the arithmetic does
            not hide, once per micro-batch, and gradient accumulation is a pass of its
            own (single-threaded CPU BLAS packs each weight, eager autograd accumulates
            apart). On GPUs GEMMs stream weight tiles under the arithmetic.
    """

    op_overhead_s: float = 0.0
    tp_overhead_s: float = 0.0
    fsdp_overhead_s: float = 0.0
    fsdp_tensor_overhead_s: float = 0.0
    fsdp_copy_bytes_per_s: float = 0.0
    sync_noise_s_per_sqrt_s: float = 0.0
    sync_speed_spread: float = 0.0
    optimizer_bytes_per_s: float = 0.0
    time_share: float = 1.0
    bandwidth_share: float = 1.0
    exposed_weight_traffic: bool = False

    def __post_init__(self) -> None:
        units = {
            "sync_noise_s_per_sqrt_s": " (seconds per square root of a second)",
            "sync_speed_spread": " (a fraction)",
        }
        for name in ("op_overhead_s", "tp_overhead_s", "fsdp_overhead_s", "fsdp_tensor_overhead_s", *units):
            value = _fraction(
                "host", name, getattr(self, name), zero_ok=True, one_ok=False, unit=units.get(name, " (seconds)")
            )
            object.__setattr__(self, name, value)
        for name in ("fsdp_copy_bytes_per_s", "optimizer_bytes_per_s"):
            object.__setattr__(self, name, _rate("host", name, getattr(self, name)))
        for name in ("time_share", "bandwidth_share"):
            object.__setattr__(self, name, _fraction("host", name, getattr(self, name), zero_ok=False, one_ok=True))
        if not isinstance(self.exposed_weight_traffic, bool):
            raise ClusterError(
                f"host exposed_weight_traffic={self.exposed_weight_traffic!r} is not allowed: it must be true or false."
            )

    @staticmethod
    def none() -> HostEffects:
        """No host effect: a GPU's."""
        return HostEffects()


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One accelerator (or one CPU process).

    Attributes:
        name: marketing name, e.g. ``"A100-SXM4-80GB"``.
        roofline: compute and bandwidth.
        memory: capacity and what is lost of it.
        host: host-side costs (none on GPUs).
        comm_overlap: the rate compute keeps, as a share of its own, while a
            data-parallel collective runs beside it. Overlapped collectives are not
            free: NCCL's kernels occupy streaming multiprocessors and compete for memory
            bandwidth, so a hidden collective costs ``1 - comm_overlap`` of its time
            (:func:`autopar.cost.data_parallel.overlapped_s`); 0.8 is the middle of the
            10-30% slowdowns reported for overlapped FSDP/DDP communication. CPU
            processes get 0: gloo reduces on the cores the compute uses, so nothing
            hides.
        preferred_dtype: the precision plans use unless told otherwise.
        async_tp: the device runs torch's asynchronous tensor parallelism (CUDA GPUs
            whose peers map each other's memory over NVLink, torch's symmetric memory):
            the H100 and H200 presets, where torchtitan measured it.
        compiles: the search compiles the blocks unless told not to. True on GPUs:
            torch.compile makes their fused kernels (Triton on CUDA) in the first step
            of a run of thousands, as torchtitan does by default, and a compiled block
            never costs more than the eager one (the fusion only removes memory traffic
            and kernels). False for CPU processes, where plans compile only when asked:
            inductor's C++ builds take minutes, a large share of a short CPU run.
        source: where the numbers come from.
    """

    name: str
    roofline: Roofline
    memory: DeviceMemory
    host: HostEffects = field(default_factory=HostEffects.none)
    comm_overlap: float = 0.8
    preferred_dtype: DType = DType.BF16
    async_tp: bool = False
    compiles: bool = False
    source: str = ""

    def __post_init__(self) -> None:
        owner = f"device {self.name!r}"
        for name, cls in (("roofline", Roofline), ("memory", DeviceMemory), ("host", HostEffects)):
            if not isinstance(getattr(self, name), cls):
                raise ClusterError(
                    f"{owner} {name}={getattr(self, name)!r} is not allowed: it must be a {cls.__name__}."
                )
        overlap = _fraction(
            owner, "comm_overlap", self.comm_overlap, zero_ok=True, one_ok=True, unit=" (0: never overlaps)"
        )
        object.__setattr__(self, "comm_overlap", overlap)
        object.__setattr__(self, "preferred_dtype", dtype_of(self.preferred_dtype, f"{owner} preferred_dtype"))
        for name in ("async_tp", "compiles"):
            if not isinstance(getattr(self, name), bool):
                raise ClusterError(f"{owner} {name}={getattr(self, name)!r} is not allowed: it must be true or false.")
        if self.preferred_dtype not in self.roofline.peak_flops:
            raise ClusterError(f"{owner} preferred_dtype={self.preferred_dtype.value} has no peak_flops entry.")
        self._check_magnitudes()

    def _check_magnitudes(self) -> None:
        """Refuse rates no real device is as slow as (:data:`~autopar.hardware.magnitudes.MIN_FLOP_PER_S`,
        :data:`~autopar.hardware.magnitudes.MIN_MEMORY_BYTES_PER_S`): a value in the wrong unit (989 for 989
        TFLOP/s) would otherwise plan as fitting with absurd times. Checked here, not in
        :class:`Roofline`, because a time-shared process states its share of the device
        (:func:`time_shared`, :func:`bandwidth_shared`): the bounds apply to the whole
        device, so many processes on a few cores still pass."""
        roof, host = self.roofline, self.host

        def refuse_below(bound: float, unit: str, field: str, value: float, share: float = 1.0, **extra: str) -> None:
            """Refuse ``value`` (``field`` ends in how it is given: ``=`` or `` at best ``)
            where the whole device, of which it states a ``share``, is slower than ``bound``."""
            if value / share >= bound:
                return
            whole = (
                f", {sci(value / share)} {unit} for the whole device of which it has {sci(share)}," if share < 1 else ""
            )
            what = f"device {self.name!r} roofline {field}{value!r} {unit}{whole}"
            raise too_small(what, value, bound, unit, "TG", **extra)

        for dtype, peak in roof.peak_flops.items():
            refuse_below(MIN_FLOP_PER_S, "FLOP/s", f"peak_flops[{dtype.value}]=", peak, host.time_share)
        for name, peak in (
            *((f"peak_flops[{d.value}]", p) for d, p in roof.peak_flops.items()),
            ("fp8_flops", roof.fp8_flops),
        ):
            if peak > MAX_FLOP_PER_S:
                raise ClusterError(
                    f"device {self.name!r} roofline {name}={peak!r} FLOP/s is above {sci(MAX_FLOP_PER_S)} FLOP/s, "
                    f"faster than any real device: the field is in FLOP/s (989 TFLOP/s is 9.89e14); fix the cluster "
                    f"file."
                )
        if roof.fp8_flops:  # never time-shared: CPU processes have no FP8 matmuls
            refuse_below(MIN_FLOP_PER_S, "FLOP/s", "fp8_flops=", roof.fp8_flops, note="0: no FP8 matmuls; ")
        for dtype, points in roof.matmul_curves.items():
            # the fastest point only: a tiny call is dispatch-bound (a 1x1x1 matmul reaches ~1e6 FLOP/s)
            refuse_below(
                MIN_FLOP_PER_S,
                "FLOP/s",
                f"matmul_curves[{dtype.value}] at best ",
                max(rate for _, rate in points),
                host.time_share,
                note="each point is [FLOPs per call, FLOP/s]; ",
                remedy=", or profile larger matmuls",
            )
        refuse_below(
            MIN_MEMORY_BYTES_PER_S,
            "B/s",
            "memory_bandwidth_bytes_per_s=",
            roof.memory_bandwidth_bytes_per_s,
            host.time_share * host.bandwidth_share,
        )

    def peak(self, dtype: DType) -> float:
        """Peak FLOP/s in ``dtype``; raises ClusterError if the device lacks it."""
        if dtype not in self.roofline.peak_flops:
            have = ", ".join(sorted(self.roofline.peak_flops))
            raise ClusterError(
                f"device {self.name} does not support dtype={dtype.value}: it has {have}. "
                f"Pick one of those with dtype=... (V100 trains in fp16, not bf16)."
            )
        return self.roofline.peak_flops[dtype]


def time_shared(device: DeviceSpec, share: float, why: str) -> DeviceSpec:
    """``device`` as seen by a process that gets only ``share`` of it: CPU processes
    outnumbering the cores are time-sliced, so every rate is multiplied by ``share`` and
    every per-op cost divided by it (``why`` is added to the source; :func:`alone` undoes
    it)."""
    if not 0 < share <= 1:
        raise ClusterError(f"device {device.name!r}: a time share of {share!r} is not allowed; it must be in (0, 1].")
    if share == 1:
        return device
    return _scaled(
        device, share, time_share=device.host.time_share * share, source=f"{device.source}{_SHARE_NOTE}{why}"
    )


def bandwidth_shared(device: DeviceSpec, share: float, why: str) -> DeviceSpec:
    """``device`` as seen by a process that keeps only ``share`` of its memory bandwidth
    because the node's other processes stream at the same time: the bandwidth and the
    (memory-bound) optimizer rate are multiplied by ``share`` (:func:`alone` undoes it)."""
    if not 0 < share <= 1:
        raise ClusterError(
            f"device {device.name!r}: a bandwidth share of {share!r} is not allowed; it must be in (0, 1]."
        )
    if share == 1:
        return device
    roofline = replace(
        device.roofline, memory_bandwidth_bytes_per_s=device.roofline.memory_bandwidth_bytes_per_s * share
    )
    host = replace(
        device.host,
        optimizer_bytes_per_s=device.host.optimizer_bytes_per_s * share,
        bandwidth_share=device.host.bandwidth_share * share,
    )
    return replace(device, roofline=roofline, host=host, source=f"{device.source}{_SHARE_NOTE}{why}")


def alone(device: DeviceSpec) -> DeviceSpec:
    """``device`` with the whole of its cores and memory bandwidth (before
    :func:`time_shared` and :func:`bandwidth_shared`): what a profile measured by one
    process alone compares against."""
    host = device.host
    if host.time_share == 1 and host.bandwidth_share == 1:
        return device
    k = 1 / host.bandwidth_share
    own = replace(
        device,
        roofline=replace(
            device.roofline, memory_bandwidth_bytes_per_s=device.roofline.memory_bandwidth_bytes_per_s * k
        ),
        host=replace(host, optimizer_bytes_per_s=host.optimizer_bytes_per_s * k, bandwidth_share=1.0),
    )
    return _scaled(own, 1 / host.time_share, time_share=1.0, source=device.source.split(_SHARE_NOTE)[0])


def _scaled(device: DeviceSpec, k: float, *, time_share: float, source: str) -> DeviceSpec:
    r, h = device.roofline, device.host
    roofline = replace(
        r,
        peak_flops={d: v * k for d, v in r.peak_flops.items()},
        memory_bandwidth_bytes_per_s=r.memory_bandwidth_bytes_per_s * k,
        matmul_curves={d: tuple((f, rate * k) for f, rate in pts) for d, pts in r.matmul_curves.items()},
    )
    host = replace(
        h,
        op_overhead_s=h.op_overhead_s / k,
        tp_overhead_s=h.tp_overhead_s / k,
        fsdp_overhead_s=h.fsdp_overhead_s / k,
        fsdp_tensor_overhead_s=h.fsdp_tensor_overhead_s / k,
        optimizer_bytes_per_s=h.optimizer_bytes_per_s * k,
        time_share=time_share,
    )
    return replace(device, roofline=roofline, host=host, source=source)


def with_host(device: DeviceSpec, **changes: Any) -> DeviceSpec:
    """``device`` with some host effects changed (what a profile measured)."""
    return replace(device, host=replace(device.host, **changes))
