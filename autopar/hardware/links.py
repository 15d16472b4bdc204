"""Links between devices: a bus bandwidth and latency per level, with measured fits and
curves per collective where a network profile took them.

Units: ``bandwidth_bytes_per_s`` is the achievable bus bandwidth per device in one
direction, as nccl-tests reports ``busbw`` (NVLink's advertised 600 GB/s is a
bidirectional total over all links); latencies are seconds per hop.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from autopar.errors import ClusterError, check_cluster_seconds, check_positive_float
from autopar.hardware.magnitudes import sci, too_small

COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")
"""The operations a link may carry a fit of its own for (what ``autopar.cost.comm`` prices)."""

MIN_LINK_BYTES_PER_S = 1e6
"""The slowest bus bandwidth a link may state (bytes per second): 1 MB/s, below 10 Mbit
Ethernet and some 3 times below the 25 Mbit link the profiler's shaped-link test fits, so
only a value in the wrong unit (45 for 45 GB/s) falls under it."""

MAX_LATENCY_S = 1.0
"""The longest latency per hop a link may state (seconds): a second, a thousand times a
gloo hop over loopback TCP and several times a round trip around the Earth, so only a
value in the wrong unit (2 for 2 ms) lies above it."""


def check_link_magnitudes(owner: str, bandwidth_bytes_per_s: float, latency_s: float) -> None:
    """Refuse a bandwidth below :data:`MIN_LINK_BYTES_PER_S` or a latency above
    :data:`MAX_LATENCY_S` (``owner`` names the link or fit): such values are in the
    wrong unit, and the plans they give would be absurd yet marked fitting."""
    if bandwidth_bytes_per_s < MIN_LINK_BYTES_PER_S:
        what = f"{owner} bandwidth_bytes_per_s={bandwidth_bytes_per_s!r} B/s"
        raise too_small(what, bandwidth_bytes_per_s, MIN_LINK_BYTES_PER_S, "B/s", "GM")
    if latency_s > MAX_LATENCY_S:
        raise ClusterError(
            f"{owner} latency_s={latency_s!r} s is above {sci(MAX_LATENCY_S)} s, longer than any real link: the field "
            f"is in seconds per hop ({latency_s:g} ms is {sci(latency_s / 1e3)}, {latency_s:g} us is "
            f"{sci(latency_s / 1e6)}); fix the cluster file."
        )


@dataclass(frozen=True, kw_only=True)
class CommCurve:
    """Measured seconds per call of one collective against its message size, on a group
    of ``ranks`` ranks: the cost model interpolates it where a group of that size runs
    the collective, instead of the alpha-beta line, which misses the middle of real
    curves (NCCL and gloo switch protocols with the message size; tensor parallelism's
    all-reduces sit in that middle; ``docs/cost-model.md``).

    ``time_s`` never decreases with ``nbytes`` (:meth:`from_measured` makes it so), so an
    interpolated price never drops as a message grows.
    """

    ranks: int
    nbytes: tuple[float, ...]
    time_s: tuple[float, ...]

    def __post_init__(self) -> None:
        if isinstance(self.ranks, bool) or not isinstance(self.ranks, int) or self.ranks < 2:
            raise ClusterError(f"a collective's curve needs a group of >= 2 ranks, got ranks={self.ranks!r}.")
        sizes = tuple(check_positive_float("curve nbytes", b, error=ClusterError) for b in self.nbytes)
        times = tuple(check_cluster_seconds("curve time_s", t) for t in self.time_s)
        if len(sizes) != len(times) or len(sizes) < 2:
            raise ClusterError(
                f"a collective's curve needs as many times as sizes, at least two; got "
                f"{len(sizes)} sizes and {len(times)} times."
            )
        if any(b >= c for b, c in itertools.pairwise(sizes)) or any(t > u for t, u in itertools.pairwise(times)):
            raise ClusterError(
                "a collective's curve needs increasing sizes and times that never decrease; build it "
                "from measurements with CommCurve.from_measured."
            )
        object.__setattr__(self, "nbytes", sizes)
        object.__setattr__(self, "time_s", times)

    @classmethod
    def from_measured(cls, ranks: int, nbytes: Any, time_s: Any) -> CommCurve:
        """The curve from measured seconds per call by size (any order), made
        non-decreasing by the least-squares monotone fit (pool-adjacent-violators; Ayer
        et al. 1955): a larger message never takes less time, so a noisy size that did
        is pooled with its neighbours rather than believed."""
        pairs = sorted(zip((float(b) for b in nbytes), (float(t) for t in time_s)))
        blocks: list[list[float]] = []  # [mean, count]
        for _, t in pairs:
            blocks.append([t, 1.0])
            while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
                mean, count = blocks.pop()
                before, weight = blocks.pop()
                blocks.append([(mean * count + before * weight) / (count + weight), count + weight])
        times = [mean for mean, count in blocks for _ in range(int(count))]
        return cls(ranks=ranks, nbytes=tuple(b for b, _ in pairs), time_s=tuple(times))

    def seconds(self, nbytes: float, *, beyond_s_per_byte: float) -> float:
        """Seconds for one call of ``nbytes``: linear between measured sizes, the
        smallest size's time below them (latency dominates there), and past the
        largest, its time plus ``beyond_s_per_byte`` for every further byte (the
        fitted bandwidth's slope)."""
        sizes, times = self.nbytes, self.time_s
        if nbytes <= sizes[0]:
            return times[0]
        if nbytes >= sizes[-1]:
            return times[-1] + (nbytes - sizes[-1]) * beyond_s_per_byte
        i = next(k for k in range(1, len(sizes)) if nbytes <= sizes[k])
        frac = (nbytes - sizes[i - 1]) / (sizes[i] - sizes[i - 1])
        return times[i - 1] + frac * (times[i] - times[i - 1])


@dataclass(frozen=True, kw_only=True)
class OpLink:
    """A measured alpha-beta fit of one collective on a link level, and optionally its
    measured curve (:class:`CommCurve`), which prices it on groups of the curve's size.
    NCCL moves every collective at about one bus bandwidth, so a level's single fit
    serves them all; gloo does not (its reduce-scatter and all-gather run several times
    slower than its all-reduce), so a network profile records one fit per collective."""

    op: str
    bandwidth_bytes_per_s: float
    latency_s: float
    curve: CommCurve | None = None

    def __post_init__(self) -> None:
        if self.op not in COLLECTIVE_OPS:
            raise ClusterError(
                f"link fit op={self.op!r} is not allowed: it must be one of {', '.join(COLLECTIVE_OPS)}."
            )
        bandwidth = check_positive_float(
            f"{self.op} bandwidth_bytes_per_s", self.bandwidth_bytes_per_s, error=ClusterError
        )
        object.__setattr__(self, "bandwidth_bytes_per_s", bandwidth)
        object.__setattr__(self, "latency_s", check_cluster_seconds(f"{self.op} latency_s", self.latency_s))
        check_link_magnitudes(self.op, self.bandwidth_bytes_per_s, self.latency_s)


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
        bandwidth = check_positive_float("link bandwidth_bytes_per_s", self.bandwidth_bytes_per_s, error=ClusterError)
        object.__setattr__(self, "bandwidth_bytes_per_s", bandwidth)
        object.__setattr__(self, "latency_s", check_cluster_seconds("link latency_s", self.latency_s))
        check_link_magnitudes("link", self.bandwidth_bytes_per_s, self.latency_s)
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
