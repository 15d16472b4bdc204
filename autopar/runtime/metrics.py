"""Per-step metrics: wall time and peak memory of each rank.

Peak memory means what the planner predicts (``Prediction.memory_bytes_per_device``):
the bytes the framework allocates at the step's peak.

- On CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, the
  caching allocator's exact count of live tensor bytes.
- On CPU there is no allocator counter. Measured on torch 2.13 (see docs/runtime.md):
  ``torch.distributed._tools.mem_tracker.MemTracker`` counts tensor storages through a
  dispatch mode, but only those created inside its context or registered with it, and
  its mode sits under DTensor/FSDP2/pipelining during a whole step; it is used only as a
  one-off check. The runtime reports the process's resident set instead: Linux's
  ``VmHWM`` (peak RSS), reset before each step by writing ``5`` to
  ``/proc/self/clear_refs``, minus the resident set measured before the model was
  parallelised. That counts tensors plus allocator slack and freed-but-retained heap,
  an upper bound on allocated bytes, as CUDA's reserved memory is.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True, kw_only=True)
class StepMetrics:
    """One training step on one rank.

    Attributes:
        step: 0 for the first ``job.step`` call.
        wall_time_s: seconds from the start of the step to the loss being known on
            every rank (forward, backward, gradient sync; not the optimizer step).
        loss: the mean loss over the global batch.
        peak_memory_bytes: peak bytes during the step (see module docstring), or -1
            where it cannot be measured.
    """

    step: int
    wall_time_s: float
    loss: float
    peak_memory_bytes: int


_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_kib(field: str) -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return -1


class MemoryMeter:
    """Resets and reads a peak-memory counter for one device."""

    def __init__(self, device: torch.device):
        self.device = device
        self._cpu = device.type == "cpu" and _STATUS.exists()
        self.baseline_bytes = _status_kib("VmRSS") * 1024 if self._cpu else 0

    def reset(self) -> None:
        """Start a new peak."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self._cpu:
            try:
                _CLEAR_REFS.write_text("5")
            except OSError:
                self._cpu = False

    def peak_bytes(self) -> int:
        """The peak since ``reset`` (-1 where unknown)."""
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        if self._cpu:
            return max(0, _status_kib("VmHWM") * 1024 - self.baseline_bytes)
        return -1
