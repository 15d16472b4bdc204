"""The ``network`` section of a profile report: collective and point-to-point times over
message sizes per group level, a fitted latency and bus bandwidth per level, and what
the ranks of a node cost each other (framework time around sharded layers, memory
bandwidth shared, finishing apart). Units are in the field names, as in
:mod:`autopar.profiles.sections`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from autopar.errors import ProfileFormatError
from autopar.profiles.sections import REMEASURE, Provenance, Timing, check_measured

CollectiveOp = Literal["all_reduce", "all_gather", "reduce_scatter", "broadcast", "send_recv"]
Level = Literal["intra", "inter", "mixed"]


@dataclass(frozen=True, kw_only=True)
class CommPoint:
    """One message size of a collective: ``nbytes`` as nccl-tests counts it (the
    all-reduce buffer, the all-gather output, the reduce-scatter input, the broadcast
    buffer, the message sent to the peer); the time is the slowest rank's."""

    nbytes: float
    time: Timing
    algbw_bytes_per_s: float
    busbw_bytes_per_s: float

    def __post_init__(self) -> None:
        if not self.nbytes > 0:
            raise ProfileFormatError(
                f"a message of nbytes={self.nbytes!r} is not allowed: a collective moves bytes (nbytes > 0); measure "
                f"the profile again with autopar profile."
            )


@dataclass(frozen=True, kw_only=True)
class CommSeries:
    """A collective over one group, swept over message sizes.

    ``level``: ``intra`` (inside one node), ``inter`` (one rank per node) or ``mixed``
    (several ranks on several nodes). ``ranks``: the group's global ranks;
    ``per_node``/``nodes``: how they lie. ``label``: what the group is, for people.
    """

    op: CollectiveOp
    level: Level
    label: str
    ranks: tuple[int, ...]
    per_node: int
    nodes: int
    points: tuple[CommPoint, ...]


@dataclass(frozen=True, kw_only=True)
class LinkFit:
    """A fitted alpha-beta model of one level, as ``autopar.cost.comm`` prices it.

    ``alpha_s``: latency per ring step inside a node, per tree level across nodes;
    ``bandwidth_bytes_per_s``: bus bandwidth per device in one direction. ``ops``: the
    collectives fitted together; ``rms_rel_error``: root-mean-square relative error of
    the fit over its ``points`` measurements.
    """

    level: Level
    ops: tuple[CollectiveOp, ...]
    alpha_s: float
    bandwidth_bytes_per_s: float
    rms_rel_error: float
    points: int

    def __post_init__(self) -> None:
        check_measured(f"the {self.level} link fit's", alpha_s=self.alpha_s, rms_rel_error=self.rms_rel_error)
        if not (math.isfinite(self.bandwidth_bytes_per_s) and self.bandwidth_bytes_per_s > 0):
            raise ProfileFormatError(
                f"the {self.level} link fit's bandwidth_bytes_per_s={self.bandwidth_bytes_per_s!r} is not allowed: a "
                f"fitted link moves bytes (a finite number > 0, in bytes per second); {REMEASURE}."
            )


@dataclass(frozen=True, kw_only=True)
class NetworkProfile:
    """Collectives and point-to-point over a process group's levels.

    ``node_of_rank[r]``: the node label of rank ``r``. ``fits``: one joint fit per level
    (all the ops that level has) followed by one fit per op and level; ``unfitted``: the
    fits that could not be made and why. ``tp_overhead_s``: framework time per forward
    of a tensor-parallel leaf, ``fsdp_overhead_s`` per FSDP2 collective call and
    ``fsdp_tensor_overhead_s`` per parameter tensor of its unit in each call,
    measured on the intra-node groups beyond the fitted transfers, and
    ``fsdp_copy_bytes_per_s`` the rate FSDP2's copies around each collective reach
    (:mod:`profiler.framework_overhead`; 0 where no node has two ranks).
    ``memory_share``: the streaming bandwidth a CPU rank keeps while every rank of its
    node streams, over what it has alone (:mod:`profiler.contention`; 1 where not
    measured). ``sync_noise_s_per_sqrt_s``: how unevenly the ranks of a node finish the
    same work, the standard deviation of ``T`` seconds of it over ``sqrt(T)``, which
    blocking collectives pay as waits (:mod:`profiler.sync_skew`; 0 where not measured),
    and ``sync_speed_spread`` what they drift apart beyond it over a stretch of work, a
    fraction of the work.
    """

    backend: str
    device_kind: Literal["cpu", "cuda"]
    world_size: int
    node_of_rank: tuple[str, ...]
    series: tuple[CommSeries, ...]
    fits: tuple[LinkFit, ...]
    unfitted: Mapping[str, str] = field(default_factory=dict)
    tp_overhead_s: float = 0.0
    fsdp_overhead_s: float = 0.0
    fsdp_tensor_overhead_s: float = 0.0
    fsdp_copy_bytes_per_s: float = 0.0
    memory_share: float = 1.0
    sync_noise_s_per_sqrt_s: float = 0.0
    sync_speed_spread: float = 0.0
    provenance: Provenance

    def __post_init__(self) -> None:
        if self.world_size < 1 or len(self.node_of_rank) != self.world_size:
            raise ProfileFormatError(
                f"world_size={self.world_size} with {len(self.node_of_rank)} node labels (node_of_rank) is not "
                f"allowed: a network profile labels the node of each of its ranks, at least one; {REMEASURE}."
            )
        if not self.series:
            raise ProfileFormatError(
                f"series is empty: a network profile measures at least one collective; {REMEASURE}."
            )
        check_measured(
            "the network's",
            tp_overhead_s=self.tp_overhead_s,
            fsdp_overhead_s=self.fsdp_overhead_s,
            fsdp_tensor_overhead_s=self.fsdp_tensor_overhead_s,
            fsdp_copy_bytes_per_s=self.fsdp_copy_bytes_per_s,
            sync_noise_s_per_sqrt_s=self.sync_noise_s_per_sqrt_s,
            sync_speed_spread=self.sync_speed_spread,
        )
        if not 0 < self.memory_share <= 1:
            raise ProfileFormatError(
                f"memory_share={self.memory_share!r} is not allowed: the bandwidth a rank keeps while its node's "
                f"ranks stream together is a share of what it has alone, in (0, 1]; {REMEASURE}."
            )

    @property
    def nodes(self) -> int:
        """Distinct nodes."""
        return len(set(self.node_of_rank))

    @property
    def ranks_per_node(self) -> int:
        """Ranks on the most populated node."""
        return max(self.node_of_rank.count(n) for n in set(self.node_of_rank))

    def link(self, level: Level) -> LinkFit | None:
        """The joint fit of ``level`` (None when that level was not measured)."""
        joint = [f for f in self.fits if f.level == level and len(f.ops) > 1]
        single = [f for f in self.fits if f.level == level]
        return (joint or single or [None])[0]
