"""Where a tensor-parallel unit's partial outputs are reduced to, and what reaches an
attention's head shards broadcast over its heads (:mod:`autopar.runtime.layouts`): the
layouts that decide where tensors meet (:func:`deciding`, :func:`unbroadcast`), the
layout a row-parallel leaf's partial output is reduced to (:func:`reduce_to`), and the
features of a replicated output whose gradient the head shards return partial
(:func:`broadcast_features`, DeepSeek-V3's rotary key part)."""

from __future__ import annotations

from autopar.graph.layer_graph import UNIT_INPUT, UNIT_OUTPUT, Unit, UnitProfile
from autopar.runtime.errors import ShardingError
from autopar.vocab import STYLE_IO, Layout, TPStyle


def unbroadcast(sources: set[int], dst: int, broadcast: set[tuple[int, int]], out: dict[int, Layout]) -> set[int]:
    """Of the tensors meeting at ``dst``, those whose layout matters: a replicated one
    that reaches it only broadcast over the attention's heads fits any head shard (one
    head's worth, expanded to the heads the rank holds: DeepSeek-V3's rotary key part),
    so it does not decide, as long as something else does."""
    kept = {s for s in sources if not ((s, dst) in broadcast and out.get(s) is Layout.R)}
    return kept if any(s >= 0 for s in kept) else sources


def broadcast_features(i: int, names: list[str], prof: UnitProfile, unit: Unit) -> tuple[int, int]:
    """The features of leaf ``i``'s replicated output that reach head shards broadcast
    over the heads, whose gradient the runtime reduces: refused where the trace could
    not name them, or where the leaf's output also goes elsewhere than to leaves (those
    features' gradient would be reduced there too)."""
    features = prof.leaves[i].broadcast_features
    elsewhere = any(f.src == i and f.dst < 0 and not f.head_broadcast for f in prof.flows)
    if features is None or elsewhere:
        raise ShardingError(
            f"layer {names[i]!r} in unit {unit.fqn!r} is replicated and reaches the attention's head shards "
            f"broadcast over the heads, but its gradient from them, a partial sum over the shards, cannot be "
            f"reduced alone: the trace found no one range of its output features that only the attention reads. "
            f"Give the attention's projections styles that keep its heads whole ('replicate' or 'row')."
        )
    return features


def deciding(sources: set[int]) -> set[int]:
    """Of the tensors meeting at one place, those whose layouts decide it: the leaves'
    outputs where any meets the unit's input (see "constants" in :mod:`autopar.runtime.layouts`)."""
    return sources - {UNIT_INPUT} if any(s >= 0 for s in sources) else sources


def reduce_to(
    i: int,
    names: list[str],
    styles: list[TPStyle],
    consumers: dict[int, set[int]],
    producers: dict[int, set[int]],
    out: dict[int, Layout],
    boundary: Layout,
    broadcast: set[tuple[int, int]],
    *,
    last: bool,
) -> Layout:
    """The layout a partial output is reduced to (:mod:`autopar.runtime.layouts`' docstring, first rule). Where
    other leaves' outputs meet the unit's input, they decide (:func:`deciding`;
    transformers hands each block its rotary tables, which reach the attention beside
    q), even while they are partial too (q, k and v all row-parallel are reduced to what
    the attention's consumer needs). A part broadcast over the attention's heads is
    reduced whole (:func:`unbroadcast`), whatever the heads it meets."""
    siblings: set[Layout] = set()
    for c in consumers.get(i, ()):
        if (i, c) in broadcast:
            siblings.add(Layout.R)
            continue
        siblings |= {out[s] for s in deciding(producers.get(c, set()) - {i}) if s in out}
    if len(siblings) == 1:
        return siblings.pop()
    if len(siblings) > 1:
        raise ShardingError(
            f"layer {names[i]!r} (style {styles[i].value!r}) is summed with tensors in several layouts "
            f"({', '.join(sorted(s.value for s in siblings))}); give its neighbours matching styles."
        )
    needs = set()
    for c in consumers.get(i, ()):
        if c == UNIT_OUTPUT:
            return Layout.R if last else boundary
        needs.add(STYLE_IO[styles[c]][0])
    return needs.pop() if len(needs) == 1 else boundary
