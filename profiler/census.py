"""Counting what a unit does besides taking time: FLOPs, saved activations, peak memory.

- FLOPs: the formulas the planner's trace uses (:func:`autopar.graph.flops.op_flops`:
  ``FlopCounterMode``'s table and the ones it lacks, such as grouped matmuls) applied to
  every aten op that runs. On real CPU tensors the
  fused SDPA kernel has no formula and would count as zero, so the counting run forces the
  math attention backend, which decomposes into
  counted batched matmuls.
- Saved activations: ``saved_tensors_hooks`` sees every tensor autograd keeps for
  backward; storages are counted once and parameters never (the method of
  ``autopar.graph``, here on real tensors).
- Peak memory: on a GPU, the caching allocator's peak statistic; on a CPU, the
  allocation and free events the PyTorch profiler records (``profile_memory=True``),
  summed in time order. Both are measured above what was allocated when the unit
  started (its inputs and parameters).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.graph.flops import op_flops
from profiler.errors import MeasurementError
from profiler.unit_runners import Phase


class FlopCount(TorchDispatchMode):
    """Sums the FLOPs of the aten ops run while active (the planner's formulas)."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0.0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.flops += op_flops(func, args, kwargs, out) or 0.0
        return out


class FlopLap:
    """A lap that counts forward and backward FLOPs separately."""

    def __init__(self) -> None:
        self.flops = {"fwd": 0.0, "bwd": 0.0}
        self._mode: FlopCount | None = None

    def begin(self, phase: Phase) -> None:
        """Start counting."""
        self._mode = FlopCount()
        self._mode.__enter__()

    def end(self, phase: Phase) -> None:
        """Stop counting and keep the phase's total."""
        assert self._mode is not None
        self._mode.__exit__(None, None, None)
        self.flops[phase] += self._mode.flops
        self._mode = None


def math_attention() -> contextlib.AbstractContextManager[None]:
    """Force the math SDPA backend, whose ops have FLOP formulas."""
    return sdpa_kernel(SDPBackend.MATH)


class MemoryLap:
    """A lap that records saved activation bytes (forward) and the peak memory
    allocated from the start of forward to the end of backward."""

    def __init__(self, device: torch.device, param_ptrs: set[int]):
        self.device = device
        self.param_ptrs = param_ptrs
        self.saved_bytes = 0.0
        self.peak_bytes = 0.0
        self._seen: set[int] = set()
        self._hooks: Any = None
        self._prof: Any = None
        self._base = 0

    def begin(self, phase: Phase) -> None:
        """Forward: start the memory probe and the saved-tensor hooks."""
        if phase == "fwd":
            self._start_peak()
            self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
            self._hooks.__enter__()

    def end(self, phase: Phase) -> None:
        """Forward: stop the hooks; backward: read the peak."""
        if phase == "fwd":
            self._hooks.__exit__(None, None, None)
        else:
            self.peak_bytes = self._stop_peak()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return t
        ptr = storage.data_ptr()
        if ptr not in self.param_ptrs and ptr not in self._seen:
            self._seen.add(ptr)
            self.saved_bytes += float(storage.nbytes())
        return t

    def _start_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            return
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        older = torch.empty(16)  # allocated before the profiler starts, freed while it runs:
        with _quiet_stderr():
            self._prof.start()
            del older  # torch warns once a process, on fd 2, of such a block: the warning is spent here, silenced

    def _stop_peak(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return float(torch.cuda.max_memory_allocated(self.device) - self._base)
        with _quiet_stderr():
            self._prof.stop()
        return float(cpu_peak_bytes(self._prof))


def cpu_peak_bytes(prof: profile) -> int:
    """The most bytes live at once, from a profiler's allocation (+) and free (-) events."""
    try:
        events = prof.profiler.kineto_results.events()
    except AttributeError as exc:
        raise MeasurementError(
            f"this torch ({torch.__version__}) does not expose the profiler's memory events "
            f"({exc}); run with measure_memory=False."
        ) from None
    deltas = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in deltas:
        live += nbytes
        peak = max(peak, live)
    return peak


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence the two ``USDT: profiler_start/stop`` lines kineto writes to fd 2 (and,
    once a process, torch's warning that a block allocated before the profiler started
    was freed while it ran, which the measured step does to its inputs)."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
