"""Achievable matmul FLOP/s and memory bandwidth of this device.

Datasheet peaks overstate what a training step gets: a GEMM reaches its peak only when
it is large enough to fill the machine (NVIDIA, "Matrix Multiplication Background User's
Guide": small GEMMs are latency and wave-quantisation bound), and memory-bound kernels
reach a fraction of the nominal bandwidth (McCalpin's STREAM benchmark). So the profiler
measures the curve the cost model needs: achieved FLOP/s against the FLOPs of one call,
square ``(n, n) @ (n, n)`` matmuls from small to large in every precision the device
runs, and the bandwidth of streaming ``copy`` and ``add`` kernels (STREAM's Copy and
Add) over arrays from in-cache to far beyond the last-level cache. On a GPU it also
measures the fused attention kernel (:mod:`profiler.attention`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from autopar.hardware.device import CPU_PROCESS
from autopar.profiles.report import ProfileReport
from autopar.profiles.sections import AttentionPoint, BandwidthPoint, DeviceProfile, MatmulPoint
from profiler.attention import HALF_PRECISIONS, SEQ_LENS, measure_attention
from profiler.errors import MeasurementError, SettingsError
from profiler.framework_overhead import tp_overhead_s
from profiler.machine import cpu_model, physical_memory_bytes, provenance
from profiler.timing import Repeats, time_call, time_calls, timer_name

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MIB = 2**20


@dataclass(frozen=True, kw_only=True)
class DeviceSweep:
    """What :func:`profile_device` measures; empty tuples mean "the default for the device".

    Attributes:
        matmul_sizes: ``n`` of the square matmuls (CPU: 16..2048, GPU: 256..16384).
        dtypes: precisions (default: fp32 and bf16, and fp16 on a GPU, where supported).
        array_bytes: sizes of the streaming arrays (CPU: 1..256 MiB, GPU: 4 MiB..1 GiB).
        repeats: warm-up and repeats of each point; ``budget_s`` caps a point's time.
    """

    matmul_sizes: tuple[int, ...] = ()
    dtypes: tuple[str, ...] = ()
    array_bytes: tuple[int, ...] = ()
    repeats: Repeats = field(default_factory=lambda: Repeats(warmup=2, repeats=7, min_repeats=3, budget_s=0.5))

    def __post_init__(self) -> None:
        bad = [d for d in self.dtypes if d not in TORCH_DTYPES]
        if bad:
            raise SettingsError(f"unknown dtype(s) {bad}; choose from {sorted(TORCH_DTYPES)}.")
        if any(n < 1 for n in self.matmul_sizes) or any(b < 4096 for b in self.array_bytes):
            raise SettingsError(
                f"matmul sizes {self.matmul_sizes} must be >= 1 and array sizes {self.array_bytes} >= 4096 bytes."
            )


def profile_device(
    *,
    device: torch.device | str | None = None,
    sweep: DeviceSweep | None = None,
    threads: int | None = 1,
    progress: Callable[[str], None] | None = None,
    command: str = "profiler.profile_device()",
) -> ProfileReport:
    """Measure this device's matmul curves and memory bandwidth.

    Args:
        device: ``cpu`` or a CUDA device (default: the current CUDA device if any).
        sweep: sizes, precisions and repeats (defaults per device kind).
        threads: CPU intra-op threads while measuring (default 1: a ``local-cpu`` device is
            one single-threaded process, and spare threads spin-wait on a busy core;
            None leaves torch's setting).
        progress: called with a line per measured point.
        command: recorded in the report's provenance.
    """
    dev = resolve_device(device)
    sweep = sweep or DeviceSweep()
    say = progress or (lambda _line: None)
    with threads_context(threads):
        n_threads = torch.get_num_threads() if dev.type == "cpu" else 1
        reserved = _reserved_bytes(dev)
        sizes = sweep.matmul_sizes or _default_sizes(dev)
        points: list[MatmulPoint] = []
        skipped: dict[str, str] = {}
        for name in sweep.dtypes or _default_dtypes(dev):
            reason = unsupported(name, dev)
            if reason:
                skipped[name] = reason
                say(f"matmul {name}: skipped ({reason})")
                continue
            for point in measure_matmuls([(n, n, n) for n in sizes], name, dev, sweep.repeats):
                points.append(point)
                say(f"matmul {name} {point.m}x{point.n}x{point.k}: {point.achieved_flop_per_s / 1e9:.1f} GFLOP/s")
        attention: list[AttentionPoint] = []
        if dev.type == "cuda":
            for name in (d for d in HALF_PRECISIONS if d in {p.dtype for p in points}):
                for ap in measure_attention(SEQ_LENS, TORCH_DTYPES[name], name, dev, sweep.repeats):
                    attention.append(ap)
                    say(f"attention {name} {ap.batch}x{ap.seq_len}: {ap.achieved_flop_per_s / 1e12:.1f} TFLOP/s")
        op_overhead = measure_op_overhead(dev, sweep.repeats)
        say(f"framework overhead: {op_overhead * 1e6:.1f} us per op")
        tp_overhead = measure_tp_overhead(sweep.repeats) if dev.type == "cpu" else 0.0
        if tp_overhead:
            say(f"tensor-parallel (DTensor) overhead: {tp_overhead * 1e6:.0f} us per sharded layer forward")
        optimizer = measure_optimizer_step(dev, sweep.repeats)
        say(f"AdamW step: {optimizer * 1e9:.2f} ns per parameter")
        bandwidth = []
        for nbytes in sweep.array_bytes or _default_arrays(dev):
            for kernel in ("copy", "add"):
                bp = measure_stream(kernel, nbytes, dev, sweep.repeats)
                bandwidth.append(bp)
                say(f"{kernel} {nbytes / MIB:g} MiB: {bp.achieved_bytes_per_s / 1e9:.1f} GB/s")
    if not points:
        raise MeasurementError(f"no matmul precision ran on {dev}: {skipped}. Choose dtypes the device supports.")
    largest = max(b.array_bytes for b in bandwidth)
    summary = max(b.achieved_bytes_per_s for b in bandwidth if b.array_bytes == largest)
    profile = DeviceProfile(
        name=device_name(dev, n_threads),
        kind="cuda" if dev.type == "cuda" else "cpu",
        threads=n_threads,
        memory_bytes=float(_memory_bytes(dev)),
        memory_shared=dev.type == "cpu",
        reserved_bytes=reserved,
        timer=timer_name(dev),
        matmul=tuple(points),
        bandwidth=tuple(bandwidth),
        memory_bandwidth_bytes_per_s=summary,
        skipped_dtypes=skipped,
        op_overhead_s=op_overhead,
        tp_overhead_s=tp_overhead,
        optimizer_s_per_param=optimizer,
        attention=tuple(attention),
        provenance=provenance(command),
    )
    return ProfileReport(device=profile)


OVERHEAD_CHAIN = 32
"""Tiny ops per timed chain: enough that one call's fixed costs dominate."""


def measure_op_overhead(device: torch.device, repeats: Repeats) -> float:
    """Framework time per op of a training step: forward and backward of a chain of
    ``OVERHEAD_CHAIN`` multiply-adds on an 8-element tensor (the arithmetic is nothing,
    so the time is dispatch, autograd and allocation), over the ops it dispatches."""
    x = torch.zeros(8, device=device, requires_grad=True)

    def step() -> None:
        y = x
        for _ in range(OVERHEAD_CHAIN):
            y = y * 1.0001 + 1e-4
        y.sum().backward()

    ops = count_ops(step)
    timing = time_call(step, device=device, settings=repeats)
    return timing.median_s / ops


OPTIMIZER_TENSORS = 8
"""Parameter tensors of the timed optimizer step: several, as a model has, so the
per-tensor cost of the loop over parameters is in the figure."""


def measure_optimizer_step(device: torch.device, repeats: Repeats) -> float:
    """Seconds per parameter of one ``torch.optim.AdamW`` step (PyTorch's default
    implementation for the device) on fp32 parameters far larger than the caches.

    The cost model charges an optimizer step as memory traffic; an eager CPU AdamW
    makes a dozen passes over its states rather than the one a fused GPU kernel makes,
    and reaches a third of the streaming bandwidth on this machine, so it is measured.
    """
    numel = (1 << 20) if device.type == "cpu" else (1 << 24)
    params = [torch.nn.Parameter(torch.zeros(numel, device=device)) for _ in range(OPTIMIZER_TENSORS)]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    opt = torch.optim.AdamW(params, lr=1e-3)
    timing = time_call(opt.step, device=device, settings=repeats)
    return timing.median_s / (numel * OPTIMIZER_TENSORS)


def count_ops(fn: Callable[[], None]) -> int:
    """The aten ops ``fn`` dispatches (forward and backward)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.calls += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return max(Count.calls, 1)


def measure_tp_overhead(repeats: Repeats) -> float:
    """Framework time per tensor-parallel leaf-forward on a one-rank CPU mesh
    (:mod:`profiler.framework_overhead`), in a forked process so this process keeps no process
    group. A network profile measures it again on a real group, which the planner
    prefers (the collectives' own framework cost only shows there)."""
    from autopar.runtime.spmd import SPMDSettings, run_spmd

    return float(run_spmd(_tp_overhead_rank, 1, repeats, settings=SPMDSettings(timeout_s=120))[0])


def _tp_overhead_rank(rank: int, world: int, repeats: Repeats) -> float:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1,))
    return tp_overhead_s(mesh, torch.device("cpu"), repeats, all_reduce_s=lambda nbytes: 0.0)


def measure_matmuls(
    shapes: Sequence[tuple[int, int, int]], dtype: str, device: torch.device, repeats: Repeats
) -> list[MatmulPoint]:
    """Time ``(m, k) @ (k, n)`` into a preallocated output for each ``(m, n, k)``,
    interleaved (:func:`profiler.timing.time_calls`): the curve's points see the same
    load, so a burst does not bend it at one size."""
    dt = TORCH_DTYPES[dtype]
    calls = []
    for m, n, k in shapes:
        a = torch.randn(m, k, device=device).to(dt)
        b = torch.randn(k, n, device=device).to(dt)
        out = torch.empty(m, n, device=device, dtype=dt)
        calls.append(functools.partial(torch.mm, a, b, out=out))
    timings = time_calls(calls, device=device, settings=repeats)
    return [
        MatmulPoint(dtype=dtype, m=m, n=n, k=k, flops=2.0 * m * n * k, time=t) for (m, n, k), t in zip(shapes, timings)
    ]


def measure_stream(kernel: str, array_bytes: int, device: torch.device, repeats: Repeats) -> BandwidthPoint:
    """Time a streaming kernel over fp32 arrays of ``array_bytes`` each."""
    numel = max(1, array_bytes // 4)
    a = torch.rand(numel, device=device)
    b = torch.rand(numel, device=device)
    if kernel == "copy":
        timing = time_call(lambda: b.copy_(a), device=device, settings=repeats)
        moved = 2 * numel * 4
    else:
        c = torch.empty_like(a)
        timing = time_call(lambda: torch.add(a, b, out=c), device=device, settings=repeats)
        moved = 3 * numel * 4
    return BandwidthPoint(
        kernel="copy" if kernel == "copy" else "add",
        array_bytes=float(numel * 4),
        moved_bytes=float(moved),
        time=timing,
    )


def unsupported(dtype: str, device: torch.device) -> str:
    """Why ``dtype`` matmuls cannot run on ``device`` ("" when they can)."""
    if device.type == "cuda" and dtype == "bf16" and not torch.cuda.is_bf16_supported():
        return f"{torch.cuda.get_device_name(device)} has no bf16 support"
    try:
        x = torch.ones(8, 8, device=device, dtype=TORCH_DTYPES[dtype])
        torch.mm(x, x)
    except (RuntimeError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    return ""


def device_name(device: torch.device, threads: int) -> str:
    """``"NVIDIA H100 80GB HBM3"`` or ``"cpu-process: AMD EPYC, 1 thread"``."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{CPU_PROCESS}: {cpu_model()}, {threads} thread{'s' if threads != 1 else ''}"


def resolve_device(device: torch.device | str | None) -> torch.device:
    """The device to measure: the given one, else the current CUDA device, else the CPU."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SettingsError(f"device {dev} was asked for but CUDA is not available here; use device='cpu'.")
    if dev.type not in ("cpu", "cuda"):
        raise SettingsError(f"device {dev} is not supported: the profiler measures 'cpu' and 'cuda' devices.")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


@contextlib.contextmanager
def threads_context(threads: int | None) -> Iterator[None]:
    """Run a block with ``threads`` CPU intra-op threads (None: unchanged), restoring after."""
    if threads is None:
        yield
        return
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise SettingsError(f"threads={threads!r} must be a positive integer.")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _default_sizes(device: torch.device) -> tuple[int, ...]:
    if device.type == "cuda":
        return tuple(2**i for i in range(8, 15))
    return tuple(2**i for i in range(4, 12))


def _default_dtypes(device: torch.device) -> tuple[str, ...]:
    return ("fp32", "bf16", "fp16") if device.type == "cuda" else ("fp32", "bf16")


def _default_arrays(device: torch.device) -> tuple[int, ...]:
    if device.type == "cuda":
        return tuple(4**i * 4 * MIB for i in range(5))
    return tuple(4**i * MIB for i in range(5))


def _memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return physical_memory_bytes()


def _reserved_bytes(device: torch.device) -> float:
    if device.type != "cuda":
        return 0.0
    torch.cuda.init()
    free, total = torch.cuda.mem_get_info(device)
    return float(max(0, total - free - torch.cuda.memory_allocated(device)))
