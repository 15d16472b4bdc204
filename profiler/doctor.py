"""``autopar doctor``: is this cluster ready to train, and if not, what to change.

Run it like the training job (``torchrun --nnodes ... -m profiler doctor``, or
``autopar doctor --nproc N`` locally). Every rank first writes what it knows about
itself into the launcher's rendezvous store, *before* any process group exists, so a
rank that never arrives, or arrives with another torch or a wrong interface name, is
named by rank 0 instead of leaving everyone hanging in ``init_process_group``. Then
the ranks form the process group and check, in order: an all-reduce with an exactly
known sum on the world and on every group a plan uses (``--plan plan.json``), a matmul
on every rank, and a bandwidth exchange over every neighbouring link, flagging ranks
and links far slower than their peers. The judgement is :mod:`profiler.doctor_checks`.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from autopar import codec
from autopar.errors import first_line
from profiler.doctor_checks import (
    COLLECTIVE_PHASES,
    ComputeTime,
    Finding,
    GroupResult,
    LinkTime,
    RankFacts,
    check_backend,
    check_collectives_stopped,
    check_environment,
    check_groups,
    check_join,
    check_process_group,
    check_settings,
    check_speed,
    check_versions,
)
from profiler.errors import ProfilerError, SettingsError
from profiler.machine import software_versions
from profiler.network import node_label
from profiler.timing import Stopwatch, synchronize

_RELEVANT_ENV = (
    "NCCL_",
    "GLOO_",
    "TORCH_NCCL_",
    "TORCH_DISTRIBUTED_",
    "CUDA_DEVICE_MAX_CONNECTIONS",
    "OMP_NUM_THREADS",
    "MASTER_ADDR",
    "MASTER_PORT",
    "CUDA_VISIBLE_DEVICES",
    "LOCAL_WORLD_SIZE",
)


@dataclass(frozen=True, kw_only=True)
class DoctorSettings:
    """What the doctor checks and how long it waits.

    Attributes:
        backend: ``nccl`` or ``gloo`` (default: nccl where CUDA is available).
        join_timeout_s: how long rank 0 waits for every rank to reach the store.
        pg_timeout_s: the process group's timeout.
        groups: extra groups to all-reduce over, e.g. a plan's (:func:`plan_groups`).
        plan_world_size: the ranks the plan runs on (``dp * tp * pp``), when a plan is
            checked: a job of any other size is an error.
        link_bytes: bytes exchanged per link test (default 4 MiB on CPU, 256 MiB on GPU).
        repeats: timed repeats of each link and matmul test.
        slow_ratio: a link or rank below this fraction of its peers' median is flagged.
    """

    backend: str | None = None
    join_timeout_s: float = 60.0
    pg_timeout_s: float = 60.0
    groups: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    plan_world_size: int | None = None
    link_bytes: int = 0
    repeats: int = 3
    slow_ratio: float = 0.5


@dataclass(frozen=True, kw_only=True)
class DoctorReport:
    """Everything the doctor found; ``ok`` when no finding is an error."""

    world_size: int
    backend: str
    findings: tuple[Finding, ...]
    facts: tuple[RankFacts, ...]
    links: tuple[LinkTime, ...] = ()
    compute: tuple[ComputeTime, ...] = ()
    groups: tuple[GroupResult, ...] = ()

    @property
    def ok(self) -> bool:
        """No errors (warnings allowed)."""
        return not any(f.severity == "error" for f in self.findings)

    def errors(self) -> tuple[Finding, ...]:
        """The error findings."""
        return tuple(f for f in self.findings if f.severity == "error")

    def text(self) -> str:
        """The findings for people, one block per finding."""
        mark = {"ok": "[ ok ]", "warning": "[warn]", "error": "[FAIL]"}
        lines = [f"autopar doctor: {self.world_size} ranks, backend {self.backend}"]
        for f in self.findings:
            lines.append(f"{mark[f.severity]} {f.check}: {f.message}")
            if f.fix:
                lines.append(f"       fix: {f.fix}")
        verdict = "ready" if self.ok else f"{len(self.errors())} problem(s) to fix"
        lines.append(f"verdict: {verdict}")
        return "\n".join(lines)

    def save(self, path: str | Path) -> None:
        """Write the report as JSON."""
        codec.write_atomically(path, codec.dumps(self, error=ProfilerError))


def collect_facts() -> RankFacts:
    """This rank's identity, versions, settings and surroundings."""
    versions = software_versions()
    backends = tuple(
        b
        for b, avail in (
            ("gloo", dist.is_gloo_available()),
            ("nccl", dist.is_nccl_available()),
            ("mpi", dist.is_mpi_available()),
        )
        if avail
    )
    env = {k: v for k, v in os.environ.items() if k.startswith(_RELEVANT_ENV)}
    try:
        interfaces = tuple(name for _, name in socket.if_nameindex())
    except OSError:
        interfaces = ()
    return RankFacts(
        rank=int(os.environ["RANK"]),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        node=node_label(),
        host=socket.gethostname(),
        pid=os.getpid(),
        versions=versions,
        backends=backends,
        env=env,
        interfaces=interfaces,
        cpu_count=os.cpu_count() or 1,
        threads=torch.get_num_threads(),
        gpus=torch.cuda.device_count() if torch.cuda.is_available() else 0,
    )


def _store(join_timeout_s: float) -> tuple[Any, str]:
    """The launcher's store (torchrun's agent hosts it), or one hosted by rank 0."""
    try:
        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except KeyError as exc:
        raise SettingsError(
            f"{exc.args[0]} is not set: run the doctor under torchrun (e.g. 'torchrun "
            f"--nproc-per-node 8 -m profiler doctor') or with 'autopar doctor --nproc N'."
        ) from None
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    timeout = datetime.timedelta(seconds=join_timeout_s)
    try:
        store = dist.TCPStore(
            addr,
            port,
            world_size=None if agent else world,
            is_master=not agent and rank == 0,
            timeout=timeout,
            wait_for_workers=False,
        )
    except (RuntimeError, OSError) as exc:  # torch's DistNetworkError is a RuntimeError
        role = "host the rendezvous store on" if not agent and rank == 0 else "reach the rendezvous store at"
        raise SettingsError(
            f"rank {rank} could not {role} {addr}:{port} ({first_line(exc)}): the port is taken by another "
            f"process, or rank 0 is not up or not reachable from here within {join_timeout_s:g} s; pick a free "
            f"MASTER_PORT, start rank 0 first, or check the address and firewall."
        ) from None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"autopar_doctor/{attempt}", store), f"{addr}:{port}"


def run_doctor(settings: DoctorSettings | None = None) -> DoctorReport | None:
    """Run every check on this rank; rank 0 returns the report, the others None."""
    settings = settings or DoctorSettings()
    store, where = _store(settings.join_timeout_s)
    facts = collect_facts()
    rank, world = facts.rank, int(os.environ["WORLD_SIZE"])
    backend = settings.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    store.set(f"facts/{rank}", json.dumps(codec.encode(facts, error=ProfilerError)))
    findings: list[Finding] = []
    present: list[RankFacts] = []
    if rank == 0:
        gathered, waited = _wait_for_facts(store, world, settings.join_timeout_s)
        findings += check_join(world, gathered, waited, where)
        present += [gathered[r] for r in sorted(gathered)]
        findings += check_versions(present) + check_settings(present) + check_environment(present, backend)
        findings += check_backend(present, backend)
        findings += _plan_size(settings.plan_world_size, world)
        go = not any(f.severity == "error" for f in findings)
        store.set("verdict", "go" if go else "stop")
        if not go:
            return DoctorReport(world_size=world, backend=backend, findings=tuple(findings), facts=tuple(present))
    else:
        store.wait(["verdict"], datetime.timedelta(seconds=settings.join_timeout_s + 30))
        if store.get("verdict") != b"go":
            return None
    return _with_process_group(store, settings, backend, rank, world, findings, present)


def _wait_for_facts(store: Any, world: int, timeout_s: float) -> tuple[dict[int, RankFacts], float]:
    start = time.monotonic()
    keys = [f"facts/{r}" for r in range(world)]
    while time.monotonic() - start < timeout_s and not store.check(keys):
        time.sleep(0.1)
    waited = time.monotonic() - start
    found = {}
    for r, key in enumerate(keys):
        if store.check([key]):
            found[r] = codec.decode(RankFacts, json.loads(store.get(key)), f"facts of rank {r}", error=ProfilerError)
    return found, waited


def _plan_size(plan_world_size: int | None, world: int) -> list[Finding]:
    """An error when the plan is for another number of ranks than the job has: larger,
    its groups name ranks that are not there; smaller, ranks would sit idle or fail."""
    if plan_world_size is None or plan_world_size == world:
        return []
    return [
        Finding(
            severity="error",
            check="plan",
            message=f"the plan runs on {plan_world_size} ranks (dp x cp x tp x pp) but the job has {world} ranks",
            fix=f"launch {plan_world_size} ranks, or plan for {world} devices",
        )
    ]


def _with_process_group(
    store: Any,
    settings: DoctorSettings,
    backend: str,
    rank: int,
    world: int,
    findings: list[Finding],
    present: list[RankFacts],
) -> DoctorReport | None:
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    try:
        dist.init_process_group(
            backend,
            store=dist.PrefixStore("pg", store),
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=settings.pg_timeout_s),
        )
    except Exception as exc:  # report why this rank could not join, then let rank 0 tell everyone
        store.set(f"pg_error/{rank}", f"{type(exc).__name__}: {exc}")
        if rank != 0:
            return None
        time.sleep(1.0)
        errors = {r: store.get(f"pg_error/{r}").decode() for r in range(world) if store.check([f"pg_error/{r}"])}
        findings += check_process_group(errors, False, backend)
        return DoctorReport(world_size=world, backend=backend, findings=tuple(findings), facts=tuple(present))
    try:
        return _collective_checks(store, settings, backend, device, rank, world, findings, present)
    except Exception as exc:  # a rank died or hung mid-check: rank 0 says which, from the store
        if rank != 0:
            return None
        findings += check_collectives_stopped(_phases(store, world), world, first_line(exc), settings.pg_timeout_s)
        return DoctorReport(world_size=world, backend=backend, findings=tuple(findings), facts=tuple(present))
    finally:
        dist.destroy_process_group()


def _phases(store: Any, world: int) -> dict[int, str]:
    """The phase each rank recorded last (none for a rank that recorded none)."""
    keys = {r: f"phase/{r}" for r in range(world)}
    return {r: store.get(k).decode() for r, k in keys.items() if store.check([k])}


def _collective_checks(
    store: Any,
    settings: DoctorSettings,
    backend: str,
    device: torch.device,
    rank: int,
    world: int,
    findings: list[Finding],
    present: list[RankFacts],
) -> DoctorReport | None:
    groups = {"world": tuple(range(world)), **settings.groups}
    handles = {
        name: (dist.group.WORLD if len(ranks) == world else dist.new_group(list(ranks)))
        for name, ranks in groups.items()
    }
    phases = iter(COLLECTIVE_PHASES)

    def phase() -> None:
        store.set(f"phase/{rank}", next(phases))

    errors = {}
    phase()
    for name, ranks in groups.items():
        if rank in ranks:
            x = torch.full((1024,), float(rank + 1), device=device)
            dist.all_reduce(x, group=handles[name])
            errors[name] = float((x - sum(r + 1 for r in ranks)).abs().max())
    phase()
    compute = _time_matmul(device, rank, world, settings.repeats)
    phase()
    nodes: list[Any] = [None] * world
    dist.all_gather_object(nodes, node_label())
    phase()
    links = _time_links(tuple(nodes), device, settings)
    phase()
    everything: list[Any] = [None] * world
    dist.all_gather_object(everything, (errors, compute, links))
    if rank != 0:
        return None
    results = tuple(
        GroupResult(
            name=name,
            ranks=ranks,
            wrong_ranks=tuple(r for r in ranks if everything[r][0][name]),
            max_error=max(everything[r][0][name] for r in ranks),
        )
        for name, ranks in groups.items()
    )
    all_links = _merge_links([e[2] for e in everything])
    all_compute = tuple(e[1] for e in everything)
    facts_by_rank = {f.rank: f for f in present}
    findings = findings + check_process_group({}, True, backend) + check_groups(results)
    findings += check_speed(all_links, all_compute, facts_by_rank, settings.slow_ratio)
    return DoctorReport(
        world_size=world,
        backend=backend,
        findings=tuple(findings),
        facts=tuple(present),
        links=all_links,
        compute=all_compute,
        groups=results,
    )


def _time_matmul(device: torch.device, rank: int, world: int, repeats: int) -> ComputeTime:
    """The best of ``repeats`` matmuls; GPUs all at once (each has its own), CPU
    processes one at a time (they share the node's cores, and the question is which
    machine is slow, not how they contend)."""
    n, dtype = (4096, torch.bfloat16) if device.type == "cuda" else (384, torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    watch = Stopwatch(device)
    times = []
    for turn in range(1 if device.type == "cuda" else world):
        dist.barrier()
        if device.type == "cuda" or turn == rank:
            torch.mm(a, a)
            synchronize(device)
            for _ in range(repeats):
                watch.start()
                torch.mm(a, a)
                times.append(watch.stop())
    return ComputeTime(rank=rank, flops=2.0 * n**3, time_s=min(times))


def link_schedule(nodes: tuple[str, ...]) -> list[list[tuple[int, int]]]:
    """Neighbouring links in phases where no rank is in two links: the ring through the
    ranks in node order, plus, across nodes, each rank to the same local rank on the
    next node (every NIC is exercised)."""
    names = list(dict.fromkeys(nodes))
    order = sorted(range(len(nodes)), key=lambda r: (names.index(nodes[r]), r))
    n = len(order)
    links: set[tuple[int, ...]] = {tuple(sorted((order[i], order[(i + 1) % n]))) for i in range(n)} if n > 1 else set()
    members = {name: [r for r in range(n) if nodes[r] == name] for name in names}
    if len(names) > 1:
        for i, name in enumerate(names):
            nxt = members[names[(i + 1) % len(names)]]
            for k, r in enumerate(members[name]):
                if k < len(nxt) and r != nxt[k]:
                    links.add(tuple(sorted((r, nxt[k]))))
    phases: list[list[tuple[int, int]]] = []
    for link in sorted(links):
        for phase in phases:
            if not any(set(link) & set(other) for other in phase):
                phase.append(link)
                break
        else:
            phases.append([link])
    return phases


def _time_links(nodes: tuple[str, ...], device: torch.device, settings: DoctorSettings) -> list[LinkTime]:
    """This rank's timings of its links, phase by phase (every rank runs every phase)."""
    rank = dist.get_rank()
    nbytes = settings.link_bytes or (256 * 2**20 if device.type == "cuda" else 4 * 2**20)
    send = torch.ones(nbytes // 4, device=device)
    recv = torch.empty_like(send)
    watch = Stopwatch(device)
    mine = []
    for phase in link_schedule(nodes):
        dist.barrier()
        for a, b in phase:
            if rank not in (a, b):
                continue
            peer = b if rank == a else a
            _exchange(send, recv, peer)
            best = float("inf")
            for _ in range(settings.repeats):
                watch.start()
                _exchange(send, recv, peer)
                best = min(best, watch.stop())
            mine.append(
                LinkTime(
                    a=a,
                    b=b,
                    kind="intra" if nodes[a] == nodes[b] else "inter",
                    nbytes=float(send.numel() * 4),
                    time_s=best,
                )
            )
    return mine


def _exchange(send: torch.Tensor, recv: torch.Tensor, peer: int) -> None:
    ops = [dist.P2POp(dist.irecv, recv, peer), dist.P2POp(dist.isend, send, peer)]  # see network._make_call
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def _merge_links(per_rank: list[list[LinkTime]]) -> tuple[LinkTime, ...]:
    """One time per link: the slower of its two ends."""
    worst: dict[tuple[int, int], LinkTime] = {}
    for links in per_rank:
        for lk in links:
            key = (lk.a, lk.b)
            if key not in worst or lk.time_s > worst[key].time_s:
                worst[key] = lk
    return tuple(worst[k] for k in sorted(worst))
