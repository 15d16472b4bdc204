"""Which pipeline schedules the search tries for a pipeline degree, and why a pinned one
cannot run: the schedules and their stages per rank, the model's split over them, and the
combinations autopar's runtime refuses."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from autopar.errors import ConfigError
from autopar.graph.layer_graph import LayerGraph
from autopar.plan import ParallelConfig
from autopar.search.split import even_bounds_of
from autopar.vocab import SPLIT_BACKWARD_MODES, Recompute, Schedule

MAX_VIRTUAL_STAGES = 8


def check_schedule_constraints(c: Mapping[str, Any], graph: LayerGraph) -> None:
    """A pinned zero-bubble schedule the runtime would refuse, said at once (unpinned, the
    search leaves these out): ZeRO-3 under a split backward, a V (``zbv``, ``dualpipev``)
    for tied weights."""
    schedule = c.get("schedule")
    if schedule is not None and schedule.zero_bubble and c.get("zero_stage") == 3:
        raise ConfigError(
            f"schedule={c['schedule'].value!r} with zero_stage=3 is not offered: autopar's runtime refuses it (FSDP2 "
            f"resharding after forward under the split backward trained to wrong losses); use zero_stage <= 2."
        )
    if schedule is not None and schedule.v_shape and graph.shared:
        tie = graph.shared[0]
        raise ConfigError(
            f"schedule={schedule.value!r} cannot run this model: {tie.first_module!r} and {tie.second_module!r} share "
            f"a weight, and its stages in a V may put both on one pipeline rank in two stages, which the runtime "
            f"refuses; use schedule='interleaved-zb' or untie the weights."
        )


def offered_schedules(pp: int, graph: LayerGraph, c: Mapping[str, Any]) -> Iterator[tuple[Schedule, int]]:
    """The (schedule, stages per rank) pairs a pipeline of ``pp`` ranks is tried with under
    the constraints ``c``: one stage per rank for 1F1B and GPipe, 2 to
    :data:`MAX_VIRTUAL_STAGES` for the interleaved ones (any count given), 2 for a V (left
    out for tied weights); the zero-bubble ones left out where compiled blocks or a
    recomputation they cannot run is fixed (:data:`autopar.vocab.SPLIT_BACKWARD_EAGER`,
    :data:`autopar.vocab.SPLIT_BACKWARD_RECOMPUTE`). Whether the model splits over them is
    :func:`split_problem`'s."""
    if pp == 1:  # stages per rank, or a pinned schedule other than 1F1B, need a pipeline
        if c.get("virtual_stages", 1) == 1 and c.get("schedule", Schedule.ONE_F_ONE_B) is Schedule.ONE_F_ONE_B:
            yield Schedule.ONE_F_ONE_B, 1
        return
    wanted = c.get("schedule")
    # a split backward runs eager blocks that recompute nothing or the attention cores alone
    splits = not c.get("compile") and c.get("recompute", Recompute.NONE) in SPLIT_BACKWARD_MODES
    for schedule in (Schedule.ONE_F_ONE_B, Schedule.GPIPE):
        if wanted in (None, schedule) and c.get("virtual_stages", 1) == 1:
            yield schedule, 1
    for schedule in (Schedule.INTERLEAVED_1F1B, Schedule.INTERLEAVED_ZB, Schedule.ZBV, Schedule.DUALPIPEV):
        if schedule.zero_bubble and not splits:
            continue
        if wanted not in (None, schedule) or (schedule.v_shape and graph.shared):
            continue  # tied weights could land in two stages of one rank (the V)
        top = 2 if schedule.v_shape else MAX_VIRTUAL_STAGES
        if "virtual_stages" not in c:
            yield from ((schedule, v) for v in range(2, top + 1))
        elif c["virtual_stages"] == 2 or (c["virtual_stages"] > 2 and not schedule.v_shape):
            yield schedule, c["virtual_stages"]  # a count given is tried beyond the search's own


def allowed_modes(config: ParallelConfig, modes: tuple[Recompute, ...]) -> tuple[Recompute, ...]:
    """Of ``modes``, those a unit of ``config`` may take: under a split backward (a
    zero-bubble schedule on a pipeline) only ``none`` and ``selective``
    (:data:`autopar.vocab.SPLIT_BACKWARD_RECOMPUTE`), ``selective`` where neither was
    asked (a configuration sized with full recomputation: the least memory it can take)."""
    if config.pp == 1 or not config.schedule.zero_bubble:
        return modes
    return tuple(m for m in modes if m in SPLIT_BACKWARD_MODES) or (Recompute.SELECTIVE,)


def split_problem(graph: LayerGraph, schedule: Schedule, pp: int, virtual_stages: int) -> str | None:
    """Why ``schedule`` cannot split the model over ``pp x virtual_stages`` stages, or None.

    Several stages per rank take a fixed even split (:func:`autopar.search.split.even_bounds`),
    down to one unit per stage with the embedding and the loss alone at the ends (Llama 3
    405B's split)."""
    if virtual_stages == 1:
        return None
    chunks = pp * virtual_stages
    if even_bounds_of(graph.units, chunks, exact=True) is not None:
        return None
    units = len(graph.units)
    blocks = sum(1 for u in graph.units if u.is_block)
    top = 2 if schedule.v_shape else MAX_VIRTUAL_STAGES
    fits = [v for v in range(2, top + 1) if even_bounds_of(graph.units, pp * v, exact=True) is not None]
    hint = f"virtual_stages={fits} split at pp={pp}" if fits else f"no virtual_stages up to {top} splits at pp={pp}"
    return (
        f"{schedule.value} over pp x virtual_stages = {chunks} stages needs its {blocks} blocks, or its "
        f"{units} units with the embedding and the loss counted as a layer each, to split evenly ({hint})"
    )
