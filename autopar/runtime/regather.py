"""Gathered inputs kept as shards: Megatron-LM's sequence parallelism, on DTensor.

With sequence parallelism a block's norms run on sequence shards and the column-parallel
matmuls after them read the whole sequence: an all-gather on the TP group makes it
(Korthikanti et al. 2022). Autograd keeps what a matmul reads for its weight gradient, so
torch's ``ColwiseParallel`` keeps the gathered tensor, ``tp`` times the shard, for every
micro-batch in flight; on a large model that is half of a rank's activations. Megatron-LM
keeps the shard and gathers again in the backward. A plan with ``regather=True`` does the
same: in each unit that keeps its activations (recompute ``none`` or ``selective``) the
column-parallel layers run under saved-tensor hooks that

- pack a tensor autograd saves if it is (a view of) the replicated result of a
  redistribute, a DTensor gathered on a one-dimensional mesh: this rank's ``1 / tp`` of
  its storage is copied and the storage is freed once the forward is done with it;
- unpack it when the backward needs it: the shards are all-gathered into the whole
  storage again, and the saved view is rebuilt on it.

The q, k and v projections save one gathered tensor three times: the storage is packed
once and gathered once, and the gathered copy lives until the last of them has read it.
The extra all-gather is asynchronous: autograd unpacks a matmul's saved tensors before its
input-gradient matmul, which does not read the input, so that matmul runs while the
gather is in flight and the weight-gradient matmul waits for it, as Megatron-LM overlaps
it. Units that recompute everything (``full``, ``op``) keep nothing but their checkpoint,
whose own hooks take precedence inside it; they are left alone. Parameters, integer
tensors and tensors that were replicated without a collective are never touched.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.multiprocessing.reductions import StorageWeakRef

from autopar.errors import ConfigError
from autopar.plan import Plan
from autopar.runtime.decoder_stages import StandIn
from autopar.runtime.layouts import TPLayout
from autopar.vocab import TPStyle

_PASSING = frozenset(
    {
        "ViewBackward0",
        "UnsafeViewBackward0",
        "AsStridedBackward0",
        "ReshapeAliasBackward0",
        "ToCopyBackward0",
        "RegisterPostBackwardFunctionBackward",
    }
)
"""What may lie between a gather and what a layer saves: the views a matmul takes of its
input (``F.linear`` flattens it), the cast autocast makes of it, and FSDP2's identity on
a sharded module's inputs (its post-backward hook)."""

_GATHER = "RedistributeBackward"
"""The node of DTensor's ``redistribute``: what a gathered tensor was made by."""


def gathered(t: torch.Tensor) -> bool:
    """Whether ``t`` is a floating-point DTensor replicated over a one-dimensional mesh of
    2 or more ranks by a redistribute (possibly through views and a cast), and not a
    parameter."""
    if not isinstance(t, DTensor) or isinstance(t, nn.Parameter) or not t.is_floating_point():
        return False
    if t.device_mesh.ndim != 1 or t.device_mesh.size() < 2 or t.placements != (Replicate(),):
        return False
    node = t.grad_fn
    while node is not None and node.name() in _PASSING:
        node = next((n for n, _ in node.next_functions if n is not None), None)
    return node is not None and node.name() == _GATHER


@dataclass
class _Shard:
    """This rank's part of one gathered storage, shared by every saved view of it."""

    shard: torch.Tensor
    numel: int
    mesh: Any
    uses: int = 0
    whole: torch.Tensor | None = None

    def gather(self) -> torch.Tensor:
        """The whole storage (flat), gathered at its first use in the backward and kept
        until its last. The all-gather is asynchronous (a functional collective): the
        backward waits for it where an op first reads the values, so the reader's
        input-gradient matmul, which does not read them, runs while it is in flight."""
        if self.whole is None:
            self.whole = funcol.all_gather_single(self.shard, 0, self.mesh)[: self.numel]
        whole = self.whole
        self.uses -= 1
        if self.uses == 0:
            self.whole = None
        return whole


@dataclass(frozen=True)
class _Saved:
    """One saved view of a gathered storage (the whole storage, contiguous), and its
    DTensor shape."""

    shard: _Shard
    size: tuple[int, ...]
    global_shape: torch.Size
    global_stride: tuple[int, ...]


@dataclass
class KeepShards:
    """The saved-tensor hooks of one unit's column-parallel layers (module docstring).

    ``packed`` maps a gathered storage (by address, checked by a weak reference, so a
    new storage at a freed one's address is not taken for it) to its shard, so that
    every layer saving a view of it shares one shard and one gather. The shard is held
    weakly too: the saved views alone keep it, and it goes with the last of them. A
    saved tensor that is not a contiguous view of its whole storage is kept as it is."""

    packed: dict[int, tuple[StorageWeakRef, weakref.ref]] = field(default_factory=dict)

    def pack(self, t: torch.Tensor) -> Any:
        if not gathered(t):
            return t
        local = t._local_tensor
        storage = local.untyped_storage()
        if not (
            local.is_contiguous()
            and local.storage_offset() == 0
            and local.numel() * local.element_size() == storage.nbytes()
        ):
            return t
        for key in [k for k, (st, sh) in self.packed.items() if st.expired() or sh() is None]:
            del self.packed[key]
        entry = self.packed.get(storage._cdata)
        shard = entry[1]() if entry is not None else None
        if shard is None:
            mesh = t.device_mesh
            size, rank = mesh.size(), mesh.get_local_rank()
            per = math.ceil(local.numel() / size)
            flat = local.reshape(-1)
            if flat.numel() != per * size:
                flat = F.pad(flat, (0, per * size - flat.numel()))
            shard = _Shard(flat[rank * per : (rank + 1) * per].clone(), local.numel(), mesh)
            self.packed[storage._cdata] = (StorageWeakRef(storage), weakref.ref(shard))
        shard.uses += 1
        return _Saved(shard, tuple(local.shape), t.shape, t.stride())

    @staticmethod
    def unpack(saved: Any) -> torch.Tensor:
        if not isinstance(saved, _Saved):
            return saved
        local = saved.shard.gather().view(saved.size)
        return DTensor.from_local(
            local,
            saved.shard.mesh,
            (Replicate(),),
            run_check=False,
            shape=saved.global_shape,
            stride=saved.global_stride,
        )

    def around(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        """``forward`` run under these hooks."""

        @functools.wraps(forward)
        def run(*args: Any, **kwargs: Any) -> Any:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                return forward(*args, **kwargs)

        return run


def check_regather(plan: Plan) -> None:
    """Refuse kept shards on compiled blocks: the saved-tensor hooks run on eager blocks
    only. Such a plan prices Megatron-LM's fused kernels (``activations='sequence-first'``),
    which keep the shards themselves."""
    if plan.config.regather and plan.config.compile:
        raise ConfigError(
            "regather=True with compile=True is priced for Megatron-LM's kernels (activations='sequence-first'); "
            "autopar's runtime keeps shards of sequence-parallel gathers on eager blocks only. Plan again with "
            "compile=False or regather=False (or without --activations sequence-first) to run it here."
        )


def apply_regather(stage: nn.Module, units: list[str], layout: TPLayout, plan: Plan) -> None:
    """Run the column-parallel layers of each of ``units`` (FQNs on ``stage``) that keeps
    its activations under one :class:`KeepShards` per unit.

    The hooks wrap the layers, not the unit: a hook that hands back the tensor it is
    given makes a reference cycle of a tensor that its own op saves (its output), which
    only the garbage collector frees; a linear layer saves its input and its weight,
    never its output."""
    modules = {n: m for n, m in stage.named_modules() if not isinstance(m, StandIn)}
    columns = [fqn for fqn, leaf in layout.leaves.items() if leaf.style is TPStyle.COLUMN and fqn in modules]
    for unit in units:
        if plan.layer_strategies.recompute_of(unit, plan.config.recompute).checkpoints_unit:
            continue
        hooks = KeepShards()
        for fqn in columns:
            if fqn == unit or fqn.startswith(unit + "."):
                modules[fqn].forward = hooks.around(modules[fqn].forward)
