"""The plan's tensor-parallel styles checked against the model's layers before any
layout is derived: every styled layer exists, its kind can take the style, and the
split divides its features and attention heads."""

from __future__ import annotations

from autopar.graph.layer_graph import UNIT_OUTPUT, LayerGraph, Leaf, LeafKind, UnitProfile
from autopar.runtime.errors import PlanMismatchError, ShardingError
from autopar.vocab import TPStyle


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
    last = len(graph.units) - 1
    leaves = {
        unit.leaf_fqn(leaf.name): (graph.profiles[unit.profile], i, leaf, u == last)
        for u, unit in enumerate(graph.units)
        for i, leaf in enumerate(graph.profiles[unit.profile].leaves)
    }
    for fqn, style in sorted(styles.items()):
        if fqn not in leaves:
            raise PlanMismatchError(
                f"the plan gives layer {fqn!r} the style {style.value!r}, but the model has no "
                f"layer with parameters of that name. Make the plan for this model."
            )
        profile, i, leaf, at_end = leaves[fqn]
        kind_allows = leaf.styles(sequence_parallel=True)
        allows = tuple(s for s in kind_allows if not always_refused(profile, i, s, last=at_end))
        if style not in allows:
            allowed = ", ".join(s.value for s in allows)
            what = (module_types or {}).get(fqn, f"{leaf.kind.value} layer")
            why = (
                "here it would hand the attention sequence shards, but attention reads every position of the "
                "sequence (nothing gathers its output first)"
                if style in kind_allows
                else "column and row split a Linear's matrix (a fused one by rows only), vocab an Embedding's "
                "rows, sequence runs a norm on sequence shards, heads a norm of each attention head on head shards"
            )
            raise ShardingError(
                f"the plan gives layer {fqn!r} ({what}) the tensor-parallel style {style.value!r}, "
                f"which it cannot take: {why}; this layer allows {allowed}. Use 'replicate' for it."
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


def always_refused(profile: UnitProfile, leaf: int, style: TPStyle, *, last: bool) -> bool:
    """Whether :func:`refusal` refuses ``style`` for leaf ``leaf`` of ``profile`` whatever
    the other leaves take: a sequence-parallel leaf whose output reaches an attention,
    where nothing gathers it first (its output is not the model's, and a consumer reads
    another leaf with parameters beside it, so :func:`_gather_at_output` never holds).
    The search leaves such styles out before pricing (Gemma 3's and OLMo 2's norms of
    queries and keys)."""
    if style is not TPStyle.SEQUENCE or not any(f.src == leaf and f.attn_flops > 0 for f in profile.flows):
        return False
    readers = {f.dst for f in profile.flows if f.src == leaf}
    if last and UNIT_OUTPUT in readers:
        return False
    return UNIT_OUTPUT in readers or any(
        f.dst in readers and f.src >= 0 and f.src != leaf and profile.leaves[f.src].kind is not LeafKind.OTHER
        for f in profile.flows
    )
