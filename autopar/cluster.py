"""Clusters: devices and the links between them, as plain numbers with their sources.

A :class:`Cluster` is ``nodes`` identical nodes of ``devices_per_node`` devices; devices
inside a node talk over ``intra_node`` (NVLink, loopback), nodes over ``inter_node``
(InfiniBand, Ethernet). Heterogeneous clusters would add a list of node groups; every
consumer reads devices through :attr:`Cluster.device`, which keeps room for that.

Units: bytes, seconds, FLOP/s. ``LinkSpec.bandwidth_bytes_per_s`` is the achievable bus
bandwidth per device in one direction, as nccl-tests reports ``busbw`` (NVLink's
advertised 600 GB/s is a bidirectional total over all links).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from autopar.comm_curve import CommCurve
from autopar.errors import ClusterError, check_cluster_seconds, check_positive_float
from autopar.vocab import DType

_SHARE_NOTE = "; time share: "


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One accelerator (or one CPU process).

    Attributes:
        name: marketing name, e.g. ``"A100-SXM4-80GB"``.
        memory_bytes: memory the framework can allocate on the device.
        peak_flops: dense peak FLOP/s per precision; a precision missing here is not
            supported by the device (V100 has no bf16).
        memory_bandwidth_bytes_per_s: peak memory bandwidth.
        matmul_efficiency: fraction of ``peak_flops`` a large matrix multiply reaches.
        memory_efficiency: fraction of the memory bandwidth a streaming kernel reaches.
        reserved_bytes: memory the framework cannot use for the model: runtime context,
            communication buffers, allocator fragmentation.
        fragmentation: fraction of the allocated bytes lost to allocator fragmentation.
        op_overhead_s: framework time per dispatched op (eager dispatch, autograd).
        tp_overhead_s: extra framework time per forward of a tensor-parallel leaf
            (DTensor dispatch).
        fsdp_overhead_s, fsdp_tensor_overhead_s: framework time per FSDP2 collective
            call beyond its transfer and the bytes its copies move (hooks, dispatch),
            and per parameter tensor of its unit (each copied and viewed apart); GPU
            presets: 0 (NCCL runs them under large kernels), a network profile measures them.
        fsdp_copy_bytes_per_s: the rate FSDP2's copies into and out of its flat buffers
            reach (:func:`autopar.cost.comm.fsdp_copy_s`); 0 means the streaming
            bandwidth. A network profile measures it: on CPU processes the copies of
            many small parameter tensors reach a fraction of the streaming rate.
        sync_noise_s_per_sqrt_s, sync_speed_spread: how unevenly the ranks of a group
            finish the same work: a rank's time for ``T`` seconds of it deviates by
            ``sqrt(sigma^2 T + (delta T)^2)`` (one standard deviation), and blocking
            collectives wait for the last (:mod:`autopar.cost.sync`). Measured by a
            network profile (:mod:`profiler.sync_skew`); 0 in GPU presets.
        comm_overlap: share of the compute time that can hide data-parallel
            communication. Overlapped collectives are not free: NCCL's kernels occupy
            streaming multiprocessors and both compete for memory bandwidth, so
            overlapped compute runs slower; 0.8 is a conservative middle of the 10-30%
            slowdowns reported for overlapped FSDP/DDP communication. CPU processes
            get 0: gloo reduces on CPU threads that compete with the compute for the
            same cores (measured on local processes: the gradient all-reduce adds its
            whole time to the step).
        optimizer_bytes_per_s: rate at which the optimizer step moves its bytes
            (``cost.memory.optimizer_step_bytes``); 0 means the streaming bandwidth.
            Eager CPU optimizers make many passes and reach a fraction of it, so a
            device profile measures it.
        time_share: the share of the device one process gets (CPU processes that
            outnumber the cores are time-sliced); the rates and overheads here already
            include it (:meth:`time_shared`).
        bandwidth_share: the share of its streaming bandwidth a process keeps while the
            other processes of its node stream too (memory is a node resource, cores
            are not), beyond ``time_share``; the bandwidth and the optimizer rate here
            already include it (:meth:`bandwidth_shared`).
        exposed_weight_traffic: a layer's weights cost memory passes the arithmetic
            does not hide, once per micro-batch: single-threaded CPU BLAS (MKL, oneDNN)
            first copies ("packs") each weight panel, a layer's weights have left the
            caches by the time it runs again, and eager autograd adds each
            micro-batch's weight gradient into ``.grad`` in a pass of its own
            (:func:`autopar.cost.tensor_parallel.leaf_fwd_s`,
            :func:`~autopar.cost.tensor_parallel.leaf_accumulate_s`). True for CPU
            processes. GPU presets keep the roofline (GEMM kernels stream weight tiles
            under the arithmetic, and the published runs the model is checked against
            fuse the accumulation into the weight-gradient GEMM, Megatron-LM's
            ``gradient_accumulation_fusion``).
        preferred_dtype: the precision plans use unless told otherwise.
        matmul_curves: measured achieved FLOP/s against matmul size (FLOPs of one call)
            per precision, from a profiler report; when present the cost model
            interpolates it instead of using ``matmul_efficiency``.
        source: where the numbers come from.
    """

    name: str
    memory_bytes: float
    peak_flops: Mapping[DType, float]
    memory_bandwidth_bytes_per_s: float
    matmul_efficiency: float = 0.8
    memory_efficiency: float = 0.8
    reserved_bytes: float = 0.0
    fragmentation: float = 0.0
    op_overhead_s: float = 0.0
    tp_overhead_s: float = 0.0
    fsdp_overhead_s: float = 0.0
    fsdp_tensor_overhead_s: float = 0.0
    sync_noise_s_per_sqrt_s: float = 0.0
    sync_speed_spread: float = 0.0
    fsdp_copy_bytes_per_s: float = 0.0
    comm_overlap: float = 0.8
    optimizer_bytes_per_s: float = 0.0
    time_share: float = 1.0
    bandwidth_share: float = 1.0
    exposed_weight_traffic: bool = False
    preferred_dtype: DType = DType.BF16
    matmul_curves: Mapping[DType, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    source: str = ""

    def __post_init__(self) -> None:
        for attr in ("memory_bytes", "memory_bandwidth_bytes_per_s"):
            object.__setattr__(
                self,
                attr,
                check_positive_float(f"device {self.name!r} {attr}", getattr(self, attr), error=ClusterError),
            )
        if not (isinstance(self.reserved_bytes, (int, float)) and 0 <= self.reserved_bytes < self.memory_bytes):
            raise ClusterError(
                f"device {self.name!r} reserved_bytes={self.reserved_bytes!r} is not allowed: it must be "
                f">= 0 and below memory_bytes={self.memory_bytes!r}."
            )
        object.__setattr__(self, "reserved_bytes", float(self.reserved_bytes))
        if isinstance(self.fragmentation, bool) or not (
            isinstance(self.fragmentation, (int, float)) and 0 <= self.fragmentation < 1
        ):
            raise ClusterError(
                f"device {self.name!r} fragmentation={self.fragmentation!r} is not allowed: it must be in [0, 1)."
            )
        object.__setattr__(self, "fragmentation", float(self.fragmentation))
        units = {"sync_noise_s_per_sqrt_s": "seconds per square root of a second", "sync_speed_spread": "a fraction"}
        for attr in ("op_overhead_s", "tp_overhead_s", "fsdp_overhead_s", "fsdp_tensor_overhead_s", *units):
            value = getattr(self, attr)
            if isinstance(value, bool) or not (isinstance(value, (int, float)) and 0 <= value < 1):
                raise ClusterError(
                    f"device {self.name!r} {attr}={value!r} is not allowed: it must be in [0, 1) "
                    f"({units.get(attr, 'seconds')})."
                )
            object.__setattr__(self, attr, float(value))
        if not isinstance(self.exposed_weight_traffic, bool):
            raise ClusterError(
                f"device {self.name!r} exposed_weight_traffic={self.exposed_weight_traffic!r} is not "
                f"allowed: it must be true or false."
            )
        if isinstance(self.comm_overlap, bool) or not (
            isinstance(self.comm_overlap, (int, float)) and 0 <= self.comm_overlap <= 1
        ):
            raise ClusterError(
                f"device {self.name!r} comm_overlap={self.comm_overlap!r} is not allowed: it must be "
                f"a share of the compute time in [0, 1] (0: communication never overlaps)."
            )
        object.__setattr__(self, "comm_overlap", float(self.comm_overlap))
        for attr in ("optimizer_bytes_per_s", "fsdp_copy_bytes_per_s"):
            value = getattr(self, attr)
            if isinstance(value, bool) or not (isinstance(value, (int, float)) and value >= 0):
                raise ClusterError(
                    f"device {self.name!r} {attr}={value!r} is not allowed: it must be bytes per second "
                    f">= 0 (0: the streaming bandwidth)."
                )
            object.__setattr__(self, attr, float(value))
        if isinstance(self.time_share, bool) or not (
            isinstance(self.time_share, (int, float)) and 0 < self.time_share <= 1
        ):
            raise ClusterError(
                f"device {self.name!r} time_share={self.time_share!r} is not allowed: it must be in (0, 1]."
            )
        object.__setattr__(self, "time_share", float(self.time_share))
        if isinstance(self.bandwidth_share, bool) or not (
            isinstance(self.bandwidth_share, (int, float)) and 0 < self.bandwidth_share <= 1
        ):
            raise ClusterError(
                f"device {self.name!r} bandwidth_share={self.bandwidth_share!r} is not allowed: it must be in (0, 1]."
            )
        object.__setattr__(self, "bandwidth_share", float(self.bandwidth_share))
        for eff_name in ("matmul_efficiency", "memory_efficiency"):
            eff = getattr(self, eff_name)
            if not (isinstance(eff, (int, float)) and 0 < eff <= 1):
                raise ClusterError(f"device {self.name!r} {eff_name}={eff!r} is not allowed: it must be in (0, 1].")
        if not self.peak_flops:
            raise ClusterError(
                f"device {self.name!r} has no peak_flops: give at least one precision, e.g. {{'bf16': 3.12e14}}."
            )
        coerced = {}
        for key, value in self.peak_flops.items():
            coerced[_dtype(key, f"device {self.name!r} peak_flops")] = check_positive_float(
                f"device {self.name!r} peak_flops[{key}]", value, error=ClusterError
            )
        object.__setattr__(self, "peak_flops", coerced)
        object.__setattr__(
            self, "preferred_dtype", _dtype(self.preferred_dtype, f"device {self.name!r} preferred_dtype")
        )
        if self.preferred_dtype not in coerced:
            raise ClusterError(
                f"device {self.name!r} preferred_dtype={self.preferred_dtype.value} has no peak_flops entry."
            )
        curves = {}
        for key, points in self.matmul_curves.items():
            pts = tuple(sorted((float(f), float(r)) for f, r in points))
            if not pts or any(f <= 0 or r <= 0 for f, r in pts):
                raise ClusterError(
                    f"device {self.name!r} matmul_curves[{key}] must be non-empty (flops, flop/s) pairs > 0, got {points!r}."
                )
            curves[_dtype(key, f"device {self.name!r} matmul_curves")] = pts
        object.__setattr__(self, "matmul_curves", curves)

    def time_shared(self, share: float, why: str) -> DeviceSpec:
        """This device as seen by a process that gets only ``share`` of it: CPU processes
        outnumbering the cores are time-sliced by the kernel, so every rate is
        multiplied by ``share`` and every per-op cost divided by it (``why`` is added
        to ``source``; :meth:`alone` undoes it)."""
        if not 0 < share <= 1:
            raise ClusterError(f"device {self.name!r}: a time share of {share!r} is not allowed; it must be in (0, 1].")
        if share == 1:
            return self
        return self._scaled(share, time_share=self.time_share * share, source=f"{self.source}{_SHARE_NOTE}{why}")

    def bandwidth_shared(self, share: float, why: str) -> DeviceSpec:
        """This device as seen by a process that keeps only ``share`` of its memory
        bandwidth because the node's other processes stream at the same time: the
        bandwidth and the (memory-bound) optimizer rate are multiplied by ``share``
        (``why`` is added to ``source``; :meth:`alone` undoes it)."""
        if not 0 < share <= 1:
            raise ClusterError(
                f"device {self.name!r}: a bandwidth share of {share!r} is not allowed; it must be in (0, 1]."
            )
        if share == 1:
            return self
        return replace(
            self,
            memory_bandwidth_bytes_per_s=self.memory_bandwidth_bytes_per_s * share,
            optimizer_bytes_per_s=self.optimizer_bytes_per_s * share,
            bandwidth_share=self.bandwidth_share * share,
            source=f"{self.source}{_SHARE_NOTE}{why}",
        )

    def alone(self) -> DeviceSpec:
        """This device with the whole of its cores and its memory (before
        :meth:`time_shared` and :meth:`bandwidth_shared`): what a profile measured by one
        process compares against."""
        if self.time_share == 1 and self.bandwidth_share == 1:
            return self
        k = 1 / self.bandwidth_share
        own = replace(
            self,
            memory_bandwidth_bytes_per_s=self.memory_bandwidth_bytes_per_s * k,
            optimizer_bytes_per_s=self.optimizer_bytes_per_s * k,
            bandwidth_share=1.0,
        )
        return own._scaled(1 / self.time_share, time_share=1.0, source=self.source.split(_SHARE_NOTE)[0])

    def _scaled(self, k: float, **changes: Any) -> DeviceSpec:
        return replace(
            self,
            peak_flops={d: v * k for d, v in self.peak_flops.items()},
            memory_bandwidth_bytes_per_s=self.memory_bandwidth_bytes_per_s * k,
            op_overhead_s=self.op_overhead_s / k,
            tp_overhead_s=self.tp_overhead_s / k,
            fsdp_overhead_s=self.fsdp_overhead_s / k,
            fsdp_tensor_overhead_s=self.fsdp_tensor_overhead_s / k,
            optimizer_bytes_per_s=self.optimizer_bytes_per_s * k,
            matmul_curves={d: tuple((f, r * k) for f, r in pts) for d, pts in self.matmul_curves.items()},
            **changes,
        )

    def peak(self, dtype: DType) -> float:
        """Peak FLOP/s in ``dtype``; raises ClusterError if the device lacks it."""
        if dtype not in self.peak_flops:
            have = ", ".join(sorted(self.peak_flops))
            raise ClusterError(
                f"device {self.name} does not support dtype={dtype.value}: it has {have}. "
                f"Pick one of those with dtype=... (V100 trains in fp16, not bf16)."
            )
        return self.peak_flops[dtype]


COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")
"""The operations a link may carry a fit of its own for (what ``autopar.cost.comm`` prices)."""


@dataclass(frozen=True, kw_only=True)
class OpLink:
    """A measured alpha-beta fit of one collective on a link level, and optionally its
    measured curve (:class:`CommCurve`), which prices it on groups of the curve's size.

    NCCL moves all collectives at about one bus bandwidth, so a level's single fit
    serves them all; gloo does not: on a 2-core box its reduce-scatter reached 0.44 GB/s
    and its all-gather 0.73 GB/s against 1.66 GB/s for all-reduce
    (benchmarks/results/predicted_vs_measured_2026-11-29_profiles.json), so ZeRO-3,
    which only gathers and scatters, priced at the all-reduce rate came out 3x cheap.
    """

    op: str
    bandwidth_bytes_per_s: float
    latency_s: float
    curve: CommCurve | None = None

    def __post_init__(self) -> None:
        if self.op not in COLLECTIVE_OPS:
            raise ClusterError(
                f"link fit op={self.op!r} is not allowed: it must be one of {', '.join(COLLECTIVE_OPS)}."
            )
        object.__setattr__(
            self,
            "bandwidth_bytes_per_s",
            check_positive_float(f"{self.op} bandwidth_bytes_per_s", self.bandwidth_bytes_per_s, error=ClusterError),
        )
        object.__setattr__(self, "latency_s", check_cluster_seconds(f"{self.op} latency_s", self.latency_s))


@dataclass(frozen=True, kw_only=True)
class LinkSpec:
    """A level of the interconnect: achievable busbw per device and per-hop latency,
    and optionally a measured fit per collective (``per_op``) that replaces them for
    that collective."""

    bandwidth_bytes_per_s: float
    latency_s: float
    source: str = ""
    per_op: tuple[OpLink, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(
            self,
            "bandwidth_bytes_per_s",
            check_positive_float("link bandwidth_bytes_per_s", self.bandwidth_bytes_per_s, error=ClusterError),
        )
        object.__setattr__(self, "latency_s", check_cluster_seconds("link latency_s", self.latency_s))
        ops = [f.op for f in self.per_op]
        if len(set(ops)) != len(ops):
            raise ClusterError(f"link per_op has {ops}: give each collective at most one fit.")

    def for_op(self, op: str) -> tuple[float, float]:
        """``(bandwidth_bytes_per_s, latency_s)`` of ``op`` on this level: its own fit
        where one was measured, else the level's."""
        for fit in self.per_op:
            if fit.op == op:
                return fit.bandwidth_bytes_per_s, fit.latency_s
        return self.bandwidth_bytes_per_s, self.latency_s

    def curve_for(self, op: str, ranks: int) -> CommCurve | None:
        """The measured curve of ``op`` on groups of ``ranks`` ranks, if this level has one."""
        for fit in self.per_op:
            if fit.op == op and fit.curve is not None and fit.curve.ranks == ranks:
                return fit.curve
        return None


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """``nodes`` x ``devices_per_node`` identical devices."""

    name: str
    nodes: int
    devices_per_node: int
    device: DeviceSpec
    intra_node: LinkSpec
    inter_node: LinkSpec

    def __post_init__(self) -> None:
        for attr in ("nodes", "devices_per_node"):
            value = getattr(self, attr)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ClusterError(
                    f"cluster {self.name!r} {attr}={value!r} is not allowed: it must be a positive integer."
                )

    @property
    def world_size(self) -> int:
        """Total number of devices."""
        return self.nodes * self.devices_per_node

    def with_nodes(self, nodes: int) -> Cluster:
        """The same cluster with another node count (for what-if questions)."""
        return replace(self, nodes=nodes, name=_rename(self.name, nodes))

    def describe(self) -> str:
        """One line: ``dgx-a100-80gb x 128 nodes = 1024 A100-SXM4-80GB (80.0 GiB)``."""
        return (
            f"{self.name}: {self.nodes} node(s) x {self.devices_per_node} = {self.world_size} "
            f"{self.device.name} ({self.device.memory_bytes / 2**30:.1f} GiB each)"
        )

    # ----- construction -------------------------------------------------------------

    @staticmethod
    def preset(name: str, *, nodes: int = 1, devices_per_node: int | None = None) -> Cluster:
        """A cluster of ``nodes`` nodes of a known type; see :func:`autopar.presets.preset_names`.

        ``devices_per_node`` overrides the node's device count (e.g. 4 processes of
        ``local-cpu``).
        """
        from autopar.presets import build_preset

        return build_preset(name, nodes=nodes, devices_per_node=devices_per_node)

    @staticmethod
    def parse(spec: str) -> Cluster:
        """``"dgx-a100-80gb:128"`` (preset:nodes), a preset name, or a JSON file path."""
        if spec.endswith(".json") or Path(spec).is_file():
            return Cluster.from_json(spec)
        name, _, count = spec.partition(":")
        if not count:
            return Cluster.preset(name)
        try:
            nodes = int(count)
        except ValueError:
            raise ClusterError(
                f"cluster spec {spec!r}: the node count after ':' must be an integer, e.g. 'dgx-a100-80gb:128'."
            ) from None
        return Cluster.preset(name, nodes=nodes)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data, the inverse of :meth:`from_dict`."""
        dev = self.device
        return {
            "name": self.name,
            "nodes": self.nodes,
            "devices_per_node": self.devices_per_node,
            "device": {
                "name": dev.name,
                "memory_bytes": dev.memory_bytes,
                "peak_flops": {k.value: v for k, v in dev.peak_flops.items()},
                "memory_bandwidth_bytes_per_s": dev.memory_bandwidth_bytes_per_s,
                "matmul_efficiency": dev.matmul_efficiency,
                "memory_efficiency": dev.memory_efficiency,
                "reserved_bytes": dev.reserved_bytes,
                "fragmentation": dev.fragmentation,
                "op_overhead_s": dev.op_overhead_s,
                "tp_overhead_s": dev.tp_overhead_s,
                "fsdp_overhead_s": dev.fsdp_overhead_s,
                "fsdp_tensor_overhead_s": dev.fsdp_tensor_overhead_s,
                "sync_noise_s_per_sqrt_s": dev.sync_noise_s_per_sqrt_s,
                "sync_speed_spread": dev.sync_speed_spread,
                "fsdp_copy_bytes_per_s": dev.fsdp_copy_bytes_per_s,
                "comm_overlap": dev.comm_overlap,
                "optimizer_bytes_per_s": dev.optimizer_bytes_per_s,
                "time_share": dev.time_share,
                "bandwidth_share": dev.bandwidth_share,
                "exposed_weight_traffic": dev.exposed_weight_traffic,
                "preferred_dtype": dev.preferred_dtype.value,
                "matmul_curves": {k.value: [list(p) for p in v] for k, v in dev.matmul_curves.items()},
                "source": dev.source,
            },
            "intra_node": _link_dict(self.intra_node),
            "inter_node": _link_dict(self.inter_node),
        }

    @staticmethod
    def from_dict(data: Mapping[str, Any], *, origin: str = "cluster data") -> Cluster:
        """Build from :meth:`to_dict` output; errors name the missing or bad field."""
        try:
            dev = dict(data["device"])
            device = DeviceSpec(
                name=str(dev["name"]),
                memory_bytes=dev["memory_bytes"],
                peak_flops=dict(dev["peak_flops"]),
                memory_bandwidth_bytes_per_s=dev["memory_bandwidth_bytes_per_s"],
                matmul_efficiency=dev.get("matmul_efficiency", 0.8),
                memory_efficiency=dev.get("memory_efficiency", 0.8),
                reserved_bytes=dev.get("reserved_bytes", 0.0),
                fragmentation=dev.get("fragmentation", 0.0),
                op_overhead_s=dev.get("op_overhead_s", 0.0),
                tp_overhead_s=dev.get("tp_overhead_s", 0.0),
                fsdp_overhead_s=dev.get("fsdp_overhead_s", 0.0),
                fsdp_tensor_overhead_s=dev.get("fsdp_tensor_overhead_s", 0.0),
                sync_noise_s_per_sqrt_s=dev.get("sync_noise_s_per_sqrt_s", 0.0),
                sync_speed_spread=dev.get("sync_speed_spread", 0.0),
                fsdp_copy_bytes_per_s=dev.get("fsdp_copy_bytes_per_s", 0.0),
                comm_overlap=dev.get("comm_overlap", 0.8),
                optimizer_bytes_per_s=dev.get("optimizer_bytes_per_s", 0.0),
                time_share=dev.get("time_share", 1.0),
                bandwidth_share=dev.get("bandwidth_share", 1.0),
                exposed_weight_traffic=dev.get("exposed_weight_traffic", False),
                preferred_dtype=dev.get("preferred_dtype", "bf16"),
                matmul_curves={k: tuple(tuple(p) for p in v) for k, v in dev.get("matmul_curves", {}).items()},
                source=str(dev.get("source", "")),
            )
            return Cluster(
                name=str(data.get("name", "custom")),
                nodes=data["nodes"],
                devices_per_node=data["devices_per_node"],
                device=device,
                intra_node=LinkSpec(**_link_kwargs(data["intra_node"])),
                inter_node=LinkSpec(**_link_kwargs(data.get("inter_node", data["intra_node"]))),
            )
        except KeyError as exc:
            raise ClusterError(
                f"{origin}: missing field {exc.args[0]!r}. See Cluster.to_dict() for the expected layout."
            ) from None
        except (TypeError, AttributeError) as exc:
            raise ClusterError(
                f"{origin}: malformed cluster description ({exc}). See Cluster.to_dict() for the expected layout."
            ) from None

    @staticmethod
    def from_json(path: str | Path) -> Cluster:
        """Read a cluster file written by :meth:`save` (or by hand in that layout)."""
        p = Path(path)
        try:
            data = json.loads(p.read_text())
        except FileNotFoundError:
            raise ClusterError(
                f"cluster file {str(p)!r} does not exist; give a path to a JSON file or a preset name such as 'dgx-a100-80gb:4'."
            ) from None
        except json.JSONDecodeError as exc:
            raise ClusterError(f"cluster file {str(p)!r} is not valid JSON: {exc}.") from None
        if not isinstance(data, dict):
            raise ClusterError(f"cluster file {str(p)!r} must hold a JSON object, got {type(data).__name__}.")
        return Cluster.from_dict(data, origin=f"cluster file {str(p)!r}")

    def save(self, path: str | Path) -> None:
        """Write :meth:`to_dict` as JSON."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @staticmethod
    def from_profile(*reports: Any, base: Cluster | None = None) -> Cluster:
        """A cluster whose numbers come from profiler reports (see :mod:`autopar.profiles`)."""
        from autopar.profiles import cluster_from_profiles

        return cluster_from_profiles(reports, base=base)


def _rename(name: str, nodes: int) -> str:
    base = name.split(" x ")[0]
    return f"{base} x {nodes}"


def _link_dict(link: LinkSpec) -> dict[str, Any]:
    return {
        "bandwidth_bytes_per_s": link.bandwidth_bytes_per_s,
        "latency_s": link.latency_s,
        "source": link.source,
        "per_op": [
            {
                "op": f.op,
                "bandwidth_bytes_per_s": f.bandwidth_bytes_per_s,
                "latency_s": f.latency_s,
                "curve": None
                if f.curve is None
                else {"ranks": f.curve.ranks, "nbytes": list(f.curve.nbytes), "time_s": list(f.curve.time_s)},
            }
            for f in link.per_op
        ],
    }


def _link_kwargs(data: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "bandwidth_bytes_per_s": data["bandwidth_bytes_per_s"],
        "latency_s": data["latency_s"],
        "source": str(data.get("source", "")),
        "per_op": tuple(
            OpLink(
                op=f["op"],
                bandwidth_bytes_per_s=f["bandwidth_bytes_per_s"],
                latency_s=f["latency_s"],
                curve=_curve(f.get("curve")),
            )
            for f in data.get("per_op", ())
        ),
    }


def _curve(data: Mapping[str, Any] | None) -> CommCurve | None:
    if data is None:
        return None
    return CommCurve(ranks=data["ranks"], nbytes=tuple(data["nbytes"]), time_s=tuple(data["time_s"]))


def _dtype(key: object, where: str) -> DType:
    try:
        return DType(key)
    except ValueError:
        allowed = ", ".join(d.value for d in DType)
        raise ClusterError(f"{where}: unknown precision {key!r}; allowed: {allowed}.") from None
