"""Private network namespaces joined by veth links, shaped with ``tc``, for tests whose
truth is a known link rate.

Everything lives in namespaces this module creates (addresses 10.200.x.x exist only
inside them; no interface is added to the host's namespace), every command has a
timeout, and the namespaces, with their links, are deleted on exit even when the test
fails. Needs root and Debian's iproute2 (``ip``, ``tc``); where the kernel or the
container refuses namespaces the test is skipped with the reason.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _ip(*args: str, timeout: float = 10) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"'ip {' '.join(args)}' failed: {done.stderr.strip()}")


def require_tools() -> None:
    """Fail (not skip) without iproute2: CI must install it."""
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        pytest.fail(f"{' and '.join(missing)} not found: install Debian's iproute2 (apt-get install -y iproute2)")


@dataclass(frozen=True)
class Node:
    """One namespace: its name, interface and address."""

    netns: str
    iface: str
    address: str


@contextlib.contextmanager
def namespaces(count: int, *, shaped: dict[int, float], subnet: int) -> Iterator[list[Node]]:
    """``count`` namespaces; with 2, one veth pair between them; with more, each joined
    to a bridge in a switch namespace. ``shaped[i]``: node ``i``'s link limited to that
    many Mbit/s in both directions (tbf on both ends)."""
    require_tools()
    tag = f"ap{os.getpid() % 100000}"
    created: list[str] = []
    try:
        try:
            _ip("netns", "add", f"{tag}n0")
        except RuntimeError as exc:
            pytest.skip(
                f"network namespaces are refused here ({exc}); the shaped-link test needs root and CAP_SYS_ADMIN"
            )
        created.append(f"{tag}n0")
        for i in range(1, count):
            _ip("netns", "add", f"{tag}n{i}")
            created.append(f"{tag}n{i}")
        nodes = [Node(netns=f"{tag}n{i}", iface=f"{tag}v{i}", address=f"10.200.{subnet}.{i + 1}") for i in range(count)]
        far: dict[int, tuple[str, str]] = {}  # the other end of each node's link
        if count == 2:
            _ip(
                "-n",
                nodes[0].netns,
                "link",
                "add",
                nodes[0].iface,
                "type",
                "veth",
                "peer",
                "name",
                nodes[1].iface,
                "netns",
                nodes[1].netns,
            )
            far = {0: (nodes[1].netns, nodes[1].iface), 1: (nodes[0].netns, nodes[0].iface)}
        else:
            switch = f"{tag}sw"
            _ip("netns", "add", switch)
            created.append(switch)
            _ip("-n", switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", switch, "link", "set", "br0", "up")
            for i, node in enumerate(nodes):
                port = f"{tag}s{i}"
                _ip("-n", switch, "link", "add", port, "type", "veth", "peer", "name", node.iface, "netns", node.netns)
                _ip("-n", switch, "link", "set", port, "master", "br0")
                _ip("-n", switch, "link", "set", port, "up")
                far[i] = (switch, port)
        for node in nodes:
            _ip("-n", node.netns, "addr", "add", f"{node.address}/24", "dev", node.iface)
            _ip("-n", node.netns, "link", "set", node.iface, "up")
            _ip("-n", node.netns, "link", "set", "lo", "up")
        for i, mbit in shaped.items():
            for netns, iface in ((nodes[i].netns, nodes[i].iface), far[i]):
                _ip(
                    "netns",
                    "exec",
                    netns,
                    "tc",
                    "qdisc",
                    "replace",
                    "dev",
                    iface,
                    "root",
                    "tbf",
                    "rate",
                    f"{mbit}mbit",
                    "burst",
                    "32kb",
                    "latency",
                    "50ms",
                )
        yield nodes
    finally:
        for name in reversed(created):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)


def run_ranks(nodes: Sequence[Node], args: Sequence[str], *, port: int, timeout_s: float) -> list[str]:
    """Run ``python -m profiler <args>`` as rank i inside node i's namespace, rank 0
    hosting the store; returns each rank's output. Every rank is killed at the deadline."""
    procs = []
    for rank, node in enumerate(nodes):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(len(nodes)),
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "1",
            "GROUP_RANK": str(rank),
            "MASTER_ADDR": nodes[0].address,
            "MASTER_PORT": str(port),
            "GLOO_SOCKET_IFNAME": node.iface,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(ROOT),
        }
        env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        procs.append(
            subprocess.Popen(
                ["ip", "netns", "exec", node.netns, sys.executable, "-m", "profiler", *args],
                env=env,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = []
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=timeout_s)[0])
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise AssertionError(
                f"ranks did not finish within {timeout_s} s: "
                + " | ".join((p.communicate()[0] or "")[-500:] for p in procs)
            ) from None
    return outputs
