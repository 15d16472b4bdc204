"""The sections of a profile report, as typed data: what was measured, and where.

- ``device``: achieved matmul FLOP/s against the FLOPs of one call, per precision, and
  streaming memory bandwidth (:class:`DeviceProfile`);
- ``layers``: forward and backward time, FLOPs and memory of each distinct unit of a
  model (:class:`ModelProfile`);
- ``network``: collective and point-to-point times over message sizes per group level,
  with a fitted latency and bus bandwidth per level
  (:class:`~autopar.profiles.network_section.NetworkProfile`).

Each section carries its own :class:`Provenance` (machine, software, date, command),
because the sections of a merged report may come from different runs or machines.
Units are in the field names: ``_s``, ``_bytes``, ``_flops``, ``_per_s``. The
``profiler`` package measures and writes these; the planner reads them
(:mod:`autopar.profiles.to_cluster`, :mod:`autopar.profiles.calibration`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from autopar.errors import ProfileFormatError
from autopar.hardware.magnitudes import MIN_MEMORY_BYTES_PER_S, sci
from autopar.vocab import DType


@dataclass(frozen=True, kw_only=True)
class Provenance:
    """Where and when a section was measured, with what software.

    Attributes:
        host: the host name (rank 0's for a network section).
        platform: operating system and architecture.
        cpu: the processor model.
        cpu_count: logical CPUs of the machine.
        memory_bytes: physical memory of the machine.
        accelerator: ``"none"`` or the accelerator's name and count.
        software: package -> version (python, torch, cuda, nccl, ...).
        created_utc: ISO 8601 date and time of the measurement.
        command: the command line or call that made it.
    """

    host: str
    platform: str
    cpu: str
    cpu_count: int
    memory_bytes: float
    accelerator: str
    software: Mapping[str, str]
    created_utc: str
    command: str


REMEASURE = "measure the profile again with autopar profile"


def check_measured(owner: str, **fields: float) -> None:
    """Refuse a measured figure of ``owner`` that no measurement gives: negative, NaN or
    infinite (a hand edit, or a file of another tool), naming the field."""
    for name, value in fields.items():
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            raise ProfileFormatError(
                f"{owner} {name}={value!r} is not allowed: a measured time, rate or share is a finite number >= 0; "
                f"{REMEASURE}."
            )


@dataclass(frozen=True, kw_only=True)
class Timing:
    """Summary of repeated timings of one thing, after warm-up (``mean_s``: None in older reports)."""

    median_s: float
    min_s: float
    max_s: float
    repeats: int
    mean_s: float | None = None

    def __post_init__(self) -> None:
        inner = (self.median_s,) if self.mean_s is None else (self.median_s, self.mean_s)
        if self.repeats < 1 or not 0 <= self.min_s <= min(inner) <= max(inner) <= self.max_s:
            raise ProfileFormatError(
                f"timing {self!r} is inconsistent: it needs repeats >= 1 and 0 <= min_s <= median_s, mean_s <= max_s."
            )

    @staticmethod
    def of(samples_s: Sequence[float]) -> Timing:
        """Summarise raw samples (seconds)."""
        if not samples_s:
            raise ProfileFormatError("cannot summarise zero timing samples; measure at least once.")
        return Timing(
            median_s=statistics.median(samples_s),
            min_s=min(samples_s),
            max_s=max(samples_s),
            repeats=len(samples_s),
            mean_s=statistics.mean(samples_s),
        )

    @property
    def spread(self) -> float:
        """(max - min) / median: how noisy the repeats were."""
        return (self.max_s - self.min_s) / self.median_s if self.median_s > 0 else 0.0

    @property
    def per_call_s(self) -> float:
        """Seconds per call of what a step repeats many times (a collective): the mean, as
        slow repeats are part of what many calls cost (a 512 KiB gloo all-reduce on 2 ranks
        here: repeats of 0.52, 0.60, 1.46 ms; 2.0 ms a call in a tp=2 step); else the median."""
        return self.median_s if self.mean_s is None else self.mean_s


@dataclass(frozen=True, kw_only=True)
class TimedKernel:
    """A kernel call of known FLOPs in ``dtype``, timed: ``flops`` per call."""

    dtype: DType
    flops: float
    time: Timing

    def __post_init__(self) -> None:
        if not self.flops > 0 or not self.time.median_s > 0:
            raise ProfileFormatError(
                f"a kernel of flops={self.flops!r} timed at median_s={self.time.median_s!r} is not allowed: a kernel "
                f"does work (flops > 0) and takes time (median_s > 0); measure the profile again with autopar profile."
            )

    @property
    def achieved_flop_per_s(self) -> float:
        """FLOPs of one call over its median time."""
        return self.flops / self.time.median_s


@dataclass(frozen=True, kw_only=True)
class MatmulPoint(TimedKernel):
    """One matmul shape: ``(m, k) @ (k, n)`` in ``dtype`` (a training precision the
    planner prices), ``2 m n k`` FLOPs per call."""

    m: int
    n: int
    k: int

    def __post_init__(self) -> None:
        super().__post_init__()
        if min(self.m, self.n, self.k) < 1:
            raise ProfileFormatError(
                f"a matmul of m={self.m}, n={self.n}, k={self.k} is not allowed: each dimension is at least 1; "
                f"{REMEASURE}."
            )


@dataclass(frozen=True, kw_only=True)
class AttentionPoint(TimedKernel):
    """One fused attention call, forward and backward: causal
    ``F.scaled_dot_product_attention`` over ``(batch, heads, seq_len, head_dim)`` queries,
    keys and values in ``dtype``. ``flops`` is what the kernel computes in the
    FlashAttention benchmarks' convention, the planner's
    (:attr:`autopar.hardware.device.Roofline.attention_efficiency`): the forward's score
    and value products, half of them under the causal mask, and a backward of 2.5 times
    that."""

    batch: int
    heads: int
    seq_len: int
    head_dim: int


@dataclass(frozen=True, kw_only=True)
class BandwidthPoint:
    """One streaming kernel (``copy``: ``b.copy_(a)``; ``add``: ``c = a + b``) over
    arrays of ``array_bytes``, moving ``moved_bytes`` through memory per call."""

    kernel: Literal["copy", "add"]
    array_bytes: float
    moved_bytes: float
    time: Timing

    @property
    def achieved_bytes_per_s(self) -> float:
        """Bytes moved over the median time."""
        return self.moved_bytes / self.time.median_s


@dataclass(frozen=True, kw_only=True)
class DeviceProfile:
    """Achievable compute and memory rates of one device (one GPU, or one CPU process).

    Attributes:
        name: the device (GPU name, or ``cpu-process`` and the CPU model).
        kind: ``cpu`` or ``cuda``.
        threads: intra-op threads the CPU measurements used (1 on GPU).
        memory_bytes: the device's memory (GPU memory; for a CPU process, the
            machine's RAM, which the processes of a node share: ``memory_shared``).
        memory_shared: whether ``memory_bytes`` is shared by the processes of a node.
        reserved_bytes: memory in use before anything was allocated (CUDA context);
            0 on CPU, where a process's baseline is not device memory.
        timer: ``cuda-events`` or ``wall-clock``.
        matmul: the matmul sweep; ``skipped_dtypes`` says which precisions did not run.
        bandwidth: the streaming sweep.
        memory_bandwidth_bytes_per_s: the summary the cost model uses: the fastest
            kernel at the largest array (out of cache on a CPU).
        op_overhead_s: framework time per dispatched op in training (eager dispatch and
            autograd), from a chain of tiny ops; 0 when not measured.
        tp_overhead_s: extra time per forward of a tensor-parallel leaf (DTensor
            dispatch), from a tiny column-parallel linear on a one-rank mesh; 0 when not
            measured (GPU, where it hides behind kernels).
        optimizer_s_per_param: time of one AdamW step per fp32 parameter (PyTorch's
            default implementation); 0 when not measured.
        attention: the fused attention sweep (GPU only: on CPU the planner prices
            attention by the flop counter, at no kernel rate); empty when not measured.
    """

    name: str
    kind: Literal["cpu", "cuda"]
    threads: int
    memory_bytes: float
    memory_shared: bool
    reserved_bytes: float
    timer: str
    matmul: tuple[MatmulPoint, ...]
    bandwidth: tuple[BandwidthPoint, ...]
    memory_bandwidth_bytes_per_s: float
    skipped_dtypes: Mapping[str, str] = field(default_factory=dict)
    op_overhead_s: float = 0.0
    tp_overhead_s: float = 0.0
    optimizer_s_per_param: float = 0.0
    attention: tuple[AttentionPoint, ...] = ()
    provenance: Provenance

    def __post_init__(self) -> None:
        if not self.memory_bytes > 0 or not 0 <= self.reserved_bytes < self.memory_bytes:
            raise ProfileFormatError(
                f"memory_bytes={self.memory_bytes!r} with reserved_bytes={self.reserved_bytes!r} is not allowed: a "
                f"device has memory (memory_bytes > 0) and reserves part of it (0 <= reserved_bytes < memory_bytes); "
                f"measure the profile again with autopar profile."
            )
        if self.threads < 1:
            raise ProfileFormatError(
                f"threads={self.threads} is not allowed: a device was measured with at least one thread; {REMEASURE}."
            )
        bandwidth = self.memory_bandwidth_bytes_per_s
        if not (math.isfinite(bandwidth) and bandwidth >= MIN_MEMORY_BYTES_PER_S):
            raise ProfileFormatError(
                f"memory_bandwidth_bytes_per_s={bandwidth!r} is not allowed: a device streams at least "
                f"{sci(MIN_MEMORY_BYTES_PER_S)} bytes per second (the field is in bytes per second: 13.8 GB/s is "
                f"1.38e10); {REMEASURE}."
            )
        check_measured(
            "the device's",
            op_overhead_s=self.op_overhead_s,
            tp_overhead_s=self.tp_overhead_s,
            optimizer_s_per_param=self.optimizer_s_per_param,
        )

    @property
    def dtypes(self) -> tuple[str, ...]:
        """Precisions with a measured matmul curve."""
        return tuple(sorted({p.dtype for p in self.matmul}))

    def curve(self, dtype: str) -> tuple[tuple[float, float], ...]:
        """``((flops per call, achieved FLOP/s), ...)`` in increasing FLOPs; points with
        equal FLOPs are averaged (the cost model interpolates over call FLOPs only)."""
        by_flops: dict[float, list[float]] = {}
        for p in self.matmul:
            if p.dtype == dtype:
                by_flops.setdefault(p.flops, []).append(p.achieved_flop_per_s)
        return tuple((f, sum(v) / len(v)) for f, v in sorted(by_flops.items()))

    def attention_flop_per_s(self, dtype: str) -> float | None:
        """The fused attention kernel's mean achieved rate in ``dtype`` over the measured
        shapes (None where none was measured): the one rate the planner prices every
        attention core at."""
        rates = [p.achieved_flop_per_s for p in self.attention if p.dtype == dtype]
        return statistics.mean(rates) if rates else None

    def peak_flop_per_s(self, dtype: str) -> float:
        """The fastest achieved matmul rate in ``dtype``."""
        rates = [p.achieved_flop_per_s for p in self.matmul if p.dtype == dtype]
        if not rates:
            raise ProfileFormatError(
                f"device profile of {self.name} has no {dtype} matmul; measured: {', '.join(self.dtypes) or 'none'}."
            )
        return max(rates)


@dataclass(frozen=True, kw_only=True)
class WorkItem:
    """One kernel of a unit as the analytic cost model sees it, at the measured batch:
    a leaf (its matmul and other FLOPs and bytes) or the glue between leaves. Kept so
    that a reader can predict the unit's time from device rates alone
    (``autopar.profiles.layer_calibration``). ``bytes`` counts everything the kernel
    moves, ``weight_bytes`` the part that is the leaf's weights (read once per call
    whatever the batch)."""

    name: str
    matmul_flops: float
    other_flops: float
    bytes: float
    ops: float = 0.0
    weight_bytes: float = 0.0


@dataclass(frozen=True, kw_only=True)
class UnitMeasurement:
    """One distinct unit of a model, measured once for all its identical instances.

    Attributes:
        fqn: the unit's name in ``autopar.graph`` (a block's FQN, or the joined module
            names of what runs before the first block or after the last, loss included).
        signature: ``autopar.graph`` ``UnitProfile.signature``, shared by identical units.
        instances: every unit of the model with this signature, in execution order.
        modules: the module FQNs the unit holds.
        fwd, bwd: forward and backward time at the measured batch.
        recompute_bwd: backward time with the unit's forward run under full
            recomputation's checkpoint, so rerun in backward; None where the unit is not
            one call that can be wrapped (what runs before the first block or after the
            last) or the report predates it.
        fwd_flops, bwd_flops: FLOPs counted while running them (math attention kernel).
        param_bytes: parameters of the unit.
        saved_bytes: activation bytes autograd keeps for backward (unique storages,
            parameters excluded) after the unit's forward.
        peak_bytes: the most memory allocated during forward plus backward, above what
            was allocated before (inputs, parameters).
        work: the unit's kernels as the cost model sees them (see :class:`WorkItem`).
    """

    fqn: str
    signature: str
    instances: tuple[str, ...]
    modules: tuple[str, ...]
    fwd: Timing
    bwd: Timing
    fwd_flops: float
    bwd_flops: float
    param_bytes: float
    saved_bytes: float
    peak_bytes: float
    work: tuple[WorkItem, ...]
    recompute_bwd: Timing | None = None

    def __post_init__(self) -> None:
        if not (self.fwd.median_s > 0 and self.bwd.median_s > 0):
            raise ProfileFormatError(
                f"unit {self.fqn!r} timed at forward median_s={self.fwd.median_s!r}, backward "
                f"median_s={self.bwd.median_s!r} is not allowed: a unit's forward and backward take time (median_s > "
                f"0); measure the profile again with autopar profile."
            )

    @property
    def time_s(self) -> float:
        """Median forward plus median backward time."""
        return self.fwd.median_s + self.bwd.median_s

    @property
    def achieved_flop_per_s(self) -> float:
        """Forward plus backward FLOPs over forward plus backward time."""
        return (self.fwd_flops + self.bwd_flops) / self.time_s if self.time_s > 0 else 0.0


@dataclass(frozen=True, kw_only=True)
class ModelProfile:
    """Per-unit measurements of one model at one batch shape on one device.

    ``sample_shape``: the shape of the first input tensor (batch first). ``batch``: the
    samples per measured call. ``seq_len``: tokens per sample (1 for non-sequence
    models). ``dtype``: the model's parameter precision. ``device``/``device_kind``: the
    device's name and ``cpu`` or ``cuda``; ``threads``: CPU intra-op threads; ``warmup``:
    untimed runs of each unit before its timed repeats.

    ``model_fingerprint`` and ``parameter_shapes``: which model was measured
    (``autopar.graph.model_fingerprint``, and every parameter's shape under its name,
    tied ones once), so the planner applies the profile to that model only, at any
    shape (:mod:`autopar.profiles.identity`). A report written before they were
    recorded reads as ``""`` and ``{}``: unknown, matched to a model by its units.
    """

    model: str
    model_fingerprint: str = ""
    parameter_shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    batch: int
    seq_len: int
    sample_shape: tuple[int, ...]
    dtype: str
    device: str
    device_kind: Literal["cpu", "cuda"]
    threads: int
    timer: str
    warmup: int
    units: tuple[UnitMeasurement, ...]
    provenance: Provenance

    def __post_init__(self) -> None:
        dtypes = [d.value for d in DType]
        problem = (
            f"dtype {self.dtype!r} is not one of {', '.join(dtypes)}"
            if self.dtype not in dtypes
            else f"batch {self.batch} is not a sample count (at least 1)"
            if self.batch < 1
            else f"seq_len {self.seq_len} is not a token count (at least 1)"
            if self.seq_len < 1
            else "it measured no unit"
            if not self.units
            else None
        )
        if problem:
            raise ProfileFormatError(
                f"the layers section of {self.model}'s profile is not one 'autopar profile model' writes: {problem}; "
                f"measure the model again."
            )

    def step_s(self) -> float:
        """Forward plus backward of the whole model: every instance of every unit."""
        return sum(u.time_s * len(u.instances) for u in self.units)
