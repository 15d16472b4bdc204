"""The plan's tensor-parallel styles checked against the model's layers before any
layout is derived: every styled layer exists, its kind can take the style, and the
split divides its features and attention heads."""

from __future__ import annotations

from autopar.graph.layer_graph import LayerGraph, Leaf, LeafKind
from autopar.runtime.errors import PlanMismatchError, ShardingError
from autopar.vocab import TPStyle

_KIND_STYLES: dict[LeafKind, tuple[TPStyle, ...]] = {
    LeafKind.LINEAR: (TPStyle.REPLICATE, TPStyle.COLUMN, TPStyle.ROW),
    LeafKind.EMBEDDING: (TPStyle.REPLICATE, TPStyle.VOCAB),
    LeafKind.NORM: (TPStyle.REPLICATE, TPStyle.SEQUENCE),
    LeafKind.OTHER: (TPStyle.REPLICATE,),
}


def check_styles(
    graph: LayerGraph,
    styles: dict[str, TPStyle],
    *,
    sequence_parallel: bool,
    tp: int,
    module_types: dict[str, str] | None = None,
) -> None:
    """Refuse styles for layers the model lacks, that the layer's kind cannot take, or
    whose split does not divide the layer's features or attention heads (a vocabulary
    may split unevenly: DTensor shards it in ``torch.chunk`` pieces where Megatron-LM
    pads it). ``module_types``: FQN -> class name, for the messages."""
    leaves = {unit.leaf_fqn(leaf.name): leaf for unit in graph.units for leaf in graph.profiles[unit.profile].leaves}
    for fqn, style in sorted(styles.items()):
        leaf = leaves.get(fqn)
        if leaf is None:
            raise PlanMismatchError(
                f"the plan gives layer {fqn!r} the style {style.value!r}, but the model has no "
                f"layer with parameters of that name. Make the plan for this model."
            )
        allows = leaf.styles(sequence_parallel=True) if leaf.per_head else _KIND_STYLES[leaf.kind]
        if style not in allows:
            allowed = ", ".join(s.value for s in allows)
            what = (module_types or {}).get(fqn, f"{leaf.kind.value} layer")
            raise ShardingError(
                f"the plan gives layer {fqn!r} (a {what}) the tensor-parallel style {style.value!r}, "
                f"which it cannot take: column and row split a Linear's matrix, vocab an Embedding's "
                f"rows, sequence runs a norm on sequence shards, heads a norm of each attention head on head "
                f"shards; this layer allows {allowed}. "
                f"Use 'replicate' for it."
            )
        _check_divides(fqn, leaf, style, tp)
        if style is TPStyle.SEQUENCE and not sequence_parallel:
            raise ShardingError(
                f"the plan gives layer {fqn!r} the style 'sequence' but sequence_parallel is off. "
                f"Set sequence_parallel=True or use 'replicate'."
            )


def _check_divides(fqn: str, leaf: Leaf, style: TPStyle, tp: int) -> None:
    if style is TPStyle.COLUMN:
        size, heads, what = leaf.out_features, leaf.out_heads, "output features"
    elif style is TPStyle.ROW:
        size, heads, what = leaf.in_features, leaf.in_heads, "input features"
    elif style is TPStyle.HEADS:
        size, heads, what = leaf.out_heads, 0, "attention heads"
    else:
        return
    if leaf.vocab and style is TPStyle.COLUMN:
        return
    if size % tp or (heads and heads % tp):
        detail = f"{size} {what}" + (f" from {heads} attention heads" if heads else "")
        raise ShardingError(
            f"the plan splits layer {fqn!r} {style.value}-wise over tp={tp}, but its {detail} do not "
            f"divide by {tp}: each rank must hold whole heads and equal slices. Use a tp that "
            f"divides them, or 'replicate' for this layer."
        )
