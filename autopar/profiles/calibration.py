"""Profile reports -> corrections of the cost model per unit, and their provenance.

- :func:`layer_calibration`: measured unit time over the roofline prediction at the
  measured shape, per unit. Multiplying a unit's predicted compute by its factor keeps
  what the roofline misses (kernel overheads, launch and framework costs) while the
  device curves still carry the shape dependence, so a layer measured at one batch
  predicts another through the curves, not linearly.
- :func:`recompute_calibration`: what full recomputation of a unit costs, as a fraction
  of its forward, measured per block.
- :func:`profile_sources`: one line per report, for the plan's provenance.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from autopar.cost.compute import rates
from autopar.cost.host import dispatch_s, kernel_s
from autopar.cost.leaf import BACKWARD_FACTOR
from autopar.errors import ProfileFormatError
from autopar.hardware.cluster import Cluster
from autopar.hardware.device import alone, device_kind
from autopar.profiles.sections import Timing, UnitMeasurement
from autopar.profiles.to_cluster import cluster_from_profiles, group_figures_apply, latest, read_reports, where_measured
from autopar.vocab import DType


def profile_sources(reports: Any, devices_per_node: int | None = None) -> tuple[str, ...]:
    """One line per report: what it measured, where and when; and, for a network measured
    with another count of processes per node than ``devices_per_node``, that its
    per-process figures were left out (:func:`autopar.profiles.to_cluster.group_figures_apply`)."""
    lines = []
    for origin, r in read_reports(reports):
        parts = []
        if r.device is not None:
            parts.append(f"device {r.device.name} [{where_measured(r.device.provenance)}]")
        if r.layers is not None:
            m = r.layers
            what = f"layers of {m.model} (batch {m.batch}, seq {m.seq_len}, {m.dtype})"
            refwd = _recompute_fractions(m.units)
            if refwd is not None:
                what += f", a recomputed forward {refwd[1]:.2f} of the forward"
            parts.append(f"{what} [{where_measured(m.provenance)}]")
        if r.network is not None:
            n = r.network
            parts.append(f"network {n.backend} x {n.world_size} ranks [{where_measured(n.provenance)}]")
            if devices_per_node is not None and not group_figures_apply(n, devices_per_node):
                parts[-1] += (
                    f" (its framework overheads, memory share and rank spread not applied: measured with "
                    f"{n.ranks_per_node} processes per node, the cluster has {devices_per_node})"
                )
        lines.append(f"{origin}: " + ("; ".join(parts) if parts else "no measurements"))
    return tuple(lines)


@dataclass(frozen=True, kw_only=True)
class UnitCalibration:
    """Measured against predicted time of one distinct unit at the measured shape.

    ``factor`` = measured (forward + backward) / predicted (forward + backward), the
    number to multiply the cost model's compute time of this unit by.
    """

    fqn: str
    signature: str
    instances: tuple[str, ...]
    measured_fwd_s: float
    measured_bwd_s: float
    predicted_fwd_s: float
    predicted_bwd_s: float

    @property
    def factor(self) -> float:
        """Measured over predicted, forward plus backward."""
        return (self.measured_fwd_s + self.measured_bwd_s) / (self.predicted_fwd_s + self.predicted_bwd_s)


def calibrate_units(reports: Any, *, base: Cluster | None = None) -> tuple[UnitCalibration, ...]:
    """Each profiled unit's measured time next to the roofline prediction.

    The prediction prices the unit's kernels as recorded in the report (leaves and glue
    at the measured batch, from ``autopar.graph``) with
    :func:`autopar.cost.host.kernel_s` on the device of
    ``cluster_from_profiles(reports, base=base)``, backward ``BACKWARD_FACTOR`` times
    forward: exactly what the cost model computes for the unit on one device, less the
    gradient accumulation (the profiler resets ``.grad`` before each run, so none
    happened). Units with nothing to predict (no FLOPs, no bytes) are left out. A layer
    section measured on another kind of device than ``base``'s (CPU processes against
    GPUs) is predicted on the machine that measured it (``base=None``): its factors are
    that device's measured over predicted time, which a plan on ``base`` carries over (a
    CPU's milliseconds over an H100's microseconds made factors of 600 and more).
    """
    rs = read_reports(reports)
    found = latest(rs, "layers")
    if found is None:
        raise ProfileFormatError(
            f"none of the profiles ({', '.join(origin for origin, _ in rs)}) has a layers section; make one "
            f"with 'autopar profile model'."
        )
    layers = found[1]
    if base is not None and device_kind(base.device.name) != layers.device_kind:
        base = None  # the machine that measured
    # the unit was measured by one process alone: compare with the device alone, so
    # that the factors carry over to time-shared processes
    device = alone(cluster_from_profiles(reports, base=base).device)
    r = rates(device, DType(layers.dtype))
    out = []
    for u in layers.units:
        fwd = sum(
            kernel_s(
                matmul_flops=w.matmul_flops,
                other_flops=w.other_flops,
                activation_bytes=w.bytes - w.weight_bytes,
                weight_bytes=w.weight_bytes,
                r=r,
                host=device.host,
            )
            + dispatch_s(device.host, w.ops)
            for w in u.work
        )
        if fwd <= 0:
            continue
        out.append(
            UnitCalibration(
                fqn=u.fqn,
                signature=u.signature,
                instances=tuple(u.instances),
                measured_fwd_s=u.fwd.median_s,
                measured_bwd_s=u.bwd.median_s,
                predicted_fwd_s=fwd,
                predicted_bwd_s=BACKWARD_FACTOR * fwd,
            )
        )
    return tuple(out)


def layer_calibration(reports: Any, *, base: Cluster | None = None) -> dict[str, float]:
    """Unit key -> measured / predicted time (see :func:`calibrate_units`).

    Keys: the unit's FQN (a block's module FQN, or ``autopar.graph``'s joined name of a
    prologue or epilogue such as ``"tok_embeddings+pos_embeddings"``), the FQN of every
    identical instance, and the unit's ``UnitProfile.signature``. Use the factors with
    the same cluster (``cluster_from_profiles(reports, base=base)``): they are relative
    to its device rates.
    """
    factors: dict[str, float] = {}
    for c in calibrate_units(reports, base=base):
        for key in (c.fqn, c.signature, *c.instances):
            factors[key] = c.factor
    return factors


def recompute_calibration(reports: Any) -> dict[str, float]:
    """Unit key -> the time full recomputation adds to the unit's backward, as a
    fraction of its forward (keys as :func:`layer_calibration`'s).

    A layer profile times each block's backward plain and with the block's forward
    under full recomputation's checkpoint, in turn; the difference of the medians over
    the forward's median is the block's fraction. The units the profiler cannot wrap
    (what runs before the first block and after the last) take the fraction of the
    measured ones together: their differences over their forwards, each counted once per
    instance. A unit whose difference is within its timings' spread (:func:`_resolved`)
    counts as not measured: a noisy machine timed reruns at no cost, which made full
    recomputation look free. Empty where no unit has a measurement (a report from before
    it, or only noise): the planner then prices a rerun forward as the forward.
    """
    found = latest(read_reports(reports), "layers")
    measured = _recompute_fractions(found[1].units) if found is not None else None
    if measured is None:
        return {}
    own, overall = measured
    fractions: dict[str, float] = {}
    for u in found[1].units:
        for key in (u.fqn, u.signature, *u.instances):
            fractions[key] = own.get(u.signature, overall)
    return fractions


def _resolved(rerun: Timing, plain: Timing) -> bool:
    """Whether a backward with its forward rerun was timed slower than the plain one by
    more than the two timings' own spread (median less fastest, each): a smaller
    difference is noise, not a measurement of the rerun (a rerun forward costs time)."""
    spread = (rerun.median_s - rerun.min_s) + (plain.median_s - plain.min_s)
    return rerun.median_s - plain.median_s > spread


def _recompute_fractions(units: Sequence[UnitMeasurement]) -> tuple[dict[str, float], float] | None:
    """Per measured unit signature its recompute fraction, and the measured units'
    together (see :func:`recompute_calibration`); None where no unit was measured."""
    extra = {
        u.signature: u.recompute_bwd.median_s - u.bwd.median_s
        for u in units
        if u.recompute_bwd is not None and u.fwd.median_s > 0 and _resolved(u.recompute_bwd, u.bwd)
    }
    if not extra:
        return None
    measured = [u for u in units if u.signature in extra]
    overall = sum(len(u.instances) * extra[u.signature] for u in measured) / sum(
        len(u.instances) * u.fwd.median_s for u in measured
    )
    return {u.signature: extra[u.signature] / u.fwd.median_s for u in measured}, overall
