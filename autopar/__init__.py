"""autopar: plan and run data x tensor x pipeline parallel training for PyTorch.

plan = autopar.plan(model, autopar.Cluster.preset("dgx-a100-80gb", nodes=128),
                    global_batch_size=1536, seq_len=2048)
print(plan.explain())
"""

from autopar.cluster import Cluster, DeviceSpec, LinkSpec
from autopar.errors import AutoparError, ClusterError, ConfigError, InfeasiblePlanError, ModelError, PlanFormatError
from autopar.plan import Alternative, LayerStrategies, ParallelConfig, Plan, Prediction
from autopar.search.planner import estimate, plan
from autopar.vocab import Attention, DType, MeshAxis, Optimizer, Recompute, Schedule, TPStyle

__all__ = [
    "Alternative",
    "Attention",
    "AutoparError",
    "Cluster",
    "ClusterError",
    "ConfigError",
    "DType",
    "DeviceSpec",
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
    "Recompute",
    "Schedule",
    "TPStyle",
    "estimate",
    "parallelize",
    "plan",
]


def __getattr__(name: str):
    """``parallelize`` and ``Job`` load the runtime (torch.distributed's FSDP, pipelining,
    checkpointing: ~1 s of imports) only when first used, so planning stays light."""
    if name == "parallelize":
        from autopar.runtime.api import parallelize

        return parallelize
    if name == "Job":
        from autopar.runtime.job import Job

        return Job
    raise AttributeError(f"module 'autopar' has no attribute {name!r}")
