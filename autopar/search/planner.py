"""``plan()`` and ``estimate()``: search the space, keep the best, explain the rest.

Candidates are costed in increasing order of their time lower bound; the scan stops
when the bound of the next candidate is no better than the ``top``-th best exact cost
found, so the optimum and the runners-up are exact while most of the space is never
costed. A hand-written configuration is the same search with every field fixed.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from torch import nn

from autopar.cluster import Cluster
from autopar.errors import ConfigError, InfeasiblePlanError, check_positive_int
from autopar.graph.extract import extract
from autopar.graph.layer_graph import LayerGraph
from autopar.plan import Alternative, ModelSummary, ParallelConfig, Plan, PlanSettings
from autopar.search.evaluate import Evaluator, Outcome
from autopar.search.predict import predict, smallest_footprint_bytes
from autopar.search.space import (
    CUT_NOTE,
    Rejection,
    check_constraints,
    enumerate_space,
    lower_bounds,
    micro_batch_range,
)
from autopar.vocab import Attention, Optimizer, Recompute

ALL_MODES = (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL)


@dataclass(frozen=True, kw_only=True)
class SearchResult:
    """Everything the search found, before it becomes a Plan."""

    best: Outcome
    runners_up: tuple[Outcome, ...]
    infeasible: tuple[Outcome, ...]
    rejected: tuple[Rejection, ...]
    evaluated: int
    considered: int
    region_sizes: Mapping[tuple[int, int], int] = field(default_factory=dict)
    """How many candidates each (tp, pp) region has: a region is out of memory when all are."""


def plan(
    model: nn.Module | LayerGraph,
    cluster: Cluster,
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
) -> Plan:
    """The fastest plan for ``model`` on ``cluster`` that fits in memory.

    Args:
        model: any ``nn.Module`` (real or on the meta device), or a LayerGraph.
        cluster: where it runs (``Cluster.preset``, ``Cluster.from_json``, ``Cluster.from_profile``).
        global_batch_size: samples per optimizer step.
        seq_len: tokens per sample, for token models.
        sample_input: otherwise, one batch of inputs (values are never read).
        constraints: fixed config fields, e.g. ``{"tp": 8, "pp": 16}``.
        optimizer: ``adam``, ``sgd`` or ``adafactor`` (optimizer state memory).
        attention: ``flash`` or ``materialized`` (attention activation memory).
        profile: profiler report(s) whose measurements replace the analytic defaults.
        top: how many runners-up to keep.
        solver: ``highs`` or ``cbc``.

    Raises:
        InfeasiblePlanError: nothing fits; the message names the smallest memory found.
        ConfigError: bad sizes or constraints.
    """
    started = time.perf_counter()
    check_positive_int("global_batch_size", global_batch_size)
    fixed = check_constraints(constraints)
    cluster, sources, calibration, refwd = _apply_profile(cluster, profile)
    graph = _graph(model, cluster, fixed, seq_len, sample_input, attention)
    evaluator = Evaluator(
        graph=graph,
        cluster=cluster,
        optimizer=Optimizer(optimizer),
        global_batch_size=global_batch_size,
        solver=solver,
        micro_batches=micro_batch_range(graph, cluster, global_batch_size, fixed),
        calibration=calibration,
        recompute_fractions=refwd,
    )
    result = search(evaluator, fixed, top=top)
    if not result.best.fits:
        raise _infeasible(result, cluster, graph)
    return _to_plan(evaluator, result, cluster, graph, global_batch_size, sources, started, attention, solver)


def estimate(
    model: nn.Module | LayerGraph,
    cluster: Cluster,
    config: Mapping[str, Any] | ParallelConfig,
    *,
    global_batch_size: int,
    seq_len: int | None = None,
    sample_input: Any = None,
    optimizer: Optimizer | str = "adam",
    attention: Attention | str = "flash",
    profile: Any = None,
    solver: str = "highs",
) -> Plan:
    """The plan of one given configuration: a search space of size one.

    Fields not given are filled: ``dp`` from the device count, ``num_microbatches`` from
    the batch, stages and per-layer styles by the same search, defaults for the rest
    (micro-batch 1, 1F1B, no virtual stages, ZeRO 0, the device's preferred precision,
    no sequence parallelism; recompute chosen per unit when not given). Never raises for
    memory: a configuration that does not fit comes back with ``prediction.fits`` False
    and the memory it would need.
    """
    started = time.perf_counter()
    check_positive_int("global_batch_size", global_batch_size)
    given = dict(config.__dict__) if isinstance(config, ParallelConfig) else dict(config)
    fixed = check_constraints(given)
    cluster, sources, calibration, refwd = _apply_profile(cluster, profile)
    fixed = _complete(fixed, cluster, global_batch_size)
    graph = _graph(model, cluster, fixed, seq_len, sample_input, attention)
    evaluator = Evaluator(
        graph=graph,
        cluster=cluster,
        optimizer=Optimizer(optimizer),
        global_batch_size=global_batch_size,
        solver=solver,
        calibration=calibration,
        recompute_fractions=refwd,
    )
    result = search(evaluator, fixed, top=0)
    if not result.best.fits:
        result = replace(result, best=_overflow(evaluator, result.best.config, fixed))
    return _to_plan(evaluator, result, cluster, graph, global_batch_size, sources, started, attention, solver)


def search(evaluator: Evaluator, fixed: Mapping[str, Any], *, top: int) -> SearchResult:
    """Cost the candidates in bound order (see the module docstring)."""
    graph, cluster = evaluator.graph, evaluator.cluster
    configs, rejected = enumerate_space(graph, cluster, evaluator.global_batch_size, fixed)
    if not configs:
        reasons = "; ".join(f"{r.what}: {r.reason}" for r in rejected[:6]) or "no candidate"
        raise ConfigError(
            f"no configuration of {cluster.world_size} devices can run global_batch_size="
            f"{evaluator.global_batch_size} with constraints {dict(fixed)}: {reasons}. Change the batch "
            f"size, the device count or the constraints."
        )
    modes = (fixed["recompute"],) if "recompute" in fixed else ALL_MODES
    region_sizes = Counter((c.tp, c.pp) for c in configs)
    cache: dict = {}
    bounded = []
    infeasible: list[Outcome] = []
    for cfg in configs:
        b = lower_bounds(graph, cluster, cfg, evaluator.optimizer, cache)
        if b.memory_bytes > cluster.device.memory_bytes:
            infeasible.append(
                Outcome(
                    config=cfg,
                    fits=False,
                    min_memory_bytes=b.memory_bytes,
                    reason=f"out of memory: needs at least {b.memory_bytes / 2**30:.1f} GiB",
                )
            )
            continue
        bounded.append((evaluator.bound_s(cfg, modes), cfg))
    bounded.sort(key=lambda x: x[0])
    fitting: list[Outcome] = []
    evaluated = 0
    keep = max(top, 0) + 1
    for bound, cfg in bounded:
        if len(fitting) >= keep and bound >= fitting[keep - 1].step_time_s:
            break
        outcome = evaluator.evaluate(cfg, modes)
        evaluated += 1
        if outcome.fits:
            fitting.append(outcome)
            fitting.sort(key=lambda o: o.step_time_s)
        else:
            infeasible.append(outcome)
    if not fitting:
        smallest = min(infeasible, key=lambda o: o.min_memory_bytes)
        return SearchResult(
            best=smallest,
            runners_up=(),
            infeasible=tuple(infeasible),
            rejected=tuple(rejected),
            evaluated=evaluated,
            considered=len(configs),
            region_sizes=region_sizes,
        )
    finished = [replace(o, prediction=predict(evaluator, o.config, o.stages)) for o in fitting[:keep]]
    return SearchResult(
        best=finished[0],
        runners_up=tuple(finished[1:]),
        infeasible=tuple(infeasible),
        rejected=tuple(rejected),
        evaluated=evaluated,
        considered=len(configs),
        region_sizes=region_sizes,
    )


def _graph(model, cluster: Cluster, fixed, seq_len, sample_input, attention) -> LayerGraph:
    if isinstance(model, LayerGraph):
        return model
    dtype = fixed.get("dtype", cluster.device.preferred_dtype)
    return extract(model, seq_len=seq_len, sample_input=sample_input, dtype=dtype, attention=attention)


def _complete(fixed: dict[str, Any], cluster: Cluster, global_batch_size: int) -> dict[str, Any]:
    out = dict(fixed)
    world = cluster.world_size
    tp, pp = out.setdefault("tp", 1), out.setdefault("pp", 1)
    if world % (tp * pp):
        raise ConfigError(f"tp x pp = {tp} x {pp} does not divide the cluster's {world} devices.")
    out.setdefault("dp", world // (tp * pp))
    if out["dp"] * tp * pp != world:
        raise ConfigError(
            f"dp x tp x pp = {out['dp']} x {tp} x {pp} = {out['dp'] * tp * pp} but the cluster has {world} devices."
        )
    if "num_microbatches" in out and "micro_batch_size" not in out:
        per = global_batch_size // out["dp"]
        if per % out["num_microbatches"]:
            raise ConfigError(
                f"num_microbatches={out['num_microbatches']} does not divide the {per} samples per data-parallel rank."
            )
        out["micro_batch_size"] = per // out["num_microbatches"]
    out.setdefault("micro_batch_size", 1)
    out.setdefault("virtual_stages", 1)
    out.setdefault("schedule", "interleaved-1f1b" if out["virtual_stages"] > 1 else "1f1b")
    out.setdefault("zero_stage", 0)
    out.setdefault("sequence_parallel", False)
    out.setdefault("dtype", cluster.device.preferred_dtype)
    return check_constraints(out)


def _overflow(evaluator: Evaluator, config: ParallelConfig, fixed: Mapping[str, Any]) -> Outcome:
    """What a configuration that does not fit would need: its fastest choices without a
    memory cap when recompute was given, else its smallest (full recomputation)."""
    modes = (fixed["recompute"],) if "recompute" in fixed else (Recompute.FULL,)
    unbounded = replace(evaluator, cluster=_huge(evaluator.cluster), _options={}, memo={})
    outcome = unbounded.evaluate(config, modes)
    pred = predict(unbounded, config, outcome.stages)
    real = evaluator.cluster.device.memory_bytes
    pred = replace(
        pred,
        memory_capacity_bytes=real,
        fits=pred.memory_bytes_per_device <= real,
        mfu=pred.mfu * unbounded.cluster.device.peak(config.dtype) / evaluator.cluster.device.peak(config.dtype),
    )
    need = pred.memory_bytes_per_device
    return Outcome(
        config=config,
        fits=False,
        step_time_s=pred.step_time_s,
        prediction=pred,
        stages=outcome.stages,
        min_memory_bytes=need,
        reason=f"out of memory: needs {need / 2**30:.1f} GiB per device, {real / 2**30:.1f} GiB available",
    )


def _huge(cluster: Cluster) -> Cluster:
    """The same cluster with practically unbounded memory (a finite number, which the
    device's validation requires), to price a configuration that does not fit."""
    return replace(cluster, device=replace(cluster.device, memory_bytes=cluster.device.memory_bytes * 1e6))


def _infeasible(result: SearchResult, cluster: Cluster, graph: LayerGraph) -> InfeasiblePlanError:
    best = min(result.infeasible, key=lambda o: o.min_memory_bytes)
    cap = cluster.device.memory_bytes
    cfg = best.config
    hints = []
    if cfg.zero_stage < 3 and cfg.dp > 1:
        hints.append("zero_stage=3")
    hints.append("recompute='full'")
    hints.append(f"more devices (e.g. {2 * cluster.nodes} nodes)")
    return InfeasiblePlanError(
        f"no plan fits: {graph.name} ({graph.num_params / 1e9:.2f}B parameters) needs at least "
        f"{best.min_memory_bytes / 2**30:.1f} GiB per device in the best case found ({cfg.short()}); each "
        f"{cluster.device.name} has {cap / 2**30:.1f} GiB. Try {', '.join(hints)}, or a smaller micro-batch or "
        f"sequence length.",
        min_memory_bytes=best.min_memory_bytes,
        capacity_bytes=cap,
    )


def _to_plan(
    evaluator: Evaluator,
    result: SearchResult,
    cluster: Cluster,
    graph: LayerGraph,
    global_batch_size: int,
    sources: tuple[str, ...],
    started: float,
    attention,
    solver: str,
) -> Plan:
    best = result.best
    assert best.prediction is not None
    strategies, default = evaluator.strategies(best.stages, best.config)
    config = replace(best.config, recompute=default)
    stages = tuple(tuple(m for u in s.units for m in graph.units[u].modules) for s in best.stages)
    alternatives = _alternatives(result, evaluator)
    notes = _notes(graph, config, strategies)
    return Plan(
        config=config,
        stages=stages,
        layer_strategies=strategies,
        prediction=best.prediction,
        alternatives=alternatives,
        model=ModelSummary(
            name=graph.name,
            num_params=graph.num_params,
            units=graph.module_names,
            fingerprint=graph.fingerprint,
            seq_len=graph.seq_len,
            global_batch_size=global_batch_size,
            flops_per_sample=3 * graph.fwd_flops_per_sample,
        ),
        cluster=cluster,
        settings=PlanSettings(
            optimizer=evaluator.optimizer, attention=Attention(attention), profile_sources=sources, solver=solver
        ),
        notes=notes,
        search_time_s=time.perf_counter() - started,
        candidates_evaluated=result.evaluated,
    )


def _alternatives(result: SearchResult, evaluator: Evaluator) -> tuple[Alternative, ...]:
    best_t = result.best.step_time_s
    out = []
    for o in result.runners_up:
        p = o.prediction
        out.append(
            Alternative(
                config=o.config,
                status="runner-up",
                step_time_s=p.step_time_s,
                memory_bytes_per_device=p.memory_bytes_per_device,
                slower_by=p.step_time_s / best_t - 1,
                over_memory_bytes=0.0,
                reason=f"{100 * (p.step_time_s / best_t - 1):.1f}% slower",
            )
        )
    cap = result.best.prediction.memory_capacity_bytes if result.best.prediction else 0.0
    for o in _oom_regions(result, cap, evaluator):
        over = o.min_memory_bytes - cap
        out.append(
            Alternative(
                config=o.config,
                status="out-of-memory",
                step_time_s=0.0,
                memory_bytes_per_device=o.min_memory_bytes,
                slower_by=0.0,
                over_memory_bytes=over,
                reason=f"tp={o.config.tp} pp={o.config.pp}: needs about {o.min_memory_bytes / 2**30:.1f} "
                f"GiB per device even with full recomputation ({over / 2**30:.1f} GiB over)",
            )
        )
    return tuple(out)


def _oom_regions(result: SearchResult, cap: float, evaluator: Evaluator, limit: int = 5) -> list[Outcome]:
    """For each (tp, pp) region where no candidate fits, the closest to fitting: the
    smaller footprint of its two most frugal candidates (smallest micro-batch, highest
    ZeRO stage, sequence parallel)."""
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
            key=lambda o: (-o.config.zero_stage, not o.config.sequence_parallel, o.config.virtual_stages),
        )
        sized = [
            replace(o, min_memory_bytes=max(o.min_memory_bytes, smallest_footprint_bytes(evaluator, o.config)))
            for o in frugal[:2]
        ]
        best = min(sized, key=lambda o: o.min_memory_bytes)
        if best.min_memory_bytes > cap:
            found.append(best)
    return sorted(found, key=lambda o: o.min_memory_bytes)[:limit]


def _notes(graph: LayerGraph, config: ParallelConfig, strategies) -> tuple[str, ...]:
    from autopar.cost.tensor_parallel import padded

    notes = [
        "Predictions model autopar's runtime (DDP/ZeroRedundancyOptimizer/FSDP2, DTensor tensor parallelism, "
        "torch.distributed.pipelining); other frameworks spend memory differently."
    ]
    if config.pp > 1 and not graph.cuttable:
        notes.append(f"Not runnable by autopar's runtime as is: {CUT_NOTE}.")
    if graph.vocab_size and config.tp > 1 and graph.vocab_size % config.tp:
        notes.append(
            f"Vocabulary {graph.vocab_size} padded to {padded(graph.vocab_size, config.tp)} for tp={config.tp} "
            f"(a multiple of 128 x tp, as Megatron-LM does)."
        )
    return tuple(notes)


def _apply_profile(
    cluster: Cluster, profile: Any
) -> tuple[Cluster, tuple[str, ...], dict[str, float], dict[str, float]]:
    """Measured numbers replace the analytic defaults: device curves and links in the
    cluster, and per-unit compute factors and recompute fractions for the units the
    profile measured."""
    if profile is None:
        return cluster, (), {}, {}
    from autopar.profiles import (
        cluster_from_profiles,
        has_layers,
        layer_calibration,
        profile_sources,
        recompute_calibration,
    )

    reports = profile if isinstance(profile, (list, tuple)) else [profile]
    calibration = layer_calibration(reports, base=cluster) if has_layers(reports) else {}
    return (
        cluster_from_profiles(reports, base=cluster),
        profile_sources(reports),
        calibration,
        recompute_calibration(reports),
    )


__all__ = ["SearchResult", "estimate", "plan", "search"]
