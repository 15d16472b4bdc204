"""autopar: plan and run data x tensor x pipeline parallel training for PyTorch.

plan = autopar.plan(model, autopar.preset("dgx-a100-80gb", nodes=128),
                    global_batch_size=1536, seq_len=2048)
print(autopar.explain(plan))
autopar.report(plan)          # in a notebook: the explanation and the pictures
"""

import importlib.metadata

from autopar.errors import (
    AutoparError,
    ClusterError,
    ConfigError,
    InfeasiblePlanError,
    ModelError,
    PlanFormatError,
    ProfileFormatError,
)
from autopar.hardware import (
    Cluster,
    DeviceMemory,
    DeviceSpec,
    HostEffects,
    LinkSpec,
    Roofline,
    load_cluster,
    parse_cluster,
    preset,
    preset_names,
    save_cluster,
)
from autopar.plan import Alternative, LayerStrategies, ParallelConfig, Plan, Prediction
from autopar.present import explain
from autopar.profiles import ProfileReport, cluster_from_profiles
from autopar.search.planner import estimate, plan
from autopar.vocab import ActivationLayout, Attention, DType, MeshAxis, Optimizer, Recompute, Schedule, TPStyle


def _installed_version() -> str:
    """The version pyproject.toml gives, as the installed metadata holds it (one place to
    write it); ``0+unknown`` for a source tree on ``sys.path`` that was never installed."""
    try:
        return importlib.metadata.version("autopar")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


__version__ = _installed_version()

__all__ = [
    "ActivationLayout",
    "Alternative",
    "Attention",
    "AutoparError",
    "Cluster",
    "ClusterError",
    "ConfigError",
    "DType",
    "DeviceMemory",
    "DeviceSpec",
    "HostEffects",
    "InfeasiblePlanError",
    "Job",
    "LayerStrategies",
    "LinkSpec",
    "MeshAxis",
    "ModelError",
    "Optimizer",
    "ParallelConfig",
    "Plan",
    "PlanFormatError",
    "Prediction",
    "ProfileFormatError",
    "ProfileReport",
    "Recompute",
    "Roofline",
    "Schedule",
    "TPStyle",
    "__version__",
    "cluster_from_profiles",
    "estimate",
    "explain",
    "load_cluster",
    "parallelize",
    "parse_cluster",
    "plan",
    "preset",
    "preset_names",
    "report",
    "save_cluster",
]


def __getattr__(name: str):
    """``parallelize`` and ``Job`` load the runtime (torch.distributed's FSDP, pipelining,
    checkpointing: ~1 s of imports), and ``report`` matplotlib, only when first used, so
    planning stays light."""
    if name == "report":
        from autopar.present.report import report

        return report
    if name == "parallelize":
        from autopar.runtime.api import parallelize

        return parallelize
    if name == "Job":
        from autopar.runtime.job import Job

        return Job
    raise AttributeError(f"module 'autopar' has no attribute {name!r}")
