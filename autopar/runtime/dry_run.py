"""Dry run: apply a plan for a big cluster on this machine, without devices or peers.

The model is built on the meta device (no memory), every check of
:func:`autopar.runtime.api.analyse` runs once, and then ``parallelize`` runs for some
ranks against PyTorch's ``fake`` process group (collectives do nothing; testing API,
``torch.testing._internal.distributed.fake_pg``), with the model left on meta. Each such
rank then holds exactly the DTensor shards it would hold on the cluster, so its
parameter bytes are measured from the runtime itself, not re-derived, and compared with
the plan's prediction.

Reported problems: names the plan uses that the model lacks (or the reverse), stage
assignments that do not cover the model's units exactly once, tensor-parallel splits a
layer's shape cannot take (a vocabulary may split unevenly: DTensor shards it in
``torch.chunk`` pieces, where Megatron-LM would pad it), and any typed error ``analyse``
or ``parallelize`` raises.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autopar.errors import AutoparError
from autopar.graph.units import find_units
from autopar.plan import Plan
from autopar.runtime.api import Analysis, analyse, parallelize
from autopar.runtime.hf import is_conv1d
from autopar.runtime.mesh import MeshDims
from autopar.vocab import TPStyle


@dataclass(frozen=True, kw_only=True)
class RankReport:
    """What one rank would hold.

    Attributes:
        rank: global rank; ``coordinate``: its (pp, dp, tp).
        stages: the pipeline stages it runs.
        param_bytes: bytes of the parameters it holds (measured on its shards).
        predicted_param_bytes: the plan's parameter bytes for those stages.
        predicted_peak_bytes: the plan's peak memory per device (all terms).
    """

    rank: int
    coordinate: tuple[int, int, int]
    stages: tuple[int, ...]
    param_bytes: int
    predicted_param_bytes: float
    predicted_peak_bytes: float


@dataclass(frozen=True, kw_only=True)
class DryRunReport:
    """The outcome of :func:`dry_run`."""

    plan: str
    world_size: int
    problems: tuple[str, ...]
    ranks: tuple[RankReport, ...]

    @property
    def ok(self) -> bool:
        """No problem found."""
        return not self.problems

    def to_text(self) -> str:
        """A report a person reads."""
        lines = [
            f"dry run of {self.plan} on {self.world_size} ranks: "
            f"{'OK' if self.ok else f'{len(self.problems)} problem(s)'}"
        ]
        lines += [f"  problem: {p}" for p in self.problems]
        if self.ranks:
            lines.append("  rank  (pp,dp,tp)  stages      params held   predicted params   predicted peak")
            for r in self.ranks:
                lines.append(
                    f"  {r.rank:<5} {r.coordinate!s:<11} {list(r.stages)!s:<11} "
                    f"{_gib(r.param_bytes):>11}   {_gib(r.predicted_param_bytes):>16}   "
                    f"{_gib(r.predicted_peak_bytes):>14}"
                )
        return "\n".join(lines)


def _gib(n: float) -> str:
    return f"{n / 2**30:.3f} GiB"


def dry_run(
    model_fn: Callable[[], nn.Module], plan: Plan, *, sample_input: Any = None, ranks: Sequence[int] | None = None
) -> DryRunReport:
    """Check ``plan`` against the model ``model_fn()`` builds (on meta) and apply it for
    ``ranks`` (default: the first rank of every pipeline rank, where the stages differ).

    Must run in a process without a default process group.
    """
    if dist.is_initialized():
        raise AutoparError("dry_run creates fake process groups; call it in a process without one.")
    dims = MeshDims.of(plan)
    model = model_fn()
    problems = coverage_problems(model, plan) + split_problems(model, plan)
    analysis: Analysis | None = None
    try:
        analysis = analyse(model, plan, sample_input=sample_input)
    except AutoparError as exc:
        problems.append(f"{type(exc).__name__}: {exc}")
    reports: list[RankReport] = []
    if analysis is not None and not problems:
        chosen = ranks if ranks is not None else [dims.rank_at(p, 0, 0) for p in range(dims.pp)]
        for rank in chosen:
            try:
                reports.append(_apply(model_fn, plan, analysis, rank, dims))
            except AutoparError as exc:
                problems.append(f"rank {rank}: {type(exc).__name__}: {exc}")
    return DryRunReport(
        plan=plan.config.short(), world_size=dims.world_size, problems=tuple(problems), ranks=tuple(reports)
    )


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
    if not (missing or unknown or twice) and listed != units:
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


def _apply(model_fn: Callable[[], nn.Module], plan: Plan, analysis: Analysis, rank: int, dims: MeshDims) -> RankReport:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=dims.world_size, store=FakeStore())
    try:
        job = parallelize(
            model_fn(), plan, loss_fn=_no_loss, analysis=analysis, materialize=False, measure_memory=False, device="cpu"
        )
        held = sum(_local(p).numel() * _local(p).element_size() for p in job.parameters())
    finally:
        dist.destroy_process_group()
    coord = dims.coordinate(rank)
    indices = plan.stage_of_rank(coord[0])
    predicted = {s.index: s.memory.params_bytes for s in plan.prediction.stages}
    return RankReport(
        rank=rank,
        coordinate=coord,
        stages=indices,
        param_bytes=int(held),
        predicted_param_bytes=sum(predicted.get(i, 0.0) for i in indices),
        predicted_peak_bytes=plan.prediction.memory_bytes_per_device,
    )


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _no_loss(output: Any, target: Any) -> torch.Tensor:
    raise AutoparError("a dry run never computes a loss")
