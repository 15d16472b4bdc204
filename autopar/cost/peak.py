"""The peak memory of a pipeline rank: model states, activations, the transient of the
unit in backward, the schedule's buffers and the device's reserve.

The search bounds a stage by ``static + inflight x activations + max transient``
(:class:`Footprint` per option; DDP's one-time bucket rebuild apart,
:func:`fits_bucket_rebuild`); the prediction follows the backward unit by unit
(:func:`autopar.cost.peak_walks.backward_peak`): a unit's transient meets only the
activations of the units before it in its own micro-batch, and where a rank runs every
micro-batch's forward before its first backward (no pipelining with one micro-batch,
GPipe, 1F1B with no more micro-batches than stages after this one) and no gradient
outlives a step (anything but DDP, whose buckets hold them), ``zero_grad`` left no
gradient, so they grow as that backward frees the activations, and without pipelining
the gathered copies of ZeRO-2 and ``replicate`` shrink as each unit's backward in the
last micro-batch ends (:func:`autopar.cost.memory.unit_freed_copy_bytes`). ZeRO-2's
reduction there meets neither the unit's activations nor its copy, its backward only
the reduce input the unit after it left; its first forward gathers each unit beside the
previous unit's buffer (:func:`autopar.cost.peak_walks.first_forward_peak`).
Interleaved 1F1B is followed action by action in torch's order
(:func:`autopar.cost.peak_walks.interleaved_peak`): its warm-up's activations meet only
the gradients of the chunk whose backward runs first, and a chunk may hold more
micro-batches later in the step than at the warm-up's end (its bound counts them there;
the knapsack gives the chunks counted heaviest the smallest options). The other
interleaved schedules keep the bound. What the search accepts under the bound fits; the
prediction is the peak. The compute-precision weight gradients a zero-bubble schedule
defers (:func:`autopar.cost.memory.deferred_weight_grad_bytes`) are static in the bound
for every unit (it does not know which units the pipeline's first stage holds, which
defers none) and, in the prediction, for the stages that defer them. So are the output
gradients of the weighted ops of micro-batches awaiting their weight gradient under a
zero-bubble schedule (``UnitCost.wait_bytes``), as many as any rank awaits at once in the
bound; the prediction takes the rank's moment where they and the activations peak
together (:func:`autopar.cost.pipeline.weight_wait_moment`).

A weight tied between two units (GPT's embedding and head) is counted once only where
one rank holds it as one tensor: both owners on the rank, splitting it alike
(:func:`held_once_numel`; a replicated embedding beside a column-parallel head are two
tensors, as ``autopar.runtime.tied`` keeps them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from autopar.cost.memory import (
    config_state_bytes,
    deferred_weight_grad_bytes,
    gathered_copy_bytes,
    held_grad_bytes,
    kept_reduce_input_bytes,
    resharded_copy_bytes,
    unit_freed_copy_bytes,
)
from autopar.cost.model import CostModel
from autopar.cost.peak_walks import alive_bytes, backward_peak, chunked, first_forward_peak, interleaved_peak
from autopar.cost.pipeline import (
    inflight_microbatches,
    interleaved_order,
    most_awaiting,
    weight_wait_moment,
)
from autopar.cost.recompute import UnitOption
from autopar.cost.stage import PricedStage, on_rank, rank_buffer_bytes
from autopar.hardware.device import DeviceMemory
from autopar.plan import MemoryBreakdown, ParallelConfig
from autopar.vocab import Schedule, TPStyle

WEIGHT_SPLIT: dict[TPStyle, int | None] = {
    TPStyle.REPLICATE: None,
    TPStyle.SEQUENCE: None,
    TPStyle.HEADS: None,
    TPStyle.COLUMN: 0,
    TPStyle.VOCAB: 0,
    TPStyle.ROW: 1,
}
"""The dimension of a leaf's weight its style splits (a Linear's ``(out, in)``, an
Embedding's ``(vocabulary, dim)``, as torch's ``ColwiseParallel``/``RowwiseParallel``
place them), None where it stays whole."""


@dataclass(frozen=True, kw_only=True)
class Footprint:
    """One option of one unit in a stage, priced for the stage bound: seconds per
    micro-batch, bytes kept for the whole step (``static``), bytes per in-flight
    micro-batch (``act``), the transient peak while it runs (in a micro-batch before
    the step's last, ``before_last``, at most that), and its share of DDP's one-time
    bucket rebuild (``rebuild``), which never meets activations. Where the unit reduces
    once its backward is over (ZeRO-2 without pipelining), ``kept`` is the reduce input
    that reduction leaves for the backward before it, and :meth:`running_bytes` its
    transient while its own backward runs; its parts: the compute's own transient
    (``compute``), what the loss's backward frees before the gradients come
    (``loss_freed``) and the model states' transient (``state``)."""

    time_s: float
    static_bytes: float
    act_bytes: float
    transient_bytes: float
    rebuild_bytes: float
    before_last_bytes: float
    kept_bytes: float = 0.0
    compute_bytes: float = 0.0
    loss_freed_bytes: float = 0.0
    state_bytes: float = 0.0

    def running_bytes(self, kept_before: float) -> float:
        """The transient while this unit's backward runs, where it reduces only once
        that backward is over: its gradients as they come (its states' transient less
        the reduce input, which is not allocated yet) beside ``kept_before``, the input
        the reduction before it left."""
        return _with_state(self.compute_bytes, self.loss_freed_bytes, self.state_bytes - self.kept_bytes + kept_before)


def _with_state(compute: float, loss_freed: float, state: float) -> float:
    """A unit's transient: the compute's own (``compute``), or, once the loss's backward
    has freed ``loss_freed``, the model states' transient (``state``) beside it."""
    return max(compute, compute - loss_freed + state)


def budget_bytes(memory: DeviceMemory) -> float:
    """Bytes the model may allocate: capacity less the fixed reserve, less the
    allocator's fragmentation on what is allocated."""
    return (memory.capacity_bytes - memory.reserved_bytes) / (1 + memory.fragmentation)


def footprint(
    model: CostModel, option: UnitOption, config: ParallelConfig, *, grads_deferred: bool = False
) -> Footprint:
    """``option``'s time and memory terms under ``config``'s sharding of model states.
    The loss's backward is over, and what it kept but the logits freed, before the
    unit's gathers and reductions begin (fully recomputed, those stay activations).
    ``grads_deferred``: the unit's stage defers its weight gradients (a zero-bubble
    schedule, any stage but the pipeline's first), whose compute-precision gradients
    are then counted for the whole step, not as the unit's transient (the search, which
    does not know the stage, keeps the transient)."""
    lay = option.layout
    st = config_state_bytes(
        config,
        model.optimizer,
        param_numel=lay.param_numel,
        factored_numel=lay.factored_numel,
        largest_unit_numel=lay.param_numel,
        expert_numel=lay.expert_numel,
        whole_grad_numel=lay.whole_grad_numel,
        largest_grad_numel=lay.largest_grad_numel,
    )
    # replicate's compute-precision gradients last until the stage's backward ends, and a
    # zero-bubble schedule's deferred weight gradients from a stage's W to its next I: in
    # the bound both are kept for the step, as the model states are (the bound does not
    # know which units the pipeline's first stage holds, which defer none)
    held = held_grad_bytes(config, param_numel=lay.param_numel, whole_grad_numel=lay.whole_grad_numel)
    if not grads_deferred:
        held += deferred_weight_grad_bytes(config, param_numel=lay.param_numel, whole_grad_numel=lay.whole_grad_numel)
    freed = lay.loss_working_bytes + (
        lay.loss_saved_bytes - lay.held_output_bytes if not option.recompute.checkpoints_unit else 0.0
    )
    deferred = grads_deferred and config.pp > 1 and config.zero_stage >= 2

    def with_grads(grad_transient: float) -> float:
        return _with_state(option.transient_bytes, freed, 0.0 if deferred else grad_transient)

    last = with_grads(st.transient_bytes)
    before_last = last if st.before_last_bytes is None else with_grads(st.before_last_bytes)
    # the output gradients awaiting weight gradients: as many as any rank awaits, for the step
    awaiting = most_awaiting(config.schedule, config.pp, config.virtual_stages, config.num_microbatches)
    held += max(lay.wait_bytes, 0.0) * awaiting / config.virtual_stages
    return Footprint(
        time_s=option.time_s,
        static_bytes=st.params_bytes + st.grads_bytes + st.optimizer_bytes + held,
        act_bytes=option.act_bytes,
        transient_bytes=last,
        rebuild_bytes=st.rebuild_bytes,
        before_last_bytes=before_last,
        kept_bytes=kept_reduce_input_bytes(config, lay.param_numel),
        compute_bytes=option.transient_bytes,
        loss_freed_bytes=freed,
        state_bytes=st.transient_bytes,
    )


def held_once_numel(model: CostModel, config: ParallelConfig, options: Mapping[int, UnitOption]) -> float:
    """Elements of tied parameters that both owners' ``options`` (unit -> option) count
    but one rank holds as one tensor: both owners on the rank, splitting the weight
    alike (``autopar.runtime.tied.retie``)."""
    numel = 0.0
    for s in model.graph.shared:
        if s.first_unit not in options or s.second_unit not in options:
            continue
        splits = {
            WEIGHT_SPLIT[_owner_style(model, options[u], u, m)]
            for u, m in ((s.first_unit, s.first_module), (s.second_unit, s.second_module))
        }
        if len(splits) == 1:
            numel += s.numel / (config.tp if splits != {None} else 1)
    return numel


def _owner_style(model: CostModel, option: UnitOption, unit: int, module: str) -> TPStyle:
    """The style ``option`` gives the leaf ``module`` of ``unit`` (replicate if no leaf is it)."""
    u = model.graph.units[unit]
    for leaf, style in zip(model.graph.profile_of(unit).leaves, option.layout.styles):
        if u.leaf_fqn(leaf.name) == module:
            return style
    return TPStyle.REPLICATE


def shared_state_bytes(model: CostModel, config: ParallelConfig, numel: float) -> float:
    """State bytes of ``numel`` tied elements counted twice."""
    st = config_state_bytes(config, model.optimizer, param_numel=numel, factored_numel=numel)
    return st.params_bytes + st.grads_bytes + st.optimizer_bytes


def fits_bucket_rebuild(chosen: Sequence[tuple[Any, int]], shared_bytes: float, budget: float) -> bool:
    """Whether a stage whose options are ``chosen`` (an item with a :class:`Footprint`'s
    ``static_bytes`` and ``rebuild_bytes``, and how many units take it) also fits DDP's
    one-time bucket rebuild: its model states plus a second copy of its gradients
    (:mod:`autopar.cost.memory`), tied parameters (``shared_bytes`` of state, counted by
    both owners) once. Only DDP (tp = 1) rebuilds, where every option of a unit holds
    the same states, so the check cannot prefer another choice."""
    static = sum(c * f.static_bytes for f, c in chosen)
    rebuild = sum(c * f.rebuild_bytes for f, c in chosen)
    if rebuild == 0.0:
        return True
    return (static - shared_bytes) * (1 + rebuild / static) <= budget


def rank_memory(
    model: CostModel, stage: PricedStage, config: ParallelConfig, stages: Sequence[PricedStage]
) -> MemoryBreakdown:
    """The memory of the pipeline rank that runs ``stage`` (with all of its ``stages``)
    at its peak, term by term (module docstring)."""
    pp = config.pp
    here = config.rank_of_stage(stage.index)
    mine = on_rank(config, stages, here)
    rank = [(u, o) for p in mine for u, o in zip(p.units, p.options)]
    stage_numel = [sum(o.layout.param_numel for o in p.options) for p in mine]
    # a zero-bubble schedule's weight gradients wait from each stage's W to its next I
    # (the pipeline's first stage runs its backward whole)
    deferred = sum(
        deferred_weight_grad_bytes(
            config,
            param_numel=sum(o.layout.param_numel for o in p.options),
            whole_grad_numel=sum(o.layout.whole_grad_numel for o in p.options),
        )
        for p in mine
        if p.index != 0
    )
    deferring = deferred_weight_grad_bytes(config, param_numel=1.0) > 0
    first_units = {u for p in mine if p.index == 0 for u in p.units} if deferring else None
    prints = [
        footprint(model, o, config, grads_deferred=first_units is not None and u not in first_units) for u, o in rank
    ]
    params = sum(o.layout.param_numel for _, o in rank)
    factored = sum(o.layout.factored_numel for _, o in rank)
    experts = sum(o.layout.expert_numel for _, o in rank)
    whole = sum(o.layout.whole_grad_numel for _, o in rank)
    st = config_state_bytes(
        config,
        model.optimizer,
        param_numel=params,
        factored_numel=factored,
        expert_numel=experts,
        whole_grad_numel=whole,
    )
    static = st.params_bytes + st.grads_bytes + st.optimizer_bytes
    shared = shared_state_bytes(model, config, held_once_numel(model, config, dict(rank)))
    scale = (static - shared) / static if static else 1.0
    grads = st.grads_bytes * scale + deferred
    held_grads = _held_grads(config, rank, first_units)
    transients = [p.transient_bytes + h for p, h in zip(prints, held_grads)]
    last = [o.layout.held_output_bytes for u, o in rank if u == model.num_units - 1]
    share = _grad_shares(model, config, rank)
    params_bytes = st.params_bytes * scale
    if pp > 1 and config.schedule is Schedule.INTERLEAVED_1F1B:  # its order, action by action
        sizes = [len(p.units) for p in mine]
        gathered = gathered_copy_bytes(config)
        copies = [n * gathered for n in stage_numel]
        peak = interleaved_peak(
            chunked([p.act_bytes for p in prints], sizes),
            chunked(transients, sizes),
            chunked([grads * f for f in share], sizes),
            copies,
            interleaved_order(pp, config.virtual_stages, config.num_microbatches, here),
            fresh_gradients=not st.rebuild_bytes,
            held_to_end=sum(last),
            lazy_gather=config.zero_stage < 2,
        )
        acts, grads, transient = peak.activations_bytes, peak.grads_bytes, peak.transient_bytes
        params_bytes += peak.gathered_bytes - sum(copies)
    elif pp > 1 and config.schedule.multi_stage:  # each stage's micro-batches (unequal in a V)
        held = [p.inflight for p in mine for _ in p.units]
        acts, transient = _with_waiting(
            sum(h * p.act_bytes for h, p in zip(held, prints)), max(transients), mine, config
        )
        params_bytes -= resharded_copy_bytes(config, stage_numel)
    else:
        fresh = stage.inflight >= config.num_microbatches and not st.rebuild_bytes
        freed_copies = _freed_copies(model, config, rank)
        running = _running(prints, held_grads, freed_copies)
        unit_acts = [p.act_bytes for p in prints]
        moment = backward_peak(
            unit_acts,
            transients,
            [grads * f for f in share],
            stage.inflight,
            fresh_gradients=fresh,
            held_to_end=sum(last),
            freed=freed_copies,
            before_last=[p.before_last_bytes + h for p, h in zip(prints, held_grads)],
            running=running,
        )
        if any(r is not None for r in running):  # ZeRO-2's units gather as the step's first forward reaches them
            moment = max(moment, first_forward_peak(unit_acts, freed_copies), key=alive_bytes)
        acts, grads, transient, freed = moment
        params_bytes -= freed
    # DDP's bucket rebuild happens with no activation alive: it raises the peak only
    # by what it holds beyond them
    transient = max(transient, st.rebuild_bytes * scale - acts)
    chosen = dict(rank)
    inflight = inflight_microbatches(config.schedule, pp, config.virtual_stages, config.num_microbatches, here)
    buffers = rank_buffer_bytes(model, tuple(chosen), config, inflight, lambda u: chosen[u].layout)
    memory = model.cluster.device.memory
    allocated = params_bytes + grads + st.optimizer_bytes * scale + acts + transient + buffers
    return MemoryBreakdown(
        params_bytes=params_bytes,
        grads_bytes=grads,
        optimizer_bytes=st.optimizer_bytes * scale,
        activations_bytes=acts,
        transient_bytes=transient,
        buffers_bytes=buffers,
        reserve_bytes=memory.reserved_bytes + memory.fragmentation * allocated,
    )


def _freed_copies(model: CostModel, config: ParallelConfig, rank: Sequence[tuple[int, UnitOption]]) -> list[float]:
    """Per unit of a rank, the gathered copy it frees once its backward in the step's
    last micro-batch is over (:func:`autopar.cost.memory.unit_freed_copy_bytes`): none
    for a unit sharing a weight with another unit of the rank, which stays in the stage
    root's group (``autopar.runtime.api``) and frees it only when the whole backward is."""
    per_param = unit_freed_copy_bytes(config)
    units = {u for u, _ in rank}
    tied = {
        u for s in model.graph.shared if {s.first_unit, s.second_unit} <= units for u in (s.first_unit, s.second_unit)
    }
    return [0.0 if u in tied else o.layout.param_numel * per_param for u, o in rank]


def _running(prints: Sequence[Footprint], held_grads: Sequence[float], freed: Sequence[float]) -> list[float | None]:
    """Per unit of a rank in forward order, its transient while its backward runs where
    it reduces only once that backward is over (:meth:`Footprint.running_bytes`; None
    elsewhere, and for a unit tied to another, which reduces with the stage root at the
    end): beside the reduce input the last reduction before it kept, that of the
    nearest unit after it that reduces on its own."""
    out: list[float | None] = []
    kept_before = 0.0
    for p, h, f in reversed(list(zip(prints, held_grads, freed))):
        reduces = p.kept_bytes > 0 and f > 0
        out.append(p.running_bytes(kept_before) + h if reduces else None)
        if reduces:
            kept_before = p.kept_bytes
    return out[::-1]


def _with_waiting(
    acts: float, transient: float, mine: Sequence[PricedStage], config: ParallelConfig
) -> tuple[float, float]:
    """A zero-bubble rank's activations and transient where it holds the most, with the
    micro-batches then awaiting their weight gradient (:func:`weight_wait_moment`), each
    holding its stage's ``wait_bytes`` more: those of the rank's last stage, whose
    micro-batches await there (the pipeline's first stage runs its backward whole). The
    one whose input-gradient step ran last made its output gradients during that step,
    when its transient was: the larger of the two counts."""
    moment = weight_wait_moment(
        config.schedule, config.pp, config.virtual_stages, config.num_microbatches, config.rank_of_stage(mine[0].index)
    )
    if not moment or not moment[1]:
        return acts, transient
    last = max(mine, key=lambda p: p.index)
    wait = sum(o.layout.wait_bytes for o in last.options) if last.index else 0.0
    return acts + (moment[1] - 1) * wait, max(transient, wait)


def _grad_shares(model: CostModel, config: ParallelConfig, rank: Sequence[tuple[int, UnitOption]]) -> list[float]:
    """Each unit's part of its rank's gradients: its own state's, so that a
    vocabulary-parallel table's whole gradient (``UnitCost.whole_grad_numel``) belongs to
    its unit alone and exists only from that unit's backward, not shared out by
    parameters over units whose gradients exist earlier."""
    own = [
        config_state_bytes(
            config,
            model.optimizer,
            param_numel=o.layout.param_numel,
            factored_numel=o.layout.factored_numel,
            expert_numel=o.layout.expert_numel,
            whole_grad_numel=o.layout.whole_grad_numel,
        ).grads_bytes
        for _, o in rank
    ]
    total = sum(own)
    return [g / total if total else 0.0 for g in own]


def _held_grads(
    config: ParallelConfig, rank: Sequence[tuple[int, UnitOption]], first_units: set[int] | None
) -> list[float]:
    """Per unit of a rank (its stages' units in order, ``(unit, option)``), the
    compute-precision gradients ``replicate`` holds while that unit runs its backward
    (:func:`autopar.cost.memory.held_grad_bytes`): its own and those of the units after it
    in its stage, whose backward has run (a stage is a run of consecutive units). Under a
    zero-bubble schedule, whose deferred weight gradients are counted for the whole step
    (:func:`autopar.cost.memory.deferred_weight_grad_bytes`), only the units of the
    pipeline's first stage (``first_units``; None otherwise), which runs its backward
    whole, add them."""
    held = [
        0.0
        if first_units is not None and u not in first_units
        else held_grad_bytes(config, param_numel=o.layout.param_numel, whole_grad_numel=o.layout.whole_grad_numel)
        for u, o in rank
    ]
    out = [0.0] * len(rank)
    after = 0.0
    for i in range(len(rank) - 1, -1, -1):
        if i == len(rank) - 1 or rank[i + 1][0] != rank[i][0] + 1:
            after = 0.0
        after += held[i]
        out[i] = after
    return out


def frugal_peak_bytes(
    model: CostModel,
    config: ParallelConfig,
    ranks: Sequence[Sequence[Sequence[UnitOption]]],
    *,
    states_only: bool = False,
) -> float:
    """The peak memory per device of the most loaded pipeline rank with every unit at
    its smallest option: ``ranks[r]`` lists, for each unit rank ``r`` holds, its
    options. What a configuration that does not fit needs at least, about. With
    ``states_only``, its weights, gradients and optimizer states alone (what no shorter
    sequence or smaller micro-batch reduces)."""
    memory = model.cluster.device.memory
    worst = 0.0
    for r, units in enumerate(ranks):
        inflight = inflight_microbatches(config.schedule, config.pp, config.virtual_stages, config.num_microbatches, r)
        static, acts, transient, rebuild = 0.0, 0.0, 0.0, 0.0
        for options in units:
            smallest = min(
                (footprint(model, o, config) for o in options),
                key=lambda p: p.static_bytes + inflight * p.act_bytes + p.transient_bytes,
            )
            static += smallest.static_bytes
            acts += inflight * smallest.act_bytes
            transient = max(transient, smallest.transient_bytes)
            rebuild += smallest.rebuild_bytes
        peak = static + (0.0 if states_only else max(acts + transient, rebuild))
        worst = max(worst, peak * (1 + memory.fragmentation) + memory.reserved_bytes)
    return worst
