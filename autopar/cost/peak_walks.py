"""A pipeline rank's activations and gradients followed through its step: unit by
unit in a 1F1B backward (:func:`backward_peak`), action by action in torch's interleaved
1F1B order (:func:`interleaved_peak`). :mod:`autopar.cost.peak` prices the rank with them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from autopar.cost.memory import UNSHARDED_STAGES
from autopar.cost.pipeline import gathered_chunks


def backward_peak(
    acts: list[float],
    transients: list[float],
    grads: list[float],
    inflight: float,
    *,
    fresh_gradients: bool,
    held_to_end: float = 0.0,
    freed: Sequence[float] = (),
    before_last: Sequence[float] = (),
    running: Sequence[float | None] = (),
) -> tuple[float, float, float, float]:
    """(activations, gradients, transient, parameter copies freed) at the peak of a
    rank's backward, its units in forward order, ``inflight`` micro-batches' activations
    held at most.

    While unit ``k`` runs its backward, the micro-batch it works on still holds the
    activations of units up to ``k``, the other micro-batches in flight all theirs, and
    ``k`` its transient. Gradients: all of them, except with ``fresh_gradients`` (every
    forward runs before the first backward and ``zero_grad`` left none), where the first
    micro-batch's backward at ``k`` has only those of the units after ``k``, and every one
    exists from the second micro-batch on, one micro-batch's activations fewer.
    ``held_to_end``: of the last unit's activations, what stays until the micro-batch's
    backward is over (the logits, which ``PipelineStage`` keeps as the output it runs
    backward from). ``freed``: per unit, the gathered parameter copy it lets go of once
    its backward in the step's last micro-batch is over (without pipelining,
    :func:`autopar.cost.memory.unit_freed_copy_bytes`): all are gone after the last
    backward, and at ``k`` of the last micro-batch those of the units after ``k``.
    ``before_last``: per unit, its transient in a micro-batch before the step's last
    (``transients`` by default), which holds every copy. ``running``: per unit that
    reduces only once its backward is over (ZeRO-2 without pipelining,
    :func:`autopar.cost.memory.kept_reduce_input_bytes`), its transient while that
    backward runs (its gradients as they come, beside the reduce input the unit before
    it in the backward left), None for the others: its reduction (``transients``) then
    meets neither its activations nor, in the last micro-batch, its copy."""
    whole = sum(acts)
    freed = list(freed) or [0.0] * len(acts)
    before_last = list(before_last) or transients
    # after the last backward, nothing but the gradients
    best = (0.0, sum(grads, 0.0), 0.0, sum(freed, 0.0))
    for k in range(len(acts)):
        held = (inflight - 1) * whole + sum(acts[: k + 1]) + (held_to_end if k < len(acts) - 1 else 0.0)
        gone = sum(freed[k + 1 :], 0.0)
        # (moment, the copy unit k frees at its reduction in it)
        if fresh_gradients:  # the first micro-batch, the last one too where it is alone in flight
            alone = inflight < 2
            moments = [
                ((held, sum(grads[k + 1 :], 0.0), transients[k], gone if alone else 0.0), freed[k] if alone else 0.0)
            ]
            if inflight >= 2:
                moments.append(((held - whole, sum(grads, 0.0), transients[k], 0.0), 0.0))
        else:  # the last micro-batch, and one before it
            moments = [
                ((held, sum(grads, 0.0), transients[k], gone), freed[k]),
                ((held, sum(grads, 0.0), before_last[k], 0.0), 0.0),
            ]
        runs = running[k] if running else None
        for (a, g, t, f), own in moments:
            split = [(a, g, t, f)] if runs is None else [(a, g, runs, f), (a - acts[k], g, t, f + own)]
            for moment in split:
                if alive_bytes(moment) > alive_bytes(best):
                    best = moment
    return best


def first_forward_peak(acts: Sequence[float], gathers: Sequence[float]) -> tuple[float, float, float, float]:
    """(activations, gradients, transient, parameter copies not gathered yet) at the
    peak of a step's first forward where each unit gathers its parameters as its
    forward begins and keeps them to its backward (ZeRO-2 without pipelining; units in
    forward order, ``gathers`` each one's gathered copy): at unit ``k`` the activations
    of the units before it, its flat all-gather buffer beside that of the unit before
    it (FSDP2 keeps each until the next all-gather, ``FSDPCommContext.all_gather_state``),
    no gradient (``zero_grad`` left none) and none of the copies of the units after it."""
    best = (0.0, 0.0, 0.0, sum(gathers, 0.0))
    for k in range(len(acts)):
        buffers = gathers[k] + (gathers[k - 1] if k else 0.0)
        moment = (sum(acts[:k], 0.0), 0.0, buffers, sum(gathers[k + 1 :], 0.0))
        if alive_bytes(moment) > alive_bytes(best):
            best = moment
    return best


def alive_bytes(moment: tuple[float, float, float, float]) -> float:
    """The bytes a moment (activations, gradients, transient, copies freed) holds beyond
    the model states."""
    acts, grads, transient, freed = moment
    return acts + grads + transient - freed


def chunked(values: Sequence[float], sizes: Sequence[int]) -> list[list[float]]:
    """``values`` (a rank's units in order) cut into its stages of ``sizes`` units."""
    out, at = [], 0
    for n in sizes:
        out.append(list(values[at : at + n]))
        at += n
    return out


@dataclass(frozen=True)
class RankPeak:
    """What a pipeline rank holds at its peak beyond its model states' fixed part: its
    activations, gradients, the transient of the unit in backward, and the gathered
    parameter copies of the stages a multi-stage schedule keeps unsharded then."""

    activations_bytes: float
    grads_bytes: float
    transient_bytes: float
    gathered_bytes: float = 0.0

    @property
    def total_bytes(self) -> float:
        return self.activations_bytes + self.grads_bytes + self.transient_bytes + self.gathered_bytes


def interleaved_peak(
    acts: Sequence[Sequence[float]],
    transients: Sequence[Sequence[float]],
    grads: Sequence[Sequence[float]],
    copies: Sequence[float],
    order: tuple[tuple[bool, int], ...],
    *,
    fresh_gradients: bool,
    held_to_end: float = 0.0,
    lazy_gather: bool = False,
) -> RankPeak:
    """What a rank that runs its chunks in ``order`` (``(is_forward, chunk)``,
    :func:`autopar.cost.pipeline.interleaved_order`) holds at its peak: ``acts[c][k]``
    of unit ``k`` of chunk ``c`` per micro-batch, in forward order (likewise
    ``transients`` and ``grads``), and ``copies[c]`` of chunk ``c``'s gathered
    parameters while torch keeps it unsharded (:func:`autopar.cost.pipeline.gathered_chunks`,
    ``lazy_gather`` for ``replicate``).

    A forward adds one micro-batch of its chunk's activations, a backward frees them; while
    unit ``k`` of chunk ``c`` runs its backward, the micro-batch it works on holds the
    activations of the units up to ``k`` and ``k`` its transient, as in
    :func:`backward_peak`. Gradients: all of them, except with ``fresh_gradients``
    (``zero_grad`` left none), where a unit's exists from its first backward on, so that
    the warm-up's activations meet only the last chunk's gradients, and the earlier
    chunks' arrive as the steady state has freed some. ``held_to_end``: the last chunk's
    logits, kept until its micro-batch's backward is over (the chunk with the model's
    last unit is the last of the rank's)."""
    whole = [sum(a) for a in acts]
    grad_sums = [sum(g) for g in grads]
    total = sum(grad_sums)
    # each chunk's worst unit in its backward, by whether its gradients exist yet: what
    # the unit adds to the other chunks' activations and the gradients already made
    worst = [
        {seen: _worst_unit(a, t, g, held_to_end if c == len(acts) - 1 else 0.0, seen) for seen in (False, True)}
        for c, (a, t, g) in enumerate(zip(acts, transients, grads))
    ]
    seen = [False] * len(acts)
    held_bytes, done = 0.0, 0.0
    best = RankPeak(0.0, total, 0.0)  # after the last backward, nothing but the gradients
    most = best.total_bytes
    for forward, c, gathered in _walk_steps(order, lazy_gather):
        if forward:
            held_bytes += whole[c]
            continue
        unit_acts, unit_grads, transient = worst[c][seen[c] or not fresh_gradients]
        alive = done + unit_grads if fresh_gradients else total
        moment_acts = held_bytes - whole[c] + unit_acts
        copy = sum(copies[g] for g in gathered)
        if moment_acts + alive + transient + copy > most:  # RankPeak.total_bytes, summed alike
            best = RankPeak(moment_acts, alive, transient, copy)
            most = best.total_bytes
        held_bytes -= whole[c]
        if not seen[c]:
            seen[c] = True
            done += grad_sums[c]
    return best


@lru_cache(maxsize=256)
def _walk_steps(order: tuple[tuple[bool, int], ...], lazy: bool) -> tuple[tuple[bool, int, tuple[int, ...]], ...]:
    """``order``'s actions with the chunks gathered during each
    (:func:`autopar.cost.pipeline.gathered_chunks`), once per order: the search walks
    the same orders for every candidate it gives room to."""
    gathered = gathered_chunks(order, UNSHARDED_STAGES, lazy=lazy)
    return tuple((forward, c, g) for (forward, c), g in zip(order, gathered))


def _worst_unit(
    acts: Sequence[float], transients: Sequence[float], grads: Sequence[float], held_to_end: float, seen: bool
) -> tuple[float, float, float]:
    """(activations, gradients, transient) of one chunk's micro-batch at the worst unit
    of its backward (:func:`interleaved_peak`): the activations of the units up to it
    (and ``held_to_end`` before the last), the unit's transient, and, before the
    chunk's first backward is over (not ``seen``), the gradients of the units after it."""
    best, most = (0.0, 0.0, 0.0), -1.0
    for k in range(len(acts)):
        ends = held_to_end if k < len(acts) - 1 else 0.0
        moment = (sum(acts[: k + 1]) + ends, 0.0 if seen else sum(grads[k + 1 :]), transients[k])
        if sum(moment) > most:
            best, most = moment, sum(moment)
    return best
