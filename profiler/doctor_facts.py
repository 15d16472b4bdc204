"""What the ranks tell ``autopar doctor``, and what it concludes: plain data.

:class:`RankFacts` is what one rank says about itself before any collective runs;
:class:`LinkTime`, :class:`ComputeTime` and :class:`GroupResult` are what the ranks
measured together; a :class:`Finding` is one conclusion of the checks
(:mod:`profiler.doctor_checks`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

Severity = Literal["ok", "warning", "error"]


@dataclass(frozen=True, kw_only=True)
class RankFacts:
    """What one rank says about itself before any collective runs."""

    rank: int
    local_rank: int
    local_world_size: int
    node: str
    host: str
    pid: int
    versions: Mapping[str, str]
    backends: tuple[str, ...]
    env: Mapping[str, str]
    interfaces: tuple[str, ...]
    cpu_count: int
    threads: int
    gpus: int


@dataclass(frozen=True, kw_only=True)
class Finding:
    """One conclusion: ``severity``, the ``check`` it comes from, what was found
    (``message``), what to change (``fix``), and the ranks concerned."""

    severity: Severity
    check: str
    message: str
    fix: str = ""
    ranks: tuple[int, ...] = ()


@dataclass(frozen=True, kw_only=True)
class LinkTime:
    """A timed exchange of ``nbytes`` each way between ranks ``a`` and ``b``."""

    a: int
    b: int
    kind: Literal["intra", "inter"]
    nbytes: float
    time_s: float

    @property
    def bandwidth_bytes_per_s(self) -> float:
        """Bytes each way over the time."""
        return self.nbytes / self.time_s


@dataclass(frozen=True, kw_only=True)
class ComputeTime:
    """A timed matmul of ``flops`` on one rank."""

    rank: int
    flops: float
    time_s: float


@dataclass(frozen=True, kw_only=True)
class GroupResult:
    """An all-reduce over ``ranks``: ``wrong_ranks`` got a result differing from the
    exact sum by more than rounding (``max_error``)."""

    name: str
    ranks: tuple[int, ...]
    wrong_ranks: tuple[int, ...]
    max_error: float


def ranks_text(ranks: Sequence[int]) -> str:
    """``"0-3, 6"``: ranks in ranges."""
    rs = sorted(set(ranks))
    parts: list[str] = []
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        parts.append(f"{rs[i]}-{rs[j]}" if j - i >= 2 else ", ".join(map(str, rs[i : j + 1])))
        i = j + 1
    return ", ".join(parts)
