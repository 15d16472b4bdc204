"""The scan: candidates solved in increasing order of their time lower bound.

The scan stops when the bound of the next candidate is no better than the ``top``-th
best exact step time found, so the optimum and the runners-up are exact for the cost
model while most of the space is never solved; and, where the space has other mixes of
degrees than the optimum's, when it is no better than the fastest of the next
:data:`OTHER_DEGREES` of them (within as many solves again, 64 at least). Candidates whose memory floor exceeds a
device are ruled out before any bound is taken; a candidate about to be solved first
gets a tighter bound where one is cheap (:meth:`TimeBound.refined`) and goes back in
line if that is larger. A candidate keeping the shards of its sequence-parallel gathers
is not solved where its twin holding them fits with every unit keeping its activations:
each of its options is one of the twin's with a re-gather added, so it is never faster.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from autopar.cost.price import Decided, UnitChoice, price
from autopar.errors import DeviceCountError
from autopar.graph.layer_graph import LayerGraph
from autopar.plan import ParallelConfig
from autopar.search.bounds import TimeBound
from autopar.search.experts import model_experts
from autopar.search.integers import divisors
from autopar.search.rejections import Rejection
from autopar.search.solve import ConfigSolver, Outcome
from autopar.search.space import config_shard_sizes, enumerate_space, memory_floor, shard_siblings
from autopar.search.walk_room import with_walk_room
from autopar.vocab import DType, Recompute

ALL_MODES = (Recompute.NONE, Recompute.SELECTIVE, Recompute.OP, Recompute.FULL)
MEGATRON_MODES = (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL)
"""The modes a unit may take in a plan priced for Megatron-LM's kernels: Megatron-LM has
no per-operator selective recomputation (torchtitan's ``op``)."""


@dataclass(frozen=True, kw_only=True)
class SearchResult:
    """Everything the search found, before it becomes a Plan.

    Attributes:
        best: the fastest configuration that fits (or, when none fits, the one that
            needs the least memory).
        runners_up: the next fastest that fit, in order.
        infeasible: the candidates found not to fit.
        rejected: regions of the space ruled out before costing, and why.
        evaluated: candidates solved.
        considered: candidates enumerated.
        region_sizes: how many candidates each (tp, pp) region has (a region is out of
            memory when all of them are).
        contrasts: the best configuration changed in its data-parallel sharding alone
            (:func:`sharding_contrasts`), priced, to show what HSDP is worth; and with
            its blocks compiled, or its linear layers in FP8, the other way
            (:func:`option_contrasts`).
        other_degrees: the fastest configuration of each of the next
            :data:`OTHER_DEGREES` mixes of degrees (:func:`degrees_of`) other than the
            best's, in order: what runners-up of the best's own degrees do not show.
        other_degrees_frontier_s: the time bound where the scan stopped its hunt for
            them (infinite where nothing was left): those no slower are the fastest of
            their mixes, and no mix left out beats it; a slower one is the fastest found.
    """

    best: Outcome
    runners_up: tuple[Outcome, ...]
    infeasible: tuple[Outcome, ...]
    rejected: tuple[Rejection, ...]
    evaluated: int
    considered: int
    region_sizes: Mapping[tuple[int, int], int] = field(default_factory=dict)
    contrasts: tuple[Outcome, ...] = ()
    other_degrees: tuple[Outcome, ...] = ()
    other_degrees_frontier_s: float = math.inf


OTHER_DEGREES = 3
"""How many mixes of degrees other than the best's a search keeps the fastest of."""

OTHER_DEGREES_SOLVES = 64
"""The fewest solves a search spends on the other mixes of degrees before it keeps what
it found (as many as it spent on the best and its runners-up, where that is more)."""


def degrees_of(config: ParallelConfig) -> tuple[int, int, int, int, int]:
    """A configuration's mix of degrees: ``(dp, cp, tp, pp, ep)``."""
    return (config.dp, config.cp, config.tp, config.pp, config.ep)


def other_degrees(fitting: list[Outcome], shown: int, count: int) -> list[Outcome]:
    """Of ``fitting`` (fastest first), the fastest of each mix of degrees that its first
    ``shown`` (the best and its runners-up) do not have, at most ``count``."""
    seen = {degrees_of(o.config) for o in fitting[:shown]}
    out: list[Outcome] = []
    for o in fitting[shown:]:
        if len(out) == count:
            break
        if degrees_of(o.config) not in seen:
            seen.add(degrees_of(o.config))
            out.append(o)
    return out


def _constraints_text(fixed: Mapping[str, Any]) -> str:
    """``constraints tp=2, schedule=1f1b`` as a person writes them, or ``no constraints``."""
    if not fixed:
        return "no constraints"
    return "constraints " + ", ".join(f"{name}={value}" for name, value in fixed.items())


def _given(fixed: Mapping[str, Any], given: Collection[str] | None) -> Mapping[str, Any]:
    """The fields of ``fixed`` the caller set: ``given``, or all of them."""
    return fixed if given is None else {name: value for name, value in fixed.items() if name in given}


def _check_expert_room(graph: LayerGraph, devices: int, fixed: Mapping[str, Any]) -> None:
    """Refuse in one line a fixed ``ep`` that divides none of the ``dp x cp`` products the
    ``devices`` leave beside the fixed ``tp`` and ``pp`` (each divides what they leave),
    naming the degrees that do, instead of one reason per product."""
    ep, pinned = fixed.get("ep", 1), math.prod(fixed.get(k, 1) for k in ("tp", "pp"))
    if ep == 1 or devices % pinned or (devices // pinned) % ep == 0:
        return
    room = devices // pinned
    usable = [d for d in divisors(model_experts(graph)) if d > 1 and room % d == 0]
    beside = f" beside {' '.join(f'{k}={fixed[k]}' for k in ('tp', 'pp') if k in fixed)}" if pinned > 1 else ""
    raise DeviceCountError(
        f"ep={ep} cannot split the experts on {devices} devices{beside}: an expert group lies within the "
        f"data- and context-parallel ranks, whose count divides {room}, which {ep} does not; use "
        + (f"ep in {usable} (dividing both {room} and the {model_experts(graph)} experts)." if usable else "ep=1.")
    )


def search(
    solver: ConfigSolver,
    fixed: Mapping[str, Any],
    *,
    top: int,
    walk_room: bool = True,
    given: Collection[str] | None = None,
) -> SearchResult:
    """Solve the candidates that satisfy ``fixed`` in bound order (module docstring);
    the kept ones come with their prediction. ``given`` names the fields of ``fixed`` the
    caller set (the rest filled by defaults), which a refusal repeats; all by default.
    The order and the stop are exact for the memory bound every configuration is solved
    under; with ``walk_room`` each one solved that fits and whose time bound beats the
    fastest so far then takes the room its pipeline ranks' walk leaves below that bound
    (:mod:`autopar.search.walk_room`), which may reorder them (no other can become the
    fastest: room only changes options)."""
    model = solver.model
    graph, cluster = model.graph, model.cluster
    configs, rejected = enumerate_space(
        graph, cluster, model.global_batch_size, fixed, fold_shard_groups=True, megatron_kernels=not model.batch_first
    )
    if not configs:  # what rules out the fixed values, where something does, not the search's own picks
        _check_expert_room(graph, cluster.world_size, fixed)
        pinned = [r for r in rejected if not set(r.searched) - fixed.keys()] or rejected
        reasons = "; ".join(list(dict.fromkeys(f"{r.what}: {r.reason}" for r in pinned))[:6]) or "no candidate"
        raise DeviceCountError(
            f"no configuration of {cluster.world_size} devices can run global_batch_size="
            f"{model.global_batch_size} with {_constraints_text(_given(fixed, given))}: {reasons}. Change the batch "
            f"size, the device count or the constraints."
        )
    modes = (fixed["recompute"],) if "recompute" in fixed else (ALL_MODES if model.batch_first else MEGATRON_MODES)
    siblings = {cfg: shard_siblings(cfg, cluster.devices_per_node, fixed) for cfg in configs}
    region_sizes = Counter((c.tp, c.pp) for c in configs)
    capacity = cluster.device.memory.capacity_bytes
    cache: dict = {}
    infeasible: list[Outcome] = []

    def floor_out(cfg: ParallelConfig) -> bool:
        """Record ``cfg`` as out of memory when its floor exceeds a device."""
        floor = memory_floor(model, cfg, cache)
        if floor > capacity:
            reason = f"out of memory: needs at least {floor / 2**30:.1f} GiB"
            infeasible.append(Outcome(config=cfg, fits=False, min_memory_bytes=floor, reason=reason))
        return floor > capacity

    # an HSDP sibling holds more per device than its plain candidate: out with it
    bounded = [cfg for cfg in configs if not floor_out(cfg)]
    bound_of = TimeBound(solver, modes, bounded)
    tighter = (bound_of, bound_of.refined)
    # a plain candidate with HSDP siblings enters as their family, under the least of their
    # bounds, and is replaced by its members when that comes up (tier -1)
    queue = [
        (bound_of.scaled_with_siblings(cfg, siblings[cfg]), (order, 0), -1 if siblings[cfg] else 0, cfg)
        for order, cfg in enumerate(bounded)
    ]
    heapq.heapify(queue)
    fitting: list[Outcome] = []
    unrecomputed: set[ParallelConfig] = set()  # fitting with every unit keeping its activations
    evaluated = 0
    keep = max(top, 0) + 1
    # the fastest of other mixes of degrees too, where the space has them: each is
    # settled, as the runners-up are, once the next bound passes its time; past as many
    # solves again as the runners-up took (OTHER_DEGREES_SOLVES at least), the scan
    # keeps what it found, and the bound it stopped at says which of them are settled
    mixes = {degrees_of(cfg) for cfg in bounded}
    extra: int | None = None
    frontier_s = math.inf  # no candidate left unsolved beats it
    while queue:
        bound, order, tier, cfg = queue[0]
        if len(fitting) >= keep and bound >= fitting[keep - 1].step_time_s:
            shown = {degrees_of(o.config) for o in fitting[:keep]}
            wanted = min(OTHER_DEGREES, len(mixes - shown)) if top > 0 else 0
            others = other_degrees(fitting, keep, wanted)
            if len(others) >= wanted and (not others or bound >= others[-1].step_time_s):
                break
            extra = evaluated + max(evaluated, OTHER_DEGREES_SOLVES) if extra is None else extra
            if evaluated >= extra:
                frontier_s = bound
                break
        heapq.heappop(queue)
        if tier < 0:
            heapq.heappush(queue, (bound_of.scaled(cfg), order, 0, cfg))
            for k, shard in enumerate(siblings[cfg], 1):
                member = replace(cfg, dp_shard=shard)
                region_sizes[cfg.tp, cfg.pp] += 1
                if not floor_out(member):
                    heapq.heappush(queue, (bound_of.scaled(member), (order[0], k), 0, member))
            continue
        if tier < len(tighter):
            better = tighter[tier](cfg)
            if math.isinf(better):
                reason = "out of memory: no per-unit choice fits a pipeline rank"
                infeasible.append(Outcome(config=cfg, fits=False, min_memory_bytes=capacity, reason=reason))
            else:
                heapq.heappush(queue, (max(bound, better), order, tier + 1, cfg))
            continue
        if cfg.regather and replace(cfg, regather=False) in unrecomputed:
            continue  # its twin holding the gathers keeps every activation: keeping shards only adds time
        outcome = solver.evaluate(cfg, modes)
        evaluated += 1
        if outcome.fits and not cfg.regather and recomputes_nothing(outcome):
            unrecomputed.add(cfg)
        if outcome.fits:
            fitting.append(outcome)
            fitting.sort(key=lambda o: o.step_time_s)
        else:
            infeasible.append(outcome)
    common = {
        "infeasible": tuple(infeasible),
        "rejected": tuple(rejected),
        "evaluated": evaluated,
        "considered": len(configs) + sum(map(len, siblings.values())),
        "region_sizes": region_sizes,
    }
    if not fitting:
        return SearchResult(best=min(infeasible, key=lambda o: o.min_memory_bytes), runners_up=(), **common)
    if walk_room:  # only a candidate whose bound beats the fastest so far can win with room
        fastest_s = math.inf
        roomy: list[Outcome] = []
        for o in fitting:
            if bound_of(o.config) < fastest_s:
                o = with_walk_room(solver, o, modes, beat_s=fastest_s)
            roomy.append(o)
            fastest_s = min(fastest_s, o.step_time_s)
        fitting = sorted(roomy, key=lambda o: o.step_time_s)
    finished = [replace(o, prediction=price(model, decided(o))) for o in fitting[:keep]]
    count = min(OTHER_DEGREES, len(mixes)) if top > 0 else 0
    others = tuple(replace(o, prediction=price(model, decided(o))) for o in other_degrees(fitting, keep, count))
    contrasts = sharding_contrasts(solver, finished[0].config, fixed, modes) + option_contrasts(
        solver, finished[0].config, modes
    )
    return SearchResult(
        best=finished[0],
        runners_up=tuple(finished[1:]),
        contrasts=contrasts,
        other_degrees=others,
        other_degrees_frontier_s=frontier_s,
        **common,
    )


def recomputes_nothing(outcome: Outcome) -> bool:
    """Whether every unit of a solved configuration keeps its activations."""
    return all(o.recompute is Recompute.NONE for stage in outcome.stages for o in stage.options)


def sharding_contrasts(
    solver: ConfigSolver, best: ParallelConfig, fixed: Mapping[str, Any], modes: tuple[Recompute, ...]
) -> tuple[Outcome, ...]:
    """The fastest fitting version of ``best`` with the other data-parallel sharding: plain
    FSDP for an HSDP winner, the best of the searched HSDP shard groups
    (:func:`autopar.search.space.config_shard_sizes`) for a plain ZeRO-2/3 winner; priced. None
    when ``dp_shard`` was fixed or the winner does not shard through FSDP2. Every such
    configuration is in the searched space, so none beats the winner."""
    if "dp_shard" in fixed or best.zero_stage < 2 or best.dp == 1:
        return ()
    if best.dp_shard is not None:
        others = [replace(best, dp_shard=None)]
    else:
        sizes = config_shard_sizes(best, solver.model.cluster.devices_per_node)
        others = [replace(best, dp_shard=d) for d in sizes]
    found = [o for o in (with_walk_room(solver, solver.evaluate(c, modes), modes) for c in others) if o.fits]
    if not found:
        return ()
    fastest = min(found, key=lambda o: o.step_time_s)
    return (replace(fastest, prediction=price(solver.model, decided(fastest))),)


def option_contrasts(solver: ConfigSolver, best: ParallelConfig, modes: tuple[Recompute, ...]) -> tuple[Outcome, ...]:
    """``best`` with its blocks the other way (compiled or eager; eager blocks run
    synchronous TP), with its linear layers the other way (FP8 or not) where the device
    has FP8 matmuls and the plan is in bf16, and with its tensor parallelism the other
    way (asynchronous or not) where that applies; priced, those that fit: what each option
    is worth on this plan, whichever way it was decided; likewise keeping the shards of
    sequence-parallel gathers (``regather``) where the blocks are eager. A schedule that
    splits the backward runs eager blocks only (:data:`autopar.vocab.SPLIT_BACKWARD_EAGER`)."""
    split_backward = best.schedule.zero_bubble and best.pp > 1
    others = [] if split_backward else [replace(best, compile=not best.compile, async_tp=False, regather=False)]
    device = solver.model.cluster.device
    if device.roofline.fp8_flops and best.dtype is DType.BF16:
        others.append(replace(best, fp8=not best.fp8))
    if device.async_tp and best.compile and best.sequence_parallel:
        others.append(replace(best, async_tp=not best.async_tp))
    if best.sequence_parallel and not best.compile:
        others.append(replace(best, regather=not best.regather))
    found = [o for o in (with_walk_room(solver, solver.evaluate(c, modes), modes) for c in others) if o.fits]
    return tuple(replace(o, prediction=price(solver.model, decided(o))) for o in found)


def decided(outcome: Outcome) -> Decided:
    """The decisions of a solved configuration, for the cost model to price."""
    choices = {
        u: UnitChoice(styles=o.layout.styles, output=o.layout.output, recompute=o.recompute)
        for stage in outcome.stages
        for u, o in zip(stage.units, stage.options)
    }
    return Decided(
        config=outcome.config,
        stages=tuple(stage.units for stage in outcome.stages),
        units=tuple(choices[u] for u in range(len(choices))),
    )
