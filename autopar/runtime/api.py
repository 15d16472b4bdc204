"""``parallelize(model, plan, loss_fn=...)``: run a plan on this rank.

Every check that can fail on local facts runs first, identically on every rank, so a
wrong plan raises a typed error everywhere before any collective (world size, model
fingerprint, units, schedule, tensor-parallel styles). Then, in torchtitan's order:
device mesh -> cut to this rank's stages -> FP8 linears in the blocks
(:mod:`autopar.runtime.fp8`, when the plan asks) -> tensor parallel -> activation
checkpointing -> compiled blocks (:mod:`autopar.runtime.compile`; not in dry runs; an ``async_tp``
plan first registers the tensor-parallel group for symmetric memory, :mod:`autopar.runtime.async_tp`) ->
FSDP2 (sharding on the meta device when the model is there) ->
materialisation of a meta model -> DDP -> ``PipelineStage`` and the schedule.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from autopar.errors import ConfigError
from autopar.graph.extract import extract
from autopar.graph.units import model_fingerprint
from autopar.model_match import model_problem
from autopar.plan import Plan
from autopar.plan_checks import check_sequence_parallel
from autopar.runtime.agreement import check_agreement
from autopar.runtime.async_tp import check_async_tp, enable_async_tp
from autopar.runtime.compile import compile_blocks
from autopar.runtime.context_parallel import bind_positions, check_context_parallel, local_positions, position_keyword
from autopar.runtime.data_parallel import DataParallelSpec, apply_data_parallel
from autopar.runtime.errors import PlanMismatchError
from autopar.runtime.expert_parallel import SharedWeightSync, apply_expert_parallel, check_expert_parallel
from autopar.runtime.finite import DEFAULT_MAX_CONSECUTIVE_SKIPS, SkipCounter
from autopar.runtime.fp8 import EMULATION_WARNING, check_fp8, check_saved_inputs, convert_blocks, emulated
from autopar.runtime.init import InitFn, Materializer, is_meta, tied_names, to_empty_tied
from autopar.runtime.job import Job, JobParts
from autopar.runtime.layouts import TPLayout, resolve
from autopar.runtime.loss_scale import LossScaler
from autopar.runtime.mesh import MeshDims, build_mesh, data_parallel_mesh, expert_meshes, weight_replicas_mesh
from autopar.runtime.metrics import MemoryMeter
from autopar.runtime.orphan import tie_to_launcher
from autopar.runtime.pipeline import build_schedule, build_stages, check_cuttable, check_schedule, cut, tensor_outputs
from autopar.runtime.recompute import apply_recompute
from autopar.runtime.regather import apply_regather, check_regather
from autopar.runtime.tensor_parallel import apply_tensor_parallel, convert_unit_inputs
from autopar.runtime.tied import TiedGradSync, TiedParam, check_tied_stages, find_tied
from autopar.vocab import DType, TPStyle

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class Analysis:
    """What the local checks found: the tensor-parallel layouts and the tied parameters.

    Computed by :func:`analyse` without any collective; a dry run that applies one plan
    for many ranks computes it once.
    """

    layout: TPLayout | None
    tied: tuple[TiedParam, ...]


def check_plan(plan: Plan) -> None:
    """The checks that need the plan alone, so ``autopar run`` makes them before any rank
    starts: the schedule can run its micro-batches, kept shards are on eager blocks, FP8
    layers' inputs are priced as torchao keeps them, sequence parallelism has a layer
    to gather the sequence back."""
    check_schedule(plan)
    check_regather(plan)
    check_saved_inputs(plan)
    check_sequence_parallel(plan)


def analyse(model: nn.Module, plan: Plan, *, sample_input: Any = None) -> Analysis:
    """Every check that needs no process group, raising a typed error on a bad plan:
    model fingerprint and units, schedule, pipeline cut, tensor-parallel styles, context
    and expert parallelism."""
    _check_model(model, plan)
    check_plan(plan)
    check_context_parallel(model, plan)
    check_expert_parallel(model, plan)
    check_cuttable(model, plan)
    tied = find_tied(model, plan.stages, plan.config.rank_of_stage)
    check_tied_stages(tied, plan.config.schedule.value)
    return Analysis(layout=_tp_layout(model, plan, sample_input), tied=tied)


def parallelize(
    model: nn.Module,
    plan: Plan,
    *,
    loss_fn: LossFn,
    init_fn: InitFn | None = None,
    seed: int = 0,
    sample_input: Any = None,
    device: torch.device | str | None = None,
    measure_memory: bool = True,
    analysis: Analysis | None = None,
    materialize: bool = True,
    fake_mode: FakeTensorMode | None = None,
    max_consecutive_skips: int = DEFAULT_MAX_CONSECUTIVE_SKIPS,
) -> Job:
    """Apply ``plan`` to ``model`` on this rank and return the Job that trains it.

    Call on every rank after ``torch.distributed.init_process_group`` (``torchrun`` or
    ``autopar run`` do it). The job takes ownership of ``model``: its units are shared
    with this rank's stages and sharded in place; units of other stages are not used.

    Args:
        model: the model the plan was made for, real or on the meta device.
        plan: the plan (``autopar.Plan.load(path)``).
        loss_fn: ``loss_fn(output, target) -> scalar``, the mean over a micro-batch.
            An fp16 plan scales it dynamically (:mod:`autopar.runtime.loss_scale`);
            ``job.step`` still returns the unscaled loss.
            With a column-sharded head on a token model the output is a DTensor of
            vocabulary-sharded logits and the loss runs under ``loss_parallel``, so
            ``F.cross_entropy`` works unchanged.
        init_fn: for a meta model, ``init_fn(unit_module)`` sets every parameter and
            buffer of one unit (default: each submodule's ``reset_parameters``); see
            :mod:`autopar.runtime.init`.
        seed: the seed of that initialisation.
        sample_input: one micro-batch of inputs, needed only for non-token models whose
            plan shards layers (the tensor-parallel layouts come from tracing one
            forward); token models are traced with the plan's sequence length.
        device: where this rank computes (default ``cuda:LOCAL_RANK`` on NCCL, else CPU).
        measure_memory: record each step's peak memory in ``job.metrics`` (on CPU this
            counts tensor storages through a dispatch mode, which slows small steps;
            see :mod:`autopar.runtime.metrics`). Dynamo compiles nothing under a
            dispatch mode, so a compiled plan on CPU does not measure its memory, and
            says so in a warning.
        analysis: the result of :func:`analyse` for this model and plan, if already made.
        materialize: False keeps a meta model on the meta device, sharded but without
            storage, and skips DDP (which needs real tensors) and compiling the blocks
            (which needs real tensors too): for dry runs only.
        fake_mode: with ``materialize=False``, give the parameters fake storage in this
            ``FakeTensorMode`` and then apply data parallelism and mixed precision as for a
            real run (DDP's all-reduce through FSDP2's ``replicate``, which takes fake
            tensors): for measured dry runs (:mod:`autopar.runtime.dry_step`).
        max_consecutive_skips: steps in a row the optimizer may skip because some rank's
            loss or gradient is not finite before the job stops with
            :class:`~autopar.runtime.errors.NonFiniteError` (:mod:`autopar.runtime.finite`).
    """
    tie_to_launcher()
    if (
        isinstance(max_consecutive_skips, bool)
        or not isinstance(max_consecutive_skips, int)
        or max_consecutive_skips < 0
    ):
        raise ConfigError(
            f"max_consecutive_skips={max_consecutive_skips!r}: it must be an integer >= 0 (0 stops the job at "
            f"the first non-finite step); pass e.g. {DEFAULT_MAX_CONSECUTIVE_SKIPS}."
        )
    dims = MeshDims.of(plan)
    if not dist.is_initialized():
        raise PlanMismatchError(
            "no default process group: call torch.distributed.init_process_group (torchrun or "
            "autopar run do it) before autopar.parallelize."
        )
    device = torch.device(device) if device is not None else _default_device()
    float8 = check_fp8(plan.config.compile and materialize, device) if plan.config.fp8 else None
    async_tp = plan.config.async_tp and materialize  # a dry run compiles nothing: its collectives run synchronously
    if async_tp:
        check_async_tp(device)
    check_agreement(plan, model_fingerprint(model))
    dims.check_world_size(dist.get_world_size())
    analysis = analysis or analyse(model, plan, sample_input=sample_input)
    layout, tied = analysis.layout, analysis.tied
    if float8 is not None and emulated(device) and materialize:  # a dry run times nothing
        warnings.warn(EMULATION_WARNING.format(device=device), stacklevel=2)
    if measure_memory and plan.config.compile and device.type == "cpu" and materialize:
        warnings.warn(
            "compile=True on CPU: the step's memory is not measured (the dispatch mode that counts it on CPU "
            "keeps torch.compile from compiling); pass measure_memory=False to silence this.",
            stacklevel=2,
        )
        measure_memory = False
    memory = MemoryMeter(device, enabled=measure_memory)

    mesh = build_mesh(dims, device.type)
    coord = dims.coordinate(dist.get_rank())
    indices = plan.stage_of_rank(coord[0])
    local_units = tuple(u for i in indices for u in plan.stages[i])
    meta = is_meta(model)
    materializer = Materializer(model, plan.model.units, local_units, init_fn, seed) if meta and materialize else None
    tied_fqns = tied_names(model)  # before tensor parallelism replaces tied parameters module by module
    cp = dims.cp
    _without_kv_cache(model)
    stages = [cut(model, plan.stages[i], plan.model.units, plan.model.seq_len // cp) for i in indices]
    if not meta:
        stages = [s.to(device) for s in stages]
    positions = local_positions(plan.model.seq_len, cp, coord[2], device) if cp > 1 else None
    replicas = weight_replicas_mesh(mesh, dims, device.type)
    dp_mesh = data_parallel_mesh(replicas, dims, device.type)
    experts_mesh = expert_meshes(replicas, dims, device.type) if dims.ep > 1 else None
    if async_tp:
        enable_async_tp(mesh["tp"], device)
    compiled: list[str] = []
    for stage, i in zip(stages, indices):
        if positions is not None:
            bind_positions(stage, position_keyword(model), positions)
        tensor_outputs(stage)
        if float8 is not None:
            convert_blocks(stage, list(plan.stages[i]), emulate=emulated(device), float8=float8)
        if layout is not None:
            apply_tensor_parallel(stage, layout, mesh["tp"], tuple(t.fqns for t in tied))
        if experts_mesh is not None:
            apply_expert_parallel(stage, experts_mesh.ep, plan.settings.routing_imbalance)
        if plan.config.regather and layout is not None:
            apply_regather(stage, list(plan.stages[i]), layout, plan)
        apply_recompute(stage, list(plan.stages[i]), plan)
        if layout is not None:
            convert_unit_inputs(stage, layout, mesh["tp"])
        if plan.config.compile and materialize:
            compiled += compile_blocks(stage, list(plan.stages[i]))
    spec_of = [_dp_spec(plan, stage, plan.stages[i]) for stage, i in zip(stages, indices)]
    sharded_on_meta = plan.config.zero_stage >= 2 and dims.dp_cp > 1
    ep_replicate = experts_mesh.replicas if experts_mesh is not None else None
    if sharded_on_meta:
        stages = [apply_data_parallel(s, spec, dp_mesh, ep_replicate) for s, spec in zip(stages, spec_of)]
    if materializer is not None:
        materializer.fill(stages, device)
    if fake_mode is not None:  # fake storage, tied parameters kept tied as the materializer keeps them
        with fake_mode:
            for s in stages:
                to_empty_tied(s, device, tied_fqns)
    if not sharded_on_meta and (materialize or not meta or fake_mode is not None):
        stages = [apply_data_parallel(s, spec, dp_mesh, ep_replicate) for s, spec in zip(stages, spec_of)]

    tied_sync = TiedGradSync(tied, dims, coord)
    pipeline_stages = build_stages(stages, indices, plan, device, mesh["pp"].get_group())
    scaler = LossScaler() if plan.config.dtype is DType.FP16 else None
    schedule = build_schedule(pipeline_stages, plan, scaler.scaled(loss_fn) if scaler is not None else loss_fn)
    parts = JobParts(
        plan=plan,
        mesh=mesh,
        stages=stages,
        stage_indices=indices,
        schedule=schedule,
        pipeline_stages=pipeline_stages,
        tied=tied,
        tied_sync=tied_sync,
        shared_sync=SharedWeightSync(stages, experts_mesh.ep if experts_mesh is not None else None),
        loss_parallel=layout is not None and layout.loss_parallel,
        dp_cp_group=replicas.get_group(),
        positions=positions,
        device=device,
        memory=memory,
        scaler=scaler,
        skips=SkipCounter(max_consecutive_skips=max_consecutive_skips),
        compiled_blocks=tuple(compiled),
        async_tp=async_tp,
    )
    return Job(parts)


def _without_kv_cache(model: nn.Module) -> None:
    """Turn off a transformers model's key/value cache (``config.use_cache``, on by default
    in most decoders): training needs none, and a recomputed layer would run its attention
    again against the cache its forward filled (per-operator recomputation then fails at
    the first backward). transformers turns it off under its own gradient checkpointing."""
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False) is True:
        config.use_cache = False


def _default_device() -> torch.device:
    if dist.get_backend() == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _check_model(model: nn.Module, plan: Plan) -> None:
    problem = model_problem(model, plan.model)
    if problem:
        raise PlanMismatchError(f"{problem}; make a plan for this model, or pass the plan's.")
    low = next(
        ((n, p.dtype) for n, p in model.named_parameters() if p.is_floating_point() and p.dtype != torch.float32), None
    )
    if low is not None:
        raise PlanMismatchError(
            f"parameter {low[0]} is {str(low[1]).removeprefix('torch.')}; autopar's runtime keeps fp32 master "
            f"weights and computes in the plan's {plan.config.dtype.value}: build the model in float32 "
            f"(model.float(), or transformers' from_config(config, dtype=torch.float32))."
        )
    modules = dict(model.named_modules())
    missing = [u for u in plan.model.units if u not in modules]
    if missing:
        raise PlanMismatchError(
            f"the plan's units {missing[:5]} are not modules of this "
            f"{type(model).__name__}; make a plan for this model."
        )


def _tp_layout(model: nn.Module, plan: Plan, sample_input: Any) -> TPLayout | None:
    cfg = plan.config
    styles = {k: TPStyle(v) for k, v in plan.layer_strategies.tp.items() if TPStyle(v) is not TPStyle.REPLICATE}
    if cfg.tp == 1 or not (styles or cfg.sequence_parallel):
        return None
    tokens = any(isinstance(m, nn.Embedding) for m in model.modules())
    if sample_input is None and not tokens:
        raise PlanMismatchError(
            f"the plan shards layers of a {type(model).__name__}, which takes no token ids; pass "
            f"sample_input= (one batch of its inputs) so autopar can trace where layouts change."
        )
    kwargs = {"sample_input": sample_input} if sample_input is not None else {"seq_len": plan.model.seq_len}
    graph = extract(model, dtype=cfg.dtype, **kwargs)
    types = {name: type(module).__name__ for name, module in model.named_modules()}
    return resolve(graph, styles, sequence_parallel=cfg.sequence_parallel, tp=cfg.tp, module_types=types)


def _dp_spec(plan: Plan, stage: nn.Module, units: tuple[str, ...]) -> DataParallelSpec:
    owners: dict[int, list[str]] = {}
    for unit in units:
        for p in stage.get_submodule(unit).parameters():
            owners.setdefault(id(p), []).append(unit)
    sharing = {u for us in owners.values() if len(set(us)) > 1 for u in us}
    return DataParallelSpec(
        zero_stage=plan.config.zero_stage,
        dtype=plan.config.dtype,
        dp=plan.config.dp_cp,
        shard_units=tuple(u for u in units if u not in sharing),
        pipelined=plan.config.pp > 1,
        reduce_dtype=plan.config.reduce_dtype,
    )
