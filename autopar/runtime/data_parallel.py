"""Data parallelism on the ``dp`` axis, as the plan's ZeRO stage says, and mixed precision.

With context parallelism it runs over ``dp`` and ``cp`` flattened (the ``dp_cp`` mesh,
:func:`autopar.runtime.mesh.data_parallel_mesh`): the context-parallel ranks hold the
same weights, and averaging their gradients over all ``dp x cp`` ranks gives the
gradient of the whole sequence's token mean (:mod:`autopar.runtime.context_parallel`).

=========  ==================================================================================
zero       what runs
=========  ==================================================================================
0, 1       ``DistributedDataParallel(gradient_as_bucket_view=True, static_graph=True)`` in
           fp32. The FSDP2-based ``replicate``, which runs the same all-reduce, in the
           other cases: mixed precision (its casts put the whole block in the low
           precision, as the cost model prices: autocast beside DDP casts only the
           matmuls' operands, so an embedding's fp32 output keeps the residual stream,
           the norms and what they save in fp32, measured at 1.08-1.29 of the
           prediction; under a pipeline autocast also casts the weights anew for every
           micro-batch in flight), parameters that tensor parallelism made DTensors (DDP
           cannot hold them; torchtitan refuses DDP with more than one mesh axis for this
           reason), pipelined plans (measured on torch 2.13: DDP under a multi-stage
           pipelining schedule gave the last stage wrong gradients; ``static_graph`` is
           needed even with one stage, or DDP's first-step bucket rebuild fails on the
           micro-batched backward), and the fake parameters of a measured dry run (DDP
           needs real ones). Without pipelining ``replicate`` wraps each unit, then the
           stage root, so each unit's gradients are all-reduced as its backward ends,
           overlapped with the rest as DDP's buckets are
           (:class:`autopar.runtime.pipeline._UnitReductionStage`); under pipelining
           the stage is one group, reduced after the last micro-batch. Stage 1 also
           shards the optimizer state (:mod:`autopar.runtime.optimizer`).
2          FSDP2 ``fully_shard`` per unit, then the stage root, ``reshard_after_forward=False``:
           gradients and optimizer state sharded, parameters kept gathered from forward to
           backward (ZeRO-2's memory, Rajbhandari et al. 2020).
3          the same with ``reshard_after_forward=True``: parameters sharded too (ZeRO-3).
=========  ==================================================================================

Under HSDP (``ParallelConfig.dp_shard``) ZeRO-2/3 run the same ``fully_shard`` calls on the
2-D (``dp_replicate``, ``dp_shard``) mesh (:func:`autopar.runtime.mesh.data_parallel_mesh`):
FSDP2 shards over ``dp_shard``, replicates over ``dp_replicate``, gathers within the shard
group and follows each reduce-scatter with an all-reduce across the replicate group.

With expert parallelism (:mod:`autopar.runtime.expert_parallel`) the experts modules are
wrapped first, on the mesh of the ranks holding the same experts (``ep_replicate``, or
under HSDP (``dp_replicate``, ``ep_shard``)): ``fully_shard`` for ZeRO-2/3, ``replicate``
for ZeRO-0/1 (their weights are DTensors on the ep mesh, which DDP cannot hold); the
stage's own wrapping then leaves them alone.

Mixed precision (``bf16``/``fp16``) keeps fp32 master weights, gradients and optimizer
state: FSDP2 and ``replicate`` cast parameters with ``MixedPrecisionPolicy(param_dtype,
reduce_dtype=fp32)``, or under ZeRO-2/3 with ``reduce_dtype=bf16`` where the plan reduces
gradients in bf16 (``ParallelConfig.reduce_dtype``: FSDP2 then reduce-scatters, and under
pipelining accumulates, the bf16 gradients as they come, and casts the reduced shard to
the fp32 gradient). fp16 plans also scale the loss dynamically
(:mod:`autopar.runtime.loss_scale`); bf16 needs no scaling.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.nn.parallel import DistributedDataParallel

from autopar.runtime.expert_parallel import experts_placement, sharded_experts
from autopar.vocab import DType

TORCH_DTYPES: dict[DType, torch.dtype] = {
    DType.FP32: torch.float32,
    DType.BF16: torch.bfloat16,
    DType.FP16: torch.float16,
}


@dataclass(frozen=True, kw_only=True)
class DataParallelSpec:
    """What to apply on one stage.

    Attributes:
        zero_stage: 0-3.
        dtype: training precision.
        dp: ranks the gradients are averaged over: the data-parallel degree times the
            context-parallel degree (``ParallelConfig.dp_cp``).
        shard_units: unit module FQNs FSDP2 wraps on their own (units that share a
            parameter with another unit of the stage stay in the root's group).
        pipelined: the plan has more than one pipeline stage.
        reduce_dtype: the precision ZeRO-2/3 reduce gradients in.
    """

    zero_stage: int
    dtype: DType
    dp: int
    shard_units: tuple[str, ...]
    pipelined: bool
    reduce_dtype: DType = DType.FP32


def even_placement(shard_ranks: int) -> Callable[[nn.Parameter], Shard | None]:
    """FSDP2's placement for a weight sharded over ``shard_ranks`` ranks: along its first
    dimension (FSDP2's default) where that splits evenly, else along the first that does,
    where one does. FSDP2 pads the first dimension to a multiple of the ranks: a stack of
    16 experts over 128 ranks held 8 times its bytes, one padded row on every rank and a
    gathered copy of 128 rows, which the plan does not count (a dry run of a small
    DeepSeek-V3 at dp=128 measured 0.58 GiB of it). A tensor-parallel weight (a DTensor)
    keeps the default, which FSDP2 composes with its tensor-parallel split."""

    def place(p: nn.Parameter) -> Shard | None:
        if isinstance(p, DTensor) or p.ndim < 2 or p.shape[0] % shard_ranks == 0:
            return None
        return next((Shard(d) for d in range(1, p.ndim) if p.shape[d] % shard_ranks == 0), None)

    return place


def apply_data_parallel(
    stage: nn.Module, spec: DataParallelSpec, dp_mesh: DeviceMesh, experts_mesh: DeviceMesh | None = None
) -> nn.Module:
    """Wrap ``stage`` for data parallelism over ``dp_mesh`` (1-D, or HSDP's 2-D mesh);
    returns the module to run (DDP wraps). With expert parallelism the experts modules
    are wrapped first on ``experts_mesh`` (``ep_replicate``, the ranks holding the same
    experts), so the stage's wrapping leaves their weights alone."""
    low = TORCH_DTYPES[spec.dtype] if spec.dtype is not DType.FP32 else None
    policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32) if low else MixedPrecisionPolicy()
    experts = sharded_experts(stage) if experts_mesh is not None else []
    if spec.zero_stage >= 2 and spec.dp > 1:
        reshard = spec.zero_stage == 3
        policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=TORCH_DTYPES[spec.reduce_dtype]) if low else policy
        place = experts_placement(experts_mesh.size(experts_mesh.ndim - 1)) if experts else None
        for module in experts:
            fully_shard(
                module, mesh=experts_mesh, mp_policy=policy, reshard_after_forward=reshard, shard_placement_fn=place
            )
        even = even_placement(dp_mesh.size(dp_mesh.ndim - 1))
        for fqn in spec.shard_units:
            fully_shard(
                stage.get_submodule(fqn),
                mesh=dp_mesh,
                mp_policy=policy,
                reshard_after_forward=reshard,
                shard_placement_fn=even,
            )
        fully_shard(stage, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard, shard_placement_fn=even)
        return stage
    # a low precision runs replicate's casts, not autocast's (module docstring)
    wrapped = spec.pipelined or any(isinstance(p, (DTensor, FakeTensor)) for p in stage.parameters())
    if (spec.dp > 1 and wrapped) or low is not None:
        from torch.distributed._composable.replicate_with_fsdp import replicate

        for module in experts:
            replicate(module, mesh=experts_mesh, mp_policy=policy)
        for fqn in () if spec.pipelined else spec.shard_units:
            replicate(stage.get_submodule(fqn), mesh=dp_mesh, mp_policy=policy)
        replicate(stage, mesh=dp_mesh, mp_policy=policy)
        return stage
    if spec.dp > 1:
        return DistributedDataParallel(
            stage, process_group=dp_mesh.get_group(), gradient_as_bucket_view=True, static_graph=True
        )
    return stage
