"""A cluster: ``nodes`` identical nodes of ``devices_per_node`` devices and the links
inside and between them, as plain numbers with their sources.

Devices inside a node talk over ``intra_node`` (NVLink, loopback), nodes over
``inter_node`` (InfiniBand, Ethernet). Heterogeneous clusters would add a list of node
groups; every consumer reads devices through :attr:`Cluster.device`, which keeps room
for that. Presets, cluster files and profiles build clusters in
:mod:`autopar.hardware.presets` and :mod:`autopar.profiles`; a cluster file is this
dataclass through :mod:`autopar.codec`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from autopar import codec
from autopar.errors import ClusterError
from autopar.hardware.device import DeviceSpec
from autopar.hardware.links import LinkSpec

MAX_DEVICES = 2**20
"""The most devices a cluster may have: 1,048,576, several times the largest training
clusters built, and few enough that the search's integer work (divisors of the device
count, by trial division up to its square root) takes milliseconds, where a count of
10**19 would take hours."""

CLUSTER_FILE_REMEDY = "give a path to a JSON file written by save_cluster, or a preset such as 'dgx-a100-80gb:4'"


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
        if self.world_size > MAX_DEVICES:
            raise ClusterError(
                f"cluster {self.name!r} has {self.world_size:,} devices ({self.nodes:,} node(s) x "
                f"{self.devices_per_node:,}); autopar plans up to {MAX_DEVICES:,}: give fewer nodes or devices "
                f"per node."
            )

    @property
    def world_size(self) -> int:
        """Total number of devices."""
        return self.nodes * self.devices_per_node

    def with_nodes(self, nodes: int) -> Cluster:
        """The same cluster with another node count (for what-if questions)."""
        return replace(self, nodes=nodes, name=f"{self.kind} x {nodes}")

    @property
    def kind(self) -> str:
        """The node type's name: ``dgx-a100-80gb`` for ``dgx-a100-80gb x 128``."""
        return self.name.split(" x ")[0]

    def describe(self) -> str:
        """One line: ``dgx-a100-80gb x 128: 128 node(s) x 8 = 1024 A100-SXM4-80GB (80.0 GiB each)``."""
        return (
            f"{self.name}: {self.nodes} node(s) x {self.devices_per_node} = {self.world_size} "
            f"{self.device.name} ({self.device.memory.capacity_bytes / 2**30:.1f} GiB each)"
        )


def cluster_to_dict(cluster: Cluster) -> dict[str, Any]:
    """The cluster as JSON data (what a cluster file holds)."""
    return codec.encode(cluster, error=ClusterError)


def cluster_from_dict(data: Any, *, origin: str = "cluster data") -> Cluster:
    """A cluster from :func:`cluster_to_dict`'s data; errors name the bad field."""
    return codec.decode(Cluster, data, origin, error=ClusterError)


def save_cluster(cluster: Cluster, path: str | Path) -> Path:
    """Write a cluster file (atomically)."""
    if not isinstance(cluster, Cluster):
        raise ClusterError(
            f"save_cluster takes a Cluster (autopar.preset(...), load_cluster(...) or a profile's cluster), "
            f"got {type(cluster).__name__} {cluster!r:.60}; nothing was written."
        )
    return codec.write_atomically(path, codec.dumps(cluster, error=ClusterError))


def load_cluster(path: str | Path) -> Cluster:
    """Read a cluster file written by :func:`save_cluster` (or by hand in that layout)."""
    if not isinstance(path, (str, Path)):
        raise ClusterError(f"cluster file path {path!r} is not allowed: {CLUSTER_FILE_REMEDY}.")
    data = codec.read_json(path, what="cluster file", error=ClusterError, remedy=CLUSTER_FILE_REMEDY)
    if isinstance(data, dict) and "schema" in data:  # a tag cluster files lack and profile reports carry
        raise ClusterError(
            f"cluster file {str(path)!r} is a profile report ('autopar profile' wrote it), not a cluster: pass it as "
            f"--profile {str(path)!r} beside a cluster such as --cluster local-cpu:1 (profile= in autopar.plan), or "
            f"make a cluster of it with autopar.cluster_from_profiles."
        )
    other = codec.misfiled(data, "cluster", "a cluster")
    if other:
        raise ClusterError(f"cluster file {str(path)!r} {other}.")
    cluster = cluster_from_dict(data, origin=f"cluster file {str(path)!r}")
    counted = cluster.name.rpartition(" x ")[2]
    if counted.isdigit() and int(counted) != cluster.nodes:  # a saved preset whose node count was edited
        cluster = replace(cluster, name=f"{cluster.kind} x {cluster.nodes}")
    return cluster
