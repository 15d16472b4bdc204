"""Per-step metrics: wall time and peak memory of each rank.

Peak memory means what the planner predicts (``Prediction.memory_bytes_per_device``):
the bytes of the tensors the framework holds at the step's peak (parameters, gradients,
optimizer state, activations, communication buffers).

- On CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, the
  caching allocator's exact count of live tensor bytes.
- On CPU there is no allocator counter. What was tried on torch 2.13 (docs/runtime.md):
  ``torch.distributed._tools.mem_tracker.MemTracker`` fails inside a pipelining schedule
  ("A leaf node was passed to _will_engine_execute_node but we are currently running
  autograd.grad()"; the schedules run backward through ``autograd.grad``); the profiler's
  ``profile_memory`` records almost none of the step's allocations on CPU; the process's
  peak resident set (``VmHWM``) is dominated by interpreter, library and allocator slack
  (tens of MB for a model of 1 MB). So :class:`TensorBytesMeter` counts tensor storages
  itself, as MemTracker does: a dispatch mode sees every op's outputs (inside DTensor
  ops too), adds each new storage's bytes once and subtracts them when a weak reference
  reports the storage freed; tensors alive at the start of the step (parameters,
  gradients, optimizer state) are counted from the start. Buffers gloo allocates
  outside PyTorch are not seen.

  FSDP2 frees a unit's unsharded parameters by resizing their storage to 0 bytes and
  regrows the same storage for the next all-gather (``free_storage`` /
  ``alloc_storage``); a storage resize is no op a dispatch mode sees. So storages are
  identified by their ``StorageImpl`` (not their data pointer, which moves on every
  regrowth) and, while the meter runs, ``UntypedStorage.resize_`` reports each resize
  to it. Counting by data pointer without that, the meter kept freed parameters alive
  and counted each regrowth anew (dp=2 ZeRO-3 with 2 micro-batches on a 3.7M-parameter
  GPT: 99 MiB counted, 85 MiB held).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


@dataclass(frozen=True, kw_only=True)
class StepMetrics:
    """One training step on one rank.

    Attributes:
        step: 0 for the first ``job.step`` call.
        wall_time_s: seconds from the start of the step to the loss being known on
            every rank (forward, backward, gradient sync; not the optimizer step).
        loss: the mean loss over the global batch.
        peak_memory_bytes: peak tensor bytes during the step (see module docstring), or
            -1 where not measured.
        skipped: the optimizer skipped this step: some rank's loss or gradient was not
            finite (:mod:`autopar.runtime.finite`).
        skip_reason: what was not finite and on which rank first, when skipped.
    """

    step: int
    wall_time_s: float
    loss: float
    peak_memory_bytes: int
    skipped: bool = False
    skip_reason: str = ""


class MemoryMeter:
    """Resets and reads a peak-memory counter for one device; ``track`` wraps a step."""

    def __init__(self, device: torch.device, *, enabled: bool = True):
        self.device = device
        self.enabled = enabled
        self._cpu: TensorBytesMeter | None = None

    def track(self, live: Iterable[torch.Tensor]) -> AbstractContextManager[Any]:
        """A context measuring the peak over one step; ``live`` are the tensors that
        exist when it starts."""
        if not self.enabled:
            return contextlib.nullcontext()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return contextlib.nullcontext()
        self._cpu = TensorBytesMeter(self.device, live)
        return self._cpu

    def peak_bytes(self) -> int:
        """The peak of the last tracked step (-1 where not measured)."""
        if not self.enabled:
            return -1
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return self._cpu.peak_bytes if self._cpu is not None else -1


BEFORE_STEP, FORWARD, BACKWARD, OPTIMIZER = "before the step", "forward", "backward", "optimizer"
"""When a storage got its bytes: alive when the meter started (parameters, optimizer
state), or allocated or regrown in a forward, a backward (autograd running: gradients,
recomputed activations, parameters gathered again) or the optimizer step."""


class TensorBytesMeter(TorchDispatchMode):
    """Live tensor-storage bytes on one device, and their peak (module docstring), also
    by when they were allocated (:data:`FORWARD`, ...): ``peak_phase_bytes`` splits the
    peak. A storage regrown (FSDP2's all-gather into a freed parameter) counts in the
    phase that regrew it.

    Attributes:
        phase: the phase new bytes count in; None: forward or backward, as autograd
            says (set it to :data:`OPTIMIZER` around an optimizer step).
    """

    def __init__(self, device: torch.device, live: Iterable[torch.Tensor] = ()):
        super().__init__()
        self.device = device
        self._bytes: dict[int, int] = {}
        self._phase_of: dict[int, str] = {}
        self._refs: dict[int, weakref.ref] = {}
        self.current_bytes = 0
        self.peak_bytes = 0
        self.phase_bytes: dict[str, int] = dict.fromkeys((BEFORE_STEP, FORWARD, BACKWARD, OPTIMIZER), 0)
        self.peak_phase_bytes = dict(self.phase_bytes)
        self.phase: str | None = BEFORE_STEP
        for t in live:
            self._track(t)
        self.phase = None

    def _current_phase(self) -> str:
        if self.phase is not None:
            return self.phase
        return BACKWARD if torch._C._current_graph_task_id() >= 0 else FORWARD

    def _track(self, t: Any) -> None:
        if isinstance(t, DTensor):
            t = t.to_local()
        if (
            not isinstance(t, torch.Tensor)
            or isinstance(t, FakeTensor)
            or t.device.type != self.device.type
            or t.is_meta
        ):
            return  # FakeTensors are DTensor's shape propagation, not memory
        try:
            storage = t.untyped_storage()
        except RuntimeError:
            return  # a wrapper subclass without storage of its own (its inner tensor is counted)
        if storage._cdata not in self._bytes:
            self._watch(storage)

    def _watch(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        self._bytes[key] = 0
        self._phase_of[key] = self._current_phase()
        self._refs[key] = weakref.ref(storage, lambda _r, k=key: self._free(k))
        self._resized(storage)

    def _resized(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        if key not in self._bytes:
            self._watch(storage)  # grown from 0 bytes before the step began: an allocation now
            return
        size, old = storage.nbytes(), self._bytes[key]
        if size > old:  # (re)grown: all of it counts in the phase growing it
            self.phase_bytes[self._phase_of[key]] -= old
            self._phase_of[key] = self._current_phase()
            self.phase_bytes[self._phase_of[key]] += size
        else:
            self.phase_bytes[self._phase_of[key]] += size - old
        self.current_bytes += size - old
        self._bytes[key] = size
        if self.current_bytes > self.peak_bytes:
            self.peak_bytes = self.current_bytes
            self.peak_phase_bytes = dict(self.phase_bytes)

    def _free(self, key: int) -> None:
        freed = self._bytes.pop(key, 0)
        self.current_bytes -= freed
        phase = self._phase_of.pop(key, None)
        if phase is not None:
            self.phase_bytes[phase] -= freed
        self._refs.pop(key, None)

    def __enter__(self) -> TensorBytesMeter:
        cls = torch.UntypedStorage
        self._own_resize = "resize_" in cls.__dict__
        resize = self._resize = cls.resize_
        meter = self

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            out = resize(storage, size)
            if storage.device.type == meter.device.type:
                meter._resized(storage)
            return out

        cls.resize_ = resize_  # type: ignore[method-assign]
        try:
            return super().__enter__()
        except BaseException:
            self._restore_resize()
            raise

    def __exit__(self, *exc: Any) -> Any:
        try:
            return super().__exit__(*exc)
        finally:
            self._restore_resize()

    def _restore_resize(self) -> None:
        if self._own_resize:
            torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]
        else:
            del torch.UntypedStorage.resize_

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor run; its inner ops on local tensors come back here
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            self._track(t)
        return out
