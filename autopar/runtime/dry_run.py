"""Dry run: apply a plan for a big cluster on this machine, without devices or peers.

The model is built on the meta device (no memory), every check of
:func:`autopar.runtime.api.analyse` runs once, and then ``parallelize`` runs for some
ranks against PyTorch's ``fake`` process group (collectives do nothing; testing API,
``torch.testing._internal.distributed.fake_pg``), with the model left on meta. Each such
rank then holds exactly the DTensor shards it would hold on the cluster, so its
parameter bytes are measured from the runtime itself, not re-derived, and compared with
the plan's prediction.

With ``measure=True`` each chosen rank also runs one training step on fake tensors
(:mod:`autopar.runtime.dry_step`), and its measured peak of tensor bytes is set beside
the plan's predicted allocation for that rank (its peak less the device's reserve).
Dropless experts under expert parallelism run there at the routing the plan prices
(balanced, or the plan's routing imbalance: :mod:`autopar.runtime.assumed_routing`),
since fake tensors have no routing to count; the report says so. A plan with compiled
blocks (``compile=True``) runs them eager here: compiling needs real tensors
(:mod:`autopar.runtime.compile`). Eager blocks keep the element-wise intermediates that
compiled ones recompute in their backward (:mod:`autopar.graph.compiled_saved`), so the
measured peak may exceed the compiled prediction by those; the report says so, with the
plan's peak priced eager where the plan carries it (else the same plan with
``compile=False`` is the like-for-like check). An ``async_tp`` plan, whose fused
collectives live in those compiled blocks, therefore runs its tensor-parallel
collectives synchronously here, and the report says async TP was not exercised.

Reported problems: names the plan uses that the model lacks (or the reverse), stage
assignments that do not cover the model's units exactly once, tensor-parallel splits a
layer's shape cannot take (a vocabulary may split unevenly: DTensor shards it in
``torch.chunk`` pieces, where Megatron-LM would pad it), and any typed error ``analyse``
or ``parallelize`` raises.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from autopar.cost.memory import holds_gathered_params
from autopar.errors import AutoparError, ConfigError
from autopar.graph.units import find_units
from autopar.models.experts import experts_modules, is_routed_experts
from autopar.plan import Plan
from autopar.runtime.api import Analysis, analyse, parallelize
from autopar.runtime.dry_run_report import DryRunReport, RankReport, gib
from autopar.runtime.dry_step import (
    PipelineMetadata,
    local_pipeline_metadata,
    measure_step,
    measured_microbatches,
)
from autopar.runtime.hf import is_conv1d
from autopar.runtime.local import cross_entropy
from autopar.runtime.mesh import MeshDims
from autopar.vocab import DType, TPStyle


def dry_run(
    model_fn: Callable[[], nn.Module],
    plan: Plan,
    *,
    sample_input: Any = None,
    ranks: Sequence[int] | None = None,
    measure: bool = False,
) -> DryRunReport:
    """Check ``plan`` against the model ``model_fn()`` builds (on meta) and apply it for
    ``ranks`` (default: the first rank of every pipeline rank, where the stages differ).
    ``measure``: also run one training step of each on fake tensors and measure its peak
    memory (token models; ranks run in pipeline order, see :mod:`autopar.runtime.dry_step`).

    Must run in a process without a default process group.
    """
    if dist.is_initialized():
        raise AutoparError("dry_run creates fake process groups; call it in a process without one.")
    dims = MeshDims.of(plan)
    bad = [r for r in ranks or () if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < dims.world_size]
    if bad:
        raise ConfigError(
            f"ranks {bad} are not ranks of this plan: give ranks from 0 to {dims.world_size - 1} "
            f"(the plan runs on {dims.world_size})."
        )
    model = model_fn()
    problems = coverage_problems(model, plan) + split_problems(model, plan)
    analysis: Analysis | None = None
    try:
        analysis = analyse(model, plan, sample_input=sample_input)
    except AutoparError as exc:
        problems.append(f"{type(exc).__name__}: {exc}")
    if measure and sample_input is not None:
        problems.append(
            "a measured dry run needs a token model (its step feeds token ids); this one takes sample_input"
        )
    if measure:
        problems += grouped_experts_problems(model, plan)
    reports: list[RankReport] = []
    added: list[int] = []
    metadata = PipelineMetadata()
    over: list[RankReport] = []  # ranks whose measured step exceeds the device
    if analysis is not None and not problems:
        chosen = list(ranks) if ranks is not None else [dims.rank_at(p, 0, 0, 0) for p in range(dims.pp)]
        if measure:
            held = {dims.coordinate(r)[0] for r in chosen}
            added = [dims.rank_at(p, 0, 0, 0) for p in range(max(held)) if p not in held]
            chosen += added
        for rank in sorted(chosen, key=lambda r: (dims.coordinate(r)[0], r)):  # stages announce their outputs in order
            try:
                if measure:
                    report, metadata = _in_child(_apply, model_fn, plan, analysis, rank, dims, metadata)
                    reports.append(report)
                else:
                    reports.append(_apply(model_fn, plan, analysis, rank, dims, None)[0])
            except AutoparError as exc:
                problems.append(f"rank {rank}: {type(exc).__name__}: {exc}")
        problems += metadata.problems()
        over = [r for r in reports if r.over_device]
        if not plan.config.compile:  # a compiled step is not measured here: its eager twin's excess is a note
            problems += [
                f"rank {r.rank}'s measured step peaks at {gib(r.measured.peak_bytes)}, more than the "
                f"{gib(r.usable_bytes)} its device holds beside the reserve: the plan does not fit as run"
                for r in over
            ]
        else:  # unless the eager step is far past the plan's own eager price: then the plan misdescribes it
            expected = _eager_peak_bytes(plan) or plan.prediction.memory_bytes_per_device
            problems += [
                f"rank {r.rank}'s measured step peaks at {gib(r.measured.peak_bytes)} eager, more than its device "
                f"holds and {r.measured.peak_bytes / expected:.2f} times the {gib(expected)} the plan predicts for "
                f"it eager: the plan's prediction does not describe its configuration (a hand-edited plan?); make "
                f"the plan again (autopar plan, or estimate this configuration)"
                for r in over
                if r.measured.peak_bytes > EAGER_BEYOND_PRICE * expected
            ]
    if not plan.prediction.fits:  # an estimate of a configuration that does not fit: it runs here, not there
        p = plan.prediction
        problems.append(
            f"the plan predicts {gib(p.memory_bytes_per_device)} per device, more than the "
            f"{gib(p.memory_capacity_bytes)} each {plan.cluster.device.name} holds: it does not fit; make a plan "
            f"that does with autopar plan (or estimate another configuration)"
        )
    return DryRunReport(
        plan=plan.config.short(),
        world_size=dims.world_size,
        problems=tuple(problems),
        ranks=tuple(reports),
        eager_blocks=plan.config.compile,
        eager_over_device=tuple(r.rank for r in over) if plan.config.compile else (),
        eager_peak_bytes=_eager_peak_bytes(plan),
        synchronous_tp=plan.config.async_tp,
        assumed_routing=_assumed_routing(model, plan) if measure and reports else None,
        gathered_params=holds_gathered_params(plan.config) and plan.config.state_shards > 1,
        added_ranks=tuple(added),
        assumed_inputs=tuple(metadata.unchecked()),
    )


EAGER_BEYOND_PRICE = 1.25
"""A compiled plan's measured eager step past its device is a problem, not a note, where it
also exceeds the plan's own eager peak by this factor: the dry runs of the planner's plans
measure within about 6% of the prediction on every rank (GPT-3 175B's eight pipeline
ranks, 0.99-1.06), so a step 25% above it runs a configuration the prediction was not
made for (a plan file edited by hand: four times the micro-batch measured 2.35 times)."""


def _eager_peak_bytes(plan: Plan) -> float | None:
    """The compiled plan's peak per device priced with eager blocks, where it carries it
    like for like (:meth:`~autopar.plan.Plan.eager_contrast`)."""
    contrast = plan.eager_contrast() if plan.config.compile else None
    return contrast.memory_bytes_per_device if contrast is not None else None


def forget_fake_sharding() -> None:
    """Drop what DTensor's sharding propagation cached under a fake process group, with
    the group: the cache outlives it, and a tensor-parallel run later in this process, or
    in one forked from it, reused those entries: after a dry run it trained to losses
    about 1e-4 apart from one process's (a plan with a vocabulary-parallel embedding or a
    column-parallel head); after a step trained on a fake group, forked tensor-parallel
    ranks trained wrong and wrote checkpoints that do not load (torch 2.13)."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()


def grouped_experts_problems(model: nn.Module, plan: Plan) -> list[str]:
    """Transformers experts modules a measured step cannot run at the plan's precision:
    those running grouped matmuls (``_experts_implementation = "grouped_mm"``), whose
    fake kernel takes bf16 only (torch's, as CUDA's), outside a bf16 plan. One problem
    naming the first of them."""
    if plan.config.dtype is DType.BF16:
        return []
    grouped = [
        name
        for name, m in experts_modules(model).items()
        if is_routed_experts(m) and getattr(getattr(m, "config", None), "_experts_implementation", None) == "grouped_mm"
    ]
    if not grouped:
        return []
    return [
        f"a measured dry run cannot run {len(grouped)} experts module(s) ({grouped[0]!r}, ...) in "
        f"{plan.config.dtype.value}: transformers runs them as grouped matmuls, which torch's fake tensors take in "
        f"bf16 only; measure the plan at dtype='bf16', or dry-run it without measuring"
    ]


def _assumed_routing(model: nn.Module, plan: Plan) -> float | None:
    """The routing imbalance a measured step of ``plan`` assumes for ``model``'s dropless
    experts: the plan's, under expert parallelism; None without such experts or ``ep``."""
    dropless = any(is_routed_experts(m) for m in experts_modules(model).values())
    return plan.settings.routing_imbalance if plan.config.ep > 1 and dropless else None


def coverage_problems(model: nn.Module, plan: Plan) -> list[str]:
    """Stage assignments that do not cover the model's units exactly once, in order."""
    units = find_units(model)
    listed = [u for stage in plan.stages for u in stage]
    problems = []
    missing = [u for u in units if u not in listed]
    unknown = [u for u in listed if u not in units]
    twice = sorted({u for u in listed if listed.count(u) > 1})
    if missing:
        problems.append(f"units of the model in no stage: {missing[:8]}")
    if unknown:
        problems.append(f"stages name units the model does not have: {unknown[:8]}")
    if twice:
        problems.append(f"units in more than one stage: {twice[:8]}")
    # the plan's order is the traced call order (a transformers Llama calls its rotary
    # embedding, registered last, before the first block); find_units' is registration order
    order = list(plan.model.units) if sorted(plan.model.units) == sorted(units) else units
    if not (missing or unknown or twice) and listed != order:
        problems.append("stages list the model's units out of their order")
    return problems


def split_problems(model: nn.Module, plan: Plan) -> list[str]:
    """Tensor-parallel styles naming layers the model lacks or shapes that do not divide."""
    tp = plan.config.tp
    modules = dict(model.named_modules())
    vocab = {m.num_embeddings for m in modules.values() if isinstance(m, nn.Embedding)}
    problems = []
    for fqn, style in sorted(plan.layer_strategies.tp.items()):
        style = TPStyle(style)
        module = modules.get(fqn)
        if module is None:
            problems.append(f"layer {fqn!r} (style {style.value}) is not in the model")
            continue
        size = _split_size(module, style)
        if size in vocab:
            continue  # vocabulary rows may split unevenly: DTensor pads the last shard (no Megatron padding needed)
        if size is not None and size % tp:
            problems.append(
                f"layer {fqn!r} ({type(module).__name__}): style {style.value} splits a dimension of "
                f"{size} over tp={tp}, which does not divide it"
            )
    return problems


def _split_size(module: nn.Module, style: TPStyle) -> int | None:
    if isinstance(module, nn.Linear):
        return {TPStyle.COLUMN: module.out_features, TPStyle.ROW: module.in_features}.get(style)
    if is_conv1d(module):
        nx, nf = module.weight.shape
        return {TPStyle.COLUMN: nf, TPStyle.ROW: nx}.get(style)
    if isinstance(module, nn.Embedding) and style is TPStyle.VOCAB:
        return module.num_embeddings
    return None


def _apply(
    model_fn: Callable[[], nn.Module],
    plan: Plan,
    analysis: Analysis,
    rank: int,
    dims: MeshDims,
    metadata: PipelineMetadata | None,
) -> tuple[RankReport, PipelineMetadata | None]:
    """Parallelize ``rank``'s part under a fake process group; with ``metadata``, also
    measure one step (:func:`autopar.runtime.dry_step.measure_step`), and return the
    metadata with this rank's stage boundaries added."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=dims.world_size, store=FakeStore())
    measured = None
    mode = FakeTensorMode(allow_non_fake_inputs=True) if metadata is not None else None
    try:
        job = parallelize(
            model_fn(),
            plan,
            loss_fn=cross_entropy if metadata is not None else _no_loss,
            analysis=analysis,
            materialize=False,
            fake_mode=mode,
            measure_memory=False,
            device="cpu",
        )
        held = sum(_local(p).numel() * _local(p).element_size() for p in job.parameters())
        if metadata is not None:
            with local_pipeline_metadata(metadata):
                measured = measure_step(job, plan, mode, microbatches=measured_microbatches(plan.config))
    finally:
        dist.destroy_process_group()
        forget_fake_sharding()
    coord = dims.coordinate(rank)
    indices = plan.stage_of_rank(coord[0])
    # a stage's memory in the prediction is its pipeline rank's: every stage the rank holds
    mine = [s.memory for s in plan.prediction.stages if s.index in indices]
    return RankReport(
        rank=rank,
        coordinate=coord,
        stages=indices,
        param_bytes=int(held),
        predicted_param_bytes=max((m.params_bytes for m in mine), default=0.0),
        predicted_peak_bytes=max((m.total_bytes for m in mine), default=0.0),
        predicted_allocated_bytes=max((m.total_bytes - m.reserve_bytes for m in mine), default=0.0),
        usable_bytes=plan.prediction.memory_capacity_bytes - max((m.reserve_bytes for m in mine), default=0.0),
        measured=measured,
    ), metadata


def _in_child(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in a forked process, its result or exception sent back pickled. A
    measured step leaves process-wide state behind (caches filled under the fake group and
    the fake mode; which one was not isolated) that made tensor-parallel runs forked from
    this process later compute wrong losses."""
    ctx = mp.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)

    def child() -> None:
        try:
            payload = ("ok", fn(*args))
        except AutoparError as exc:
            payload = ("error", exc)
        except BaseException:  # a bug: its traceback, as text, for the parent to raise
            payload = ("crash", traceback.format_exc())
        send.send_bytes(pickle.dumps(payload))

    proc = ctx.Process(target=child)
    proc.start()
    send.close()
    try:
        data = receive.recv_bytes()
    except EOFError:
        proc.join()
        raise RuntimeError(f"the dry run's process ended with exit code {proc.exitcode} before reporting") from None
    proc.join()
    kind, value = pickle.loads(data)
    if kind == "error":
        raise value
    if kind == "crash":
        raise RuntimeError(f"the dry run failed in its process:\n{value}")
    return value


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _no_loss(output: Any, target: Any) -> torch.Tensor:
    raise AutoparError("a dry run never computes a loss")
