"""profiler: measure a model's layers, a device and the network, for autopar's planner.

    report = profiler.profile_model(model, sample_input)       # per-unit time, FLOPs, memory
    report = profiler.ProfileReport.merge(report, profiler.profile_device())
    report.save("model.json")
    plan = autopar.plan(model, cluster, ..., profile=report)

Names are imported on first use (PEP 562), so ``import profiler`` stays light. The
report type is autopar's (:class:`autopar.profiles.ProfileReport`): the profiler writes
it, the planner reads it, with the same code.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ProfileReport": "autopar.profiles.report",
    "profile_model": "profiler.layers",
    "LayerSweep": "profiler.layers",
    "profile_device": "profiler.device",
    "DeviceSweep": "profiler.device",
    "profile_network": "profiler.network",
    "NetworkSweep": "profiler.network",
    "Repeats": "profiler.timing",
    "render_html": "profiler.render",
    "render_markdown": "profiler.render",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'profiler' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return __all__
