"""Timing on a device: CUDA events on a GPU, a monotonic wall clock on a CPU.

GPU kernels run asynchronously, so a host clock measures the launch, not the kernel;
CUDA events recorded on the stream around the work, then synchronized, measure the
kernel (the method of NVIDIA's "How to Implement Performance Metrics in CUDA C/C++").
On a CPU the work is synchronous and ``time.perf_counter`` is right. Every measurement
warms up first (lazy initialisation, allocator growth, oneDNN/cuBLAS heuristics) and
reports the median over repeats, which a single preempted repeat on a shared machine
does not move.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from autopar.profiles.sections import Timing
from profiler.errors import SettingsError


@dataclass(frozen=True, kw_only=True)
class Repeats:
    """How often to run something before and while timing it.

    Attributes:
        warmup: untimed runs first.
        repeats: timed samples wanted.
        min_repeats: samples taken even when ``budget_s`` is spent.
        budget_s: stop sampling once this much time was measured (after ``min_repeats``).
        min_sample_s: a sample shorter than this repeats the call inside the sample and
            divides, so a microsecond kernel is not lost in clock resolution.
    """

    warmup: int = 2
    repeats: int = 7
    min_repeats: int = 3
    budget_s: float = math.inf
    min_sample_s: float = 1e-3

    def __post_init__(self) -> None:
        if self.warmup < 0 or self.repeats < 1 or not 1 <= self.min_repeats <= self.repeats:
            raise SettingsError(
                f"repeats: warmup={self.warmup}, repeats={self.repeats}, min_repeats="
                f"{self.min_repeats} are not allowed: need warmup >= 0 and "
                f"1 <= min_repeats <= repeats."
            )
        if not self.budget_s > 0 or self.min_sample_s < 0:
            raise SettingsError(
                f"repeats: budget_s={self.budget_s} must be > 0 and min_sample_s={self.min_sample_s} >= 0."
            )


def timer_name(device: torch.device) -> str:
    """The clock used on ``device``."""
    return "cuda-events" if device.type == "cuda" else "wall-clock"


class Stopwatch:
    """Times consecutive laps of work on one device: ``start()``, work, ``stop()``."""

    def __init__(self, device: torch.device):
        self.device = device
        self._t0 = 0.0
        self._event: Any = None

    def start(self) -> None:
        """Mark the beginning of a lap."""
        if self.device.type == "cuda":
            self._event = torch.cuda.Event(enable_timing=True)
            self._event.record()
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> float:
        """Seconds since :meth:`start`, the device's work included."""
        if self.device.type == "cuda":
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            return self._event.elapsed_time(end) / 1e3
        return time.perf_counter() - self._t0


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], Any], *, device: torch.device, settings: Repeats) -> Timing:
    """Time ``fn()`` per call: warm-up, then samples until ``settings`` say stop."""
    return time_calls([fn], device=device, settings=settings)[0]


def time_calls(fns: Sequence[Callable[[], Any]], *, device: torch.device, settings: Repeats) -> list[Timing]:
    """Time each of ``fns`` per call, their samples interleaved: every round takes one
    sample of each, so a burst of load from another process lands on one sample of
    each (which the median drops) instead of on every sample of one. On this shared box
    a matmul timed in one block came out at 75 GFLOP/s in one profile and 91 in the next,
    which moved every prediction at that shape. ``settings.budget_s`` is per call."""
    watch = Stopwatch(device)
    inners = [_calls_per_sample(fn, watch, device, settings) for fn in fns]
    samples: list[list[float]] = [[] for _ in fns]
    spent = 0.0
    while len(samples[0]) < settings.repeats and (
        len(samples[0]) < settings.min_repeats or spent < settings.budget_s * len(fns)
    ):
        for fn, inner, taken in zip(fns, inners, samples):
            watch.start()
            for _ in range(inner):
                fn()
            elapsed = watch.stop()
            spent += elapsed
            taken.append(elapsed / inner)
    return [Timing.of(taken) for taken in samples]


def _calls_per_sample(fn: Callable[[], Any], watch: Stopwatch, device: torch.device, settings: Repeats) -> int:
    """Warm ``fn`` up, then double the calls per sample until a sample lasts
    ``settings.min_sample_s``."""
    for _ in range(settings.warmup):
        fn()
    synchronize(device)
    inner = 1
    while True:
        watch.start()
        for _ in range(inner):
            fn()
        if watch.stop() >= settings.min_sample_s or inner >= 8192:
            return inner
        inner *= 2
