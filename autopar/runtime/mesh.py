"""The device mesh: validate the plan's degrees against the job, then build (pp, dp, cp, tp).

Ranks are laid out row-major over (pp, dp, cp, tp) with tp innermost and cp next
(Megatron-LM's placement, see :class:`autopar.vocab.MeshAxis`), so tensor-parallel
groups are consecutive ranks and stay inside a node, and a context-parallel ring comes
next. Every axis is kept at degree 1. Data parallelism runs over ``dp`` and ``cp``
flattened (``dp_cp``): context-parallel ranks hold the same weights
(:func:`data_parallel_mesh`). An HSDP plan's data-parallel axis unflattens
row-major into (dp_replicate, dp_shard) for FSDP2: a shard
group is consecutive data-parallel ranks. Expert parallelism unflattens ``dp_cp`` into
(``ep_replicate``, ``ep``) (:func:`expert_meshes`). Validation reads only local facts (the world
size the launcher set), so a plan for another job size fails identically on every rank
before any collective runs (torchtitan's ``ParallelDims`` habit).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autopar.plan import Plan
from autopar.runtime.errors import PlanMismatchError
from autopar.vocab import MeshAxis

MESH_AXES: tuple[str, str, str, str] = (MeshAxis.PP.value, MeshAxis.DP.value, MeshAxis.CP.value, MeshAxis.TP.value)


@dataclass(frozen=True, kw_only=True)
class MeshDims:
    """Degrees of the four mesh axes, HSDP's shard group (None: plain sharding) and the
    expert-parallel degree (``ep`` consecutive ``dp_cp`` ranks split each MoE layer's experts)."""

    pp: int
    dp: int
    tp: int
    cp: int = 1
    dp_shard: int | None = None
    ep: int = 1

    @staticmethod
    def of(plan: Plan) -> MeshDims:
        """The degrees a plan asks for."""
        c = plan.config
        return MeshDims(pp=c.pp, dp=c.dp, cp=c.cp, tp=c.tp, dp_shard=c.dp_shard, ep=c.ep)

    @property
    def world_size(self) -> int:
        """Ranks the mesh spans."""
        return self.pp * self.dp * self.cp * self.tp

    @property
    def dp_cp(self) -> int:
        """Ranks holding the same weights: data- times context-parallel ranks."""
        return self.dp * self.cp

    def shape(self) -> tuple[int, int, int, int]:
        """(pp, dp, cp, tp)."""
        return self.pp, self.dp, self.cp, self.tp

    def coordinate(self, rank: int) -> tuple[int, int, int, int]:
        """(pp, dp, cp, tp) coordinates of a global rank (row-major, tp innermost)."""
        tp, rest = rank % self.tp, rank // self.tp
        cp, rest = rest % self.cp, rest // self.cp
        return rest // self.dp, rest % self.dp, cp, tp

    def rank_at(self, pp: int, dp: int, cp: int, tp: int) -> int:
        """The global rank at mesh coordinates (pp, dp, cp, tp)."""
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    def check_world_size(self, world_size: int) -> None:
        """Raise PlanMismatchError unless the job has exactly the plan's ranks."""
        if world_size != self.world_size:
            axes = {"pp": self.pp, "dp": self.dp, **({"cp": self.cp} if self.cp > 1 else {}), "tp": self.tp}
            raise PlanMismatchError(
                f"the plan needs {' x '.join(axes)} = {' x '.join(map(str, axes.values()))} = {self.world_size} ranks "
                f"but this job has {world_size}. Launch with {self.world_size} processes (autopar run "
                f"--nproc-per-node ...), or make a plan for {world_size} devices (autopar plan/estimate)."
            )


def build_mesh(dims: MeshDims, device_type: str) -> DeviceMesh:
    """The (pp, dp, cp, tp) DeviceMesh over the default process group.

    The world size is checked first, so a wrong launch fails before the collectives that
    ``init_device_mesh`` runs. Every axis is kept even at degree 1 so code can always
    slice ``mesh["dp"]`` etc. The axes' groups get the default group's timeout: without
    it ``new_group`` falls back to c10d's 30-minute default, and a rank waiting on a dead
    peer through the dp or pp group would hang that long.
    """
    if not dist.is_initialized():
        raise PlanMismatchError(
            "no default process group: call torch.distributed.init_process_group (torchrun or "
            "autopar run set it up) before autopar.parallelize."
        )
    dims.check_world_size(dist.get_world_size())
    override = _backend_with_timeout(device_type)
    return init_device_mesh(
        device_type,
        dims.shape(),
        mesh_dim_names=MESH_AXES,
        backend_override={axis: override for axis in MESH_AXES} if override else None,
    )


def weight_replicas_mesh(mesh: DeviceMesh, dims: MeshDims, device_type: str) -> DeviceMesh:
    """The 1-D mesh of the ranks that hold the same weights: the ``dp`` axis, or with
    context parallelism ``dp`` and ``cp`` flattened into ``dp_cp`` (torchtitan's
    ``dp_shard_cp``). Its group gets the default group's timeout, as :func:`build_mesh`'s do."""
    if dims.cp == 1:
        return mesh[MeshAxis.DP.value]
    axes = (MeshAxis.DP.value, MeshAxis.CP.value)
    return mesh[axes]._flatten(MeshAxis.DP_CP.value, backend_override=_backend_with_timeout(device_type))


def data_parallel_mesh(replicas: DeviceMesh, dims: MeshDims, device_type: str) -> DeviceMesh:
    """The mesh data parallelism runs over: the weight replicas
    (:func:`weight_replicas_mesh`), or under HSDP those unflattened into
    (``dp_replicate``, ``dp_shard``), FSDP2's 2-D mesh for hybrid sharding, whose shard
    group spans the cp ranks too (``dp / dp_shard`` groups of ``dp_shard x cp``
    consecutive ranks). New groups get the default group's timeout."""
    if dims.dp_shard is None:
        return replicas
    override = _backend_with_timeout(device_type)
    names = (MeshAxis.DP_REPLICATE.value, MeshAxis.DP_SHARD.value)
    return replicas._unflatten(
        0,
        (dims.dp // dims.dp_shard, dims.dp_shard * dims.cp),
        names,
        backend_override={axis: override for axis in names} if override else None,
    )


EP_SHARD = "ep_shard"
"""Under HSDP with expert parallelism, the ranks of one shard group holding the same
experts (``state_shards / ep``): FSDP2 shards expert state over them."""


@dataclass(frozen=True)
class ExpertMeshes:
    """The meshes of expert parallelism: ``ep`` (the ranks splitting the experts) and
    ``replicas`` (the ranks holding the same experts, which data parallelism runs over:
    1-D ``ep_replicate``, or under HSDP 2-D (``dp_replicate``, ``ep_shard``))."""

    ep: DeviceMesh
    replicas: DeviceMesh


def expert_meshes(replicas: DeviceMesh, dims: MeshDims, device_type: str) -> ExpertMeshes:
    """The weight replicas (:func:`weight_replicas_mesh`) unflattened row-major into
    (``ep_replicate``, ``ep``): an expert-parallel group is ``ep`` consecutive ``dp_cp``
    ranks, which together hold every expert once; the ranks at the same place in each
    group hold the same experts and average their gradients over ``ep_replicate``. Under
    HSDP an ep group lies inside a shard group and the replicas are (``dp_replicate``,
    ``ep_shard``): FSDP2 shards expert state over the ``state_shards / ep`` ranks of a
    shard group holding the same experts and replicates it across the groups. New groups
    get the default group's timeout."""
    override = _backend_with_timeout(device_type)
    if dims.dp_shard is None:
        names: tuple[str, ...] = (MeshAxis.EP_REPLICATE.value, MeshAxis.EP.value)
        sizes: tuple[int, ...] = (dims.dp_cp // dims.ep, dims.ep)
    else:
        names = (MeshAxis.DP_REPLICATE.value, EP_SHARD, MeshAxis.EP.value)
        state_shards = dims.dp_shard * dims.cp
        sizes = (dims.dp // dims.dp_shard, state_shards // dims.ep, dims.ep)
    mesh = replicas._unflatten(
        0, sizes, names, backend_override={axis: override for axis in names} if override else None
    )
    return ExpertMeshes(ep=mesh[MeshAxis.EP.value], replicas=mesh[names[:-1]] if len(names) == 3 else mesh[names[0]])


def default_timeout(device_type: str = "cpu") -> timedelta | None:
    """The default process group's collective timeout (None for backends without one)."""
    backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device(device_type))
    options = getattr(backend, "options", None)
    return getattr(options, "_timeout", None)


def _backend_with_timeout(device_type: str) -> tuple[str, object] | None:
    name = dist.get_backend()
    if name == "gloo":
        options = dist.ProcessGroupGloo._Options()
    elif name == "nccl":
        options = dist.ProcessGroupNCCL.Options()
    else:
        return None
    timeout = default_timeout(device_type)
    if timeout is None:
        return None
    options._timeout = timeout
    return name, options
