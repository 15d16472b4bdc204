"""Compute time of a piece of work: a roofline (Williams et al. 2009).

Matrix multiplies run on the tensor cores at ``peak_flops[dtype] x efficiency``; other
FLOPs (element-wise, reductions) at the fp32 vector peak; and no kernel runs faster
than its bytes through memory at ``bandwidth x memory_efficiency``. So a large GEMM is
compute bound, a LayerNorm or a GELU memory bound, and a skinny GEMM (small micro-batch
per tensor-parallel rank) falls onto the bandwidth roof by itself.

When a profiler report gives a measured matmul curve (achieved FLOP/s against the FLOPs
of one call), it replaces the single efficiency: small calls are slower per FLOP than
large ones, which is why layer times measured at one shape predict another shape
through the curve rather than linearly.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from autopar.hardware.device import DeviceSpec
from autopar.vocab import DType


@dataclass(frozen=True, kw_only=True)
class ComputeRates:
    """The rates one device runs at in one precision."""

    matmul_flops_per_s: float
    vector_flops_per_s: float
    bytes_per_s: float
    curve: tuple[tuple[float, float], ...] = ()
    fp8_matmul_flops_per_s: float = 0.0
    attention_flops_per_s: float = 0.0

    def in_fp8(self) -> ComputeRates:
        """These rates with matmuls at the FP8 rate (:mod:`autopar.cost.fp8`)."""
        return ComputeRates(
            matmul_flops_per_s=self.fp8_matmul_flops_per_s,
            vector_flops_per_s=self.vector_flops_per_s,
            bytes_per_s=self.bytes_per_s,
        )

    def in_fused_attention(self) -> ComputeRates:
        """These rates with matmuls at the fused attention kernel's rate, where the
        device states one (``Roofline.attention_efficiency``); else unchanged."""
        if not self.attention_flops_per_s:
            return self
        return ComputeRates(
            matmul_flops_per_s=self.attention_flops_per_s,
            vector_flops_per_s=self.vector_flops_per_s,
            bytes_per_s=self.bytes_per_s,
        )

    def matmul_rate(self, call_flops: float) -> float:
        """Achieved FLOP/s of one matmul call of ``call_flops`` FLOPs."""
        if not self.curve:
            return self.matmul_flops_per_s
        return interpolate_loglog(self.curve, call_flops)


def rates(device: DeviceSpec, dtype: DType) -> ComputeRates:
    """The roofline of ``device`` in ``dtype`` (raises ClusterError if unsupported)."""
    peak = device.peak(dtype)
    roof = device.roofline
    vector = roof.peak_flops.get(DType.FP32, peak)
    return ComputeRates(
        matmul_flops_per_s=peak * roof.matmul_efficiency,
        vector_flops_per_s=vector * roof.matmul_efficiency,
        bytes_per_s=roof.memory_bandwidth_bytes_per_s * roof.memory_efficiency,
        curve=tuple(roof.matmul_curves.get(dtype, ())),
        fp8_matmul_flops_per_s=roof.fp8_flops * (roof.fp8_matmul_efficiency or roof.matmul_efficiency),
        attention_flops_per_s=peak * roof.attention_efficiency if roof.attention_efficiency else 0.0,
    )


def work_s(*, matmul_flops: float, other_flops: float, nbytes: float, r: ComputeRates, calls: int = 1) -> float:
    """Time of a kernel (or a group of ``calls`` similar kernels): the slower of its
    compute and its memory traffic."""
    if matmul_flops <= 0 and other_flops <= 0 and nbytes <= 0:
        return 0.0
    per_call = matmul_flops / max(calls, 1)
    compute = (matmul_flops / r.matmul_rate(per_call) if matmul_flops > 0 else 0.0) + other_flops / r.vector_flops_per_s
    return max(compute, nbytes / r.bytes_per_s)


def interpolate_loglog(points: tuple[tuple[float, float], ...], x: float) -> float:
    """Piecewise-linear interpolation in log-log space, clamped at both ends."""
    xs = [p[0] for p in points]
    if x <= xs[0]:
        return points[0][1]
    if x >= xs[-1]:
        return points[-1][1]
    i = bisect.bisect_right(xs, x)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    w = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return math.exp(math.log(y0) + w * (math.log(y1) - math.log(y0)))
