"""Measured collective curves: seconds per call against message size, as a network
profile measured them, for the cost model to interpolate (:mod:`autopar.cost.comm`)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from autopar.errors import ClusterError, check_cluster_seconds, check_positive_float


@dataclass(frozen=True, kw_only=True)
class CommCurve:
    """Measured seconds per call of one collective against its message size, on a group
    of ``ranks`` ranks: the cost model interpolates it where a group of that size runs
    the collective, instead of the alpha-beta line.

    One line through 1 KiB to 64 MiB misses the middle of real curves: gloo on
    loopback sockets took 2.3 ms for a 512 KiB all-reduce on 2 ranks where the fit
    through all sizes gave 1.2, and NCCL switches protocols with size (nccl-tests'
    curves bend where it does). Tensor parallelism's all-reduces sit in that middle, so
    a tp=2 step was priced about 40 ms short.

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
