"""``plan()`` and ``estimate()``: the public entry points of the search.

``plan`` scans the whole space (:mod:`autopar.search.scan`) and keeps the fastest
configuration that fits with its runners-up; ``estimate`` is the same search with every
given field fixed, a space of size one, and prices a configuration that does not fit
within an unbounded memory budget instead of failing.
"""

from __future__ import annotations

import functools
import gc
import math
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any, ParamSpec, TypeVar

from torch import nn

from autopar.cost.model import ROUTING_IMBALANCE, CostModel
from autopar.cost.peak import budget_bytes
from autopar.cost.price import price
from autopar.errors import (
    ConfigError,
    DeviceCountError,
    ModelError,
    check_positive_int,
)
from autopar.graph.extract import extract
from autopar.graph.layer_graph import LayerGraph
from autopar.hardware.cluster import Cluster
from autopar.models.positions import check_seq_len, longest_length_note, max_positions
from autopar.parallel_config import ONE_REPLICA_REDUCES_NOTHING
from autopar.plan import ParallelConfig, Plan, PlanSettings
from autopar.plan_checks import check_sequence_parallel
from autopar.profiles.apply import Measurements, measurements
from autopar.profiles.identity import LayerProfileMatch, match_layer_profile
from autopar.search.assemble import Provenance, infeasible_error, to_plan
from autopar.search.constraints import check_constraints, check_degrees
from autopar.search.context_degrees import cp_below_floor, cp_floor_note, floor_lifted_note
from autopar.search.experts import check_routing_imbalance
from autopar.search.ilp import check_solver
from autopar.search.kernel_options import check_async_tp, check_fp8
from autopar.search.plan_inputs import (
    as_cluster,
    check_batch,
    check_headroom,
    check_imbalance,
    check_top,
    option,
    with_headroom,
)
from autopar.search.scan import decided, search
from autopar.search.solve import ConfigSolver, Outcome
from autopar.search.space import micro_batch_range
from autopar.vocab import ActivationLayout, Attention, DType, Optimizer, Recompute

P = ParamSpec("P")
R = TypeVar("R")


def _cycles_collected_after(fn: Callable[P, R]) -> Callable[P, R]:
    """Runs ``fn`` with Python's cycle collector paused, and resumes it after. Planning
    makes millions of short-lived objects that reference counting frees, and each time
    they pass the collector's threshold it walks every object in the process: with
    PyTorch's compiler stack loaded (any meta or fake tensor loads it), those walks took a
    fifth of a large plan's time. What cyclic garbage planning leaves is collected after."""

    @functools.wraps(fn)
    def paused(*args: P.args, **kwargs: P.kwargs) -> R:
        if not gc.isenabled():
            return fn(*args, **kwargs)
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            gc.enable()

    return paused


@_cycles_collected_after
def plan(
    model: nn.Module | LayerGraph,
    cluster: Cluster | str,
    *,
    global_batch_size: int,
    seq_len: int | None = None,
    sample_input: Any = None,
    constraints: Mapping[str, Any] | None = None,
    optimizer: Optimizer | str = "adam",
    attention: Attention | str = "flash",
    profile: Any = None,
    top: int = 5,
    solver: str = "highs",
    routing_imbalance: float = ROUTING_IMBALANCE,
    activations: ActivationLayout | str = ActivationLayout.BATCH_FIRST,
    memory_headroom_gib: float = 0.0,
) -> Plan:
    """The fastest plan for ``model`` on ``cluster`` that fits in memory.

    Args:
        model: any ``nn.Module`` (real or on the meta device), or a LayerGraph.
        cluster: where it runs (``autopar.preset``, ``autopar.load_cluster``,
            ``autopar.cluster_from_profiles``), or a spec string as the command line
            takes it: ``"dgx-a100-80gb:4"`` (preset:nodes), a preset name, a cluster file.
        global_batch_size: samples per optimizer step.
        seq_len: tokens per sample, for token models. Left out (with no
            ``sample_input``), a token model whose config gives its longest sequence
            (``max_position_embeddings``, ``n_positions``, ``seq_len``) is planned at that
            length, with a warning and a note on the plan saying so.
        sample_input: otherwise, one batch of inputs (values are never read).
        constraints: fixed config fields, e.g. ``{"tp": 8, "pp": 16}``.
        optimizer: ``adam``, ``sgd`` or ``adafactor`` (optimizer state memory).
        attention: ``flash`` or ``materialized`` (attention activation memory).
        profile: profile report(s) whose measurements replace the analytic defaults.
        top: how many runners-up to keep.
        solver: ``highs`` or ``cbc``.
        routing_imbalance: under expert parallelism, the busiest rank's routed rows over
            the mean for dropless experts (a number >= 1; 1: a balanced router).
        activations: ``batch-first`` (autopar's runtime) or ``sequence-first``
            (Megatron-LM's layout, which makes no copies around sequence-parallel
            collectives: for a plan to be exported there; the plan's notes say so).
        memory_headroom_gib: GiB of each device to keep free beyond its reserve, a
            margin for what the prediction may miss: the plan fits without them.

    Raises:
        InfeasiblePlanError: nothing fits; the message names the smallest memory found.
        ConfigError: bad sizes, constraints or options, or a sequence longer than the
            model's positions (ClusterError for a bad cluster).
        ProfileModelError: ``profile`` has a layers section of another model (a
            ConfigError; one of this model at another shape is used, and the plan's
            notes say so).
    """
    started = time.perf_counter()
    global_batch_size = check_batch(global_batch_size)
    seq_len = check_positive_int("seq_len", seq_len) if seq_len is not None else None
    check_top(top)
    check_solver(solver)
    check_imbalance(routing_imbalance)
    headroom_gib = check_headroom(memory_headroom_gib)
    cluster = as_cluster(cluster)
    optimizer, attention = option("optimizer", optimizer, Optimizer), option("attention", attention, Attention)
    activations = option("activations", activations, ActivationLayout)
    megatron = activations.megatron_kernels
    fixed = check_constraints(constraints, megatron_kernels=megatron)
    measured = measurements(cluster, profile)
    measured = replace(measured, cluster=with_headroom(measured.cluster, headroom_gib))
    seq_len, seq_note = _default_seq_len(model, seq_len, sample_input)
    graph = _graph(model, measured.cluster, fixed, seq_len, sample_input, attention)
    check_routing_imbalance(graph, routing_imbalance)
    match = match_layer_profile(measured.layers, model, graph)
    solver_ = ConfigSolver(
        model=_cost_model(graph, measured, optimizer, global_batch_size, routing_imbalance, activations),
        budget_bytes=budget_bytes(measured.cluster.device.memory),
        solver=solver,
        micro_batches=micro_batch_range(graph, measured.cluster, global_batch_size, fixed),
    )
    unsearched = cp_below_floor(graph, measured.cluster.world_size, fixed)
    floor_note = cp_floor_note(unsearched, graph.seq_len) if unsearched else ""
    try:
        result = search(solver_, fixed, top=top)
    except DeviceCountError as refused:  # the degrees below the floor may be what the constraints need
        if not floor_note:
            raise
        raise DeviceCountError(f"{refused} {floor_note}") from None
    if not result.best.fits:
        refused = infeasible_error(result, solver_, graph, fixed=fixed, optimizer=optimizer)
        counted = f"These figures count the {headroom_gib:g} GiB of headroom asked for." if headroom_gib else ""
        added = [n for n in (counted, floor_note) if n]  # floor: a wider ring holds fewer tokens per rank
        refused.args = (" ".join([str(refused), *added]),)
        raise refused
    provenance = _provenance(
        measured,
        optimizer,
        attention,
        solver,
        routing_imbalance,
        activations,
        started,
        headroom_bytes=headroom_gib * 2**30,
    )
    plan = _noted(to_plan(solver_, result, provenance, fixed), match, seq_note, activations)
    check_sequence_parallel(plan)  # an estimate notes it
    lifted = floor_lifted_note(plan.config, graph.seq_len, fixed)
    added = tuple(n for n in (floor_note, lifted) if n)
    return replace(plan, notes=(*plan.notes, *added)) if added else plan


@_cycles_collected_after
def estimate(
    model: nn.Module | LayerGraph,
    cluster: Cluster | str,
    config: Mapping[str, Any] | ParallelConfig,
    *,
    global_batch_size: int,
    seq_len: int | None = None,
    sample_input: Any = None,
    optimizer: Optimizer | str = "adam",
    attention: Attention | str = "flash",
    profile: Any = None,
    solver: str = "highs",
    routing_imbalance: float = ROUTING_IMBALANCE,
    activations: ActivationLayout | str = ActivationLayout.BATCH_FIRST,
    memory_headroom_gib: float = 0.0,
) -> Plan:
    """The plan of one given configuration: a search space of size one.

    Fields not given are filled: ``dp`` from the device count, ``num_microbatches`` from
    the batch, stages and per-layer styles by the same search, defaults for the rest
    (micro-batch 1, 1F1B, no virtual stages (2 for a schedule given that runs several
    per rank), ZeRO 0 sharded over all of dp (no HSDP),
    the device's preferred precision, no sequence parallelism, blocks compiled where the
    device compiles unasked (``DeviceSpec.compiles``), no FP8 or asynchronous TP;
    recompute chosen per unit when not given). A :class:`ParallelConfig` gives every
    field, its own defaults included (recompute ``none``, eager blocks), so it is priced
    as it stands; pass a mapping to have the rest filled as above. Never raises for
    memory: a configuration that does not fit comes back with ``prediction.fits`` False
    and the memory it would need. A layer profile is checked as :func:`plan` checks it,
    and a missing ``seq_len`` and ``memory_headroom_gib`` mean what they mean there.
    """
    started = time.perf_counter()
    global_batch_size = check_batch(global_batch_size)
    seq_len = check_positive_int("seq_len", seq_len) if seq_len is not None else None
    check_solver(solver)
    check_imbalance(routing_imbalance)
    headroom_gib = check_headroom(memory_headroom_gib)
    cluster = as_cluster(cluster)
    optimizer, attention = option("optimizer", optimizer, Optimizer), option("attention", attention, Attention)
    activations = option("activations", activations, ActivationLayout)
    megatron = activations.megatron_kernels
    fixed = check_constraints(
        config.__dict__ if isinstance(config, ParallelConfig) else config, what="config", megatron_kernels=megatron
    )
    given = set(fixed)
    measured = measurements(cluster, profile)
    measured = replace(measured, cluster=with_headroom(measured.cluster, headroom_gib))
    fixed = _complete(fixed, measured.cluster, global_batch_size, megatron_kernels=megatron)
    seq_len, seq_note = _default_seq_len(model, seq_len, sample_input)
    graph = _graph(model, measured.cluster, fixed, seq_len, sample_input, attention)
    check_routing_imbalance(graph, routing_imbalance)
    match = match_layer_profile(measured.layers, model, graph)
    cost_model = _cost_model(graph, measured, optimizer, global_batch_size, routing_imbalance, activations)
    solver_ = ConfigSolver(model=cost_model, budget_bytes=budget_bytes(measured.cluster.device.memory), solver=solver)
    result = search(solver_, fixed, top=0, given=given)
    if not result.best.fits:  # priced as given: nothing else was rejected, and it is one configuration
        result = replace(result, best=_overflow(cost_model, result.best.config, fixed, solver), infeasible=())
    result = replace(result, evaluated=1)
    provenance = _provenance(
        measured,
        optimizer,
        attention,
        solver,
        routing_imbalance,
        activations,
        started,
        searched=False,
        headroom_bytes=headroom_gib * 2**30,
    )
    return _noted(to_plan(solver_, result, provenance), match, seq_note, activations)


def _cost_model(
    graph: LayerGraph,
    measured: Measurements,
    optimizer: Optimizer,
    batch: int,
    routing_imbalance: float,
    activations: ActivationLayout,
) -> CostModel:
    return CostModel(
        graph=graph,
        cluster=measured.cluster,
        optimizer=optimizer,
        global_batch_size=batch,
        calibration=measured.calibration,
        recompute_fractions=measured.recompute_fractions,
        routing_imbalance=float(routing_imbalance),
        batch_first=activations is ActivationLayout.BATCH_FIRST,
    )


SEQUENCE_FIRST_NOTE = (
    "Priced for sequence-first activations (Megatron-LM's layout), whose sequence-parallel collectives copy "
    "nothing; autopar's runtime lays activations out batch-first and pays those copies, which this prediction "
    "leaves out."
)


def _noted(plan: Plan, match: LayerProfileMatch | None, seq_note: str | None, activations: ActivationLayout) -> Plan:
    """``plan`` with, among its notes, the sequence length taken from the model's
    maximum, what its layer profile's match says (where the profile was measured at
    another shape, or matched without a model fingerprint), and a sequence-first
    pricing of a plan that has sequence-parallel collectives."""
    extra: tuple[str, ...] = (seq_note,) if seq_note else ()
    if activations.megatron_kernels and plan.config.sequence_parallel:
        extra += (SEQUENCE_FIRST_NOTE,)
    if match is not None:
        c = plan.config
        extra += match.notes(
            micro_batch=c.micro_batch_size,
            seq_len=plan.model.seq_len,
            dtype=c.dtype.value,
            device=plan.cluster.device.name,
        )
    return replace(plan, notes=plan.notes + extra) if extra else plan


def _default_seq_len(model: object, seq_len: int | None, sample_input: Any) -> tuple[int | None, str | None]:
    """``seq_len`` as given; left out with no ``sample_input``, for a token model (one
    with an ``nn.Embedding``) whose config gives its longest sequence, that length and a
    note saying so, also issued as a warning: a plan silently made for a 32K-token
    context when training runs at 4K would be wrong in memory and time."""
    if seq_len is not None or sample_input is not None or not isinstance(model, nn.Module):
        return seq_len, None
    limit = max_positions(model)
    if limit is None or not any(isinstance(m, nn.Embedding) for m in model.modules()):
        return None, None
    note = longest_length_note(limit, "seq_len=", getattr(model, "config", None))
    warnings.warn(note, UserWarning, stacklevel=4)
    return limit[0], note


def _provenance(
    measured: Measurements,
    optimizer: Optimizer,
    attention: Attention,
    solver: str,
    imbalance: float,
    activations: ActivationLayout,
    started: float,
    *,
    searched: bool = True,
    headroom_bytes: float = 0.0,
) -> Provenance:
    settings = PlanSettings(
        searched=searched,
        optimizer=optimizer,
        attention=attention,
        profile_sources=measured.sources,
        solver=solver,
        routing_imbalance=float(imbalance),
        activations=activations,
        memory_headroom_bytes=headroom_bytes,
    )
    return Provenance(settings=settings, search_time_s=time.perf_counter() - started)


def model_graph(
    model: nn.Module | LayerGraph,
    cluster: Cluster,
    constraints: Mapping[str, Any],
    *,
    seq_len: int | None,
    sample_input: Any,
    attention: Attention | str,
) -> LayerGraph:
    """The layer graph :func:`plan` prices ``model`` by, with its checks and its default
    sequence length (a warning says so): for callers that plan one model many times,
    such as :func:`autopar.present.whatif.fewest_nodes`."""
    seq_len, _ = _default_seq_len(model, seq_len, sample_input)
    return _graph(model, cluster, constraints, seq_len, sample_input, option("attention", attention, Attention))


def _graph(model, cluster: Cluster, fixed, seq_len, sample_input, attention) -> LayerGraph:
    if isinstance(model, LayerGraph):
        if sample_input is not None or (seq_len is not None and seq_len != model.seq_len):
            given = f"seq_len={seq_len}" if sample_input is None else "sample_input="
            raise ConfigError(
                f"{given} is not allowed with a LayerGraph: the graph of {model.name} was extracted at "
                f"{model.seq_len} tokens and prices that length only; extract it again at the length wanted "
                f"(autopar.graph.extract), or pass the model."
            )
        graph = model
    else:
        if isinstance(model, nn.Module) and next(model.parameters(), None) is None:
            raise ModelError(_NO_PARAMETERS.format(name=type(model).__name__))
        if seq_len is not None:
            check_seq_len(seq_len, model)
        dtype = fixed.get("dtype", cluster.device.preferred_dtype)
        graph = extract(model, seq_len=seq_len, sample_input=sample_input, dtype=dtype, attention=attention)
    if graph.num_params == 0:
        raise ModelError(_NO_PARAMETERS.format(name=graph.name))
    return graph


_NO_PARAMETERS = (
    "model {name} has no parameters: there is nothing to train, shard or synchronise, and its plan could not "
    "run. Pass the model with its layers (on the meta device for a large one)."
)


def _complete(
    fixed: dict[str, Any], cluster: Cluster, global_batch_size: int, *, megatron_kernels: bool = False
) -> dict[str, Any]:
    out = dict(fixed)
    world = cluster.world_size
    tp, pp, cp = out.setdefault("tp", 1), out.setdefault("pp", 1), out.setdefault("cp", 1)
    check_degrees(out, world)  # the product of those given divides world; of all four, is world
    out.setdefault("dp", world // (tp * cp * pp))
    if "num_microbatches" in out and "micro_batch_size" not in out:
        if global_batch_size % out["dp"]:
            raise ConfigError(
                f"num_microbatches={out['num_microbatches']} splits each data-parallel rank's samples, but global "
                f"batch {global_batch_size} is not divisible by dp={out['dp']}; fix dp, micro_batch_size or the batch "
                f"size."
            )
        per = global_batch_size // out["dp"]
        if per % out["num_microbatches"]:
            raise ConfigError(
                f"num_microbatches={out['num_microbatches']} does not divide the {per} samples per data-parallel rank."
            )
        out["micro_batch_size"] = per // out["num_microbatches"]
    out.setdefault("micro_batch_size", 1)
    schedule = out.get("schedule")  # a Schedule: check_constraints converted it
    several = schedule is not None and schedule.multi_stage
    if several and "pp" not in fixed:
        raise ConfigError(
            f"schedule={schedule.value!r} runs several stages per rank of a pipeline, and no pp was given (1 by "
            f"default); set pp to 2 or more as well."
        )
    out.setdefault("virtual_stages", 2 if several else 1)  # a schedule of stages per rank: its fewest
    out.setdefault("schedule", "interleaved-1f1b" if out["virtual_stages"] > 1 else "1f1b")
    reduce_dtype = out.get("reduce_dtype", DType.FP32)
    if reduce_dtype is not DType.FP32 and out["dp"] * out["cp"] == 1:  # first: no zero_stage would help
        raise ConfigError(ONE_REPLICA_REDUCES_NOTHING)
    if reduce_dtype is not DType.FP32 and "zero_stage" not in out:
        raise ConfigError(
            f"reduce_dtype={reduce_dtype.value!r} needs zero_stage 2 or 3, and estimate prices zero_stage=0 unless "
            f"given; set zero_stage=2 or 3 too."
        )
    out.setdefault("zero_stage", 0)
    out.setdefault("dp_shard", None)
    out.setdefault("sequence_parallel", False)
    out.setdefault("dtype", cluster.device.preferred_dtype)
    out.setdefault("compile", cluster.device.compiles)
    out.setdefault("fp8", False)
    out.setdefault("async_tp", False)
    out.setdefault("regather", megatron_kernels and out["sequence_parallel"])  # Megatron-LM's kernels keep shards
    check_fp8(out, cluster)
    check_async_tp(out, cluster)
    return check_constraints(out, megatron_kernels=megatron_kernels)


def _overflow(model: CostModel, config: ParallelConfig, fixed: Mapping[str, Any], solver: str) -> Outcome:
    """What a configuration that does not fit would need: its fastest choices without a
    memory budget when recompute was given, else its smallest (full recomputation),
    priced against the real device."""
    modes = (fixed["recompute"],) if "recompute" in fixed else (Recompute.FULL,)
    unbounded = ConfigSolver(model=model, budget_bytes=math.inf, solver=solver).evaluate(config, modes)
    pred = price(model, decided(unbounded))
    need, real = pred.memory_bytes_per_device, pred.memory_capacity_bytes
    return Outcome(
        config=config,
        fits=False,
        step_time_s=pred.step_time_s,
        prediction=pred,
        stages=unbounded.stages,
        min_memory_bytes=need,
        reason=f"out of memory: needs {need / 2**30:.1f} GiB per device, {real / 2**30:.1f} GiB available",
    )


__all__ = ["estimate", "plan"]
