"""Simulate a pipeline schedule: who runs which micro-batch when, and where the bubbles are.

Each pipeline rank runs its operations in the order ``torch.distributed.pipelining``
does (GPipe: all forwards, then all backwards; 1F1B: ``p - 1 - r`` warm-up forwards, then
one forward one backward, then the remaining backwards; interleaved 1F1B: Megatron-LM's
depth-first order over virtual stages with ``(v - 1) p + 2 (p - 1 - r)`` warm-up
forwards). An operation starts when its rank is free and its inputs have arrived: the
forward of stage ``s`` after the forward of stage ``s - 1`` plus the point-to-point time,
the backward after the backward of stage ``s + 1`` (and its own forward).

Used to draw a plan's timeline and, in tests, to check the closed-form bubble of
:mod:`autopar.cost.pipeline` (pure: numbers in, a timeline out).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from autopar.vocab import Schedule


@dataclass(frozen=True, kw_only=True)
class Op:
    """One scheduled operation."""

    rank: int
    stage: int
    microbatch: int
    kind: Literal["F", "B"]
    start_s: float
    end_s: float


def rank_order(
    schedule: Schedule, pp: int, virtual_stages: int, num_microbatches: int, rank: int
) -> list[tuple[Literal["F", "B"], int, int]]:
    """(kind, micro-batch, local chunk) in the order rank ``rank`` runs them."""
    m, v = num_microbatches, virtual_stages
    if schedule is Schedule.GPIPE or pp == 1:
        return [("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)]
    if v == 1:
        warm = min(pp - 1 - rank, m)
        order: list[tuple[Literal["F", "B"], int, int]] = [("F", i, 0) for i in range(warm)]
        for i in range(m - warm):
            order += [("F", warm + i, 0), ("B", i, 0)]
        return order + [("B", i, 0) for i in range(m - warm, m)]
    forwards = _interleaved_sequence(pp, v, m, forward=True)
    backwards = _interleaved_sequence(pp, v, m, forward=False)
    rounds = max(1, m // pp)
    per_round = m // rounds
    warm = min((v - 1) * per_round + 2 * (pp - 1 - rank), m * v)
    order = [("F", mb, c) for mb, c in forwards[:warm]]
    f_next, b_next = warm, 0
    while f_next < len(forwards) or b_next < len(backwards):
        if f_next < len(forwards):
            mb, c = forwards[f_next]
            order.append(("F", mb, c))
            f_next += 1
        if b_next < len(backwards):
            mb, c = backwards[b_next]
            order.append(("B", mb, c))
            b_next += 1
    return order


def _interleaved_sequence(pp: int, v: int, m: int, *, forward: bool) -> list[tuple[int, int]]:
    """Depth-first: micro-batches in groups of ``pp``, all chunks of a group before the next
    group (Narayanan et al. 2021, section 2.2)."""
    seq = []
    for start in range(0, m, pp):
        group = range(start, min(start + pp, m))
        chunks = range(v) if forward else reversed(range(v))
        for c in chunks:
            seq += [(mb, c) for mb in group]
    return seq


def simulate(
    schedule: Schedule,
    pp: int,
    virtual_stages: int,
    num_microbatches: int,
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    p2p_s: float = 0.0,
) -> list[Op]:
    """Run the schedule with per-stage forward and backward times (``pp * v`` stages,
    stage ``s`` on rank ``s % pp``). Raises ValueError if the schedule deadlocks."""
    v = virtual_stages
    stages = pp * v
    if len(forward_s) != stages or len(backward_s) != stages:
        raise ValueError(f"need {stages} forward and backward times, got {len(forward_s)} and {len(backward_s)}")
    orders = [rank_order(schedule, pp, v, num_microbatches, r) for r in range(pp)]
    done_f: dict[tuple[int, int], float] = {}
    done_b: dict[tuple[int, int], float] = {}
    free = [0.0] * pp
    pos = [0] * pp
    ops: list[Op] = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(pp):
            while pos[r] < len(orders[r]):
                kind, mb, chunk = orders[r][pos[r]]
                stage = chunk * pp + r
                if kind == "F":
                    if stage > 0 and (mb, stage - 1) not in done_f:
                        break
                    ready = done_f[(mb, stage - 1)] + p2p_s if stage > 0 else 0.0
                    duration = forward_s[stage]
                else:
                    if (mb, stage) not in done_f or (stage < stages - 1 and (mb, stage + 1) not in done_b):
                        break
                    ready = max(done_f[(mb, stage)], done_b[(mb, stage + 1)] + p2p_s if stage < stages - 1 else 0.0)
                    duration = backward_s[stage]
                start = max(free[r], ready)
                end = start + duration
                (done_f if kind == "F" else done_b)[(mb, stage)] = end
                free[r] = end
                ops.append(Op(rank=r, stage=stage, microbatch=mb, kind=kind, start_s=start, end_s=end))
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ValueError(f"schedule {schedule.value} deadlocks with pp={pp}, v={v}, m={num_microbatches}")
    return ops


def makespan_s(ops: Sequence[Op]) -> float:
    """When the last operation ends."""
    return max(op.end_s for op in ops)
