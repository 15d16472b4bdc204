"""Parameters shared by units on different pipeline ranks (GPT-2's tied embedding and
head): each rank holds a copy, and their gradients are summed every step.

Both copies start equal (same initial values, same checkpoint) and receive the summed
gradient, so the optimizer keeps them equal: Megatron-LM's treatment of the word
embeddings on the first and last stage (Shoeybi et al. 2019; Narayanan et al. 2021).
The copies may be sharded differently on their stages (a replicated embedding, a
column-sharded head; FSDP2 on top), so the sum runs on full gradients: each side
gathers its gradient over its own stage's mesh, the holders all-reduce it, and each
keeps its own shard of the result.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from autopar.runtime.errors import PipelineError
from autopar.runtime.mesh import MeshDims, default_timeout
from autopar.runtime.recompute import clean_fqn


@dataclass(frozen=True, kw_only=True)
class TiedParam:
    """One parameter held under several names.

    Attributes:
        fqns: its names, in the order of the units that hold them.
        pipeline_ranks: for each name, the pipeline rank whose stage holds it.
        stages: for each name, the index of the stage that holds it.
    """

    fqns: tuple[str, ...]
    pipeline_ranks: tuple[int, ...]
    stages: tuple[int, ...]

    @property
    def spans_ranks(self) -> bool:
        """Whether the copies live on different pipeline ranks (a sync is needed)."""
        return len(set(self.pipeline_ranks)) > 1


def find_tied(
    model: nn.Module, stages: tuple[tuple[str, ...], ...], rank_of_stage: Callable[[int], int]
) -> tuple[TiedParam, ...]:
    """Parameters of the full ``model`` reachable under several names; stage ``i``
    runs on pipeline rank ``rank_of_stage(i)``."""
    unit_stage = {u: i for i, stage in enumerate(stages) for u in stage}
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    tied = []
    for fqns in names.values():
        if len(fqns) < 2:
            continue
        held_by = tuple(_stage_of(f, unit_stage) for f in fqns)
        tied.append(
            TiedParam(fqns=tuple(fqns), pipeline_ranks=tuple(rank_of_stage(i) for i in held_by), stages=held_by)
        )
    return tuple(tied)


def _stage_of(fqn: str, unit_stage: dict[str, int]) -> int:
    best = max((u for u in unit_stage if fqn == u or fqn.startswith(u + ".")), key=len)
    return unit_stage[best]


def check_tied_stages(tied: tuple[TiedParam, ...], schedule: str) -> None:
    """Refuse copies of one parameter in two stages of one pipeline rank: each stage
    scales, reduces and steps its own parameters, so the shared one would be scaled,
    reduced and updated twice (``zbv`` puts the first and the last stage, a tied
    embedding and head, on rank 0)."""
    for t in tied:
        by_rank: dict[int, set[int]] = {}
        for rank, stage in zip(t.pipeline_ranks, t.stages):
            by_rank.setdefault(rank, set()).add(stage)
        for rank, held in by_rank.items():
            if len(held) > 1:
                raise PipelineError(
                    f"parameter {t.fqns[0]!r} is tied to {t.fqns[1:]!r} and schedule {schedule!r} places both "
                    f"copies on pipeline rank {rank}, in stages {sorted(held)}, which would scale and update it "
                    f"twice. Use another schedule (e.g. 'interleaved-zb'), or untie the weights."
                )


class TiedGradSync:
    """Sums the gradients of a tied parameter's copies: across pipeline ranks, and on
    one rank where tensor parallelism gave the copies different shardings (a replicated
    embedding and a column-sharded head are two tensors then, no longer one).

    Every rank creates the same process groups in the same order (``new_group`` is
    collective over the world), one per (dp, cp, tp) coordinate and tied parameter.
    """

    def __init__(self, tied: tuple[TiedParam, ...], dims: MeshDims, coord: tuple[int, int, int, int]):
        self._tied = tied
        self._groups: dict[int, dist.ProcessGroup] = {}
        pp_rank, *others = coord
        timeout = default_timeout()
        for index, t in enumerate(tied):
            if not t.spans_ranks:
                continue
            ranks_pp = sorted(set(t.pipeline_ranks))
            for d, c, r in itertools.product(range(dims.dp), range(dims.cp), range(dims.tp)):
                group = dist.new_group([dims.rank_at(p, d, c, r) for p in ranks_pp], timeout=timeout)
                if [d, c, r] == others and pp_rank in ranks_pp:
                    self._groups[index] = group

    @torch.no_grad()
    def sync(self, params: dict[str, nn.Parameter]) -> None:
        """Give every copy the sum of all copies' gradients (call after backward).

        ``params`` are this rank's parameters by name, one name per distinct tensor.
        """
        for index, t in enumerate(self._tied):
            copies = [params[name] for name in t.fqns if name in params]
            group = self._groups.get(index)
            if len(copies) < 2 and group is None:
                continue
            total = None
            for p in copies:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                full = _full(p.grad)
                total = full if total is None else total + full
            if group is not None:
                dist.all_reduce(total, group=group)
            for p in copies:
                _write_local(p.grad, total)


def _full(grad: torch.Tensor) -> torch.Tensor:
    return grad.full_tensor() if isinstance(grad, DTensor) else grad.clone()


def _write_local(grad: torch.Tensor, full: torch.Tensor) -> None:
    if isinstance(grad, DTensor):
        local = distribute_tensor(full, grad.device_mesh, grad.placements, src_data_rank=None).to_local()
        grad.to_local().copy_(local)
    else:
        grad.copy_(full)


def retie(stage: nn.Module, names: tuple[str, ...]) -> None:
    """Make the names of one tied parameter on ``stage`` share one tensor again, when
    their copies have the same shape and sharding (TP styles and ``to_empty`` replace
    parameters module by module, which unties them)."""
    present = [n for n in names if _has_param(stage, n)]
    params = [stage.get_parameter(n) for n in present]
    if len({id(p) for p in params}) < 2 or not all(_same_layout(params[0], p) for p in params[1:]):
        return
    for name in present[1:]:
        owner, _, attr = name.rpartition(".")
        setattr(stage.get_submodule(owner) if owner else stage, attr, params[0])


def _has_param(stage: nn.Module, name: str) -> bool:
    try:
        stage.get_parameter(name)
    except AttributeError:
        return False
    return True


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    if isinstance(a, DTensor) != isinstance(b, DTensor) or a.shape != b.shape:
        return False
    return not isinstance(a, DTensor) or (a.placements == b.placements and a.device_mesh == b.device_mesh)


def named_params(module: nn.Module) -> dict[str, nn.Parameter]:
    """Parameters by clean FQN (wrapper prefixes removed)."""
    return {clean_fqn(n): p for n, p in module.named_parameters()}
