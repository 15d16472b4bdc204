"""Which kernel options a device allows and the search tries: FP8 matmuls where the device
has FP8 tensor cores, asynchronous tensor parallelism where it runs it (and the plan
compiles its blocks with sequence parallelism). Compiled blocks are only ever asked for."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from autopar.errors import ConfigError
from autopar.hardware.cluster import Cluster


def check_async_tp(constraints: Mapping[str, Any], cluster: Cluster) -> None:
    """``async_tp=True`` needs a device that runs it (``DeviceSpec.async_tp``)."""
    if constraints.get("async_tp") and not cluster.device.async_tp:
        raise ConfigError(
            f"async_tp=True needs GPUs that run torch's asynchronous tensor parallelism (symmetric memory over "
            f"NVLink), which {cluster.device.name} is not known to (its async_tp is false); plan with "
            f"async_tp=False, or for an H100 or H200 cluster."
        )


def async_tp_options(c: Mapping[str, Any], cluster: Cluster, tp: int, sp: bool) -> list[bool]:
    """Whether to try asynchronous TP: as fixed, else both ways where it applies (a
    device that runs it, tp > 1, sequence parallelism, compiled blocks)."""
    applies = tp > 1 and sp and c.get("compile", False)
    if "async_tp" in c:
        return [c["async_tp"]] if applies or not c["async_tp"] else []
    return [False, True] if applies and cluster.device.async_tp else [False]


def check_fp8(constraints: Mapping[str, Any], cluster: Cluster) -> None:
    """``fp8=True`` needs a device with FP8 matmuls (``Roofline.fp8_flops``)."""
    if constraints.get("fp8") and not cluster.device.roofline.fp8_flops:
        raise ConfigError(
            f"fp8=True needs FP8 tensor cores, which {cluster.device.name} does not have (no fp8_flops in its "
            f"roofline); plan with fp8=False, or for an H100 or H200 cluster."
        )
