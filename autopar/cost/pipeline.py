"""Pipeline schedules: how long a step takes and how many micro-batches each rank holds.

Step time of a pipeline over ``m`` micro-batches, where rank ``r`` spends ``W_r`` per
micro-batch (its stages' forward and backward, point-to-point included)::

    T = m * max_r W_r + (sum_r W_r - max_r W_r) / v

With one stage per rank (``v = 1``) this is the fill-and-drain bound of GPipe/1F1B for
unbalanced stages, ``(m - 1) max W + sum W`` (Narayanan et al. 2019, PipeDream; the
form Alpa's stage DP minimises). With equal stages it is ``(m + p - 1) W``: the bubble
fraction ``(p - 1)/m`` of Narayanan et al. 2021; with ``v`` virtual stages per rank it is
``(m + (p - 1)/v) W``, their interleaved schedule's bubble ``(p - 1)/(v m)``.

In-flight micro-batches (whose activations a rank holds at its peak) follow the
schedules of ``torch.distributed.pipelining`` 2.13: GPipe holds all ``m``; 1F1B holds
``min(m, p - r)`` on rank ``r``; interleaved 1F1B runs
``(v - 1) * mpr + 2 (p - 1 - r)`` warm-up chunk forwards (``_get_warmup_ops``, with
``mpr`` micro-batches per round) before its first backward.

Zero-bubble schedules (Qi et al. 2023, "Zero Bubble Pipeline Parallelism") split a
rank's backward per micro-batch into the input gradient ``I`` and the weight gradient
``W`` (:func:`weight_grad_s`; ``F`` the forward) and run ``W`` where 1F1B idles. The
fill-and-drain part of each rank (:func:`zero_bubble_fill_s`) replaces its whole work
in the bubble term (each rank's own, :func:`zero_bubble_rank_fill_s`): with equal
ranks, ``interleaved-zb`` (torch 2.13's ``ScheduleInterleavedZeroBubble``, ZB-H1's
order over ``v`` virtual stages) takes
``m (F + I + W) + (p - 1) max(F + I - W, F, I) / v``: ZB-H1's bubble
``(p - 1)(T_F + T_B - T_W)`` of the paper (section 3.1) divided by ``v`` as interleaving
divides 1F1B's; ``zbv`` (torch's ``ScheduleZBVZeroBubble``, the paper's ZB-V, section
6) takes ``m (F + I + W) + (p - 1)(max(F, I) - min(W, I / 2)) - min(W, max(F - I, 0)) / 2``
for ``W <= min(F, I)``, the closed form of torch's ZB-V order with per-stage times
``F/2, I/2, W/2`` (derived from that order; the paper gives only the ``F = I = W``
case). Both are checked against a simulation of torch's own action lists
(``tests/planner/test_zero_bubble_cost.py``). ``dualpipev`` (torch's ``ScheduleDualPipeV``,
DeepSeek-V3's DualPipe folded into the same V) takes, for ``m >= 2p`` and ``W <= min(F, I)``,
``m (F + I + W) + max((p - 1) max(F + I - W, 2 (F - W)), (p - 1)(2 I - W) - F) / 2``:
the longest path through torch's order with per-stage times ``F/2, I/2, W/2``: the
paths of excess ``((p - 1 + j) F + (k - j) I - (j + k) W) / 2`` (``0 <= j, k <= p - 1``)
and ``((p - 1)(2 I - W) - F) / 2``, enumerated on that order (derived here, not in the
report). Its steady state pairs a forward with a full backward, which torch 2.13 runs
one after the other: nothing of DualPipe's overlap of one micro-batch's communication
with another's compute is there to price. The deferred ``W`` keeps a micro-batch's
activations until it runs (torch's ``stage_backward_input`` retains the graph), so
their in-flight micro-batches are counted from each forward to its ``W``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from autopar.plan import ParallelConfig
from autopar.vocab import Schedule


def schedule_problem(schedule: Schedule, pp: int, virtual_stages: int, num_microbatches: int) -> str | None:
    """Why ``torch.distributed.pipelining`` would refuse this combination, or None."""
    if pp == 1:
        return None
    m = num_microbatches
    if schedule is Schedule.ONE_F_ONE_B and m < pp:
        return f"1f1b needs at least as many micro-batches as stages (m={m} < pp={pp})"
    if schedule is Schedule.DUALPIPEV and m < 2 * pp:
        return f"dualpipev needs at least as many micro-batches as stages (m={m} < 2 * pp={2 * pp})"
    if schedule in (Schedule.INTERLEAVED_1F1B, Schedule.INTERLEAVED_ZB):
        rounds = max(1, m // pp)
        if m % rounds:
            return f"{schedule.value} needs m divisible by its rounds (m={m}, rounds={rounds})"
    return None


def inflight_microbatches(
    schedule: Schedule, pp: int, virtual_stages: int, num_microbatches: int, pipeline_rank: int
) -> float:
    """Micro-batches whose activations rank ``pipeline_rank`` holds at its peak, in units
    of "all of the rank's stages for one micro-batch": non-increasing in the rank, but
    non-decreasing for ``zbv`` (its last rank holds the V's turn) and equal on every rank
    for ``dualpipev`` (``m >= 2p``), so the least and the most loaded ranks are the first
    and the last."""
    m = num_microbatches
    if pp == 1:
        return 1.0
    if schedule is Schedule.GPIPE:
        return float(m)
    if schedule is Schedule.ONE_F_ONE_B:
        return float(min(m, pp - pipeline_rank))
    v = virtual_stages
    if schedule is Schedule.INTERLEAVED_ZB:  # every chunk of min(p, mpr) micro-batches before its first W,
        # and the first v - 1 chunks of a round's micro-batches beyond p
        per_round = m // max(1, m // pp)
        return min(pp, per_round) + (v - 1) * max(per_round - pp, 0) / v
    if schedule is Schedule.ZBV:  # forwards of 2 chunks run ahead of their W by m + 1 + r at most
        return min(2 * pp, m + 1 + pipeline_rank, 2 * m) / 2
    if schedule is Schedule.DUALPIPEV:  # every rank: 2p chunks' forwards and the first steady-state one
        return (2 * pp + 1) / 2
    return sum(interleaved_chunk_counts(pp, v, m, pipeline_rank)) / v


@functools.cache  # pure, and asked for every rank of every zero-bubble candidate
def weight_wait_moment(
    schedule: Schedule, pp: int, virtual_stages: int, num_microbatches: int, rank: int
) -> tuple[int, int] | None:
    """Where a zero-bubble schedule's rank ``rank`` holds the most: chunk micro-batches
    held from forward to weight gradient and, of them, those past their input gradient
    awaiting ``W``, each keeping its weighted ops' output gradients too
    (``UnitCost.wait_bytes``). Counted on torch 2.13's orders
    (``tests/planner/test_zero_bubble_cost.py``): ``interleaved-zb``
    ``(H, min(r + 1, v m))``, its last stage's micro-batches awaiting; ``zbv`` ``(H, 1)``;
    ``dualpipev`` ``(2p + 1, 0)``. A V's drain runs input gradients ahead of weight
    gradients (ZB-V's last rank reaches ``(2p - 1, 2p - 1)`` from ``m = 2p - 1``), but
    its measured dry runs peak no higher than this moment predicts
    (``tests/runtime/test_weight_wait_memory.py``). None for other schedules."""
    p, v, m, r = pp, virtual_stages, num_microbatches, rank
    if p == 1 or not schedule.zero_bubble:
        return None
    held = round(inflight_microbatches(schedule, p, v, m, r) * v)
    if schedule is Schedule.INTERLEAVED_ZB:
        return held, min(r + 1, v * m)
    return held, 0 if schedule is Schedule.DUALPIPEV else 1


@functools.cache  # pure, and asked for every option of every zero-bubble candidate
def most_awaiting(schedule: Schedule, pp: int, virtual_stages: int, num_microbatches: int) -> int:
    """The most chunk micro-batches awaiting their weight gradient on any rank where it
    holds the most (:func:`weight_wait_moment`; 0 for other schedules)."""
    moments = (weight_wait_moment(schedule, pp, virtual_stages, num_microbatches, r) for r in range(pp))
    return max((moment[1] for moment in moments if moment), default=0)


@functools.cache  # pure, and asked for every stage of every candidate
def stage_inflight_microbatches(
    schedule: Schedule, pp: int, virtual_stages: int, num_microbatches: int, stage_index: int
) -> float:
    """Micro-batches of stage ``stage_index`` whose activations its rank holds at its
    peak. A V (``zbv``, ``dualpipev``) holds its two stages unevenly: rank ``r``'s first
    stage ``min(2p - r, m)``, its second ``min(r + 1, m)`` (the most of each at any of
    the rank's peaks, counted on torch's orders: exact for ``dualpipev``, at most one
    chunk of the lighter stage over for ``zbv``). Interleaved 1F1B runs its warm-up
    forwards chunk by chunk, ``mpr`` micro-batches each, so at the rank's peak its first
    chunks hold more than its last (:func:`interleaved_chunk_counts`). Every other
    schedule holds all of a rank's stages alike (:func:`inflight_microbatches`)."""
    rank = schedule.rank_of_stage(stage_index, pp)
    if pp > 1 and schedule.v_shape:
        return float(min(2 * pp - rank if stage_index < pp else rank + 1, num_microbatches))
    if pp > 1 and schedule is Schedule.INTERLEAVED_1F1B:
        return float(interleaved_chunk_counts(pp, virtual_stages, num_microbatches, rank)[stage_index // pp])
    return inflight_microbatches(schedule, pp, virtual_stages, num_microbatches, rank)


@functools.cache  # pure, and asked for every stage of every candidate
def interleaved_chunk_counts(pp: int, virtual_stages: int, num_microbatches: int, rank: int) -> tuple[int, ...]:
    """Micro-batches each of rank ``rank``'s chunks holds when its activations peak under
    torch 2.13's ``ScheduleInterleaved1F1B``: the first ``N`` forwards (the
    ``(v - 1) mpr + 2 (p - 1 - r)`` of the warm-up, ``_get_warmup_ops``, and the first of
    the steady state, at most ``m v``) go to chunk ``(i // mpr) % v``, and no backward has
    run. Their sum over ``v`` is the rank's count (:func:`inflight_microbatches`); checked
    against torch's own order (``tests/planner/test_zero_bubble_cost.py``).

    They take two values at most, as a V's stages do (the search's knapsack weighs a kind
    of unit two ways at most, :mod:`autopar.search.split_weights`): the ``2 (p - 1 - r) + 1``
    forwards beyond the first ``v - 1`` chunks' ``mpr`` each are fewer than ``2 mpr``
    where ``m >= p`` (``mpr >= p``), and where ``m < p`` (``mpr = m``) either fewer than
    ``mpr`` or enough to fill every chunk with all ``m``."""
    m, v = num_microbatches, virtual_stages
    per_round, warmup = _interleaved_warmup(pp, v, m, rank)
    n = min(warmup + 1, m * v)
    cycles, rest = divmod(n, per_round * v)
    return tuple(cycles * per_round + min(max(rest - k * per_round, 0), per_round) for k in range(v))


def _interleaved_warmup(pp: int, virtual_stages: int, num_microbatches: int, rank: int) -> tuple[int, int]:
    """Interleaved 1F1B's micro-batches per round (``mpr``) and rank ``rank``'s warm-up
    forwards before its first backward, ``(v - 1) mpr + 2 (p - 1 - r)`` at most ``m v``
    (torch 2.13's ``_get_warmup_ops``)."""
    m = num_microbatches
    per_round = m // max(1, m // pp)
    return per_round, min((virtual_stages - 1) * per_round + 2 * (pp - 1 - rank), m * virtual_stages)


@functools.lru_cache(maxsize=1024)
def interleaved_order(pp: int, virtual_stages: int, num_microbatches: int, rank: int) -> tuple[tuple[bool, int], ...]:
    """Rank ``rank``'s compute actions under torch 2.13's ``ScheduleInterleaved1F1B``, as
    ``(is_forward, chunk)``: the warm-up's forwards (:func:`interleaved_chunk_counts`),
    then a forward and a backward in turn, then the remaining backwards. Forward ``i``
    runs chunk ``(i // mpr) % v``, backward ``j`` chunk ``v - 1 - (j // mpr) % v``, each
    chunk's micro-batches in order; checked against torch's own order
    (``tests/planner/test_zero_bubble_cost.py``)."""
    m, v = num_microbatches, virtual_stages
    total = m * v
    per_round, warmup = _interleaved_warmup(pp, v, m, rank)
    forward = [(True, (i // per_round) % v) for i in range(total)]
    backward = [(False, v - 1 - (j // per_round) % v) for j in range(total)]
    steady = total - warmup
    paired = [a for i in range(steady) for a in (forward[warmup + i], backward[i])]
    return tuple(forward[:warmup] + paired + backward[steady:])


@functools.lru_cache(maxsize=1024)
def gathered_chunks(
    order: tuple[tuple[bool, int], ...], active: int, *, lazy: bool = False
) -> tuple[tuple[int, ...], ...]:
    """The chunks whose parameters are gathered while each action of ``order`` runs: the
    next ``active`` distinct chunks from it on, as torch 2.13's ``_add_unshard_reshard``
    (``max_active_stages``) lowers a multi-stage schedule for FSDP2. With ``lazy``
    (``replicate``, whose shard group is one rank: its ``unshard`` gathers nothing and
    the copy is made when the chunk next computes), only those of them that have
    computed since their ``UNSHARD``."""
    ahead: tuple[int, ...] = ()
    nexts: list[tuple[int, ...]] = []
    for _, chunk in reversed(order):
        ahead = (chunk, *(c for c in ahead if c != chunk))
        nexts.append(ahead[:active])
    nexts.reverse()
    if not lazy:
        return tuple(nexts)
    out, made = [], ()
    for (_, chunk), now in zip(order, nexts):
        made = tuple(c for c in now if c in made or c == chunk)
        out.append(made)
    return tuple(out)


def least_stage_inflight(schedule: Schedule, pp: int, virtual_stages: int, num_microbatches: int, rank: int) -> float:
    """The fewest micro-batches any stage of ``rank`` holds at its peak
    (:func:`stage_inflight_microbatches`): what a bound on the rank's activations that
    does not know how they split between its stages may count."""
    if pp == 1 or not schedule.multi_stage:  # one stage per rank
        return inflight_microbatches(schedule, pp, virtual_stages, num_microbatches, rank)
    stages = schedule.stages_of_rank(rank, pp, pp * virtual_stages)
    return min(stage_inflight_microbatches(schedule, pp, virtual_stages, num_microbatches, s) for s in stages)


def stage_buffer_bytes(
    *,
    receives_input: bool,
    sends_output: bool,
    input_bytes: float,
    output_bytes: float,
    inflight: float,
) -> float:
    """Bytes a pipeline stage holds beyond its units' activations, under autopar's
    runtime (``torch.distributed.pipelining`` 2.13 with receive buffers allocated when a
    receive is posted and dropped once consumed, ``autopar.runtime.pipeline.BoundedStage``):

    - the output of each micro-batch in flight, kept for its backward (``fwd_cache``;
      a block's output is saved by none of its own ops), and the gradient of one output
      received for the backward in progress;
    - the gradient of one input on its way back (a stage after the first): the
      schedule keeps its send until the next forward has run.

    The input of each micro-batch in flight is its first unit's saved input, already
    counted with the activations. ``input_bytes``/``output_bytes`` per micro-batch
    (measured against: ``docs/cost-model.md``)."""
    held = input_bytes if receives_input else 0.0
    return held + ((inflight + 1) * output_bytes if sends_output else 0.0)


def weight_grad_s(fwd_compute_s: float, attn_fwd_s: float) -> float:
    """The weight-gradient part ``W`` of a unit's backward: each weighted matmul's
    backward is two matmuls of its forward's size, one for the input's gradient and one
    for the weight's (Qi et al. 2023, section 2: ``T_W`` about ``T_F``), so ``W`` is the
    forward's compute less the attention core's, which has no weights."""
    return max(fwd_compute_s - attn_fwd_s, 0.0)


def zero_bubble_fill_s(schedule: Schedule, forward_s: float, input_grad_s: float, weight_grad_s: float) -> float:
    """A rank's share of a zero-bubble pipeline's fill and drain, per micro-batch of
    work ``F + I + W`` (module docstring): ``max(F + I - W, F, I)`` under
    ``interleaved-zb`` (divided by ``v`` in the step), ``max(F, I) - min(W, I / 2)``
    under ``zbv``. ``W`` beyond ``min(F, I)`` is not deferred (the ``zbv`` form holds up
    to it; units have ``W <= F`` by :func:`weight_grad_s`, and ``I`` includes the
    recomputation)."""
    f, i = forward_s, input_grad_s
    w = min(weight_grad_s, f, i)
    if schedule is Schedule.ZBV:
        return max(f, i) - min(w, i / 2)
    return max(f + i - w, f, i)


def pipeline_time_s(
    rank_work_s: list[float],
    num_microbatches: int,
    virtual_stages: int,
    *,
    schedule: Schedule = Schedule.ONE_F_ONE_B,
    rank_forward_s: list[float] | None = None,
    rank_weight_grad_s: list[float] | None = None,
) -> float:
    """Step time of the pipeline part (see the module docstring).

    A zero-bubble ``schedule`` needs each rank's forward and weight-gradient time per
    micro-batch (``rank_forward_s``, ``rank_weight_grad_s``; the input gradient is the
    rest of its work): each rank then takes its ``m`` micro-batches and ``p - 1`` of its
    own fills (:func:`zero_bubble_rank_fill_s`), and the step is the longest of those.
    With equal ranks this is the form the simulation checks; with unequal ones it grows
    with every rank's forward and input gradient, so that a rank's fastest options stay
    the pipeline's best. Without the split it gives a lower bound
    (:func:`zero_bubble_floor_s`)."""
    m, top = num_microbatches, max(rank_work_s)
    if not schedule.zero_bubble:
        return m * top + (sum(rank_work_s) - top) / virtual_stages
    p = len(rank_work_s)
    if rank_forward_s is None or rank_weight_grad_s is None:
        return max(m * w + zero_bubble_floor_s(schedule, w, p, virtual_stages) for w in rank_work_s)
    return max(zero_bubble_timelines_s(schedule, rank_work_s, rank_forward_s, rank_weight_grad_s, m, virtual_stages))


def zero_bubble_timelines_s(
    schedule: Schedule,
    rank_work_s: list[float],
    rank_forward_s: list[float],
    rank_weight_grad_s: list[float],
    num_microbatches: int,
    virtual_stages: int,
) -> list[float]:
    """Each rank's own timeline under a zero-bubble schedule: its ``m`` micro-batches of
    work and its fill and drain (:func:`zero_bubble_rank_fill_s`); the step is the longest."""
    p = len(rank_work_s)
    return [
        num_microbatches * work + zero_bubble_rank_fill_s(schedule, p, virtual_stages, f, work - f - w, w)
        for work, f, w in zip(rank_work_s, rank_forward_s, rank_weight_grad_s)
    ]


@dataclass(frozen=True)
class RankSlack:
    """Where one pipeline rank idles in a step of the pipeline's makespan, and how much of
    its own work a data-parallel collective overlaps (:func:`rank_slack_s`): ``lead_s``
    before its first forward, ``trail_s`` after its last backward, and ``own_share``, the
    share of its forward and backward per micro-batch that the step model charges for
    one more second of them on a rank off the critical path."""

    lead_s: float = 0.0
    trail_s: float = 0.0
    own_share: float = 1.0


def rank_slack_s(
    rank_work_s: list[float],
    rank_forward_s: list[float],
    rank_weight_grad_s: list[float],
    num_microbatches: int,
    virtual_stages: int,
    *,
    schedule: Schedule,
    step_s: float,
) -> list[RankSlack]:
    """Each rank's idle time around its work in a pipeline step of ``step_s``
    (:func:`pipeline_time_s`), in which its data-parallel collectives run as well as they
    do under compute: the parameter gather before its first forward and the gradient
    reduction after its last backward.

    - GPipe and 1F1B: rank ``r`` waits for the first micro-batch's forward on the ranks
      before it, ``sum_{r' < r} F_r'``, and after its last backward for theirs,
      ``sum_{r' < r} B_r'`` (the drain passes the gradient from the last rank to the first).
    - Interleaved 1F1B: the same over one chunk of each rank (``/ v``); a second more of an
      off-critical rank's work costs the step ``1 / v`` of it (the module's closed form), and
      so the collectives overlap ``1 / v`` of the rank's own work (``own_share``): the last
      chunk's.
    - Zero-bubble schedules: each rank runs its own timeline (:func:`zero_bubble_timelines_s`),
      and idles what separates it from the step's, before or after.

    Each window grows with a rank's work by no more than the step does, so a slower option
    never prices a faster step by hiding more of its rank's communication."""
    p, m, v = len(rank_work_s), num_microbatches, virtual_stages
    if p == 1:
        return [RankSlack()]
    if schedule.zero_bubble:
        own = zero_bubble_timelines_s(schedule, rank_work_s, rank_forward_s, rank_weight_grad_s, m, v)
        return [RankSlack(lead_s=step_s - o, trail_s=step_s - o) for o in own]
    backward = [w - f for w, f in zip(rank_work_s, rank_forward_s)]
    return [
        RankSlack(lead_s=sum(rank_forward_s[:r]) / v, trail_s=sum(backward[:r]) / v, own_share=1 / v) for r in range(p)
    ]


def zero_bubble_rank_fill_s(
    schedule: Schedule, pp: int, virtual_stages: int, forward_s: float, input_grad_s: float, weight_grad_s: float
) -> float:
    """The fill and drain of one rank of a zero-bubble pipeline of ``pp`` ranks: ``(p - 1)
    max(F + I - W, F, I) / v`` under ``interleaved-zb``, ``(p - 1)(max(F, I) - min(W, I/2))
    - min(W, max(F - I, 0)) / 2`` under ``zbv`` (module docstring; :func:`zero_bubble_fill_s`),
    ``max((p - 1) max(F + I - W, 2 (F - W)), (p - 1)(2 I - W) - F) / 2`` under ``dualpipev``."""
    if schedule is Schedule.DUALPIPEV:
        f, i, q = forward_s, input_grad_s, pp - 1
        w = min(weight_grad_s, f, i)
        return max(q * max(f + i - w, 2 * (f - w)), q * (2 * i - w) - f, 0.0) / 2
    fill = (pp - 1) * zero_bubble_fill_s(schedule, forward_s, input_grad_s, weight_grad_s)
    if schedule is Schedule.ZBV:
        w = min(weight_grad_s, forward_s, input_grad_s)
        return max(fill - min(w, max(forward_s - input_grad_s, 0.0)) / 2, 0.0)
    return fill / virtual_stages


def zero_bubble_floor_s(schedule: Schedule, work_s: float, pp: int, virtual_stages: int) -> float:
    """The least :func:`zero_bubble_rank_fill_s` of a rank whose work ``F + I + W`` is
    ``work_s``: ``W <= F`` (:func:`weight_grad_s`) makes the work at most ``3 max(F, I)``,
    so the fill is at least ``(p - 1)/3`` of it under ``interleaved-zb`` (over ``v``), and
    under ``zbv`` at least ``(p - 1)/6`` of it less ``W / 2``, at most a quarter of it;
    under ``dualpipev`` at least ``(p - 1)/6`` of it (``F + I - W >= max(F, I)``).
    Non-decreasing in the work, as a search bound must be."""
    if schedule is Schedule.DUALPIPEV:
        return (pp - 1) * work_s / 6
    if schedule is Schedule.ZBV:
        return max((pp - 1) * work_s / 6 - work_s / 4, 0.0)
    return (pp - 1) * work_s / (3 * virtual_stages)


def pipeline_lower_bound_s(work_s: float, config: ParallelConfig) -> float:
    """The least :func:`pipeline_time_s` of ``work_s`` seconds per micro-batch spread
    over ``config``'s pipeline: every rank equally loaded,
    ``(m - 1 + p) / p * W`` with one stage per rank, ``(m + (p - 1) / v) W / p`` with
    ``v`` (the maximum is never below the mean), and :func:`zero_bubble_floor_s` of the
    even spread under a zero-bubble schedule (lowest there, as for the others)."""
    pp, m, v = config.pp, config.num_microbatches, config.virtual_stages
    if config.schedule.zero_bubble and pp > 1:
        return pipeline_time_s([work_s / pp] * pp, m, v, schedule=config.schedule)
    return (m - 1 + pp) / pp * work_s if v == 1 else (m + (pp - 1) / v) * work_s / pp
