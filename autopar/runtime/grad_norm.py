"""The global gradient norm over every mesh axis, and clipping by it.

``torch.nn.utils.clip_grad_norm_`` sees one rank's tensors: it would count a replicated
gradient once per data- or tensor-parallel rank, miss the other pipeline stages, and
cannot mix DTensors of different meshes (TP-sharded leaves next to replicated ones). Here
each element of the model's gradient is counted exactly once: a rank adds the squares
of its local gradient only if it is the first rank along every axis that replicates
that gradient (data-parallel copies, HSDP's replicate groups, the ranks holding the same
experts, a replicated leaf's tensor-parallel copies, the second holder of a tied parameter), and one all-reduce over the world sums the rest.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from autopar.runtime.mesh import EP_SHARD, MESH_AXES
from autopar.vocab import MeshAxis


def _sharding_axes(grad: torch.Tensor) -> set[str]:
    if not isinstance(grad, DTensor):
        return set()
    names = grad.device_mesh.mesh_dim_names or ()
    return {names[i] for i, pl in enumerate(grad.placements) if isinstance(pl, (Shard, _StridedShard))}


def _counted_elsewhere(grad: torch.Tensor, coord: dict[str, int]) -> bool:
    """Whether another rank counts this rank's copy of ``grad``: this rank is not the
    first along an axis that replicates it. An HSDP gradient is sharded over
    ``dp_shard`` and replicated over ``dp_replicate`` (:mod:`autopar.runtime.mesh`), so
    along ``dp`` only the first replicate group counts it. With context parallelism FSDP2
    shards over ``dp`` and ``cp`` flattened (``dp_cp``), which covers both axes, and an
    HSDP shard group spans the ``cp`` ranks of its data-parallel ranks, covering ``cp``.
    An expert's gradient (expert parallelism) is split over ``ep`` and replicated over
    ``ep_replicate`` (sharded there too under ZeRO-2/3), which together span ``dp`` and
    ``cp``: only the first ``ep_replicate`` rank counts a replicated one; under HSDP the
    experts are sharded over ``ep_shard`` and replicated over ``dp_replicate``, whose first
    group counts them. Another weight of an experts module (a router) sharded with its
    experts' replicas is the same on every ep rank: only ep rank 0 (``coord["ep"]``) counts it."""
    shard_axes = _sharding_axes(grad)
    expert_replicas = shard_axes & {MeshAxis.EP_REPLICATE.value, EP_SHARD}
    if MeshAxis.EP in shard_axes or expert_replicas:  # an expert's gradient, or a router sharded with its experts
        assert isinstance(grad, DTensor)  # sharded on a named axis
        if MeshAxis.EP not in shard_axes and coord.get(MeshAxis.EP.value, 0) != 0:
            return True
        names = grad.device_mesh.mesh_dim_names or ()
        for axis in (MeshAxis.EP_REPLICATE.value, MeshAxis.DP_REPLICATE.value):
            if axis in names and axis not in shard_axes and grad.device_mesh.get_local_rank(axis) != 0:
                return True
        shard_axes |= {MeshAxis.DP.value, MeshAxis.CP.value}
    if MeshAxis.DP_CP in shard_axes:
        shard_axes |= {MeshAxis.DP.value, MeshAxis.CP.value}
    if MeshAxis.DP_SHARD in shard_axes:
        shard_axes.add(MeshAxis.CP.value)
    for axis in MESH_AXES[1:]:
        if axis in shard_axes:
            continue
        if axis == MeshAxis.DP and MeshAxis.DP_SHARD in shard_axes:
            assert isinstance(grad, DTensor)  # sharded on a named axis
            if grad.device_mesh.get_local_rank(MeshAxis.DP_REPLICATE.value) != 0:
                return True
        elif coord[axis] != 0:
            return True
    return False


def local_grad(grad: torch.Tensor) -> torch.Tensor:
    """The local values of a gradient (partial sums reduced first)."""
    if isinstance(grad, DTensor):
        if any(isinstance(pl, Partial) for pl in grad.placements):
            grad = grad.redistribute(
                placements=[Replicate() if isinstance(pl, Partial) else pl for pl in grad.placements]
            )
        return grad.to_local()
    return grad


def global_grad_norm(
    params: dict[str, nn.Parameter], coord: dict[str, int], duplicates: frozenset[str]
) -> torch.Tensor:
    """The L2 norm of the whole model's gradient, the same on every rank.

    Args:
        params: this rank's parameters by clean FQN.
        coord: this rank's coordinate on each mesh axis (``{"pp": 0, "dp": 1, "cp": 0, "tp": 0}``), and
            on ``ep`` under expert parallelism.
        duplicates: names of tied copies that another rank already counts.
    """
    total = torch.zeros((), dtype=torch.float64)
    for name, p in params.items():
        if p.grad is None or name in duplicates:
            continue
        # every rank of a partial sum's group reduces it (a collective), whichever counts it
        grad = local_grad(p.grad)
        if _counted_elsewhere(p.grad, coord):
            continue
        total += grad.double().pow(2).sum()
    dist.all_reduce(total)
    return total.sqrt()


def clip_(params: dict[str, nn.Parameter], norm: torch.Tensor, max_norm: float) -> None:
    """Scale every gradient by ``min(1, max_norm / norm)`` (PyTorch's rule, eps 1e-6)."""
    coef = float(max_norm) / (float(norm) + 1e-6)
    if coef >= 1.0:
        return
    for p in params.values():
        if p.grad is not None:
            p.grad.mul_(coef)
