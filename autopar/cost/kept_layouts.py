"""Where a tensor-parallel unit's glue keeps what it saves for backward, as the runtime
runs it (``autopar.runtime.layouts``): a row-parallel leaf's partial output is reduced to
the layout of what it meets (:func:`reduced_layouts`); the glue on a flow keeps its
share in its producer's layout so reduced, or the consumer's (:func:`kept_layout`); and
a leaf whose input reaches it through a conversion after the glue keeps a new tensor
(:func:`converted_input`). Memory only: :func:`autopar.cost.tensor_parallel.evaluate_layout`
prices the glue's time in the consumer's layout, as the layout search does."""

from __future__ import annotations

from autopar.cost.leaf import TPContext, glue_layout
from autopar.graph.layer_graph import UNIT_INPUT, Flow, UnitProfile
from autopar.vocab import STYLE_IO, Layout, TPStyle


def out_layout(profile: UnitProfile, styles: tuple[TPStyle, ...], ctx: TPContext, node: int) -> Layout:
    """Output layout of a flow endpoint."""
    if node == UNIT_INPUT:
        return ctx.input_layout
    return STYLE_IO[styles[node]][1]


def reduced_layouts(profile: UnitProfile, styles: tuple[TPStyle, ...], ctx: TPContext) -> dict[int, Layout]:
    """Per partial producer (a row-parallel leaf) that meets other leaves' outputs in one
    layout at a consumer, that layout: the runtime reduces it there, so that the glue
    combining them (an attention core reading a row-parallel q beside a replicated
    key/value projection) runs in it (``autopar.runtime.layouts``; the unit's input
    decides only where no leaf's output meets it). A partial producer meeting none is
    reduced to what its consumers need (:func:`autopar.cost.leaf.glue_layout`).

    Memory only: the glue's time, and the conversion's, are priced in the consumer's
    layout, as the layout search prices them."""
    producers: dict[int, set[int]] = {}
    for flow in profile.flows:
        producers.setdefault(flow.dst, set()).add(flow.src)
    out: dict[int, Layout] = {}
    for i, style in enumerate(styles):
        if STYLE_IO[style][1] is not Layout.P:
            continue
        siblings: set[Layout] = set()
        for c in {f.dst for f in profile.flows if f.src == i}:
            others = producers[c] - {i}
            if any(o >= 0 for o in others):
                others.discard(UNIT_INPUT)
            siblings |= {out_layout(profile, styles, ctx, o) for o in others} - {Layout.P}
        if len(siblings) == 1:
            out[i] = siblings.pop()
    return out


def converted_input(
    profile: UnitProfile, styles: tuple[TPStyle, ...], ctx: TPContext, meets: dict[int, Layout], leaf: int
) -> bool:
    """Whether the input of ``leaf`` reaches it through a layout conversion after the glue
    (a replicated attention's output sliced for a row-parallel projection): the leaf then
    keeps the converted tensor, a new one, where it would have shared the glue's."""
    need = STYLE_IO[styles[leaf]][0]
    return any(kept_layout(profile, styles, ctx, meets, f, need) is not need for f in profile.flows if f.dst == leaf)


def kept_layout(
    profile: UnitProfile,
    styles: tuple[TPStyle, ...],
    ctx: TPContext,
    meets: dict[int, Layout],
    flow: Flow,
    need: Layout,
) -> Layout:
    """The layout the glue on ``flow`` keeps its share of what it saves in: its
    producer's as the runtime leaves it (a partial one reduced where it meets others,
    :func:`reduced_layouts`), or the consumer's where that is partial. What decides
    nothing where it meets leaves' outputs keeps in the layout those arrive in, as the
    runtime runs the glue combining them (``autopar.runtime.layouts``): the unit's input
    (transformers hands each block its rotary tables, which meet q and k in the
    attention) and a replicated output that reaches the attention broadcast over its
    heads (DeepSeek-V3's rotary key part: on head shards where q and the values are
    split by heads, whole where they arrive whole)."""
    own = meets.get(flow.src, out_layout(profile, styles, ctx, flow.src))
    if _undeciding(flow, own):
        others = {
            kept_layout(profile, styles, ctx, meets, f, need)
            for f in profile.flows
            if f.dst == flow.dst and not _undeciding(f, meets.get(f.src, out_layout(profile, styles, ctx, f.src)))
        }
        if len(others) == 1:
            return others.pop()
    return glue_layout(own, need, head_broadcast=flow.head_broadcast)


def _undeciding(flow: Flow, layout: Layout) -> bool:
    """Whether ``flow``'s tensor, in ``layout``, leaves the layout of the glue it meets
    others in to them."""
    return flow.src == UNIT_INPUT or (flow.head_broadcast and layout is Layout.R)
