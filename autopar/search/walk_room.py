"""The room an interleaved 1F1B rank's walk leaves below its bound, given back to its
options.

The search bounds a pipeline rank's memory by every in-flight micro-batch's activations
beside every gradient (:class:`autopar.cost.peak.Footprint`, a knapsack's one linear
constraint). Under interleaved 1F1B the rank's peak, followed action by action in torch's
order (:func:`autopar.cost.peak_walks.interleaved_peak`), is often well below it: a chunk's
gradients exist only from its first backward, and where a rank runs most of its forwards
before its first backward, its activations peak before most gradients exist (Llama 3
405B at 128K tokens on 16,384 H100: 64.5 GiB walked where the bound counts 75.6).

For every configuration the search solved and fits, each rank is solved again with the
room its walk leaves as an allowance beyond the budget, and the allowance bisected
where the new options' walk does not fit (:data:`ROUNDS`): the knapsack may keep more
activations (less recomputation). A rank keeps the options of the largest allowance
whose walk fits, its first ones at worst, so the result never fits worse than the
search's, and it replaces the search's only where it is faster.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from autopar.cost.peak import rank_memory
from autopar.cost.stage import PricedStage, on_rank
from autopar.cost.step import timing
from autopar.plan import ParallelConfig
from autopar.search.solve import ConfigSolver, Outcome
from autopar.vocab import Recompute, Schedule

ROUNDS = 5
"""Re-solves of the ranks: the whole room first, then a bisection of each rank's
allowance between what fits by its walk and what does not."""


def with_walk_room(
    solver: ConfigSolver, outcome: Outcome, modes: tuple[Recompute, ...], beat_s: float = math.inf
) -> Outcome:
    """``outcome`` with each rank re-solved in the room its walk leaves (module
    docstring), where that is faster; unchanged for anything but a fitting interleaved
    1F1B configuration, and where even the whole room cannot bring its step under
    ``beat_s`` (the fastest the caller holds): the first round gives every rank the most
    room any round gives it, so no later round's options are faster."""
    config = outcome.config
    if not outcome.fits or config.pp == 1 or config.schedule is not Schedule.INTERLEAVED_1F1B:
        return outcome
    if all(  # every unit at its fastest option: no room makes the step shorter
        option.time_s <= min(o.time_s for o in solver.options(unit, config, modes))
        for stage in outcome.stages
        for unit, option in zip(stage.units, stage.options)
    ):
        return outcome
    budget = solver.budget_bytes
    fits = [0.0] * config.pp  # allowances known to fit (none: the search's own options)
    walked = [walked_bytes(solver, config, outcome.stages, r) for r in range(config.pp)]  # of the kept options
    over = [max(budget - w, 0.0) for w in walked]
    if max(over) == 0.0:
        return outcome
    best = list(outcome.stages)
    for k in range(ROUNDS):
        trial = over if k == 0 else [(a + b) / 2 for a, b in zip(fits, over)]
        solved = solver.interleaved(config, modes, allowances=trial)
        if solved is None:
            break
        stages = tuple(stage for stage, _ in solved)
        if k == 0 and timing(solver.model, config, stages).step_s >= beat_s:
            return outcome
        for r in range(config.pp):
            if trial[r] <= fits[r]:
                continue
            peak_r = walked_bytes(solver, config, stages, r)
            if peak_r <= budget:
                fits[r], walked[r] = trial[r], peak_r
                for c in config.stages_of_rank(r):
                    best[c] = stages[c]
            else:
                over[r] = trial[r]
    step_s = timing(solver.model, config, best).step_s
    if step_s >= outcome.step_time_s:
        return outcome
    peak = max(walked)
    reserved = solver.model.cluster.device.memory.reserved_bytes
    return replace(outcome, step_time_s=step_s, stages=tuple(best), min_memory_bytes=peak + reserved)


def walked_bytes(solver: ConfigSolver, config: ParallelConfig, stages: Sequence[PricedStage], rank: int) -> float:
    """What pipeline rank ``rank`` of ``config`` allocates at its peak (its prediction
    less the device's reserve), ``stages`` the configuration's, in chunk order."""
    mine = on_rank(config, stages, rank)
    memory = rank_memory(solver.model, mine[0], config, mine)
    return memory.total_bytes - memory.reserve_bytes
