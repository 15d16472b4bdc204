"""Fitting the alpha-beta model to measured collective times, the way autopar prices them.

``autopar.cost.comm`` prices a collective of ``S`` bytes over ``n`` devices as
``t = c_bw * S / B + c_lat * alpha`` with, inside a node (a ring; Thakur et al. 2005):

=================  =============  ==================
op                 c_bw           c_lat
=================  =============  ==================
all_reduce         2 (n-1) / n    2 (n-1)
all_gather         (n-1) / n      n-1
reduce_scatter     (n-1) / n      n-1
send_recv          1              1
broadcast          1              n-1
=================  =============  ==================

and across nodes (one device per node) the same bandwidth terms with a tree's latency,
``ceil(log2 n)`` in place of ``n-1``. ``B`` is then the bus bandwidth per device in one
direction (nccl-tests' ``busbw``; ``c_bw * S / t`` is exactly busbw) and ``alpha`` the
latency per step, so a fitted pair plugs into ``LinkSpec`` with the meaning the cost
model gives it. The fit minimises the squared *relative* error over every size, so a
1 KiB message weighs as much as a 64 MiB one: latency is read from the small sizes and
bandwidth from the large.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from profiler.errors import MeasurementError


@dataclass(frozen=True, kw_only=True)
class Sample:
    """One measurement: ``nbytes`` took ``time_s`` with the model's coefficients."""

    nbytes: float
    time_s: float
    c_bw: float
    c_lat: float


def coefficients(op: str, level: str, n: int) -> tuple[float, float]:
    """``(c_bw, c_lat)`` of ``op`` over ``n`` ranks at ``level`` (``intra`` or ``inter``)."""
    if n < 2:
        raise MeasurementError(f"a collective over {n} rank moves nothing; groups need >= 2 ranks.")
    steps = n - 1 if level == "intra" else math.ceil(math.log2(n))
    table = {
        "all_reduce": (2 * (n - 1) / n, 2 * steps),
        "all_gather": ((n - 1) / n, steps),
        "reduce_scatter": ((n - 1) / n, steps),
        "send_recv": (1.0, 1),
        "broadcast": (1.0, steps),
    }
    if op not in table:
        raise MeasurementError(f"no alpha-beta model for op {op!r}; known: {', '.join(table)}.")
    c_bw, c_lat = table[op]
    return c_bw, float(c_lat)


def bus_factor(op: str, n: int) -> float:
    """busbw / algbw for ``op`` over ``n`` ranks (nccl-tests PERFORMANCE.md)."""
    return coefficients(op, "intra", n)[0]


@dataclass(frozen=True, kw_only=True)
class AlphaBeta:
    """A fitted model: ``alpha_s`` per step, ``bandwidth_bytes_per_s`` bus bandwidth."""

    alpha_s: float
    bandwidth_bytes_per_s: float
    rms_rel_error: float
    points: int

    def time_s(self, s: Sample) -> float:
        """The model's time for a sample's size and coefficients."""
        return s.c_bw * s.nbytes / self.bandwidth_bytes_per_s + s.c_lat * self.alpha_s


def fit_alpha_beta(samples: Sequence[Sample]) -> AlphaBeta:
    """Least squares in relative error with ``alpha >= 0`` (a negative latency would fit
    noise, not the link)."""
    rows = [(s.c_lat / s.time_s, s.c_bw * s.nbytes / s.time_s) for s in samples if s.time_s > 0]
    if len({s.nbytes for s in samples}) < 2:
        raise MeasurementError(
            f"an alpha-beta fit needs at least two message sizes, got {sorted({s.nbytes for s in samples})}."
        )
    # minimise sum((a_i alpha + b_i beta - 1)^2), beta = 1 / bandwidth
    saa = sum(a * a for a, _ in rows)
    sbb = sum(b * b for _, b in rows)
    sab = sum(a * b for a, b in rows)
    sa = sum(a for a, _ in rows)
    sb = sum(b for _, b in rows)
    det = saa * sbb - sab * sab
    alpha, beta = ((sa * sbb - sb * sab) / det, (sb * saa - sa * sab) / det) if det > 0 else (-1.0, 0.0)
    if alpha < 0:
        alpha, beta = 0.0, sb / sbb
    if beta <= 0:
        raise MeasurementError(
            "the measured times do not grow with message size, so no bandwidth can be fitted; "
            "extend the sweep to larger messages (--max-bytes)."
        )
    fit = AlphaBeta(alpha_s=alpha, bandwidth_bytes_per_s=1.0 / beta, rms_rel_error=0.0, points=len(rows))
    err = math.sqrt(sum(((fit.time_s(s) - s.time_s) / s.time_s) ** 2 for s in samples) / len(samples))
    return AlphaBeta(alpha_s=alpha, bandwidth_bytes_per_s=1.0 / beta, rms_rel_error=err, points=len(rows))
