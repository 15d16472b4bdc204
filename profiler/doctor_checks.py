"""What ``autopar doctor`` concludes from what the ranks reported: pure functions.

Every check takes plain data gathered from the ranks (:class:`RankFacts`, measured link
and compute times, all-reduce results) and returns :class:`Finding` objects that say
what is wrong, on which ranks, and what to change. Keeping the judgement apart from the
gathering lets each rule be tested on made-up facts, including situations a test
machine cannot produce (two torch versions, a node with a missing NIC).
"""

from __future__ import annotations

import itertools
import re
import statistics
from collections.abc import Mapping, Sequence

from profiler.doctor_facts import ComputeTime, Finding, GroupResult, LinkTime, RankFacts, ranks_text

MATCHING_ENV_PREFIXES = (
    "NCCL_",
    "GLOO_",
    "TORCH_NCCL_",
    "TORCH_DISTRIBUTED_",
    "CUDA_DEVICE_MAX_CONNECTIONS",
    "OMP_NUM_THREADS",
)
"""Settings every rank should share; interface names are exempt (NICs may be named
differently on different nodes, which :func:`check_environment` checks instead)."""
IFNAME_VARS = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
CRITICAL_VERSIONS = ("python", "torch", "cuda", "nccl")


def check_join(world_size: int, facts: Mapping[int, RankFacts], waited_s: float, store_at: str) -> list[Finding]:
    """Did every rank reach the rendezvous store? If not, which and the likely reason."""
    missing = [r for r in range(world_size) if r not in facts]
    if not missing:
        return [
            Finding(severity="ok", check="rendezvous", message=f"all {world_size} ranks joined in {waited_s:.1f} s")
        ]
    local = {f.local_world_size for f in facts.values()}
    per_node = local.pop() if len(local) == 1 else 0
    findings = []
    if per_node:
        by_node: dict[int, list[int]] = {}
        for r in missing:
            by_node.setdefault(r // per_node, []).append(r)
        for node, ranks in sorted(by_node.items()):
            node_ranks = range(node * per_node, (node + 1) * per_node)
            present = [facts[r] for r in node_ranks if r in facts]
            if not present:
                findings.append(
                    Finding(
                        severity="error",
                        check="rendezvous",
                        message=f"ranks {ranks_text(ranks)} (all of node #{node} in torchrun's layout of {per_node} "
                        f"ranks per node) never reached the store at {store_at} within {waited_s:.0f} s",
                        fix=f"check that the launch on node #{node} started (same --nnodes/--nproc-per-node/--rdzv-id as "
                        f"the others) and that it can reach {store_at} (firewall, routing, --rdzv-endpoint)",
                        ranks=tuple(ranks),
                    )
                )
            else:
                host = present[0].host
                findings.append(
                    Finding(
                        severity="error",
                        check="rendezvous",
                        message=f"ranks {ranks_text(ranks)} on {host} never reached the store at {store_at} within "
                        f"{waited_s:.0f} s, while ranks {ranks_text([f.rank for f in present])} on the same node "
                        f"did: the process died or hangs before joining",
                        fix=f"read those ranks' output on {host} (torchrun --tee 3 or --log-dir) for the exception: an "
                        f"import error, a CUDA error, or the script stuck before init_process_group",
                        ranks=tuple(ranks),
                    )
                )
    else:
        findings.append(
            Finding(
                severity="error",
                check="rendezvous",
                message=f"ranks {ranks_text(missing)} never reached the store at {store_at} within {waited_s:.0f} s",
                fix="check that every node's launch started and can reach the store; read the missing ranks' logs",
                ranks=tuple(missing),
            )
        )
    return findings


def _groups_by_value(facts: Sequence[RankFacts], value_of) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = {}
    for f in facts:
        groups.setdefault(value_of(f), []).append(f.rank)
    return groups


def _nodes_of(facts: Sequence[RankFacts], ranks: Sequence[int]) -> str:
    by_rank = {f.rank: f.node for f in facts}
    return ", ".join(dict.fromkeys(by_rank[r] for r in ranks))


def check_versions(facts: Sequence[RankFacts]) -> list[Finding]:
    """The same python, torch, CUDA and NCCL (and ideally everything else) on every rank."""
    findings = []
    keys = sorted({k for f in facts for k in f.versions})
    for key in keys:
        groups = _groups_by_value(facts, lambda f: f.versions.get(key, "(missing)"))
        if len(groups) == 1:
            continue
        majority = max(groups, key=lambda v: len(groups[v]))
        odd = [(v, rs) for v, rs in groups.items() if v != majority]
        detail = "; ".join(f"ranks {ranks_text(rs)} ({_nodes_of(facts, rs)}) have {v}" for v, rs in odd)
        findings.append(
            Finding(
                severity="error" if key in CRITICAL_VERSIONS else "warning",
                check="versions",
                message=f"{key} differs: ranks {ranks_text(groups[majority])} have {majority}; {detail}",
                fix=f"install {key} {majority} on {_nodes_of(facts, [r for _, rs in odd for r in rs])} (one container "
                f"image or one environment for every node)",
                ranks=tuple(r for _, rs in odd for r in rs),
            )
        )
    if not findings:
        v = facts[0].versions
        findings.append(
            Finding(
                severity="ok",
                check="versions",
                message="same versions on every rank: " + ", ".join(f"{k} {v[k]}" for k in CRITICAL_VERSIONS if k in v),
            )
        )
    return findings


def check_settings(facts: Sequence[RankFacts]) -> list[Finding]:
    """Communication settings that differ between ranks (usually launch scripts that
    differ between nodes)."""
    names = sorted({k for f in facts for k in f.env if k.startswith(MATCHING_ENV_PREFIXES) and k not in IFNAME_VARS})
    findings = []
    for name in names:
        groups = _groups_by_value(facts, lambda f: f.env.get(name, "(unset)"))
        if len(groups) == 1:
            continue
        detail = "; ".join(f"{v!r} on ranks {ranks_text(rs)} ({_nodes_of(facts, rs)})" for v, rs in groups.items())
        majority = max(groups, key=lambda v: len(groups[v]))
        odd = tuple(r for v, rs in groups.items() if v != majority for r in rs)
        findings.append(
            Finding(
                severity="warning",
                check="settings",
                message=f"{name} differs: {detail}",
                fix=f"set {name} to the same value on every node (or unset it everywhere)",
                ranks=odd,
            )
        )
    if not findings:
        findings.append(Finding(severity="ok", check="settings", message="communication settings agree on every rank"))
    return findings


def _iface_matches(spec: str, interfaces: Sequence[str]) -> bool:
    """NCCL's ``*_SOCKET_IFNAME`` syntax: comma list of prefixes, ``=`` for exact names,
    ``^`` to exclude (an exclusion list always leaves something to use)."""
    if spec.startswith("^"):
        return True
    exact = spec.startswith("=")
    wanted = [w for w in spec.lstrip("=").split(",") if w]
    return any((i == w) if exact else i.startswith(w) for w in wanted for i in interfaces)


def check_environment(facts: Sequence[RankFacts], backend: str) -> list[Finding]:
    """Settings that are wrong on their own: interfaces that do not exist, debug modes
    that slow or crash training, a loopback rendezvous across nodes, oversubscription."""
    findings = []
    nodes = {f.node for f in facts}
    for name in IFNAME_VARS:
        bad = [f for f in facts if name in f.env and not _iface_matches(f.env[name], f.interfaces)]
        for node, ranks in _groups_by_value(bad, lambda f: f.node).items():
            f0 = next(f for f in bad if f.node == node)
            findings.append(
                Finding(
                    severity="error",
                    check="environment",
                    message=f"{name}={f0.env[name]!r} on {node} (ranks {ranks_text(ranks)}) matches none of its "
                    f"interfaces: {', '.join(f0.interfaces)}",
                    fix=f"set {name} to the interface on the network the nodes share (one of {', '.join(f0.interfaces)}) "
                    f"or unset it",
                    ranks=tuple(ranks),
                )
            )
    detail = [f.rank for f in facts if f.env.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL"]
    if detail:
        findings.append(
            Finding(
                severity="warning",
                check="environment",
                message=f"TORCH_DISTRIBUTED_DEBUG=DETAIL on ranks {ranks_text(detail)}: it adds ~40% to step time, makes "
                f"DDP segfault in torch 2.13 and reports false mismatches with >= 3 pipeline ranks",
                fix="unset it (or use INFO) outside a debugging session",
                ranks=tuple(detail),
            )
        )
    master = {f.env.get("MASTER_ADDR", "") for f in facts}
    if len(nodes) > 1 and any(m in ("localhost", "::1") or m.startswith("127.") for m in master):
        findings.append(
            Finding(
                severity="error",
                check="environment",
                message=f"MASTER_ADDR is a loopback address ({', '.join(sorted(master))}) but the job spans "
                f"{len(nodes)} nodes: the other nodes cannot reach it",
                fix="pass --rdzv-endpoint (or MASTER_ADDR) as rank 0's address on the network the nodes share",
            )
        )
    if backend == "nccl" and len(nodes) > 1:
        ib_off = [f.rank for f in facts if f.env.get("NCCL_IB_DISABLE") == "1"]
        if ib_off:
            findings.append(
                Finding(
                    severity="warning",
                    check="environment",
                    message=f"NCCL_IB_DISABLE=1 on ranks {ranks_text(ib_off)}: inter-node traffic goes over TCP sockets",
                    fix="unset NCCL_IB_DISABLE where InfiniBand/RoCE is available",
                    ranks=tuple(ib_off),
                )
            )
    for node, ranks in _groups_by_value(facts, lambda f: f.node).items():
        f0 = next(f for f in facts if f.node == node)
        if backend == "nccl" and f0.gpus < len(ranks):
            findings.append(
                Finding(
                    severity="error",
                    check="environment",
                    message=f"{node} runs {len(ranks)} ranks but sees {f0.gpus} GPU(s)",
                    fix="lower --nproc-per-node to the GPU count, or check CUDA_VISIBLE_DEVICES",
                    ranks=tuple(ranks),
                )
            )
        threads = sum(f.threads for f in facts if f.node == node)
        if backend != "nccl" and threads > f0.cpu_count:
            fix = (
                f"set OMP_NUM_THREADS={max(1, f0.cpu_count // len(ranks))} (torchrun sets 1)"
                if threads > len(ranks)
                else f"run at most {f0.cpu_count} ranks on {node} (--nproc-per-node), or accept the slowdown "
                f"in a test run"
            )
            findings.append(
                Finding(
                    severity="warning",
                    check="environment",
                    message=f"{node}: {len(ranks)} ranks use {threads} compute threads on {f0.cpu_count} CPUs; "
                    f"oversubscribed threads spin-wait and slow every rank",
                    fix=fix,
                    ranks=tuple(ranks),
                )
            )
    if not findings:
        findings.append(Finding(severity="ok", check="environment", message="no suspicious settings"))
    return findings


def check_backend(facts: Sequence[RankFacts], backend: str) -> list[Finding]:
    """The backend is built into torch on every rank."""
    lacking = [f.rank for f in facts if backend not in f.backends]
    if lacking:
        return [
            Finding(
                severity="error",
                check="backend",
                message=f"backend {backend} is not available on ranks {ranks_text(lacking)}",
                fix=f"install a torch build with {backend} there, or choose --backend "
                f"{'gloo' if backend == 'nccl' else 'nccl'}",
                ranks=tuple(lacking),
            )
        ]
    return []


def check_process_group(errors: Mapping[int, str], joined: bool, backend: str) -> list[Finding]:
    """Ranks that could not join the process group, with the error they reported. A
    rank that timed out waiting for another is a victim, not a cause: causes come first."""
    if joined and not errors:
        return [Finding(severity="ok", check="process group", message=f"every rank joined the {backend} process group")]
    waited = sorted(r for r, msg in errors.items() if re.search(r"time[d ]*out", msg, re.IGNORECASE))
    causes = {r: msg for r, msg in sorted(errors.items()) if r not in waited}
    findings = [
        Finding(
            severity="error",
            check="process group",
            message=f"rank {r} could not join the {backend} process group: {msg.splitlines()[0]}",
            fix="fix the cause in that error (interface name, port, driver, library); the other ranks "
            "waited for this one",
            ranks=(r,),
        )
        for r, msg in causes.items()
    ]
    if causes and waited:
        findings.append(
            Finding(
                severity="warning",
                check="process group",
                message=f"ranks {ranks_text(waited)} timed out waiting for rank(s) {ranks_text(list(causes))}",
                ranks=tuple(waited),
            )
        )
    elif not causes:
        findings.append(
            Finding(
                severity="error",
                check="process group",
                message=f"the {backend} process group timed out"
                + (f" on ranks {ranks_text(waited)}" if waited else "")
                + " and no rank reported a cause",
                fix="a rank is stuck or unreachable: check the firewall between nodes (gloo and NCCL "
                "open their own TCP ports beyond the store's) and the interface each rank uses",
                ranks=tuple(waited),
            )
        )
    return findings


def check_groups(results: Sequence[GroupResult]) -> list[Finding]:
    """Every all-reduce returned the exact sum on every rank."""
    wrong = [g for g in results if g.wrong_ranks]
    if not wrong:
        names = ", ".join(dict.fromkeys(g.name.split(" ")[0] for g in results))
        return [
            Finding(
                severity="ok",
                check="all-reduce",
                message=f"{len(results)} groups ({names}) returned exact sums on every rank",
            )
        ]
    return [
        Finding(
            severity="error",
            check="all-reduce",
            message=f"{g.name} (ranks {ranks_text(g.ranks)}) returned a wrong sum on ranks "
            f"{ranks_text(g.wrong_ranks)} (off by up to {g.max_error:g})",
            fix="a broken link or a buggy transport: rerun with NCCL_DEBUG=WARN, and with NCCL_P2P_DISABLE=1 "
            "or NCCL_ALGO=Ring to narrow it down; check the driver and NCCL versions",
            ranks=g.wrong_ranks,
        )
        for g in wrong
    ]


COLLECTIVE_PHASES = ("group all-reduces", "matmul timing", "node labels", "link timing", "gathering results")
"""The collective checks in the order every rank runs them (``profiler.doctor``); each rank
records the one it is in, so that where a collective fails rank 0 can name the ranks that
never reached it."""


def check_collectives_stopped(phases: Mapping[int, str], world: int, error: str, pg_timeout_s: float) -> list[Finding]:
    """A collective check that failed on rank 0 (``error``), and the ranks of the
    ``world`` behind it: those whose last recorded phase (``phases``, in :data:`profiler.doctor.COLLECTIVE_PHASES`
    order, recorded on entry) comes before rank 0's, or that recorded none. Rank 0
    stops in the phase where a rank died or hung; a rank still in an earlier one is
    where to look."""
    order = {name: i for i, name in enumerate(COLLECTIVE_PHASES)}
    mine = phases.get(0, COLLECTIVE_PHASES[0])
    behind = [r for r in range(world) if order.get(phases.get(r, ""), -1) < order[mine]]
    where = (
        f"rank(s) {ranks_text(behind)} never reached it"
        if behind
        else "every rank had entered it, so one died or hung inside it"
    )
    return [
        Finding(
            severity="error",
            check="collectives",
            message=f"the {mine} failed on rank 0 ({error}); {where}",
            fix="look at those ranks' output and logs for a crash, a hang or an out-of-memory kill, and on their "
            f"nodes for the network; a collective waits --pg-timeout ({pg_timeout_s:g} s) for a rank before failing",
            ranks=tuple(behind),
        )
    ]


def check_speed(
    links: Sequence[LinkTime], compute: Sequence[ComputeTime], facts: Mapping[int, RankFacts], slow_ratio: float
) -> list[Finding]:
    """Links and ranks much slower than their peers (below ``slow_ratio`` x the median
    of the same kind)."""
    findings: list[Finding] = []
    node = {r: f.node for r, f in facts.items()}
    for kind in ("intra", "inter"):
        same = [lk for lk in links if lk.kind == kind]
        if len(same) < 3:
            continue
        median = statistics.median(lk.bandwidth_bytes_per_s for lk in same)
        slow = [lk for lk in same if lk.bandwidth_bytes_per_s < slow_ratio * median]
        counts: dict[int, int] = {}
        for lk in slow:
            counts[lk.a] = counts.get(lk.a, 0) + 1
            counts[lk.b] = counts.get(lk.b, 0) + 1
        touching = {r: sum(1 for lk in same if r in (lk.a, lk.b)) for r in counts}
        culprits = {r for r in counts if counts[r] == touching[r] and touching[r] >= 2}
        for r in sorted(culprits):
            mine = [lk for lk in slow if r in (lk.a, lk.b)]
            findings.append(
                Finding(
                    severity="warning",
                    check="speed",
                    message=f"every {kind}-node link of rank {r} ({node.get(r, '?')}) is slow: "
                    + ", ".join(f"{lk.a}<->{lk.b} {lk.bandwidth_bytes_per_s / 1e6:.3g} MB/s" for lk in mine)
                    + f", against a median of {median / 1e6:.3g} MB/s",
                    fix=f"check {node.get(r, 'that node')}'s network: NIC speed and errors (ethtool -S), cabling or switch "
                    f"port, traffic shaping (tc qdisc show), other traffic on it",
                    ranks=(r,),
                )
            )
        for lk in slow:
            if lk.a in culprits or lk.b in culprits:
                continue
            findings.append(
                Finding(
                    severity="warning",
                    check="speed",
                    message=f"{kind}-node link {lk.a}<->{lk.b} ({node.get(lk.a, '?')} - {node.get(lk.b, '?')}) moves "
                    f"{lk.bandwidth_bytes_per_s / 1e6:.3g} MB/s, {lk.bandwidth_bytes_per_s / median:.2f}x the "
                    f"median {median / 1e6:.3g} MB/s",
                    fix="check that link's path: NICs, cables, switch ports",
                    ranks=(lk.a, lk.b),
                )
            )
    if len(compute) >= 3:
        median = statistics.median(c.flops / c.time_s for c in compute)
        for c in compute:
            rate = c.flops / c.time_s
            if rate < slow_ratio * median:
                findings.append(
                    Finding(
                        severity="warning",
                        check="speed",
                        message=f"rank {c.rank} ({node.get(c.rank, '?')}) computes at {rate / 1e9:.4g} GFLOP/s, "
                        f"{rate / median:.2f}x the median {median / 1e9:.4g}",
                        fix="check that device's clocks and temperature (nvidia-smi -q -d PERFORMANCE) and other "
                        "processes competing for it",
                        ranks=(c.rank,),
                    )
                )
    if not findings and (links or compute):
        findings.append(Finding(severity="ok", check="speed", message=_speed_summary(links, compute, slow_ratio)))
    return findings


def _speed_summary(links: Sequence[LinkTime], compute: Sequence[ComputeTime], slow_ratio: float) -> str:
    """What was measured (the median bandwidth of each kind of link, the median compute
    rate) and what was compared: a kind with fewer than 3 links, or fewer than 3 ranks,
    has no peers to set a median against, which the verdict says."""
    parts, compared, alone = [], [], []
    for kind in ("intra", "inter"):
        same = [lk.bandwidth_bytes_per_s for lk in links if lk.kind == kind]
        if same:
            parts.append(f"{kind}-node links {statistics.median(same) / 1e9:.3g} GB/s")
            (compared if len(same) >= 3 else alone).append(f"{len(same)} {kind}-node link{'s' * (len(same) > 1)}")
    if compute:
        parts.append(f"compute {statistics.median(c.flops / c.time_s for c in compute) / 1e9:.4g} GFLOP/s")
        (compared if len(compute) >= 3 else alone).append(f"{len(compute)} rank{'s' * (len(compute) > 1)}")
    text = "measured (medians): " + ", ".join(parts)
    if compared:
        text += f"; {' and '.join(compared)} within {slow_ratio:g}x of their peers"
    if alone:
        text += f"; {' and '.join(alone)} not compared (fewer than 3 to compare)"
    return text


def plan_groups(dp: int, tp: int, pp: int, cp: int = 1) -> dict[str, tuple[int, ...]]:
    """The process groups a plan's mesh uses: ranks row-major over (pp, dp, cp, tp), as
    ``autopar.vocab.MeshAxis`` lays them out; groups of one rank are left out."""
    sizes = {"pp": pp, "dp": dp, "cp": cp, "tp": tp}
    axes = tuple(sizes)
    coords = list(itertools.product(*(range(n) for n in sizes.values())))

    def rank(c: tuple[int, ...]) -> int:
        out = 0
        for axis, i in zip(axes, c):
            out = out * sizes[axis] + i
        return out

    groups: dict[str, tuple[int, ...]] = {}
    for axis in ("tp", "cp", "dp", "pp"):
        k = axes.index(axis)
        rest = sorted({c[:k] + c[k + 1 :] for c in coords})
        for i, others in enumerate(rest):
            group = tuple(rank((*others[:k], j, *others[k:])) for j in range(sizes[axis]))
            if len(group) > 1:
                groups[f"{axis} group {i}"] = group
    return groups
