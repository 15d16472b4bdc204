"""From what the search found to a :class:`~autopar.plan.Plan`: the per-layer strategies
of the winner, the runners-up and the regions that do not fit, and notes; or the error
that says nothing fits and what would help."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from autopar.cost.leaf import padded
from autopar.cost.memory import GRAD_BYTES, MASTER_BYTES, optimizer_state_bytes
from autopar.cost.peak import budget_bytes, frugal_peak_bytes
from autopar.errors import ConfigError, InfeasiblePlanError
from autopar.graph.layer_graph import LayerGraph
from autopar.hardware.cluster import MAX_DEVICES
from autopar.models.experts import ROUTED_FORM
from autopar.plan import Alternative, LayerStrategies, ModelSummary, ParallelConfig, Plan, PlanSettings
from autopar.plan_checks import idle_sequence_parallel
from autopar.present.units import count, size
from autopar.search.context_degrees import CP_MIN_TOKENS, ring_blocker
from autopar.search.scan import SearchResult
from autopar.search.schedules import allowed_modes
from autopar.search.solve import ConfigSolver, Outcome
from autopar.search.space import CUT_NOTE, enumerate_space
from autopar.vocab import DType, Optimizer, Recompute, TPStyle


@dataclass(frozen=True, kw_only=True)
class Provenance:
    """How a plan was made: its settings, the search's cost in time and candidates."""

    settings: PlanSettings
    search_time_s: float


def to_plan(
    solver: ConfigSolver, result: SearchResult, provenance: Provenance, fixed: Mapping[str, Any] | None = None
) -> Plan:
    """The plan of the search's best configuration; ``fixed``, the constraints, sizes its
    out-of-memory alternatives with the recomputation they allow."""
    model = solver.model
    graph = model.graph
    best = result.best
    if best.prediction is None:
        raise ValueError("to_plan needs a priced best configuration; the search prices the ones it keeps.")
    strategies, default = strategies_of(graph, best)
    config = replace(best.config, recompute=default)
    idle = (idle_sequence_parallel(graph.name, config),) if config.sequence_parallel and not strategies.tp else ()
    return Plan(
        config=config,
        stages=tuple(tuple(m for u in s.units for m in graph.units[u].modules) for s in best.stages),
        layer_strategies=strategies,
        prediction=best.prediction,
        alternatives=_alternatives(result, solver, _sizing_modes(fixed or {})),
        model=ModelSummary(
            name=graph.name,
            num_params=graph.num_params,
            units=graph.module_names,
            fingerprint=graph.fingerprint,
            seq_len=graph.seq_len,
            global_batch_size=model.global_batch_size,
            flops_per_sample=3 * graph.model_fwd_flops_per_sample,
            has_attention=any(prof.has_attention for prof in graph.profiles),
        ),
        cluster=model.cluster,
        settings=provenance.settings,
        notes=(*_notes(graph, config), *idle),
        search_time_s=provenance.search_time_s,
        candidates_evaluated=result.evaluated,
    )


def strategies_of(graph: LayerGraph, outcome: Outcome) -> tuple[LayerStrategies, Recompute]:
    """Leaf styles and per-unit recompute overrides of a solved configuration, and the
    default recompute: the mode most units take (counting units, not modules, so that
    an embedding unit of two modules does not outvote a block)."""
    tp_map: dict[str, TPStyle] = {}
    modes: dict[str, Recompute] = {}
    for stage in outcome.stages:
        for u, opt in zip(stage.units, stage.options):
            unit = graph.units[u]
            for leaf, style in zip(graph.profile_of(u).leaves, opt.layout.styles):
                if style is not TPStyle.REPLICATE:
                    tp_map[unit.leaf_fqn(leaf.name)] = style
            for mod in unit.modules:
                modes[mod] = opt.recompute
    default, _ = unit_modes(outcome)
    overrides = {k: v for k, v in modes.items() if v is not default}
    return LayerStrategies(tp=tp_map, recompute=overrides), default


def unit_modes(outcome: Outcome) -> tuple[Recompute, Counter[Recompute]]:
    """The recompute mode most units of a solved configuration take (the configuration's
    own where it has no units), and how many units take each mode."""
    counts = Counter(opt.recompute for stage in outcome.stages for opt in stage.options)
    default = counts.most_common(1)[0][0] if counts else outcome.config.recompute
    return default, counts


def infeasible_error(
    result: SearchResult,
    solver: ConfigSolver,
    graph: LayerGraph,
    *,
    fixed: Mapping[str, Any],
    optimizer: Optimizer,
) -> InfeasiblePlanError:
    """Nothing fits: the least memory found against a device's, and what would help: a
    ZeRO stage, recomputation or bf16 gradient reduction the search was not allowed
    (the last where the closest candidate is pipelined ZeRO-2/3 and halving its held
    gradients alone would make it fit), and the first node count found where a
    configuration of the search's space fits with every unit at its smallest option
    (:func:`_first_fitting`: another mix of degrees, a wider context-parallel ring, more
    ranks sharding the states), from the count the model's states need fully sharded
    (a lower bound, said beside it where the states outgrow the cluster). Estimates from
    the states alone mislead where expert parallelism or small ZeRO groups hold them
    unevenly, or where a wider ring would shrink the activations, so only a count with a
    configuration that fits is offered; where none fits up to sixteen times the first
    count, the refusal says so and names the fixed choices instead. A ZeRO stage or
    recomputation the constraints pinned is marked where lifting it alone fits nothing
    on this cluster."""
    cluster = solver.model.cluster
    modes = _sizing_modes(fixed)
    best = _least_memory(result, solver, modes)
    cap = cluster.device.memory.capacity_bytes
    searched_full = fixed.get("recompute", Recompute.FULL) is Recompute.FULL
    cfg = best.config if not searched_full else replace(best.config, recompute=allowed_modes(best.config, modes)[0])
    hints = []

    def unpinned(pin: str, hint: str, mode: Recompute) -> str:
        """``hint``, marked where lifting ``pin`` alone fits nothing on this cluster."""
        lifted = {k: v for k, v in fixed.items() if k != pin}
        alone = _first_fitting(graph, solver, lifted, (mode,), cluster.nodes, cluster.nodes) is not None
        return hint + ("" if alone else " (not enough alone)")

    if fixed.get("zero_stage", 3) < 3 and cluster.world_size > 1:
        hints.append(unpinned("zero_stage", "zero_stage=3", cfg.recompute))
    if not searched_full:
        hints.append(unpinned("recompute", "recompute='full'", Recompute.FULL))
    c = best.config
    if "reduce_dtype" not in fixed and c.dtype is DType.BF16 and c.pp > 1 and c.zero_stage >= 2 and c.dp_cp > 1:
        # a rank's unsharded pipelined gradients at 2 bytes instead of 4: offered where that alone fits
        low = _frugal_peak(solver, replace(c, reduce_dtype=DType.BF16), modes)
        if low <= cap:
            hints.append(
                f"reduce_dtype='bf16' (pipeline stages then hold their gradients in 2 bytes per parameter, not 4: "
                f"{size(_frugal_peak(solver, c, modes) - low)} less)"
            )
    states = graph.num_params * (MASTER_BYTES + GRAD_BYTES + optimizer_state_bytes(optimizer))
    devices = math.ceil(states / budget_bytes(cluster.device.memory))
    least = _usable_count(graph, solver, fixed, math.ceil(devices / cluster.devices_per_node))
    alone = f"its weights, gradients and {optimizer.value} states alone fill {devices} devices, fully sharded"
    outgrown = devices > cluster.world_size and least is not None
    start = max(cluster.nodes + 1, least or 0)
    last = min(16 * start, MAX_DEVICES // cluster.devices_per_node)  # fitting on none of them needs other choices
    found = _first_fitting(graph, solver, fixed, (cfg.recompute,), start, last)
    nodes = None if found is None else found[0].world_size // cluster.devices_per_node
    nowhere = ""
    if found is not None:
        config, peak = found
        fit = f"{config.short()} fits there, {size(peak)} per device with each unit at its smallest option"
        hints.append(
            f"{nodes} nodes ({fit}; below {least} nodes none can: {alone}; "
            f"autopar plan --fewest-nodes (autopar.present.whatif.fewest_nodes) plans the counts between)"
            if outgrown and least < nodes
            else f"{nodes} nodes ({fit})"
        )
    elif outgrown or fixed:  # more nodes alone do not help: say so, not a lower bound
        pins = ", ".join(f"{k}={getattr(fixed[k], 'value', fixed[k])!r}" for k in sorted(fixed))
        counts = f"from {start} to {last}" if start <= last else f"up to {last}"
        nowhere = f" No node count {counts} fits" + (f" with {pins} fixed: fix fewer." if fixed else ".")
    held = _frugal_peak(solver, cfg, modes, states_only=True)
    if held <= cap:  # else the model states alone overflow: fewer activations cannot help
        hints.append("a smaller micro-batch or sequence length" if cfg.micro_batch_size > 1 else "a shorter sequence")
    states_over = f"; its weights, gradients and optimizer states alone take {size(held)} there" if held > cap else ""
    tries = f" Try {', '.join(hints[:-1])}{', or ' if len(hints) > 1 else ''}{hints[-1]}." if hints else ""
    blocker = ring_blocker(graph) if "cp" not in fixed and (graph.seq_len or 0) >= 2 * CP_MIN_TOKENS else None
    no_ring = f" Context parallelism, which would split the sequence, cannot run it: {blocker}." if blocker else ""
    return InfeasiblePlanError(
        f"no plan fits: {graph.name} ({count(graph.num_params)} parameters) needs at least "
        f"{size(best.min_memory_bytes)} per device in the best case found ({cfg.short()}{states_over}); each "
        f"{cluster.device.name} has {size(cap)}.{tries}{nowhere}{no_ring}",
        min_memory_bytes=best.min_memory_bytes,
        capacity_bytes=cap,
        nodes_that_fit=nodes,
    )


def _usable_count(graph: LayerGraph, solver: ConfigSolver, fixed: Mapping[str, Any], nodes: int) -> int | None:
    """The first node count from ``nodes`` up where the search's space holds a
    configuration for the global batch under ``fixed``, or None: so that a count
    suggested is one the constraints and the batch allow (a batch of 64 on 5 nodes of 8
    has no data-parallel degree of 40 to divide it). It tries the next eight counts, then
    the powers of two up to twice the count (within autopar's largest cluster): a few
    unpriced enumerations, however large the cluster."""
    most = min(2 * nodes, MAX_DEVICES // solver.model.cluster.devices_per_node)
    return next((n for n in _node_counts(nodes, most) if _space_at(graph, solver, fixed, n)), None)


def _first_fitting(
    graph: LayerGraph,
    solver: ConfigSolver,
    fixed: Mapping[str, Any],
    modes: tuple[Recompute, ...],
    start: int,
    last: int,
) -> tuple[ParallelConfig, float] | None:
    """The first node count from ``start`` to ``last`` (:func:`_node_counts`) where a
    configuration of the search's space under ``fixed`` fits a device with every unit at
    its smallest option (:func:`_frugal_peak`, on the even split): that configuration and
    its peak, or None where no count tried has one. The search on that count finds a plan
    that fits, since each unit may take its smallest option."""
    model = solver.model
    cap = model.cluster.device.memory.capacity_bytes
    per_node = model.cluster.devices_per_node
    for nodes in _node_counts(start, last):
        space = _space_at(graph, solver, fixed, nodes)
        sized = [(_frugal_peak(solver, c, modes), c) for c in _frugal_variants(space, modes[0], model.batch_first)]
        fitting = [(peak, c) for peak, c in sized if peak <= cap]
        if fitting:  # tensor parallelism inside a node where one fits, as the search would pick
            peak, config = min(fitting, key=lambda f: (f[1].tp > per_node, f[0], f[1].short()))
            return config, peak
    return None


def _frugal_variants(space: list[ParallelConfig], recompute: Recompute, batch_first: bool) -> list[ParallelConfig]:
    """One configuration of ``space`` per mix of degrees and schedule, with ``recompute``:
    the one with the smallest micro-batch (a pipeline holds at most ``pp`` micro-batches,
    so more of them add none), sharding most (the highest ZeRO stage, plain FSDP), with
    sequence parallelism and kept gather shards where it has them, and FP8 only where
    its layers keep their inputs in FP8 (not ``batch_first``): what holds least, without
    sizing every option of each. A zero-bubble schedule takes the mode it allows in place
    of ``recompute`` (:func:`autopar.search.schedules.allowed_modes`)."""

    def key(c: ParallelConfig) -> tuple[Any, ...]:
        return (c.dp, c.tp, c.pp, c.cp, c.ep, c.schedule, c.virtual_stages)

    def thrift(c: ParallelConfig) -> tuple[Any, ...]:
        return (
            -c.micro_batch_size,
            c.zero_stage,
            c.dp_shard is None,
            c.sequence_parallel,
            c.regather,
            c.fp8 != batch_first,
        )

    chosen: dict[tuple[Any, ...], ParallelConfig] = {}
    for c in space:
        if key(c) not in chosen or thrift(c) > thrift(chosen[key(c)]):
            chosen[key(c)] = c
    return [replace(c, recompute=allowed_modes(c, (recompute,))[0]) for c in chosen.values()]


def _space_at(graph: LayerGraph, solver: ConfigSolver, fixed: Mapping[str, Any], nodes: int) -> list[ParallelConfig]:
    """The search's space under ``fixed`` on ``nodes`` nodes of the solver's cluster
    (unpriced), empty where a pinned degree cannot be held there."""
    model = solver.model
    try:
        space, _ = enumerate_space(
            graph,
            replace(model.cluster, nodes=nodes),
            model.global_batch_size,
            fixed,
            fold_shard_groups=True,
            megatron_kernels=not model.batch_first,
        )
    except ConfigError:
        return []
    return space


def _node_counts(start: int, most: int) -> list[int]:
    """The node counts a refusal tries from ``start``: the next eight, then the powers of
    two up to ``most`` (a few unpriced enumerations, however large the cluster)."""
    if start > most:
        return []
    near = list(range(start, min(start + 8, most) + 1))
    return near + [2**k for k in range(start.bit_length(), most.bit_length()) if near[-1] < 2**k <= most]


def _least_memory(result: SearchResult, solver: ConfigSolver, modes: tuple[Recompute, ...]) -> Outcome:
    """The infeasible candidate needing the least memory, sized: a candidate carries a
    lower bound (its states and one unit's activations, or the device's capacity where
    its stages found no split or per-unit choice that fits), so the most frugal
    candidates of each (tp, pp) region are sized at their smallest options
    (:func:`_frugal_peak`), as the plan's out-of-memory regions are."""
    cap = solver.model.cluster.device.memory.capacity_bytes
    sized = _oom_regions(result, cap, solver, limit=len(result.infeasible), modes=modes)
    return min(sized or result.infeasible, key=lambda o: o.min_memory_bytes)


def _sizing_modes(fixed: Mapping[str, Any]) -> tuple[Recompute, ...]:
    """The recomputation a configuration that does not fit is sized with: the pinned mode,
    else full (the least memory the search could reach)."""
    return (fixed["recompute"],) if "recompute" in fixed else (Recompute.FULL,)


def _alternatives(result: SearchResult, solver: ConfigSolver, modes: tuple[Recompute, ...]) -> tuple[Alternative, ...]:
    best_t = result.best.step_time_s

    def priced(o: Outcome, status: str, why: str) -> Alternative:
        """A priced outcome (the search prices what it keeps and its contrasts)."""
        p = o.prediction
        assert p is not None
        slower = p.step_time_s / best_t - 1
        default, modes = unit_modes(o)
        return Alternative(
            config=replace(o.config, recompute=default),
            status=status,
            step_time_s=p.step_time_s,
            memory_bytes_per_device=p.memory_bytes_per_device,
            slower_by=slower,
            over_memory_bytes=0.0,
            reason=f"{why}{100 * slower:.1f}% slower",
            unit_recompute={mode: n for mode, n in modes.items() if mode is not default},
        )

    out = [priced(o, "runner-up", "") for o in result.runners_up]
    for o in result.other_degrees:
        found = " found" if o.step_time_s > result.other_degrees_frontier_s else ""
        out.append(priced(o, "degrees", f"the fastest of its degrees{found}: "))
    for o in result.contrasts:
        if o.config.compile != result.best.config.compile:
            out.append(priced(o, "compile", f"the winner {'compiled' if o.config.compile else 'eager'}: "))
            continue
        if o.config.fp8 != result.best.config.fp8:
            out.append(priced(o, "fp8", f"the winner {'with' if o.config.fp8 else 'without'} FP8 matmuls: "))
            continue
        if o.config.async_tp != result.best.config.async_tp:
            way = "asynchronous" if o.config.async_tp else "synchronous"
            out.append(priced(o, "async_tp", f"the winner with {way} tensor parallelism: "))
            continue
        if o.config.regather != result.best.config.regather:
            way = "keeping shards of" if o.config.regather else "holding"
            out.append(priced(o, "regather", f"the winner {way} the sequence-parallel gathers: "))
            continue
        sharding = "plain FSDP" if o.config.dp_shard is None else f"HSDP with shard groups of {o.config.dp_shard}"
        out.append(priced(o, "sharding", f"the winner with {sharding}: "))
    cap = result.best.prediction.memory_capacity_bytes if result.best.prediction else 0.0
    sized_with = "full recomputation" if modes[0] is Recompute.FULL else f"recompute={modes[0].value!r}"
    for o in _oom_regions(result, cap, solver, modes=modes):
        over = o.min_memory_bytes - cap
        out.append(
            Alternative(
                config=replace(o.config, recompute=allowed_modes(o.config, modes)[0]),  # as it was sized
                status="out-of-memory",
                step_time_s=0.0,
                memory_bytes_per_device=o.min_memory_bytes,
                slower_by=0.0,
                over_memory_bytes=over,
                reason=f"tp={o.config.tp} pp={o.config.pp}: needs about {o.min_memory_bytes / 2**30:.1f} "
                f"GiB per device even with {sized_with} ({over / 2**30:.1f} GiB over)",
            )
        )
    return tuple(out)


def _oom_regions(
    result: SearchResult,
    cap: float,
    solver: ConfigSolver,
    limit: int = 5,
    modes: tuple[Recompute, ...] = (Recompute.FULL,),
) -> list[Outcome]:
    """For each (tp, pp) region where no candidate fits, the closest to fitting: the
    smaller footprint of its two most frugal candidates (smallest micro-batch, highest
    ZeRO stage sharded over all of dp, most experts and context split, sequence
    parallel)."""
    regions: dict[tuple[int, int], list[Outcome]] = {}
    for o in result.infeasible:
        regions.setdefault((o.config.tp, o.config.pp), []).append(o)
    found = []
    for key, members in regions.items():
        if len(members) < result.region_sizes.get(key, 0):
            continue  # some candidate of this region fits (or was only slower)
        smallest_mbs = min(o.config.micro_batch_size for o in members)
        frugal = sorted(
            (o for o in members if o.config.micro_batch_size == smallest_mbs),
            key=lambda o: (
                -o.config.zero_stage,
                o.config.dp_shard is not None,  # plain FSDP shards over all of dp, HSDP over a group
                -o.config.ep,
                -o.config.cp,
                not o.config.sequence_parallel,
                o.config.virtual_stages,
            ),
        )
        # the even split the frugal peak takes may not exist (fewer units than an even cut
        # needs): then the candidate's own least memory stands
        sized = [
            replace(o, min_memory_bytes=max(o.min_memory_bytes, peak)) if math.isfinite(peak) else o
            for o in frugal[:2]
            for peak in [_frugal_peak(solver, o.config, modes)]
        ]
        best = min(sized, key=lambda o: o.min_memory_bytes)
        if cap < best.min_memory_bytes < math.inf:
            found.append(best)
    return sorted(found, key=lambda o: o.min_memory_bytes)[:limit]


def _frugal_peak(
    solver: ConfigSolver, config: ParallelConfig, modes: tuple[Recompute, ...], *, states_only: bool = False
) -> float:
    """The peak of ``config``'s most loaded rank on the even split (interleaved stages'
    rule for ``v > 1``) with every unit at its smallest option (:func:`autopar.cost.peak.frugal_peak_bytes`;
    ``states_only``: its model states alone)."""
    pp, v = config.pp, config.virtual_stages
    chunks = pp * v
    bounds = solver.even_split(chunks, exact=v > 1) if chunks > 1 else (0, solver.num_units)
    if bounds is None:
        return float("inf")
    ranks = [
        [solver.options(u, config, modes) for c in config.stages_of_rank(r) for u in range(bounds[c], bounds[c + 1])]
        for r in range(pp)
    ]
    return frugal_peak_bytes(solver.model, config, ranks, states_only=states_only)


def _notes(graph: LayerGraph, config: ParallelConfig) -> tuple[str, ...]:
    notes = [
        "Predictions model autopar's runtime (DDP/ZeroRedundancyOptimizer/FSDP2, DTensor tensor parallelism, "
        "torch.distributed.pipelining); other frameworks spend memory differently."
    ]
    if not graph.cuttable:
        if config.pp > 1:
            notes.append(f"Not runnable by autopar's runtime as is: {CUT_NOTE}.")
        else:
            notes.append(f"Pipeline parallelism was left out: {CUT_NOTE}.")
    if graph.vocab_size and config.tp > 1 and graph.vocab_size % config.tp:
        notes.append(
            f"Vocabulary {graph.vocab_size} padded to {padded(graph.vocab_size, config.tp)} for tp={config.tp} "
            f"(a multiple of 128 x tp, as Megatron-LM does)."
        )
    if graph.unsplit_experts:
        notes.append(
            f"The experts of {', '.join(graph.unsplit_experts)} run whole on every rank (ep=1), priced as the "
            f"dense matmuls their forward runs (MFU counts the routed share of them, HFU all): expert parallelism "
            f"splits only modules that take routed tokens, {ROUTED_FORM}, and autopar's MoEFeedForward."
        )
    if config.tp > 1 and any(leaf.experts for p in graph.profiles for leaf in p.leaves):
        notes.append(
            f"Tensor parallelism does not split experts: under tp={config.tp} each rank runs its experts whole on "
            f"every routed row of its tensor-parallel group, {config.tp} times the expert work of tp=1 per device "
            f"(expert parallelism, ep, is what splits them; Megatron-Core's expert tensor parallelism is not "
            f"modelled)."
        )
    if graph.seq_len > 1 and not any(p.has_attention for p in graph.profiles):
        notes.append(
            "No unit calls scaled_dot_product_attention: its attention, if any, is priced as the matmuls and "
            "softmax its trace runs (scores materialized), whatever attention= says (a custom attention, such as "
            "gpt-oss's with sinks, which transformers runs eagerly)."
        )
    if graph.uncounted_ops:
        notes.append(
            f"Counted as 0 FLOPs: {', '.join(graph.uncounted_ops)} read weight matrices but have no FLOP formula "
            f"(autopar.graph.flops); compute time and MFU are underestimated for the layers that run them."
        )
    return tuple(notes)
