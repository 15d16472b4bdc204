"""Profiler reports -> the numbers the planner uses.

Reports are read as data (a ``ProfileReport``, its ``to_dict()``, or a JSON file path):
autopar never imports the profiler, whose report format is plain versioned JSON.

- :func:`cluster_from_profiles`: measured matmul curves and memory bandwidth replace
  the device's analytic efficiencies; fitted alpha-beta links replace the datasheet
  links. The base cluster supplies the node counts and whatever was not measured; its
  datasheet peak FLOP/s stay (MFU is measured against the datasheet, as Narayanan et
  al. 2021 and Chowdhery et al. 2022 report it) unless a measurement exceeds them, as
  it does the nominal figures of the ``local-cpu`` preset.
- :func:`profile_sources`: one line per report, for the plan's provenance.
- :func:`layer_calibration`: measured unit time over the roofline prediction at the
  measured shape, per unit. Multiplying a unit's predicted compute by its factor keeps
  what the roofline misses (kernel overheads, launch and framework costs) while the
  device curves still carry the shape dependence, so a layer measured at one batch
  predicts another through the curves, not linearly.
- :func:`recompute_calibration`: what full recomputation of a unit costs, as a fraction
  of its forward, measured per block.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from autopar.cluster import COLLECTIVE_OPS, Cluster, DeviceSpec, LinkSpec, OpLink
from autopar.comm_curve import CommCurve
from autopar.cost.compute import rates
from autopar.cost.memory import optimizer_step_bytes
from autopar.cost.tensor_parallel import BACKWARD_FACTOR, roofline_s
from autopar.errors import ClusterError
from autopar.vocab import DType, Optimizer

SCHEMA = "autopar-profile"
SCHEMA_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class _Report:
    """A report read as data, with where it came from."""

    origin: str
    data: Mapping[str, Any]

    def section(self, name: str) -> Mapping[str, Any] | None:
        return self.data.get(name)


def read_reports(reports: Sequence[Any]) -> list[_Report]:
    """Each report as checked JSON data; a path, a mapping or an object with ``to_dict()``."""
    if isinstance(reports, (str, Path, Mapping)) or hasattr(reports, "to_dict"):
        reports = [reports]
    out = []
    for i, r in enumerate(reports):
        if isinstance(r, (str, Path)):
            origin = str(r)
            try:
                data = json.loads(Path(r).read_text())
            except FileNotFoundError:
                raise ClusterError(f"profile {origin!r} does not exist; make one with 'autopar profile'.") from None
            except json.JSONDecodeError as exc:
                raise ClusterError(f"profile {origin!r} is not valid JSON ({exc}).") from None
        elif hasattr(r, "to_dict"):
            origin, data = f"report #{i + 1}", r.to_dict()
        elif isinstance(r, Mapping):
            origin, data = f"report #{i + 1}", r
        else:
            raise ClusterError(
                f"profile #{i + 1} is a {type(r).__name__}; give a ProfileReport, its to_dict(), or a JSON file path."
            )
        if not isinstance(data, Mapping) or data.get("schema") != SCHEMA:
            raise ClusterError(f"profile {origin!r} is not an autopar profile report (no 'schema': {SCHEMA!r}).")
        if data.get("schema_version") != SCHEMA_VERSION:
            raise ClusterError(
                f"profile {origin!r} has schema_version {data.get('schema_version')!r}; this autopar "
                f"reads version {SCHEMA_VERSION}. Measure again or upgrade autopar."
            )
        out.append(_Report(origin=origin, data=data))
    if not out:
        raise ClusterError("no profile reports given; pass at least one (a ProfileReport or a JSON path).")
    return out


def _latest(reports: list[_Report], name: str) -> tuple[_Report, Mapping[str, Any]] | None:
    """The section ``name`` of the last report that has it (later reports win, as in
    ``ProfileReport.merge``)."""
    found = None
    for r in reports:
        sec = r.section(name)
        if sec is not None:
            found = (r, sec)
    return found


def has_layers(reports: Sequence[Any]) -> bool:
    """Whether any report holds per-layer measurements (``autopar profile model``)."""
    return _latest(read_reports(reports), "layers") is not None


def cluster_from_profiles(reports: Sequence[Any], base: Cluster | None = None) -> Cluster:
    """A cluster whose device and links come from measurements where there are some.

    Args:
        reports: profiler reports (device, network and layer sections are read; a
            section present in several reports is taken from the last).
        base: what the measurements apply to: node count, devices per node, datasheet
            peaks and everything not measured. Default: for measurements taken on CPU
            processes, the ``local-cpu`` preset sized like the measured network; for a
            GPU, the measurements alone (then both a device and a network section are
            needed).

    A CPU device measured by one process is time-shared where the node's processes
    (times the threads each measured with) outnumber the machine's cores. What a network
    profile measured on its real intra-node groups, with their processes sharing the
    cores as they will in training, applies where it ran as many processes per node as
    the cluster has: its framework overheads (tensor-parallel and FSDP) replace the
    device profile's one-rank figures, and its memory share lowers the bandwidth.
    """
    rs = read_reports(reports)
    dev = _latest(rs, "device")
    net = _latest(rs, "network")
    try:
        kinds = {found[1]["device_kind"] for found in (net, _latest(rs, "layers")) if found is not None}
        if dev is not None:
            kinds.add(dev[1]["kind"])
        if base is None and kinds == {"cpu"}:
            base = _local_cpu_base(net)
        if dev is None and net is None:
            if base is None:
                raise ClusterError(
                    f"the profiles ({', '.join(r.origin for r in rs)}) measure neither a device nor a "
                    f"network, and no base cluster was given; pass base=Cluster.preset(...)."
                )
            return base
        nodes, per_node = _shape(base, net)
        device = _device(dev, base, per_node) if dev is not None else _base_device(base)
        device = _with_group_measurements(device, net, per_node)
        intra, inter = _links(net, base, nodes, per_node)
    except (KeyError, TypeError) as exc:
        raise ClusterError(
            f"profile data is malformed ({type(exc).__name__}: {exc}); load it with "
            f"profiler.ProfileReport.load to see which field."
        ) from None
    prefix = base.name.split(" x ")[0].removesuffix("+profile") if base is not None else "measured"
    return Cluster(
        name=f"{prefix}+profile x {nodes}",
        nodes=nodes,
        devices_per_node=per_node,
        device=device,
        intra_node=intra,
        inter_node=inter,
    )


def _local_cpu_base(net: tuple[_Report, Mapping[str, Any]] | None) -> Cluster:
    from autopar.presets import build_preset

    if net is None:
        return build_preset("local-cpu", nodes=1, devices_per_node=1)
    nodes, per_node = _net_shape(net[1])
    return build_preset("local-cpu", nodes=nodes, devices_per_node=per_node)


def _net_shape(net: Mapping[str, Any]) -> tuple[int, int]:
    labels = list(net["node_of_rank"])
    return len(set(labels)), max(labels.count(n) for n in set(labels))


def _shape(base: Cluster | None, net: tuple[_Report, Mapping[str, Any]] | None) -> tuple[int, int]:
    if base is not None:
        return base.nodes, base.devices_per_node
    return _net_shape(net[1]) if net is not None else (1, 1)


def _base_device(base: Cluster | None) -> DeviceSpec:
    if base is None:
        raise ClusterError(
            "the profiles measure a network but no device, and no base cluster was given; add a "
            "device profile ('autopar profile device') or pass base=Cluster.preset(...)."
        )
    return base.device


def _device(found: tuple[_Report, Mapping[str, Any]], base: Cluster | None, per_node: int) -> DeviceSpec:
    """The measured device as one of ``per_node`` processes sees it."""
    report, d = found
    curves: dict[DType, tuple[tuple[float, float], ...]] = {}
    for p in d["matmul"]:
        curves.setdefault(DType(p["dtype"]), ())
    for dt in curves:
        by_flops: dict[float, list[float]] = {}
        for p in d["matmul"]:
            if p["dtype"] == dt.value:
                by_flops.setdefault(float(p["flops"]), []).append(float(p["flops"]) / float(p["time"]["median_s"]))
        curves[dt] = tuple((f, sum(v) / len(v)) for f, v in sorted(by_flops.items()))
    measured_peaks = {dt: max(r for _, r in pts) for dt, pts in curves.items()}
    memory = float(d["memory_bytes"]) / (per_node if d["memory_shared"] else 1)
    where = _where(d)
    if base is not None:
        bdev = base.device.alone()  # the measurement is of one process alone too
        peaks = {
            dt: max(bdev.peak_flops.get(dt, 0.0), measured_peaks.get(dt, 0.0))
            for dt in {*bdev.peak_flops, *measured_peaks}
        }
        efficiency = bdev.matmul_efficiency
        reserved = bdev.reserved_bytes
        raised = sorted(dt.value for dt in measured_peaks if measured_peaks[dt] > bdev.peak_flops.get(dt, 0.0))
        peak_note = f"peak FLOP/s from {bdev.name} ({bdev.source})" + (
            f", raised to the measured maximum for {', '.join(raised)} (a peak cannot be below what was achieved)"
            if raised
            else ""
        )
        preferred = bdev.preferred_dtype if bdev.preferred_dtype in peaks else next(iter(curves))
    else:
        peaks, efficiency, reserved = measured_peaks, 1.0, float(d["reserved_bytes"])
        peak_note = "peak FLOP/s = the fastest measured matmul (no datasheet given)"
        preferred = DType.BF16 if DType.BF16 in curves else next(iter(curves))
    share = f" / {per_node} processes" if d["memory_shared"] and per_node > 1 else ""
    cpu = d.get("kind") == "cpu"
    overlap = 0.0 if cpu else (bdev.comm_overlap if base is not None else DeviceSpec.comm_overlap)
    per_param = float(d.get("optimizer_s_per_param", 0.0))
    optimizer_rate = optimizer_step_bytes(Optimizer.ADAM) / per_param if per_param > 0 else 0.0
    spec = DeviceSpec(
        name=str(d["name"]),
        memory_bytes=memory,
        peak_flops=peaks,
        memory_bandwidth_bytes_per_s=float(d["memory_bandwidth_bytes_per_s"]),
        matmul_efficiency=efficiency,
        memory_efficiency=1.0,
        reserved_bytes=reserved,
        preferred_dtype=preferred,
        matmul_curves=curves,
        op_overhead_s=float(d.get("op_overhead_s", 0.0)),
        tp_overhead_s=float(d.get("tp_overhead_s", 0.0)),
        comm_overlap=overlap,
        optimizer_bytes_per_s=optimizer_rate,
        exposed_weight_traffic=cpu,
        source=(
            f"measured ({report.origin}, {where}): matmul curves {', '.join(dt.value for dt in curves)} over "
            f"{len(d['matmul'])} shapes, streaming bandwidth {float(d['memory_bandwidth_bytes_per_s']) / 1e9:.3g} "
            f"GB/s (memory_efficiency 1: already achieved); framework overhead "
            f"{float(d.get('op_overhead_s', 0.0)) * 1e6:.1f} us per op, "
            f"{float(d.get('tp_overhead_s', 0.0)) * 1e6:.0f} us per tensor-parallel layer; "
            + (
                f"AdamW step {per_param * 1e9:.2f} ns per parameter "
                f"({optimizer_rate / 1e9:.3g} GB/s of its ideal traffic); "
                if per_param > 0
                else ""
            )
            + (
                "communication overlaps no compute (gloo shares the cores), weight traffic is not hidden under "
                "the arithmetic; "
                if cpu
                else ""
            )
            + f"memory {float(d['memory_bytes']) / 2**30:.1f} GiB"
            f"{share}; {peak_note}"
        ),
    )
    cores = int(d["provenance"].get("cpu_count", 0)) if cpu else 0
    threads = max(int(d.get("threads", 1)), 1)
    if not (cores and per_node * threads > cores):
        return spec
    return spec.time_shared(
        cores / (per_node * threads), f"{per_node} processes of {threads} thread(s) time-share {cores} cores"
    )


def _with_group_measurements(
    device: DeviceSpec, net: tuple[_Report, Mapping[str, Any]] | None, per_node: int
) -> DeviceSpec:
    """The device with what a network profile measured on its real groups, where it was
    measured with this cluster's processes per node (the figures depend on how many
    share a node): the framework overheads and the rate of FSDP's copies
    (:mod:`profiler.framework_overhead`), how unevenly the ranks finish the same work
    (:mod:`profiler.sync_skew`) and the memory bandwidth a process keeps while the others
    stream (:mod:`profiler.contention`; the time share the device already has is divided
    out of it)."""
    if net is None or _net_shape(net[1])[1] != per_node:
        return device
    n = net[1]
    where = f"measured on {n['world_size']} {n['backend']} ranks ({net[0].origin})"
    per = {
        "tp_overhead_s": "tensor-parallel layer forward",
        "fsdp_overhead_s": "FSDP collective",
        "fsdp_tensor_overhead_s": "parameter tensor in an FSDP collective",
    }
    measured = {k: float(n.get(k, 0.0)) for k in per}
    measured = {k: v for k, v in measured.items() if v > 0}
    if measured:
        what = ", ".join(f"{v * 1e6:.0f} us per {per[k]}" for k, v in measured.items())
        device = replace(device, **measured, source=f"{device.source}; framework overhead {what}, {where}")
    copies = float(n.get("fsdp_copy_bytes_per_s", 0.0))
    if copies > 0:
        device = replace(
            device,
            fsdp_copy_bytes_per_s=copies,
            source=f"{device.source}; FSDP copies at {copies / 1e9:.2f} GB/s, {where}",
        )
    noise = float(n.get("sync_noise_s_per_sqrt_s", 0.0))
    spread = float(n.get("sync_speed_spread", 0.0))
    if noise > 0 or spread > 0:
        device = replace(
            device,
            sync_noise_s_per_sqrt_s=noise,
            sync_speed_spread=spread,
            source=f"{device.source}; ranks finish the same work {noise * 1e3:.1f} ms per sqrt(s) of "
            f"it and {spread:.1%} of it apart (one standard deviation), {where}",
        )
    share = float(n.get("memory_share", 1.0))
    beyond = share / device.time_share
    if beyond < 1:
        device = device.bandwidth_shared(
            beyond,
            f"{per_node} processes streaming at once keep {share:.2f} of one process's memory bandwidth, {where}",
        )
    return device


def _links(
    net: tuple[_Report, Mapping[str, Any]] | None, base: Cluster | None, nodes: int, per_node: int
) -> tuple[LinkSpec, LinkSpec]:
    fits = {}
    if net is not None:
        report, n = net
        for level in ("intra", "inter"):
            fit = _fit(n, level)
            if fit is not None:
                per_op = _per_op(n, level)
                fits[level] = LinkSpec(
                    bandwidth_bytes_per_s=float(fit["bandwidth_bytes_per_s"]),
                    latency_s=float(fit["alpha_s"]),
                    per_op=per_op,
                    source=(
                        f"fitted alpha-beta ({report.origin}, {_where(n)}): {n['backend']}, "
                        f"{'+'.join(fit['ops'])} over {fit['points']} measurements, rms error "
                        f"{100 * float(fit['rms_rel_error']):.0f}%"
                        + (f"; own fits for {', '.join(f.op for f in per_op)}" if per_op else "")
                        + "".join(
                            f"; {f.op} by its measured curve on {f.curve.ranks} ranks"
                            for f in per_op
                            if f.curve is not None
                        )
                    ),
                )
    intra = fits.get("intra") or (base.intra_node if base is not None else None)
    inter = fits.get("inter") or (base.inter_node if base is not None else None)
    if intra is None and inter is None:
        raise ClusterError(
            "no link was measured and no base cluster was given; add a network profile ('autopar "
            "profile network') or pass base=Cluster.preset(...)."
        )
    intra = intra or _stand_in("intra-node", inter, per_node, "devices per node", "measure with several ranks per node")
    inter = inter or _stand_in("inter-node", intra, nodes, "nodes", "measure across nodes")
    return intra, inter


def _stand_in(level: str, other: LinkSpec, count: int, what: str, remedy: str) -> LinkSpec:
    """The measured link of the other level, for a level this cluster never uses."""
    if count > 1:
        raise ClusterError(
            f"the network profile has no {level} measurement but the cluster has {count} {what}; "
            f"{remedy}, or pass base= with that link."
        )
    return replace(other, source=f"not measured ({what}: 1, so never used); the other level's fit")


def _fit(net: Mapping[str, Any], level: str) -> Mapping[str, Any] | None:
    level_fits = [f for f in net["fits"] if f["level"] == level]
    joint = [f for f in level_fits if len(f["ops"]) > 1]
    return (joint or level_fits or [None])[0]


def _per_op(net: Mapping[str, Any], level: str) -> tuple[OpLink, ...]:
    """The single-op fits of ``level`` for the collectives the cost model prices: with
    them an all-gather is priced at the all-gather's measured rate, not the joint fit's
    (which averages ops whose rates differ threefold on gloo; :class:`OpLink`); each
    with its measured curve (:func:`_curve`)."""
    return tuple(
        OpLink(
            op=f["ops"][0],
            bandwidth_bytes_per_s=float(f["bandwidth_bytes_per_s"]),
            latency_s=float(f["alpha_s"]),
            curve=_curve(net, level, f["ops"][0]),
        )
        for f in net["fits"]
        if f["level"] == level and len(f["ops"]) == 1 and f["ops"][0] in COLLECTIVE_OPS
    )


def _curve(net: Mapping[str, Any], level: str, op: str) -> CommCurve | None:
    """``op``'s measured seconds per call at ``level`` as a :class:`CommCurve`: each
    point's mean over its repeats (the median in reports from before means were
    recorded; :attr:`profiler.report.Timing.per_call_s` says why); where several groups
    measured it (one per node), those of the commonest size, the median over groups per
    message size; None where fewer than two sizes were measured."""
    series = [s for s in net["series"] if s["level"] == level and s["op"] == op]
    if not series:
        return None
    sizes = [len(s["ranks"]) for s in series]
    ranks = max(set(sizes), key=sizes.count)
    per_size: dict[float, list[float]] = {}
    for s in series:
        if len(s["ranks"]) == ranks:
            for point in s["points"]:
                t = point["time"]
                per_size.setdefault(float(point["nbytes"]), []).append(float(t.get("mean_s") or t["median_s"]))
    if len(per_size) < 2 or ranks < 2:
        return None
    return CommCurve.from_measured(ranks, per_size, [statistics.median(v) for v in per_size.values()])


def _where(section: Mapping[str, Any]) -> str:
    p = section["provenance"]
    return f"host {p['host']}, {p['created_utc']}, torch {p['software'].get('torch', '?')}"


def profile_sources(reports: Sequence[Any]) -> tuple[str, ...]:
    """One line per report: what it measured, where and when."""
    lines = []
    for r in read_reports(reports):
        parts = []
        for name in ("device", "layers", "network"):
            sec = r.section(name)
            if sec is None:
                continue
            if name == "device":
                what = f"device {sec['name']}"
            elif name == "layers":
                what = f"layers of {sec['model']} (batch {sec['batch']}, seq {sec['seq_len']}, {sec['dtype']})"
                refwd = _recompute_fractions(sec["units"])
                if refwd is not None:
                    what += f", a recomputed forward {refwd[1]:.2f} of the forward"
            else:
                what = f"network {sec['backend']} x {sec['world_size']} ranks"
            parts.append(f"{what} [{_where(sec)}]")
        lines.append(f"{r.origin}: " + ("; ".join(parts) if parts else "no measurements"))
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


def calibrate_units(reports: Sequence[Any], *, base: Cluster | None = None) -> tuple[UnitCalibration, ...]:
    """Each profiled unit's measured time next to the roofline prediction.

    The prediction prices the unit's kernels as recorded in the report (leaves and glue
    at the measured batch, from ``autopar.graph``) with
    :func:`autopar.cost.tensor_parallel.roofline_s` on the device of
    ``cluster_from_profiles(reports, base=base)``, backward ``BACKWARD_FACTOR`` times
    forward: exactly what the cost model computes for the unit on one device, less the
    gradient accumulation (the profiler resets ``.grad`` before each run, so none
    happened). Units with nothing to predict (no FLOPs, no bytes) are left out.
    """
    rs = read_reports(reports)
    found = _latest(rs, "layers")
    if found is None:
        raise ClusterError(
            f"none of the profiles ({', '.join(r.origin for r in rs)}) has a layers section; make one "
            f"with 'autopar profile model'."
        )
    layers = found[1]
    # the unit was measured by one process alone: compare with the device alone, so
    # that the factors carry over to time-shared processes
    device = cluster_from_profiles(reports, base=base).device.alone()
    r = rates(device, DType(layers["dtype"]))
    out = []
    for u in layers["units"]:
        fwd = sum(
            roofline_s(
                matmul_flops=float(w["matmul_flops"]),
                other_flops=float(w["other_flops"]),
                activation_bytes=float(w["bytes"]) - float(w.get("weight_bytes", 0.0)),
                weight_bytes=float(w.get("weight_bytes", 0.0)),
                r=r,
                exposed_weights=device.exposed_weight_traffic,
            )
            + float(w.get("ops", 0.0)) * device.op_overhead_s
            for w in u["work"]
        )
        if fwd <= 0:
            continue
        out.append(
            UnitCalibration(
                fqn=u["fqn"],
                signature=u["signature"],
                instances=tuple(u["instances"]),
                measured_fwd_s=float(u["fwd"]["median_s"]),
                measured_bwd_s=float(u["bwd"]["median_s"]),
                predicted_fwd_s=fwd,
                predicted_bwd_s=BACKWARD_FACTOR * fwd,
            )
        )
    return tuple(out)


def layer_calibration(reports: Sequence[Any], *, base: Cluster | None = None) -> dict[str, float]:
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


def recompute_calibration(reports: Sequence[Any]) -> dict[str, float]:
    """Unit key -> the time full recomputation adds to the unit's backward, as a
    fraction of its forward (keys as :func:`layer_calibration`'s).

    A layer profile times each block's backward plain and with the block's forward
    under full recomputation's checkpoint, in turn (:mod:`profiler.layers`); the
    difference of the medians over the forward's median is the block's fraction. The
    units the profiler cannot wrap (what runs before the first block and after the
    last) take the fraction of the measured ones together: their differences over their
    forwards, each counted once per instance. A difference below zero (noise around a
    cheap rerun) counts as zero. Empty where no unit has the measurement (a report from
    before it): the planner then prices a rerun forward as the forward.
    """
    found = _latest(read_reports(reports), "layers")
    measured = _recompute_fractions(found[1]["units"]) if found is not None else None
    if measured is None:
        return {}
    own, overall = measured
    fractions: dict[str, float] = {}
    for u in found[1]["units"]:
        for key in (u["fqn"], u["signature"], *u["instances"]):
            fractions[key] = own.get(u["signature"], overall)
    return fractions


def _recompute_fractions(units: Sequence[Mapping[str, Any]]) -> tuple[dict[str, float], float] | None:
    """Per measured unit signature its recompute fraction, and the measured units'
    together (see :func:`recompute_calibration`); None where no unit was measured."""
    extra = {
        u["signature"]: max(float(u["recompute_bwd"]["median_s"]) - float(u["bwd"]["median_s"]), 0.0)
        for u in units
        if u.get("recompute_bwd") is not None and float(u["fwd"]["median_s"]) > 0
    }
    if not extra:
        return None
    measured = [u for u in units if u["signature"] in extra]
    overall = sum(len(u["instances"]) * extra[u["signature"]] for u in measured) / sum(
        len(u["instances"]) * float(u["fwd"]["median_s"]) for u in measured
    )
    return {u["signature"]: extra[u["signature"]] / float(u["fwd"]["median_s"]) for u in measured}, overall
