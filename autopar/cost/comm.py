"""Collective and point-to-point times: the alpha-beta model, hierarchical across nodes.

Bandwidths are bus bandwidths (nccl-tests ``busbw``): a ring all-reduce of ``S`` bytes
over ``n`` devices moves ``2 (n-1)/n S`` through each device, an all-gather or
reduce-scatter ``(n-1)/n S`` (Thakur et al. 2005; nccl-tests PERFORMANCE.md). A group
that spans nodes runs hierarchically, as NCCL does: reduce-scatter inside each node,
all-reduce of the ``1/n_local`` shard across nodes (every local device on its own NIC),
all-gather inside the node; so each device's inter-node link carries ``1/n_local`` of
the data. Latency: ``alpha`` per ring step inside a node, a tree (``log2``) across nodes.
Where a network profile measured a collective on groups of the size that runs it, the
measured curve replaces the line on that level (:class:`autopar.hardware.CommCurve`).

All functions are pure: numbers in, seconds out.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from autopar.hardware.cluster import Cluster
from autopar.hardware.links import LinkSpec


@dataclass(frozen=True, kw_only=True)
class GroupSpan:
    """Where a process group's devices are: ``per_node`` devices in each of ``nodes`` nodes
    (on a group that lies unevenly, the fewest it has on one of them)."""

    size: int
    per_node: int
    nodes: int

    @property
    def crosses_nodes(self) -> bool:
        """Whether the group spans more than one node."""
        return self.nodes > 1


@functools.cache
def group_span(size: int, stride: int, devices_per_node: int) -> GroupSpan:
    """The span of the slowest group of ``size`` ranks spaced ``stride`` apart (rank-major
    layout).

    With mesh axes (pp, dp, tp) row-major, a tp group has stride 1, a dp group stride
    ``tp`` and a pp group stride ``tp * dp``; node ``k`` holds ranks
    ``[k * devices_per_node, (k + 1) * devices_per_node)``. Groups tile the ranks in
    blocks of ``size * stride``, so where that block and the node do not divide each
    other, groups lie differently: tp=6 on nodes of 8 puts ranks 6-11 on two nodes (2
    and 4 of them). Every group of one axis runs each collective together, so the
    slowest sets the pace: the one with the fewest members on one node (each of them
    carries the largest share across nodes), then the most nodes. Every way a group
    can lie repeats within a world of whole nodes, so looking at one period of the
    layout is exact."""
    if size <= 1:
        return GroupSpan(size=1, per_node=1, nodes=1)
    block = size * stride
    members = np.arange(size, dtype=np.int64) * stride
    worst = (size, -1)  # (fewest on one node, -nodes): the least is the slowest
    for first in range(devices_per_node // math.gcd(block, devices_per_node)):
        for offset in range(min(stride, devices_per_node)):
            _, counts = np.unique((first * block + offset + members) // devices_per_node, return_counts=True)
            worst = min(worst, (int(counts.min()), -len(counts)))
    return GroupSpan(size=size, per_node=worst[0], nodes=-worst[1])


def _ring_latency_s(n: int, alpha_s: float) -> float:
    return (n - 1) * alpha_s if n > 1 else 0.0


def _tree_latency_s(n: int, alpha_s: float) -> float:
    return math.ceil(math.log2(n)) * alpha_s if n > 1 else 0.0


def _hierarchical_s(nbytes: float, span: GroupSpan, cluster: Cluster, op: str, calls: int) -> float:
    """Ring passes (2 for an all-reduce, 1 for an all-gather or a reduce-scatter) inside
    each node, then over the nodes on each device's ``1/n_local`` share; ring latency
    inside a node, tree latency across nodes, paid by each of the ``calls`` collectives
    the bytes are split into. Each level prices ``op`` at its own fit where the link has
    one (:meth:`LinkSpec.for_op`), and by its measured curve where it has one for groups
    of this size (:func:`level_s`)."""
    nl, nn = span.per_node, span.nodes
    t = 0.0
    if nl > 1:
        t += level_s(cluster.intra_node, op, nbytes, nl, calls=calls)
    if nn > 1:
        t += level_s(cluster.inter_node, op, nbytes / nl, nn, calls=calls, across_nodes=True)
    return t


def level_s(link: LinkSpec, op: str, nbytes: float, ranks: int, *, calls: int = 1, across_nodes: bool = False) -> float:
    """Seconds of ``op`` over ``ranks`` ranks of one link level, ``nbytes`` split into
    ``calls`` collectives: ``calls`` calls of ``nbytes / calls`` by the curve measured on
    groups of ``ranks`` ranks where the link has one (:class:`autopar.hardware.CommCurve`:
    a measured time is the best price of the same collective on the same group size),
    else the alpha-beta model (ring latency, or a tree's ``across_nodes``)."""
    if ranks < 2 or nbytes <= 0:
        return 0.0
    passes = 2 if op == "all_reduce" else 1
    bw, alpha = link.for_op(op)
    per_byte_s = passes * (ranks - 1) / ranks / bw
    curve = link.curve_for(op, ranks)
    if curve is not None:
        return calls * curve.seconds(nbytes / calls, beyond_s_per_byte=per_byte_s)
    latency_s = _tree_latency_s(ranks, alpha) if across_nodes else _ring_latency_s(ranks, alpha)
    return per_byte_s * nbytes + passes * calls * latency_s


def all_reduce_s(nbytes: float, span: GroupSpan, cluster: Cluster, *, calls: int = 1) -> float:
    """Time of an all-reduce of ``nbytes`` (the full buffer on every device), split
    into ``calls`` collectives (each pays the latency; FSDP2 issues one per unit)."""
    if span.size <= 1 or nbytes <= 0:
        return 0.0
    return _hierarchical_s(nbytes, span, cluster, "all_reduce", calls)


def all_gather_s(nbytes: float, span: GroupSpan, cluster: Cluster, *, calls: int = 1) -> float:
    """Time of an all-gather whose *result* is ``nbytes`` on every device, in ``calls``
    collectives."""
    if span.size <= 1 or nbytes <= 0:
        return 0.0
    return _hierarchical_s(nbytes, span, cluster, "all_gather", calls)


def reduce_scatter_s(nbytes: float, span: GroupSpan, cluster: Cluster, *, calls: int = 1) -> float:
    """Time of a reduce-scatter of an ``nbytes`` input (the same ring traffic as an
    all-gather of that result; gloo runs it slower, which a per-op fit captures), in
    ``calls`` collectives."""
    if span.size <= 1 or nbytes <= 0:
        return 0.0
    return _hierarchical_s(nbytes, span, cluster, "reduce_scatter", calls)


def all_to_all_s(nbytes: float, span: GroupSpan, cluster: Cluster) -> float:
    """Time of an all-to-all exchanging ``nbytes`` per device (``(n-1)/n`` leaves it).
    Across nodes, the ``(n - n_local)/n`` bound for other nodes leave through the
    device's own NIC while the rest crosses the node's links at the same time: the
    slower of the two sets the pace, plus one latency per peer."""
    n = span.size
    if n <= 1 or nbytes <= 0:
        return 0.0
    intra = cluster.intra_node
    if not span.crosses_nodes:
        return (n - 1) / n * nbytes / intra.bandwidth_bytes_per_s + (n - 1) * intra.latency_s
    inter = cluster.inter_node
    off_node = (n - span.per_node) / n * nbytes / inter.bandwidth_bytes_per_s
    on_node = (span.per_node - 1) / n * nbytes / intra.bandwidth_bytes_per_s
    return max(off_node, on_node) + (n - 1) * inter.latency_s


def p2p_s(nbytes: float, *, cross_node: bool, cluster: Cluster) -> float:
    """Time to send ``nbytes`` to one peer."""
    if nbytes <= 0:
        return 0.0
    link = cluster.inter_node if cross_node else cluster.intra_node
    bw, alpha = link.for_op("send_recv")
    curve = link.curve_for("send_recv", 2)
    if curve is not None:
        return curve.seconds(nbytes, beyond_s_per_byte=1 / bw)
    return nbytes / bw + alpha
