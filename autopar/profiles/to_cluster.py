"""Profile reports -> a cluster whose numbers come from measurements where there are some.

Measured matmul curves and memory bandwidth replace the device's analytic efficiencies;
fitted alpha-beta links (and a curve per collective) replace the datasheet links. The
base cluster supplies the node counts and whatever was not measured; its datasheet peak
FLOP/s stay (MFU is measured against the datasheet, as Narayanan et al. 2021 and
Chowdhery et al. 2022 report it) unless a measurement exceeds them, as it does the
nominal figures of the ``local-cpu`` preset.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from autopar.cost.memory import optimizer_step_bytes
from autopar.errors import ClusterError, ProfileFormatError
from autopar.hardware.cluster import Cluster
from autopar.hardware.device import (
    DeviceMemory,
    DeviceSpec,
    HostEffects,
    Roofline,
    alone,
    bandwidth_shared,
    device_kind,
    time_shared,
    with_host,
)
from autopar.hardware.links import COLLECTIVE_OPS, CommCurve, LinkSpec, OpLink
from autopar.hardware.presets import preset
from autopar.profiles.network_section import NetworkProfile
from autopar.profiles.report import ProfileReport
from autopar.profiles.sections import DeviceProfile, Provenance
from autopar.vocab import DType, Optimizer


def read_reports(reports: Any) -> list[tuple[str, ProfileReport]]:
    """Each report with where it came from: a :class:`ProfileReport`, its ``to_dict()``
    data, or a JSON file's path; one or a sequence of them."""
    if isinstance(reports, (str, ProfileReport, dict)) or hasattr(reports, "__fspath__"):
        reports = [reports]
    if not isinstance(reports, (list, tuple)):
        raise ProfileFormatError(
            f"profile={type(reports).__name__} is not allowed: give a ProfileReport, its to_dict(), a JSON file "
            f"path, or a list of them."
        )
    out = []
    for i, r in enumerate(reports):
        if isinstance(r, ProfileReport):
            out.append((f"report #{i + 1}", r))
        elif isinstance(r, dict):
            out.append((f"report #{i + 1}", ProfileReport.from_dict(r, origin=f"report #{i + 1}")))
        elif isinstance(r, str) or hasattr(r, "__fspath__"):
            out.append((str(r), ProfileReport.load(r)))
        else:
            raise ProfileFormatError(
                f"profile #{i + 1} is a {type(r).__name__}; give a ProfileReport, its to_dict(), or a JSON file path."
            )
    if not out:
        raise ProfileFormatError("no profile reports given; pass at least one (a ProfileReport or a JSON path).")
    return out


def latest(reports: Sequence[tuple[str, ProfileReport]], section: str) -> tuple[str, Any] | None:
    """The section ``section`` of the last report that has it, with its report's origin
    (later reports win, as in :meth:`ProfileReport.merge`)."""
    found = None
    for origin, r in reports:
        value = getattr(r, section)
        if value is not None:
            found = (origin, value)
    return found


def cluster_from_profiles(reports: Any, base: Cluster | None = None) -> Cluster:
    """A cluster whose device and links come from measurements where there are some.

    Args:
        reports: profile reports (device, network and layer sections are read; a
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

    Raises:
        ClusterError: a device or network section measured another kind of device than
            ``base``'s (:func:`_check_kinds`), or what is needed was not measured.
    """
    rs = read_reports(reports)
    dev = latest(rs, "device")
    net = latest(rs, "network")
    layers = latest(rs, "layers")
    _check_kinds(dev, net, base)
    kinds = {found[1].device_kind for found in (net, layers) if found is not None}
    if dev is not None:
        kinds.add(dev[1].kind)
    if base is None and kinds == {"cpu"}:
        base = _local_cpu_base(net[1] if net is not None else None)
    if dev is None and net is None:
        if base is None:
            raise ClusterError(
                f"the profiles ({', '.join(origin for origin, _ in rs)}) measure neither a device nor a network, and "
                f"no base cluster was given; pass base=autopar.preset(...)."
            )
        return base
    nodes, per_node = _shape(base, net[1] if net is not None else None)
    device = _device(dev, base, per_node) if dev is not None else _base_device(base)
    device = _with_group_measurements(device, net, per_node)
    intra, inter = _links(net, base, nodes, per_node)
    prefix = base.kind.removesuffix("+profile") if base is not None else "measured"
    return Cluster(
        name=f"{prefix}+profile x {nodes}",
        nodes=nodes,
        devices_per_node=per_node,
        device=device,
        intra_node=intra,
        inter_node=inter,
    )


def _check_kinds(
    dev: tuple[str, DeviceProfile] | None, net: tuple[str, NetworkProfile] | None, base: Cluster | None
) -> None:
    """Refuse a device or network section measured on another kind of device (CPU
    processes or CUDA GPUs) than ``base``'s: its rates, memory or gloo links would stand
    in for the cluster's without a word (gloo between two CPU processes priced a GPT-2
    step on 16 H100s at 21 to 125 ms over runs, the datasheet's links at 2.5 ms). A
    layer section is kept, with a note: its factors are relative to the device it
    measured (:mod:`autopar.profiles.identity`)."""
    if base is None:
        return
    want = device_kind(base.device.name)
    if want == "cpu":
        remedy = "pass a --cluster of the GPUs it measured (a preset or cluster file)"
    else:
        remedy = f"plan for the machine it measured with --cluster local-cpu:{net[1].nodes if net else 1}"
    for what, found in (("device", dev), ("network", net)):
        if found is None:
            continue
        origin, section = found
        if isinstance(section, DeviceProfile):
            kind, measured, replaced = section.kind, f"{section.name} ({section.kind})", "rates and memory"
        else:
            kind, replaced = section.device_kind, "links"
            measured = f"{section.backend} between {section.world_size} {kind} ranks"
        if kind != want:
            raise ClusterError(
                f"the {what} profile in {origin} measured {measured} but the cluster {base.name} has "
                f"{base.device.name} ({want}) devices, whose {replaced} it would silently replace; profile the "
                f"{what} on the cluster's devices, drop --profile, or {remedy}."
            )


def _local_cpu_base(net: NetworkProfile | None) -> Cluster:
    if net is None:
        return preset("local-cpu", nodes=1, devices_per_node=1)
    return preset("local-cpu", nodes=net.nodes, devices_per_node=net.ranks_per_node)


def _shape(base: Cluster | None, net: NetworkProfile | None) -> tuple[int, int]:
    if base is not None:
        return base.nodes, base.devices_per_node
    return (net.nodes, net.ranks_per_node) if net is not None else (1, 1)


def _base_device(base: Cluster | None) -> DeviceSpec:
    if base is None:
        raise ClusterError(
            "the profiles measure a network but no device, and no base cluster was given; add a device profile "
            "('autopar profile device') or pass base=autopar.preset(...)."
        )
    return base.device


def _device(found: tuple[str, DeviceProfile], base: Cluster | None, per_node: int) -> DeviceSpec:
    """The measured device as one of ``per_node`` processes sees it."""
    origin, d = found
    curves = {DType(dt): d.curve(dt) for dt in dict.fromkeys(p.dtype for p in d.matmul)}  # in the order measured
    measured_peaks = {dt: max(r for _, r in pts) for dt, pts in curves.items()}
    memory = d.memory_bytes / (per_node if d.memory_shared else 1)
    where = where_measured(d.provenance)
    if base is not None:
        bdev = alone(base.device)  # the measurement is of one process alone too
        base_peaks = bdev.roofline.peak_flops
        peaks = {dt: max(base_peaks.get(dt, 0.0), measured_peaks.get(dt, 0.0)) for dt in {*base_peaks, *measured_peaks}}
        efficiency = bdev.roofline.matmul_efficiency
        reserved = bdev.memory.reserved_bytes
        raised = sorted(dt.value for dt in measured_peaks if measured_peaks[dt] > base_peaks.get(dt, 0.0))
        peak_note = f"peak FLOP/s from {bdev.name} ({bdev.source})" + (
            f", raised to the measured maximum for {', '.join(raised)} (a peak cannot be below what was achieved)"
            if raised
            else ""
        )
        preferred = bdev.preferred_dtype if bdev.preferred_dtype in peaks else next(iter(curves))
    else:
        peaks, efficiency, reserved = measured_peaks, 1.0, d.reserved_bytes
        peak_note = "peak FLOP/s = the fastest measured matmul (no datasheet given)"
        preferred = DType.BF16 if DType.BF16 in curves else next(iter(curves))
    share = f" / {per_node} processes" if d.memory_shared and per_node > 1 else ""
    cpu = d.kind == "cpu"
    overlap = 0.0 if cpu else (bdev.comm_overlap if base is not None else DeviceSpec.comm_overlap)
    per_param = d.optimizer_s_per_param
    optimizer_rate = optimizer_step_bytes(Optimizer.ADAM) / per_param if per_param > 0 else 0.0
    spec = DeviceSpec(
        name=d.name,
        roofline=Roofline(
            peak_flops=peaks,
            memory_bandwidth_bytes_per_s=d.memory_bandwidth_bytes_per_s,
            matmul_efficiency=efficiency,
            memory_efficiency=1.0,
            matmul_curves=curves,
            fp8_flops=bdev.roofline.fp8_flops if base is not None else 0.0,
            fp8_matmul_efficiency=bdev.roofline.fp8_matmul_efficiency if base is not None else None,
            attention_efficiency=_attention_efficiency(d, peaks, preferred, bdev if base is not None else None),
        ),
        memory=DeviceMemory(capacity_bytes=memory, reserved_bytes=reserved),
        host=HostEffects(
            op_overhead_s=d.op_overhead_s,
            tp_overhead_s=d.tp_overhead_s,
            optimizer_bytes_per_s=optimizer_rate,
            exposed_weight_traffic=cpu,
        ),
        comm_overlap=overlap,
        preferred_dtype=preferred,
        async_tp=bdev.async_tp if base is not None else False,
        compiles=not cpu,
        source=(
            f"measured ({origin}, {where}): matmul curves {', '.join(dt.value for dt in curves)} over "
            f"{len(d.matmul)} shapes, streaming bandwidth {d.memory_bandwidth_bytes_per_s / 1e9:.3g} "
            f"GB/s (memory_efficiency 1: already achieved); framework overhead "
            f"{d.op_overhead_s * 1e6:.1f} us per op, {d.tp_overhead_s * 1e6:.0f} us per tensor-parallel layer; "
            + (
                f"AdamW step {per_param * 1e9:.2f} ns per parameter ({optimizer_rate / 1e9:.3g} GB/s of its ideal "
                f"traffic); "
                if per_param > 0
                else ""
            )
            + (f"fused attention (causal SDPA forward and backward) {_attention_note(d)}; " if d.attention else "")
            + (
                "communication overlaps no compute (gloo shares the cores), weight traffic is not hidden under "
                "the arithmetic; "
                if cpu
                else ""
            )
            + f"memory {d.memory_bytes / 2**30:.1f} GiB{share}; {peak_note}"
        ),
    )
    cores = d.provenance.cpu_count if cpu else 0
    threads = max(d.threads, 1)
    if not (cores and per_node * threads > cores):
        return spec
    return time_shared(
        spec, cores / (per_node * threads), f"{per_node} processes of {threads} thread(s) time-share {cores} cores"
    )


def _attention_efficiency(
    d: DeviceProfile, peaks: dict[DType, float], preferred: DType, base: DeviceSpec | None
) -> float | None:
    """The fused attention kernel's fraction of the peak: measured (the preferred
    precision's rate, else the first measured one's, over that precision's peak), else
    the base's stated value (None without a base: attention priced by the flop counter)."""
    measured = [DType(p.dtype) for p in d.attention]
    for dt in dict.fromkeys([preferred, *measured]):
        rate = d.attention_flop_per_s(dt)
        if rate is not None and peaks.get(dt):
            return rate / peaks[dt]
    return base.roofline.attention_efficiency if base is not None else None


def _attention_note(d: DeviceProfile) -> str:
    rates = {p.dtype: d.attention_flop_per_s(p.dtype) or 0.0 for p in d.attention}
    return ", ".join(f"{dt} {rate / 1e12:.3g} TFLOP/s" for dt, rate in rates.items()) + (
        f" over {len({p.seq_len for p in d.attention})} sequence lengths"
    )


def group_figures_apply(network: NetworkProfile, per_node: int) -> bool:
    """Whether what ``network`` measured per process (framework overheads, memory share,
    how unevenly ranks finish) applies to a cluster of ``per_node`` processes per node:
    only at the count it was measured with, as the figures depend on how many share a node."""
    return network.ranks_per_node == per_node


def _with_group_measurements(device: DeviceSpec, net: tuple[str, NetworkProfile] | None, per_node: int) -> DeviceSpec:
    """The device with what a network profile measured on its real groups, where it was
    measured with this cluster's processes per node (the figures depend on how many
    share a node): the framework overheads and the rate of FSDP's copies, how unevenly
    the ranks finish the same work, and the memory bandwidth a process keeps while the
    others stream (the time share the device already has is divided out of it)."""
    if net is None or not group_figures_apply(net[1], per_node):
        return device
    origin, n = net
    where = f"measured on {n.world_size} {n.backend} ranks ({origin})"
    per = {
        "tp_overhead_s": "tensor-parallel layer forward",
        "fsdp_overhead_s": "FSDP collective",
        "fsdp_tensor_overhead_s": "parameter tensor in an FSDP collective",
    }
    measured = {k: getattr(n, k) for k in per if getattr(n, k) > 0}
    if measured:
        what = ", ".join(f"{v * 1e6:.0f} us per {per[k]}" for k, v in measured.items())
        device = replace(with_host(device, **measured), source=f"{device.source}; framework overhead {what}, {where}")
    if n.fsdp_copy_bytes_per_s > 0:
        copies = n.fsdp_copy_bytes_per_s
        device = replace(
            with_host(device, fsdp_copy_bytes_per_s=copies),
            source=f"{device.source}; FSDP copies at {copies / 1e9:.2f} GB/s, {where}",
        )
    noise, spread = n.sync_noise_s_per_sqrt_s, n.sync_speed_spread
    if noise > 0 or spread > 0:
        device = replace(
            with_host(device, sync_noise_s_per_sqrt_s=noise, sync_speed_spread=spread),
            source=f"{device.source}; ranks finish the same work {noise * 1e3:.1f} ms per sqrt(s) of "
            f"it and {spread:.1%} of it apart (one standard deviation), {where}",
        )
    beyond = n.memory_share / device.host.time_share
    if beyond < 1:
        device = bandwidth_shared(
            device,
            beyond,
            f"{per_node} processes streaming at once keep {n.memory_share:.2f} of one process's memory bandwidth, {where}",
        )
    return device


def _links(
    net: tuple[str, NetworkProfile] | None, base: Cluster | None, nodes: int, per_node: int
) -> tuple[LinkSpec, LinkSpec]:
    fits = {}
    if net is not None:
        origin, n = net
        for level in ("intra", "inter"):
            fit = n.link(level)
            if fit is not None:
                per_op = _per_op(n, level)
                fits[level] = LinkSpec(
                    bandwidth_bytes_per_s=fit.bandwidth_bytes_per_s,
                    latency_s=fit.alpha_s,
                    per_op=per_op,
                    source=(
                        f"fitted alpha-beta ({origin}, {where_measured(n.provenance)}): {n.backend}, "
                        f"{'+'.join(fit.ops)} over {fit.points} measurements, rms error "
                        f"{100 * fit.rms_rel_error:.0f}%"
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
            "no link was measured and no base cluster was given; add a network profile ('autopar profile network') "
            "or pass base=autopar.preset(...)."
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


def _per_op(net: NetworkProfile, level: str) -> tuple[OpLink, ...]:
    """The single-op fits of ``level`` for the collectives the cost model prices: with
    them an all-gather is priced at the all-gather's measured rate, not the joint fit's,
    each with its measured curve (:func:`_curve`)."""
    return tuple(
        OpLink(
            op=f.ops[0],
            bandwidth_bytes_per_s=f.bandwidth_bytes_per_s,
            latency_s=f.alpha_s,
            curve=_curve(net, level, f.ops[0]),
        )
        for f in net.fits
        if f.level == level and len(f.ops) == 1 and f.ops[0] in COLLECTIVE_OPS
    )


def _curve(net: NetworkProfile, level: str, op: str) -> CommCurve | None:
    """``op``'s measured seconds per call at ``level`` as a :class:`CommCurve`: each
    point's price per call (:attr:`autopar.profiles.sections.Timing.per_call_s`); where
    several groups measured it (one per node), those of the commonest size, the median
    over groups per message size; None where fewer than two sizes were measured."""
    series = [s for s in net.series if s.level == level and s.op == op]
    if not series:
        return None
    sizes = [len(s.ranks) for s in series]
    ranks = max(set(sizes), key=sizes.count)
    per_size: dict[float, list[float]] = {}
    for s in series:
        if len(s.ranks) == ranks:
            for point in s.points:
                per_size.setdefault(point.nbytes, []).append(point.time.per_call_s)
    if len(per_size) < 2 or ranks < 2:
        return None
    return CommCurve.from_measured(ranks, per_size, [statistics.median(v) for v in per_size.values()])


def where_measured(p: Provenance) -> str:
    """Where and when a section was measured: host, date, torch version."""
    return f"host {p.host}, {p.created_utc}, torch {p.software.get('torch', '?')}"
