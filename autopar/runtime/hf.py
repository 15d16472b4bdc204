"""Tensor-parallel styles for Hugging Face transformers' ``Conv1D`` (GPT-2's linear layer
with a transposed ``(in, out)`` weight), including GPT-2's fused ``c_attn``.

PyTorch's ``ColwiseParallel``/``RowwiseParallel`` accept only ``nn.Linear`` and
``nn.Embedding``. Here the weights become DTensors with the transposed placements
(column: ``Shard(1)``; row: ``Shard(0)``) and the layer computes on local shards, with
DTensor doing the conversions at its edges so every collective has its correct
backward (Megatron-LM's ``f``/``g``, Shoeybi et al. 2019).

The fused ``c_attn`` projects to ``[q | k | v]`` (3 x hidden). A plain column split would
hand rank 0 all of q and part of k. It must be split by heads within each of q, k and v
(Megatron-LM's layout for fused QKV), so its weight is held as a ``(in, 3, hidden)``
DTensor sharded on the last dim (bias ``(3, hidden)``): rank ``r`` holds heads
``r*n/t .. (r+1)*n/t`` of q, of k and of v, and its local output is ``[q_r | k_r | v_r]``.
The attention module's ``split_size`` is set to the local hidden size so transformers'
``split(split_size)`` cuts that local output correctly. Checkpoints then hold
``c_attn.weight`` as ``(in, 3, hidden)``; :mod:`autopar.runtime.checkpoint` loads a
tensor saved in one shape into another of the same size by reshaping it.

Attention modules that view their projections by a stored head count (transformers'
OPT: ``q.view(bsz, -1, self.num_heads, self.head_dim)``) would, with the global count,
fold each rank's narrower q, k and v over the sequence and silently attend over the
wrong positions; :func:`count_local_heads` makes them count the heads on the rank.
"""

from __future__ import annotations

import types

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel.style import ParallelStyle

from autopar.graph.units import is_conv1d
from autopar.runtime.errors import ShardingError
from autopar.runtime.layouts import LeafLayout
from autopar.runtime.local_tensor import to_local
from autopar.runtime.placements import placement
from autopar.vocab import Layout, TPStyle

HEAD_COUNTS = ("num_heads", "num_attention_heads", "n_head", "n_heads", "num_key_value_heads", "num_kv_heads")
"""Attributes in which transformers' attention modules store how many (query or
key/value) heads they compute."""


def count_local_heads(attention: nn.Module, tp: int, fqn: str) -> None:
    """Make ``attention`` (at ``fqn``), whose q, k and v projections are column-parallel,
    count the heads each rank computes: every head count it stores divided by ``tp``.
    Modules that view by ``-1`` heads (Llama's) store none and need nothing."""
    for name in HEAD_COUNTS:
        count = getattr(attention, name, None)
        if not isinstance(count, int) or isinstance(count, bool):
            continue
        if count % tp:
            raise ShardingError(
                f"attention {fqn!r} ({type(attention).__name__}) has {name}={count}, which does not divide "
                f"by tp={tp}: each rank must hold whole heads. Use 'replicate' for its projections."
            )
        setattr(attention, name, count // tp)


def fused_parts(module: nn.Module, parent: nn.Module | None) -> int:
    """How many projections a Conv1D fuses: 3 for GPT-2's ``c_attn`` (q, k, v), 2 for
    its cross-attention ``c_attn`` (k, v), else 1."""
    split = getattr(parent, "split_size", None)
    if parent is None or getattr(parent, "c_attn", None) is not module or not split:
        return 1
    return int(module.nf // split)


def styles_for(module: nn.Module, leaf: LeafLayout, parent: nn.Module | None) -> list[ParallelStyle] | None:
    """Styles for a transformers layer, or None for ordinary PyTorch layers."""
    if not is_conv1d(module) or leaf.style is TPStyle.REPLICATE:
        return None
    if leaf.style not in (TPStyle.COLUMN, TPStyle.ROW):
        raise ShardingError(
            f"layer {leaf.fqn!r} is a transformers Conv1D; it takes 'column' or 'row', not {leaf.style.value!r}."
        )
    if leaf.dtensor_output:
        raise ShardingError(
            f"layer {leaf.fqn!r} (a Conv1D) ends the model column-sharded; a vocabulary-parallel "
            f"loss needs the head to be an nn.Linear."
        )
    return [_Conv1DParallel(leaf, fused_parts(module, parent), parent)]


def _as_replicated_input(x: torch.Tensor, mesh: DeviceMesh, arrives: Layout) -> torch.Tensor:
    """The full input of a column split as a local tensor whose gradient is partial (each
    rank's shard of the weight contributes part of it), reduced by DTensor in backward."""
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, [placement(arrives, x.dim())], run_check=False)
    if x.placements != (Replicate(),):
        x = x.redistribute(mesh, [Replicate()])
    return x.to_local(grad_placements=[Partial()])


class _Conv1DParallel(ParallelStyle):
    def __init__(self, leaf: LeafLayout, parts: int, parent: nn.Module | None):
        super().__init__()
        self.leaf, self.parts, self.parent = leaf, parts, parent

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp = device_mesh.size()
        nx, nf = module.weight.shape
        column = self.leaf.style is TPStyle.COLUMN
        split = nf // self.parts if column else nx
        if split % tp:
            raise ShardingError(
                f"layer {self.leaf.fqn!r} (Conv1D {nx}x{nf}) cannot be split {tp} ways: "
                f"{'output' if column else 'input'} size {split} is not a multiple of tp={tp}."
            )
        if column and self.parts > 1:
            weight = module.weight.detach().reshape(nx, self.parts, nf // self.parts)
            bias = module.bias.detach().reshape(self.parts, nf // self.parts)
            w_pl, b_pl = Shard(2), Shard(1)
        elif column:
            weight, bias = module.weight.detach(), module.bias.detach()
            w_pl, b_pl = Shard(1), Shard(0)
        else:
            weight, bias = module.weight.detach(), module.bias.detach()
            w_pl, b_pl = Shard(0), Replicate()
        module.weight = nn.Parameter(distribute_tensor(weight, device_mesh, [w_pl], src_data_rank=None))
        module.bias = nn.Parameter(distribute_tensor(bias, device_mesh, [b_pl], src_data_rank=None))
        if column and self.parts > 1:
            self.parent.split_size = self.parent.split_size // tp
        forward = _column_forward if column else _row_forward
        module.forward = types.MethodType(lambda m, x: forward(m, x, device_mesh, self.leaf), module)
        return module


def _column_forward(m: nn.Module, x: torch.Tensor, mesh: DeviceMesh, leaf: LeafLayout) -> torch.Tensor:
    local = _as_replicated_input(x, mesh, leaf.arrives)
    w = m.weight.to_local()
    b = m.bias.to_local()
    y = torch.addmm(b.reshape(-1), local.reshape(-1, local.shape[-1]), w.reshape(w.shape[0], -1))
    y = y.view(*local.shape[:-1], -1)
    if leaf.output is not Layout.F:
        y = to_local(
            DTensor.from_local(y, mesh, [Shard(-1)], run_check=False).redistribute(
                mesh, [placement(leaf.output, y.dim())]
            )
        )
    return y


def _row_forward(m: nn.Module, x: torch.Tensor, mesh: DeviceMesh, leaf: LeafLayout) -> torch.Tensor:
    if isinstance(x, DTensor):
        x = x.redistribute(mesh, [Shard(-1)]).to_local()
    elif leaf.arrives is not Layout.F:
        x = (
            DTensor.from_local(x, mesh, [placement(leaf.arrives, x.dim())], run_check=False)
            .redistribute(mesh, [Shard(-1)])
            .to_local()
        )
    partial = torch.mm(x.reshape(-1, x.shape[-1]), m.weight.to_local()).view(*x.shape[:-1], -1)
    y = DTensor.from_local(partial, mesh, [Partial()], run_check=False).redistribute(
        mesh, [placement(leaf.output, partial.dim())]
    )
    return to_local(y + m.bias)
