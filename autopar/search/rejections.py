"""Why a region of the parallel space is ruled out before costing: the reasons a refusal
gives when no candidate is left (:func:`autopar.search.space.enumerate_space`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from autopar.search.constraints import DEGREES


@dataclass(frozen=True, kw_only=True)
class Rejection:
    """A region of the space ruled out before costing, and why; ``searched``: the fields
    whose values, where the search picks them, it rules out (none: it is about fixed
    values, such as a pinned schedule), so that a refusal can keep to what the user fixed."""

    what: str
    reason: str
    searched: tuple[str, ...] = ()


def expert_rejection(c: Mapping[str, Any], dp: int, cp: int) -> Rejection | None:
    """Why a fixed ``ep`` cannot split the experts over ``dp x cp`` ranks, if it cannot:
    its expert groups tile the ranks that hold the same weights."""
    ep = c.get("ep", 1)
    if (dp * cp) % ep == 0:
        return None
    return Rejection(
        what=f"ep={ep} (dp={dp} cp={cp})",
        reason=f"an expert group of {ep} ranks must divide dp x cp = {dp * cp}; make dp x cp a multiple of {ep}, "
        f"or lower ep",
        searched=DEGREES,
    )


def shard_rejection(c: Mapping[str, Any], dp: int, cp: int) -> Rejection | None:
    """Why a fixed ``dp_shard`` cannot shard ``dp`` ranks (``cp`` apart), if it cannot."""
    shard = c.get("dp_shard")
    if shard is None:
        return None
    if dp % shard:
        return Rejection(what=f"dp_shard={shard} (dp={dp})", reason=f"the shard group does not divide dp={dp}")
    ep = c.get("ep", 1)
    if shard * cp % ep:
        return Rejection(
            what=f"ep={ep} dp_shard={shard} (cp={cp})",
            reason=f"an expert group of {ep} ranks must lie inside one shard group of dp_shard x cp = {shard * cp}",
        )
    return None
