"""Tensor parallelism: the plan's per-leaf styles applied with DTensor.

Each leaf gets PyTorch's own style (``ColwiseParallel``, ``RowwiseParallel``,
``SequenceParallel``, ``torch.distributed.tensor.parallel``) with the input and output
layouts :mod:`autopar.runtime.layouts` derived from the planner's data-flow graph;
replicated leaves and blocks whose input arrives in another layout get a small hook that
converts through DTensor, so every conversion has its correct backward (a slice's is an
all-gather, a gather's a slice). Leaves of other libraries (transformers' ``Conv1D``)
get styles from :mod:`autopar.runtime.hf`. Local outputs are handed to user code as
:func:`autopar.runtime.local_tensor.to_local` makes them, so it may add into them in
place; an attention whose q, k and v are column-parallel counts its local heads
(:func:`autopar.runtime.hf.count_local_heads`).

Layouts map to placements as in Megatron-LM: R -> ``Replicate()``, F -> ``Shard(-1)``
(features, so attention keeps whole heads), Q -> ``Shard(1)`` (the sequence dim of a
``(batch, seq, ...)`` activation, Korthikanti et al. 2022), or ``Shard(0)`` of a 2-D
``(tokens, features)`` view a model flattens its activations to (:func:`placement`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module
from torch.distributed.tensor.parallel.style import ParallelStyle
from torch.distributed.tensor.placement_types import Placement

from autopar.runtime import hf
from autopar.runtime.decoder_stages import StandIn
from autopar.runtime.errors import ShardingError
from autopar.runtime.layouts import LeafLayout, TPLayout
from autopar.runtime.local_tensor import local_output, to_local
from autopar.runtime.placements import at_rank, placement
from autopar.runtime.tied import retie
from autopar.vocab import Layout, TPStyle


def embedding_placement(layout: Layout) -> Placement:
    """The placement of an embedding's output in ``layout``.

    An embedding appends the feature dim to the shape of its ids, so its output has no
    batch dim when the ids have none: a learned position table looked up with
    ``arange(seq)`` gives ``(seq, dim)``, which the model broadcasts onto the
    ``(batch, seq, dim)`` token embeddings. Sequence-sharded (Q) therefore means the
    dim before the features, ``Shard(-2)`` (``Shard(1)`` for ``(batch, seq)`` ids, as
    :func:`placement` says; ``Shard(0)`` for ``(seq,)`` ids), so both addends hold the
    same positions on each rank. ``Shard(1)`` would split a position table's features.
    """
    return Shard(-2) if layout is Layout.Q else placement(layout)


def convert(x: torch.Tensor, mesh: DeviceMesh, src: Layout, dst: Layout, *, dtensor: bool = False) -> torch.Tensor:
    """A local tensor in layout ``src`` as a local tensor in ``dst`` (differentiable), or
    as a DTensor when ``dtensor``."""
    if src is dst and not dtensor:
        return x
    if Layout.Q in (src, dst) and x.dim() < 2:
        raise ShardingError(
            f"sequence parallelism shards the tokens of (batch, seq, ...) or (tokens, features) "
            f"activations, but a {x.dim()}-D tensor of shape {tuple(x.shape)} arrived; use sequence_parallel=False."
        )
    src_p, dst_p = placement(src, x.dim()), placement(dst, x.dim())
    out = DTensor.from_local(x, mesh, [src_p], run_check=False).redistribute(mesh, [dst_p])
    return out if dtensor else to_local(out)


def apply_tensor_parallel(
    stage: nn.Module, layout: TPLayout, mesh: DeviceMesh, tied: tuple[tuple[str, ...], ...]
) -> None:
    """Shard ``stage``'s leaves in place (only leaves and blocks present on the stage).

    ``tied`` lists the names of each parameter shared by several leaves; styles replace
    parameters one leaf at a time, so a tie is restored afterwards wherever its copies
    ended up sharded alike (a vocabulary-parallel embedding and a column-parallel head
    both split the vocabulary rows). Where they differ the copies stay separate and
    :class:`autopar.runtime.tied.TiedGradSync` sums their gradients.
    """
    modules = {n: m for n, m in stage.named_modules() if not isinstance(m, StandIn)}
    for fqn, conversion in layout.module_inputs.items():
        if fqn in modules:
            modules[fqn].register_forward_pre_hook(
                _input_converter(mesh, conversion.src, conversion.dst, dtensor=conversion.dtensor), with_kwargs=True
            )
    for fqn, (src, dst) in layout.module_outputs.items():
        if fqn in modules:
            modules[fqn].register_forward_hook(_output_converter(mesh, src, dst))
    split_heads = set()
    for fqn, leaf in layout.leaves.items():
        module = modules.get(fqn)
        if module is None:
            continue
        for style in styles_for(module, leaf, modules.get(fqn.rpartition(".")[0])):
            parallelize_module(module, mesh, style)
        if leaf.splits_heads:
            split_heads.add(fqn.rpartition(".")[0])
        if leaf.reduce_grad is not None:
            module.register_forward_hook(_broadcast_grad_reducer(mesh, leaf.reduce_grad))
    for fqn in sorted(split_heads):
        if fqn in modules:
            hf.count_local_heads(modules[fqn], mesh.size(), fqn)
    for names in tied:
        retie(stage, names)


def convert_unit_inputs(stage: nn.Module, layout: TPLayout, mesh: DeviceMesh) -> None:
    """Convert each block's input that arrives in another layout to the boundary's, on
    the block as the stage now holds it.

    Called after recomputation wraps the blocks, so the conversion runs outside a
    block's checkpoint: the checkpoint then keeps the converted (sequence-sharded)
    input, not the whole tensor it was cut from. A learned position embedding is added
    replicated, so a GPT's first block would otherwise keep the whole sum for every
    micro-batch in flight.
    """
    for fqn, arrives in layout.unit_inputs.items():
        try:
            module = stage.get_submodule(fqn)
        except AttributeError:
            continue
        if not isinstance(module, StandIn):
            module.register_forward_pre_hook(_input_converter(mesh, arrives, layout.boundary), with_kwargs=True)


def styles_for(module: nn.Module, leaf: LeafLayout, parent: nn.Module | None = None) -> list[ParallelStyle]:
    """The styles (applied in order) that run ``module`` (child of ``parent``) as ``leaf`` says."""
    special = hf.styles_for(module, leaf, parent)
    if special is not None:
        return special
    style = leaf.style
    if style is TPStyle.COLUMN and isinstance(module, nn.Linear):
        column = _Column(
            input_layouts=placement(leaf.arrives), output_layouts=placement(leaf.output), use_local_output=False
        )
        return [column] if leaf.dtensor_output else [column, _LocalOutput()]
    if style is TPStyle.ROW and isinstance(module, nn.Linear):
        return [
            _Row(input_layouts=placement(leaf.arrives), output_layouts=placement(leaf.output), use_local_output=False),
            _LocalOutput(),
        ]
    if style is TPStyle.VOCAB and isinstance(module, nn.Embedding):
        if leaf.arrives is not Layout.R:
            raise ShardingError(
                f"embedding {leaf.fqn!r} takes token ids, which must arrive replicated, not in "
                f"layout {leaf.arrives.value}."
            )
        return [
            RowwiseParallel(
                input_layouts=Replicate(), output_layouts=embedding_placement(leaf.output), use_local_output=False
            ),
            _LocalOutput(),
        ]
    if style is TPStyle.SEQUENCE:
        return _around([_Sequence(use_local_output=False), _LocalOutput()], Layout.Q, leaf)
    if style is TPStyle.HEADS:
        # the norm reads (..., heads, head_dim) views of a column-parallel projection's
        # feature shards: whole heads, Shard(-2) to DTensor, whose replicated weight then
        # has its partial gradients summed over the group (torchtitan's Qwen3 does so)
        return [SequenceParallel(sequence_dim=-2, use_local_output=False), _LocalOutput()]
    if style is TPStyle.REPLICATE:
        return _around([], Layout.R, leaf)
    raise ShardingError(
        f"layer {leaf.fqn!r} is a {type(module).__name__}, which cannot take the tensor-parallel "
        f"style {style.value!r}: column and row need nn.Linear (or transformers' Conv1D), vocab needs "
        f"nn.Embedding. Use 'replicate' for it."
    )


def _around(styles: list[ParallelStyle], computes_in: Layout, leaf: LeafLayout) -> list[ParallelStyle]:
    before = [_Convert(leaf.arrives, computes_in, output=False)] if leaf.arrives is not computes_in else []
    after = (
        [_Convert(computes_in, leaf.output, output=True, dtensor=leaf.dtensor_output)]
        if leaf.output is not computes_in or leaf.dtensor_output
        else []
    )
    return before + styles + after


def _ndim(inputs: tuple) -> int:
    """The dims of a module's first input (3 when it has no tensor there: torch's style
    then refuses it)."""
    return inputs[0].dim() if inputs and isinstance(inputs[0], torch.Tensor) else 3


def _placed_by_rank(style: type[ColwiseParallel] | type[RowwiseParallel]) -> type:
    """``style`` (torch's ``ColwiseParallel`` or ``RowwiseParallel``) whose sequence-sharded
    input or output is placed by its rank (:func:`placement`: ``Shard(0)`` of a 2-D
    ``(tokens, features)`` activation)."""

    class ByRank(style):  # type: ignore[valid-type, misc]
        @staticmethod
        def _prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh):  # type: ignore[override]
            layouts = at_rank(input_layouts, _ndim(inputs))
            return style._prepare_input_fn(layouts, desired_input_layouts, mod, inputs, device_mesh)

        @staticmethod
        def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):  # type: ignore[override]
            layouts = at_rank(output_layouts, outputs.dim())
            return style._prepare_output_fn(layouts, use_local_output, mod, outputs, device_mesh)

    ByRank.__name__ = ByRank.__qualname__ = f"{style.__name__}ByRank"
    return ByRank


_Column = _placed_by_rank(ColwiseParallel)
_Row = _placed_by_rank(RowwiseParallel)


class _Sequence(SequenceParallel):
    """``SequenceParallel`` taking its input's sequence dim by its rank (:func:`placement`)."""

    @staticmethod
    def _prepare_input_fn(sequence_sharding, mod, inputs, device_mesh):  # type: ignore[override]
        layouts = at_rank(sequence_sharding, _ndim(inputs))
        return SequenceParallel._prepare_input_fn(layouts, mod, inputs, device_mesh)


class _LocalOutput(ParallelStyle):
    """Hand the DTensor output of the style before it on as a local tensor that user
    code may modify in place (:mod:`autopar.runtime.local_tensor`)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_hook(local_output)
        return module


class _Convert(ParallelStyle):
    """Convert a leaf's (first) input or its output between two layouts."""

    def __init__(self, src: Layout, dst: Layout, *, output: bool, dtensor: bool = False):
        super().__init__()
        self.src, self.dst, self.output, self.dtensor = src, dst, output, dtensor

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if self.output:
            module.register_forward_hook(
                lambda _m, _a, out: convert(out, device_mesh, self.src, self.dst, dtensor=self.dtensor)
            )
        else:
            module.register_forward_pre_hook(_input_converter(device_mesh, self.src, self.dst), with_kwargs=True)
        return module


def _output_converter(mesh: DeviceMesh, src: Layout, dst: Layout) -> Callable[..., Any]:
    def hook(_module: nn.Module, _args: tuple, out: Any) -> Any:
        if isinstance(out, torch.Tensor):
            return convert(out, mesh, src, dst)
        if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
            return (convert(out[0], mesh, src, dst), *out[1:])
        raise ShardingError(
            f"{type(_module).__name__} returned {type(out).__name__}, not a tensor to convert from layout "
            f"{src.value} to {dst.value}."
        )

    return hook


def _broadcast_grad_reducer(mesh: DeviceMesh, features: tuple[int, int]) -> Callable[..., Any]:
    """A replicated output whose features ``start:stop`` reach head shards broadcast over
    the heads (DeepSeek-V3's rotary key part, expanded to the heads each rank holds):
    their gradient comes back as each rank's sum over its own heads, a partial sum,
    which Megatron-LM's ``f`` (identity forward, all-reduce backward) on that part alone
    makes whole; the rest of the output keeps the gradient its leaves reduce already."""
    start, stop = features

    def hook(_module: nn.Module, _args: tuple, out: Any) -> Any:
        if not isinstance(out, torch.Tensor):
            raise ShardingError(
                f"{type(_module).__name__} returned {type(out).__name__}, not the tensor whose features "
                f"{start}:{stop} reach the attention's head shards."
            )
        part = DTensor.from_local(out[..., start:stop], mesh, [Replicate()], run_check=False)
        whole = part.to_local(grad_placements=[Partial()])  # its gradient is reduced on the way back
        return torch.cat((out[..., :start], whole, out[..., stop:]), dim=-1)

    return hook


def _input_converter(mesh: DeviceMesh, src: Layout, dst: Layout, *, dtensor: bool = False) -> Callable[..., Any]:
    def hook(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args and isinstance(args[0], torch.Tensor):
            return (convert(args[0], mesh, src, dst, dtensor=dtensor), *args[1:]), kwargs
        if isinstance(kwargs.get("hidden_states"), torch.Tensor):
            return args, {**kwargs, "hidden_states": convert(kwargs["hidden_states"], mesh, src, dst, dtensor=dtensor)}
        raise ShardingError(
            f"{type(_module).__name__} got neither a positional tensor nor hidden_states= to convert "
            f"from layout {src.value} to {dst.value}."
        )

    return hook
