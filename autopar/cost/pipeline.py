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
"""

from __future__ import annotations

from autopar.plan import ParallelConfig
from autopar.vocab import Schedule


def schedule_problem(schedule: Schedule, pp: int, virtual_stages: int, num_microbatches: int) -> str | None:
    """Why ``torch.distributed.pipelining`` would refuse this combination, or None."""
    if pp == 1:
        return None
    m = num_microbatches
    if schedule is Schedule.ONE_F_ONE_B and m < pp:
        return f"1f1b needs at least as many micro-batches as stages (m={m} < pp={pp})"
    if schedule is Schedule.INTERLEAVED_1F1B:
        rounds = max(1, m // pp)
        if m % rounds:
            return f"interleaved-1f1b needs m divisible by its rounds (m={m}, rounds={rounds})"
    return None


def inflight_microbatches(
    schedule: Schedule, pp: int, virtual_stages: int, num_microbatches: int, pipeline_rank: int
) -> float:
    """Micro-batches whose activations rank ``pipeline_rank`` holds at its peak, in units
    of "all of the rank's stages for one micro-batch" (non-increasing in the rank)."""
    m = num_microbatches
    if pp == 1:
        return 1.0
    if schedule is Schedule.GPIPE:
        return float(m)
    if schedule is Schedule.ONE_F_ONE_B:
        return float(min(m, pp - pipeline_rank))
    v = virtual_stages
    rounds = max(1, m // pp)
    per_round = m // rounds
    warmup = min((v - 1) * per_round + 2 * (pp - 1 - pipeline_rank), m * v)
    return min(warmup + 1, m * v) / v


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


def pipeline_time_s(rank_work_s: list[float], num_microbatches: int, virtual_stages: int) -> float:
    """Step time of the pipeline part (see the module docstring)."""
    top = max(rank_work_s)
    return num_microbatches * top + (sum(rank_work_s) - top) / virtual_stages


def pipeline_lower_bound_s(work_s: float, config: ParallelConfig) -> float:
    """The least :func:`pipeline_time_s` of ``work_s`` seconds per micro-batch spread
    over ``config``'s pipeline: every rank equally loaded,
    ``(m - 1 + p) / p * W`` with one stage per rank, ``(m + (p - 1) / v) W / p`` with
    ``v`` (the maximum is never below the mean)."""
    pp, m, v = config.pp, config.num_microbatches, config.virtual_stages
    return (m - 1 + pp) / pp * work_s if v == 1 else (m + (pp - 1) / v) * work_s / pp
