"""Collective and point-to-point bandwidth and latency over a process group's levels.

Run on every rank of an initialised process group (``torchrun -m profiler network``,
``autopar profile network --nproc N``, or :func:`profile_network` from your own
script). Ranks are grouped by node; each *level* is swept with all its groups running
at once, because that is how training uses the links:

- ``intra``: the ranks of each node (tensor parallelism's groups, the first and last
  stage of a hierarchical all-reduce);
- ``inter``: one rank per node, for each local rank at once (every device's own NIC,
  as NCCL's hierarchical algorithms use them);
- ``mixed``: the whole world when it spans several nodes with several ranks each (a
  data-parallel all-reduce), measured for comparison, not fitted.

Message sizes follow nccl-tests (``-b 1K -e 256M``): the all-reduce and broadcast
buffer, the all-gather output, the reduce-scatter input, the message each rank sends
to its ring neighbour. A point's time is the slowest rank's, after a barrier, averaged
over enough back-to-back calls to fill ``target_s``; the repeats' median and mean are
kept, and the mean prices a call (:attr:`autopar.profiles.sections.Timing.per_call_s`: a step
issues many, so the slow repeats count). Each level gets a joint alpha-beta fit over
the ops the cost model prices (:mod:`profiler.fit`) and one fit per op.
"""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, get_args

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from autopar.cost.comm import level_s
from autopar.hardware import CommCurve, LinkSpec, OpLink
from autopar.profiles.network_section import CollectiveOp, CommPoint, CommSeries, Level, LinkFit, NetworkProfile
from autopar.profiles.report import ProfileReport
from autopar.profiles.sections import Timing
from profiler.contention import contended_share
from profiler.errors import MeasurementError, SettingsError
from profiler.fit import Sample, bus_factor, coefficients, fit_alpha_beta
from profiler.framework_overhead import fsdp_copy_bytes_per_s, fsdp_overhead_s, fsdp_tensor_overhead_s, tp_overhead_s
from profiler.machine import provenance
from profiler.sync_skew import LONG_WORK_S, MEETINGS_PER_REPEAT, speed_spread, sync_noise_s_per_sqrt_s
from profiler.timing import Repeats, Stopwatch, synchronize

KIB, MIB = 2**10, 2**20
ALL_OPS: tuple[CollectiveOp, ...] = get_args(CollectiveOp)
FITTED_OPS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")
"""The ops ``autopar.cost.comm`` prices, fitted jointly per level."""


@dataclass(frozen=True, kw_only=True)
class NetworkSweep:
    """What :func:`profile_network` measures.

    Attributes:
        min_bytes, max_bytes: the size range (default 1 KiB to 256 MiB on GPUs, 64 MiB
            on CPUs, where gloo moves well under 1 GB/s).
        factor: sizes grow by this factor (nccl-tests ``-f``).
        ops: the collectives to run.
        levels: the levels to sweep (those the group has).
        repeats: timed repeats per size (median kept).
        target_s: back-to-back calls per repeat fill about this long.
        max_calls: at most this many calls per repeat.
    """

    min_bytes: int = KIB
    max_bytes: int = 0
    factor: int = 2
    ops: tuple[CollectiveOp, ...] = ALL_OPS
    levels: tuple[Level, ...] = ("intra", "inter", "mixed")
    repeats: int = 3
    target_s: float = 0.02
    max_calls: int = 50

    def __post_init__(self) -> None:
        if self.min_bytes < 4:
            raise SettingsError(
                f"min_bytes={self.min_bytes} is not allowed: the smallest message is one 4-byte element; give "
                f"min_bytes >= 4."
            )
        if self.max_bytes and self.max_bytes < self.min_bytes:
            raise SettingsError(
                f"max_bytes={self.max_bytes} is below min_bytes={self.min_bytes}; give max_bytes >= min_bytes, or "
                f"leave it out (256 MiB on GPUs, 64 MiB on CPUs)."
            )
        if self.factor < 2:
            raise SettingsError(f"factor={self.factor} is not allowed: sizes grow by a factor >= 2; give factor >= 2.")
        unknown = [op for op in self.ops if op not in ALL_OPS]
        if unknown or not self.ops:
            raise SettingsError(f"ops {list(self.ops)} are not allowed; choose from {', '.join(ALL_OPS)}.")
        if self.repeats < 1 or self.max_calls < 1 or not self.target_s > 0:
            raise SettingsError("repeats, max_calls and target_s must be positive.")

    def sizes(self, device_kind: str) -> tuple[int, ...]:
        """The message sizes, smallest first."""
        top = self.max_bytes or (256 * MIB if device_kind == "cuda" else 64 * MIB)
        out, s = [], self.min_bytes
        while s <= top:
            out.append(s)
            s *= self.factor
        return tuple(out)


@dataclass(frozen=True, kw_only=True)
class _Group:
    level: Level
    label: str
    ranks: tuple[int, ...]
    handle: Any
    per_node: int
    nodes: int


def node_label() -> str:
    """This rank's node: torchrun's ``GROUP_RANK`` (the node rank) when set, else the host name."""
    node = os.environ.get("GROUP_RANK")
    return f"node{node}" if node is not None else socket.gethostname()


def profile_network(
    *,
    sweep: NetworkSweep | None = None,
    node_of_rank: tuple[str, ...] | None = None,
    progress: Callable[[str], None] | None = None,
    command: str = "profiler.profile_network()",
) -> ProfileReport:
    """Sweep collectives over every level of the default process group; call on every rank.

    Args:
        sweep: sizes, ops, levels and repeats.
        node_of_rank: the node label of each rank (default: gathered :func:`node_label`).
        progress: called with a line per op and level (pass it on one rank only).
        command: recorded in the report's provenance.

    Returns the same report on every rank.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise MeasurementError(
            "profile_network needs an initialised process group: run under torchrun "
            "('torchrun --nproc-per-node N -m profiler network') or 'autopar profile network "
            "--nproc N', or call torch.distributed.init_process_group first."
        )
    sweep = sweep or NetworkSweep()
    say = progress or (lambda _line: None)
    world, rank = dist.get_world_size(), dist.get_rank()
    if world < 2:
        raise MeasurementError("a network profile needs at least 2 ranks; launch with --nproc-per-node >= 2.")
    backend = str(dist.get_backend())
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    labels = _labels(node_of_rank, world)
    groups = _groups(labels, sweep.levels)
    sizes = sweep.sizes(device.type)
    mine: dict[tuple[str, str, int], list[float]] = {}
    for level in dict.fromkeys(g.level for g in groups):
        my_group = next((g for g in groups if g.level == level and rank in g.ranks), None)
        for op in sweep.ops:
            for nbytes in sizes:
                times = _measure(op, nbytes, my_group, device, sweep)
                if my_group is not None:
                    mine[(level, op, nbytes)] = times
            say(f"{level} {op}: {len(sizes)} sizes up to {sizes[-1] / MIB:g} MiB")
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, (mine, provenance(command)))
    series = tuple(_series(g, op, sizes, [times for times, _ in everyone]) for g in groups for op in sweep.ops)
    fits, unfitted = fit_levels(series)
    tp, fsdp, fsdp_tensor, fsdp_copy = _framework_overheads(groups, fits, series, rank, device, sweep)
    if tp or fsdp or fsdp_tensor:
        say(
            f"framework overhead on the intra-node groups: {tp * 1e6:.0f} us per tensor-parallel layer forward, "
            f"{fsdp * 1e6:.0f} us per FSDP collective and {fsdp_tensor * 1e6:.0f} us per parameter tensor in it, "
            + (
                f"FSDP copies at {fsdp_copy / 1e9:.1f} GB/s"
                if fsdp_copy
                else "FSDP copies not resolved (the device's own figure is kept)"
            )
        )
    memory_share = _memory_share(groups, rank, device)
    if memory_share < 1:
        say(f"memory bandwidth with every rank of a node streaming: {memory_share:.2f} of one rank's alone")
    noise, spread = _sync_noise(groups, rank, device, sweep)
    if noise or spread:
        say(
            f"ranks of a node finishing the same work apart: {noise * 1e3:.1f} ms per sqrt(s) of work, and "
            f"{spread:.1%} of it over {LONG_WORK_S:.1f} s stretches"
        )
    # rank 0's provenance on every rank: each rank's own clock could read another second
    profile = NetworkProfile(
        backend=backend,
        device_kind="cuda" if device.type == "cuda" else "cpu",
        world_size=world,
        node_of_rank=labels,
        series=series,
        fits=fits,
        unfitted=unfitted,
        tp_overhead_s=tp,
        fsdp_overhead_s=fsdp,
        fsdp_tensor_overhead_s=fsdp_tensor,
        fsdp_copy_bytes_per_s=fsdp_copy,
        memory_share=memory_share,
        sync_noise_s_per_sqrt_s=noise,
        sync_speed_spread=spread,
        provenance=everyone[0][1],
    )
    return ProfileReport(network=profile)


def _framework_overheads(
    groups: list[_Group],
    fits: tuple[LinkFit, ...],
    series: tuple[CommSeries, ...],
    rank: int,
    device: torch.device,
    sweep: NetworkSweep,
) -> tuple[float, float, float, float]:
    """(tensor-parallel, FSDP per call, FSDP per parameter tensor and call) framework
    time and the rate of FSDP's copies (:mod:`profiler.framework_overhead`) on the
    intra-node groups (where tensor
    parallelism runs, and where a one-node data-parallel group runs): the largest times
    and the slowest rate over the groups; 0 without an intra-node group or without fits
    of the collectives the measurement subtracts. The transfers subtracted are priced as
    the cost model will price them (:func:`_transfer_cost`), so what is left is neither
    counted twice nor dropped."""
    fitted = {op: f for op in ("all_reduce", "all_gather", "reduce_scatter") if (f := _op_fit(fits, op))}

    def measure(group: _Group) -> tuple[float, float, float, float]:
        mesh = DeviceMesh.from_group(group.handle, device.type)
        repeats = Repeats(warmup=3, repeats=sweep.repeats + 4)
        cost = {op: _transfer_cost(f, op, group, series) for op, f in fitted.items()}
        tp = tp_overhead_s(mesh, device, repeats, cost["all_reduce"]) if "all_reduce" in cost else 0.0
        if "all_gather" not in cost or "reduce_scatter" not in cost:
            return tp, 0.0, 0.0, 0.0
        ag, rs = cost["all_gather"], cost["reduce_scatter"]
        two_tensors = fsdp_overhead_s(mesh, device, repeats, ag, rs)  # units of one linear: 2 tensors
        per_tensor = fsdp_tensor_overhead_s(mesh, device, repeats, ag, rs, two_tensors)
        rate = fsdp_copy_bytes_per_s(mesh, device, repeats, ag, rs, two_tensors)
        return tp, max(two_tensors - 2 * per_tensor, 0.0), per_tensor, rate

    values = _on_intra_groups(groups, rank, measure)
    rates = [v[3] for v in values if v[3] > 0]
    return (
        max((v[0] for v in values), default=0.0),
        max((v[1] for v in values), default=0.0),
        max((v[2] for v in values), default=0.0),
        min(rates, default=0.0),
    )


def _memory_share(groups: list[_Group], rank: int, device: torch.device) -> float:
    """:func:`profiler.contention.contended_share` on the intra-node groups, the mean
    over the ranks that measured; 1 on GPUs (each rank streams its own memory) or
    without an intra-node group."""
    if device.type != "cpu":
        return 1.0
    shares = _on_intra_groups(groups, rank, lambda g: contended_share(g.handle, g.ranks, Repeats(warmup=2, repeats=5)))
    return sum(shares) / len(shares) if shares else 1.0


def _sync_noise(groups: list[_Group], rank: int, device: torch.device, sweep: NetworkSweep) -> tuple[float, float]:
    """(:func:`profiler.sync_skew.sync_noise_s_per_sqrt_s`, :func:`~profiler.sync_skew.speed_spread`)
    on the intra-node groups (where tensor parallelism's blocking collectives run), the
    largest of each; 0 without an intra-node group. ``MEETINGS_PER_REPEAT`` meetings per
    work length for each of the sweep's repeats, plus two."""
    meetings = MEETINGS_PER_REPEAT * (sweep.repeats + 2)

    def measure(group: _Group) -> tuple[float, float]:
        noise = sync_noise_s_per_sqrt_s(group.handle, device, meetings=meetings)
        return noise, speed_spread(group.handle, device, noise)

    values = _on_intra_groups(groups, rank, measure)
    return max((v[0] for v in values), default=0.0), max((v[1] for v in values), default=0.0)


def _on_intra_groups(groups: list[_Group], rank: int, measure: Callable[[_Group], Any]) -> list[Any]:
    """``measure(group)`` on every intra-node group at once, called by the group's
    ranks; every rank gets the values of all the ranks that measured (a rank alone on
    its node measures nothing)."""
    mine = next((g for g in groups if g.level == "intra" and rank in g.ranks), None)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, measure(mine) if mine is not None else None)
    return [v for v in gathered if v is not None]


def _op_fit(fits: tuple[LinkFit, ...], op: str) -> LinkFit | None:
    """The intra-node fit the cost model prices ``op`` with: its own, else the joint one."""
    own = next((f for f in fits if f.level == "intra" and f.ops == (op,)), None)
    return own or next((f for f in fits if f.level == "intra" and op in f.ops), None)


def _transfer_cost(fit: LinkFit, op: str, group: _Group, series: tuple[CommSeries, ...]) -> Callable[[float], float]:
    """Seconds of one ``op`` of ``nbytes`` on ``group``, as :func:`autopar.cost.comm.level_s`
    prices it from this profile: by the group's own measured curve, past its sizes by
    the fit's bandwidth."""
    own = next((s for s in series if s.op == op and s.ranks == group.ranks), None)
    curve = (
        None
        if own is None
        else CommCurve.from_measured(
            len(group.ranks), [p.nbytes for p in own.points], [p.time.per_call_s for p in own.points]
        )
    )
    link = OpLink(op=op, bandwidth_bytes_per_s=fit.bandwidth_bytes_per_s, latency_s=fit.alpha_s, curve=curve)
    spec = LinkSpec(bandwidth_bytes_per_s=fit.bandwidth_bytes_per_s, latency_s=fit.alpha_s, per_op=(link,))
    return lambda nbytes: level_s(spec, op, nbytes, len(group.ranks))


def _labels(node_of_rank: tuple[str, ...] | None, world: int) -> tuple[str, ...]:
    if node_of_rank is not None:
        if len(node_of_rank) != world:
            raise SettingsError(f"node_of_rank has {len(node_of_rank)} labels for {world} ranks; give one per rank.")
        return tuple(node_of_rank)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, node_label())
    return tuple(gathered)


def _groups(labels: tuple[str, ...], levels: tuple[Level, ...]) -> list[_Group]:
    """The groups of each level; every rank creates every group, in the same order."""
    nodes = list(dict.fromkeys(labels))
    members = {n: [r for r, lab in enumerate(labels) if lab == n] for n in nodes}
    world = len(labels)
    groups: list[_Group] = []
    if "intra" in levels:
        for n in nodes:
            ranks = tuple(members[n])
            if len(ranks) >= 2:
                handle = dist.group.WORLD if len(ranks) == world else dist.new_group(list(ranks))
                groups.append(
                    _Group(
                        level="intra",
                        label=f"{n} (ranks {_span(ranks)})",
                        ranks=ranks,
                        handle=handle,
                        per_node=len(ranks),
                        nodes=1,
                    )
                )
    if "inter" in levels and len(nodes) >= 2:
        for k in range(min(len(m) for m in members.values())):
            ranks = tuple(members[n][k] for n in nodes)
            handle = dist.group.WORLD if len(ranks) == world else dist.new_group(list(ranks))
            groups.append(
                _Group(
                    level="inter",
                    label=f"local rank {k} of {len(nodes)} nodes (ranks {_span(ranks)})",
                    ranks=ranks,
                    handle=handle,
                    per_node=1,
                    nodes=len(nodes),
                )
            )
    if "mixed" in levels and len(nodes) >= 2 and max(len(m) for m in members.values()) >= 2:
        per_node = max(len(m) for m in members.values())
        groups.append(
            _Group(
                level="mixed",
                label=f"world ({world} ranks on {len(nodes)} nodes)",
                ranks=tuple(range(world)),
                handle=dist.group.WORLD,
                per_node=per_node,
                nodes=len(nodes),
            )
        )
    if not groups:
        raise MeasurementError(
            f"no group of >= 2 ranks at levels {levels} with nodes {dict(members)}; choose other levels."
        )
    return groups


def _span(ranks: tuple[int, ...]) -> str:
    if len(ranks) > 2 and ranks == tuple(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def _measure(op: str, nbytes: int, group: _Group | None, device: torch.device, sweep: NetworkSweep) -> list[float]:
    """Seconds per call of each repeat on this rank; every rank calls it in step."""
    call = _make_call(op, nbytes, group, device) if group is not None else None
    first = torch.zeros(1, dtype=torch.float64, device=device)  # NCCL reduces device tensors only
    dist.barrier()
    if call is not None:
        watch = Stopwatch(device)
        watch.start()
        call()
        first[0] = watch.stop()
    dist.all_reduce(first, op=dist.ReduceOp.MAX)
    calls = max(1, min(sweep.max_calls, math.ceil(sweep.target_s / max(float(first[0]), 1e-9))))
    times = []
    for _ in range(sweep.repeats):
        dist.barrier()
        if call is None:
            continue
        synchronize(device)
        watch.start()
        for _ in range(calls):
            call()
        times.append(watch.stop() / calls)
    return times


def _make_call(op: str, nbytes: int, group: _Group, device: torch.device) -> Callable[[], None]:
    n = len(group.ranks)
    numel = max(n, (nbytes // 4) // n * n)
    pg = group.handle
    if op == "all_reduce":
        buf = torch.ones(numel, device=device)
        return lambda: dist.all_reduce(buf, group=pg)
    if op == "broadcast":
        buf = torch.ones(numel, device=device)
        return lambda: dist.broadcast(buf, src=group.ranks[0], group=pg)
    if op == "all_gather":
        out, part = torch.empty(numel, device=device), torch.ones(numel // n, device=device)
        return lambda: dist.all_gather_single(out, part, group=pg)
    if op == "reduce_scatter":
        full, part = torch.ones(numel, device=device), torch.empty(numel // n, device=device)
        return lambda: dist.reduce_scatter_single(part, full, group=pg)
    me = group.ranks.index(dist.get_rank())
    send, recv = torch.ones(numel, device=device), torch.empty(numel, device=device)
    nxt, prv = group.ranks[(me + 1) % n], group.ranks[(me - 1) % n]

    def send_recv() -> None:
        # receive posted first: gloo then runs both directions at once (isend first measured half the rate
        # of a 100 Mbit/s shaped link in each direction)
        ops = [dist.P2POp(dist.irecv, recv, prv, group=pg), dist.P2POp(dist.isend, send, nxt, group=pg)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    return send_recv


def _series(group: _Group, op: CollectiveOp, sizes: tuple[int, ...], everyone: list[Any]) -> CommSeries:
    n = len(group.ranks)
    points = []
    for nbytes in sizes:
        per_rank = [everyone[r][(group.level, op, nbytes)] for r in group.ranks]
        slowest = [max(rep) for rep in zip(*per_rank)]
        timing = Timing.of(slowest)
        actual = float(max(n, (nbytes // 4) // n * n) * 4)
        algbw = actual / timing.per_call_s
        points.append(
            CommPoint(nbytes=actual, time=timing, algbw_bytes_per_s=algbw, busbw_bytes_per_s=algbw * bus_factor(op, n))
        )
    return CommSeries(
        op=op,
        level=group.level,
        label=group.label,
        ranks=group.ranks,
        per_node=group.per_node,
        nodes=group.nodes,
        points=tuple(points),
    )


def fit_levels(series: tuple[CommSeries, ...]) -> tuple[tuple[LinkFit, ...], dict[str, str]]:
    """A joint fit per level over :data:`FITTED_OPS`, then one fit per op and level; and
    why a fit could not be made (``"inter all_reduce": reason``), which noisy sweeps
    over small messages only can cause."""
    fits, unfitted = [], {}
    for level in ("intra", "inter"):
        at_level = [s for s in series if s.level == level]
        joint_ops = tuple(op for op in FITTED_OPS if any(s.op == op for s in at_level))
        wanted = ([joint_ops] if len(joint_ops) > 1 else []) + [(op,) for op in dict.fromkeys(s.op for s in at_level)]
        for ops in wanted:
            try:
                fits.append(_fit(level, ops, at_level))
            except MeasurementError as exc:
                unfitted[f"{level} {'+'.join(ops)}"] = str(exc)
    return tuple(fits), unfitted


def _fit(level: Level, ops: tuple[CollectiveOp, ...], series: list[CommSeries]) -> LinkFit:
    samples = []
    for s in series:
        if s.op in ops:
            c_bw, c_lat = coefficients(s.op, level, len(s.ranks))
            samples += [Sample(nbytes=p.nbytes, time_s=p.time.per_call_s, c_bw=c_bw, c_lat=c_lat) for p in s.points]
    ab = fit_alpha_beta(samples)
    return LinkFit(
        level=level,
        ops=ops,
        alpha_s=ab.alpha_s,
        bandwidth_bytes_per_s=ab.bandwidth_bytes_per_s,
        rms_rel_error=ab.rms_rel_error,
        points=ab.points,
    )
