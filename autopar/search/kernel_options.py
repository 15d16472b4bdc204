"""Which kernel options a device allows and the search tries, each as fixed where the
constraints fix it: compiled blocks where the device compiles (``DeviceSpec.compiles``),
FP8 matmuls where it has FP8 tensor cores, asynchronous tensor parallelism where it runs
it (and the plan compiles its blocks with sequence parallelism).

Compiled blocks and asynchronous TP are tried one way only where they apply: in the cost
model neither makes a unit slower (fusion only removes memory traffic and kernels; async
TP only hides collective time) and neither changes memory, so the other way is left out,
and ``explain()`` prices it as a contrast. (A shorter backward hides less of the
data-parallel tail, the one way a faster unit can lengthen the predicted step; the search
does not take such gains for any option, docs/cost-model.md, and brute force over both
ways agrees on the test instances.) FP8 is tried both ways: its casts can cost more than
its faster matmuls save on small layers. So is keeping the shards of sequence-parallel
gathers (``regather``; on eager blocks only where autopar's runtime runs the plan, on any
where the plan prices Megatron-LM's kernels): it trades an all-gather for memory."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from autopar.errors import ConfigError
from autopar.hardware.cluster import Cluster
from autopar.vocab import DType


def check_async_tp(constraints: Mapping[str, Any], cluster: Cluster) -> None:
    """``async_tp=True`` needs a device that runs it (``DeviceSpec.async_tp``)."""
    if constraints.get("async_tp") and not cluster.device.async_tp:
        raise ConfigError(
            f"async_tp=True needs GPUs that run torch's asynchronous tensor parallelism (symmetric memory over "
            f"NVLink), which {cluster.device.name} is not known to (its async_tp is false); plan with "
            f"async_tp=False, or for an H100 or H200 cluster."
        )


def compile_options(c: Mapping[str, Any], cluster: Cluster, *, split_backward: bool = False) -> list[bool]:
    """Whether to compile the blocks: as fixed, else where the device compiles; eager
    only under a schedule that splits the backward (:data:`autopar.vocab.SPLIT_BACKWARD_EAGER`),
    none there where compiling is fixed."""
    if split_backward:
        return [] if c.get("compile") else [False]
    return [c["compile"]] if "compile" in c else [cluster.device.compiles]


def fp8_options(c: Mapping[str, Any], cluster: Cluster, dtype: DType) -> list[bool]:
    """Whether to multiply in FP8: as fixed, else both ways where the device has FP8 and
    the plan trains in bf16 (FP8 matmuls keep bf16 weights and activations around them)."""
    if "fp8" in c:
        return [c["fp8"]]
    return [False, True] if cluster.device.roofline.fp8_flops and dtype is DType.BF16 else [False]


def async_tp_options(c: Mapping[str, Any], cluster: Cluster, tp: int, sp: bool, compiled: bool) -> list[bool]:
    """Whether to run TP asynchronously: as fixed, else where it applies (a device that
    runs it, tp > 1, sequence parallelism, compiled blocks)."""
    applies = tp > 1 and sp and compiled
    if "async_tp" in c:
        return [c["async_tp"]] if applies or not c["async_tp"] else []
    return [applies and cluster.device.async_tp]


def regather_options(c: Mapping[str, Any], sp: bool, compiled: bool, megatron_kernels: bool = False) -> list[bool]:
    """Whether to keep shards of the sequence-parallel gathers: it saves memory for one
    more all-gather each in the backward. Under ``megatron_kernels`` always with sequence
    parallelism, as Megatron-LM's kernels do (fixed otherwise, nothing: the plan would
    price what Megatron-LM does not run); else as fixed, or both ways where it applies
    (sequence parallelism on eager blocks in autopar's runtime)."""
    if megatron_kernels and sp:
        return [True] if c.get("regather", True) else []
    applies = sp and not compiled
    if "regather" in c:
        return [c["regather"]] if applies or not c["regather"] else []
    return [False, True] if applies else [False]


def check_fp8(constraints: Mapping[str, Any], cluster: Cluster) -> None:
    """``fp8=True`` needs a device with FP8 matmuls (``Roofline.fp8_flops``)."""
    if constraints.get("fp8") and not cluster.device.roofline.fp8_flops:
        raise ConfigError(
            f"fp8=True needs FP8 tensor cores, which {cluster.device.name} does not have (no fp8_flops in its "
            f"roofline); plan with fp8=False, or for an H100 or H200 cluster."
        )
