"""Where tensor-parallel layouts change: the plan's per-leaf styles turned into one
input and one output conversion per leaf, from the planner's own data-flow graph.

The planner prices each leaf style with the layouts of :data:`autopar.vocab.STYLE_IO`
(replicated R, feature-sharded F, partial P, sequence-sharded Q) and charges a
collective wherever a producer's layout differs from what a consumer needs. This module
decides where the runtime performs those conversions, using the same
:class:`~autopar.graph.layer_graph.LayerGraph` flows, so the runtime and the cost model
agree by construction:

- what user code (the glue between leaves: views, attention, activations, residual
  adds) sees is never partial: a row or vocab leaf reduces its partial output at once,
  to the layout the other inputs of its consumers already have (Megatron-LM's ``g``
  all-reduce, or a reduce-scatter with sequence parallelism, Korthikanti et al. 2022);
  with no such sibling, to what its consumers need, else to the boundary layout;
- every other leaf hands its natural layout to the glue, and each consumer converts
  what arrives into what it needs at its input (a column leaf after a sequence-parallel
  norm all-gathers, Megatron's ``f``);
- tensors that meet in the glue must be in the same layout, else the plan is refused
  naming the leaves (e.g. q column-sharded but k replicated); nor may the glue's
  attention read sequence shards (OLMo 2's norm over the whole query projection
  run on sequence shards), since attention reads every position. Where leaf outputs meet
  the unit's input, the leaf outputs decide: the tracer attributes constants made inside
  a unit (positions, rotary tables, the loss's targets) to the unit input, and the real
  residual stream is already in the layout partial outputs are reduced to;
- under sequence parallelism, a replicated leaf that feeds only the unit's output next
  to a partial one keeps its sequence shard, so the residual sum meets in Q;
- between units the activation is in the boundary layout (R, or Q with sequence
  parallelism); a block whose input arrives otherwise (after embeddings that end in R)
  converts it on entry, so every stage boundary carries one known layout;
- the model's output is replicated, or vocabulary-sharded for a token model whose head
  is column-parallel: the loss then runs under ``loss_parallel`` (as the planner assumes
  whenever the model has a vocabulary).

Pure functions of the graph and the styles: no process group, testable alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from autopar.graph.layer_graph import UNIT_INPUT, UNIT_OUTPUT, LayerGraph, Leaf, LeafKind, Unit, UnitProfile
from autopar.runtime.errors import ShardingError
from autopar.runtime.partial_outputs import broadcast_features, deciding, reduce_to, unbroadcast
from autopar.runtime.style_checks import check_styles
from autopar.vocab import STYLE_IO, Layout, TPStyle


@dataclass(frozen=True, kw_only=True)
class LeafLayout:
    """How one leaf runs under tensor parallelism.

    Attributes:
        fqn: the leaf's module FQN in the model.
        style: its plan style.
        arrives: layout of the input user code hands it.
        output: layout its output is handed to user code in (never P).
        dtensor_output: the output stays a DTensor (the vocabulary-sharded logits the
            loss reads under ``loss_parallel``).
        out_heads: the attention heads its output feeds (the traced leaf's), 0 for none.
        reduce_grad: the range of its (replicated) output's features that reaches head
            shards broadcast over the heads (:attr:`autopar.graph.layer_graph.Leaf.
            broadcast_features`): their gradient is all-reduced over the group in
            backward (Megatron-LM's ``f`` on that part alone).
    """

    fqn: str
    style: TPStyle
    arrives: Layout
    output: Layout
    dtensor_output: bool = False
    out_heads: int = 0
    reduce_grad: tuple[int, int] | None = None

    @property
    def splits_heads(self) -> bool:
        """Its output reaches the attention split by heads: each rank computes a share
        of them (a column-parallel projection of q, k or v handed on sharded)."""
        return self.style is TPStyle.COLUMN and self.output is Layout.F and self.out_heads > 0

    @property
    def needs(self) -> Layout:
        """The input layout its style computes on."""
        return STYLE_IO[self.style][0]


@dataclass(frozen=True, kw_only=True)
class ModuleInput:
    """A conversion at a submodule's input.

    Attributes:
        src, dst: layouts before and after.
        dtensor: hand the submodule a DTensor (its entry leaves are all column-parallel
            and consume it as is), not a local tensor.
        leaves: the entry leaves the conversion serves.
    """

    src: Layout
    dst: Layout
    dtensor: bool
    leaves: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class TPLayout:
    """Every conversion the runtime makes for one plan.

    Attributes:
        boundary: the layout between units (R, or Q with sequence parallelism).
        leaves: per leaf FQN, for every leaf that converts something or is sharded.
        unit_inputs: module FQN of a block -> the layout its input arrives in, for the
            blocks that convert their input to ``boundary`` on entry.
        module_inputs: submodule FQN -> the conversion of its first input, moved up
            from the leaves inside it (see :func:`_hoist`).
        module_outputs: submodule FQN -> the conversion of its output (``src``,
            ``dst``), for a replicated addend whose leaf output is not the addend (see
            :func:`_shard_replicated_addends`).
        unit_outputs: per unit module FQN, the layout its output leaves in.
        loss_parallel: the model's output is vocabulary-sharded.
    """

    boundary: Layout
    leaves: dict[str, LeafLayout]
    unit_inputs: dict[str, Layout]
    module_inputs: dict[str, ModuleInput]
    unit_outputs: dict[str, Layout]
    loss_parallel: bool
    module_outputs: dict[str, tuple[Layout, Layout]] = field(default_factory=dict)


def resolve(
    graph: LayerGraph,
    styles: dict[str, TPStyle],
    *,
    sequence_parallel: bool,
    tp: int,
    module_types: dict[str, str] | None = None,
) -> TPLayout:
    """The conversions of every leaf and unit (see the module docstring)."""
    check_styles(graph, styles, sequence_parallel=sequence_parallel, tp=tp, module_types=module_types)
    boundary = Layout.Q if sequence_parallel else Layout.R
    loss_parallel = graph.vocab_size > 0
    leaves: dict[str, LeafLayout] = {}
    unit_inputs: dict[str, Layout] = {}
    unit_outputs: dict[str, Layout] = {}
    module_inputs: dict[str, ModuleInput] = {}
    module_outputs: dict[str, tuple[Layout, Layout]] = {}
    previous = Layout.R
    n = len(graph.units)
    for index, unit in enumerate(graph.units):
        arrives = previous
        if index > 0 and previous is not boundary and _single_module(unit):
            unit_inputs[unit.modules[0]] = previous
            arrives = boundary
        last = index == n - 1
        out, unit_leaves, hoisted, carried = _resolve_unit(
            graph.profiles[unit.profile], unit, styles, arrives, boundary, last=last, loss_parallel=loss_parallel
        )
        leaves.update(unit_leaves)
        module_inputs.update(hoisted)
        module_outputs.update(carried)
        for m in unit.modules:
            unit_outputs[m] = out
        previous = out
    return TPLayout(
        boundary=boundary,
        leaves=leaves,
        unit_inputs=unit_inputs,
        module_inputs=module_inputs,
        unit_outputs=unit_outputs,
        loss_parallel=loss_parallel and any(v.dtensor_output for v in leaves.values()),
        module_outputs=module_outputs,
    )


def _single_module(unit: Unit) -> bool:
    return len(unit.modules) == 1 and unit.prefix == unit.modules[0]


def refusal(
    profile: UnitProfile,
    styles: Sequence[TPStyle],
    *,
    arrives: Layout,
    boundary: Layout,
    last: bool,
    loss_parallel: bool,
) -> str | None:
    """Why the runtime cannot run one unit under ``styles`` (one per leaf of ``profile``,
    its input arriving in ``arrives``), or None when it can.

    The planner prices each flow's conversion on its own, so its cost model admits
    layouts whose tensors meet in user code in two layouts (q column-parallel beside a
    replicated k), which :func:`resolve` refuses; the search asks this of the layouts it
    picks, so every plan it returns runs."""
    unit = Unit(fqn="unit", modules=(), prefix="", profile=0, param_numel=0)
    named = {leaf.name: style for leaf, style in zip(profile.leaves, styles, strict=True)}
    try:
        _resolve_unit(profile, unit, named, arrives, boundary, last=last, loss_parallel=loss_parallel)
    except ShardingError as err:
        return str(err)
    return None


def _resolve_unit(
    prof: UnitProfile,
    unit: Unit,
    styles: dict[str, TPStyle],
    arrives: Layout,
    boundary: Layout,
    *,
    last: bool,
    loss_parallel: bool,
) -> tuple[Layout, dict[str, LeafLayout], dict[str, ModuleInput], dict[str, tuple[Layout, Layout]]]:
    names = [unit.leaf_fqn(leaf.name) for leaf in prof.leaves]
    leaf_styles = [styles.get(name, TPStyle.REPLICATE) for name in names]
    consumers: dict[int, set[int]] = {}
    producers: dict[int, set[int]] = {}
    for flow in prof.flows:
        consumers.setdefault(flow.src, set()).add(flow.dst)
        producers.setdefault(flow.dst, set()).add(flow.src)

    out: dict[int, Layout] = {UNIT_INPUT: arrives}
    dtensor_out: set[int] = set()
    for i, style in enumerate(leaf_styles):
        natural = STYLE_IO[style][1]
        if natural is Layout.P:
            continue
        mine = consumers.get(i, set())
        if last and UNIT_OUTPUT in mine:
            if natural is Layout.F and loss_parallel:
                dtensor_out.add(i)
            elif natural is not Layout.R:
                natural = Layout.R
        elif natural is not Layout.R and _gather_at_output(i, mine, producers, leaf_styles, prof.leaves):
            natural = Layout.R
            if all(leaf_styles[c] is TPStyle.COLUMN for c in mine):
                dtensor_out.add(i)
        out[i] = natural
    carried: dict[str, tuple[Layout, Layout]] = {}
    carried_leaves: set[int] = set()  # their module converts, they hand on R
    if boundary is Layout.Q and not last:
        for i in _shard_replicated_addends(leaf_styles, consumers, producers, out):
            child = _child(unit, names[i])
            if child != names[i]:
                carried[child] = (Layout.R, Layout.Q)
                carried_leaves.add(i)
    broadcast = {(f.src, f.dst) for f in prof.flows if f.head_broadcast}
    for i, style in enumerate(leaf_styles):
        if STYLE_IO[style][1] is Layout.P:
            out[i] = reduce_to(i, names, leaf_styles, consumers, producers, out, boundary, broadcast, last=last)

    reduced: dict[int, tuple[int, int]] = {}

    def arrival(dst: int) -> Layout:
        srcs = sorted(deciding(unbroadcast(producers.get(dst, {UNIT_INPUT}), dst, broadcast, out)))
        seen = {out[s] for s in srcs}
        if len(seen) > 1:
            where = "the unit's output" if dst == UNIT_OUTPUT else repr(names[dst])
            detail = ", ".join(f"{_name(s, names, unit)} in {out[s].value}" for s in srcs)
            raise ShardingError(
                f"tensors meeting before {where} in unit {unit.fqn!r} arrive in different tensor-parallel layouts "
                f"({detail}; R replicated, F feature-sharded, Q sequence-sharded): user code cannot combine them. "
                f"Give the layers that feed the same computation matching styles (e.g. q, k and v all 'column')."
            )
        layout = seen.pop()
        if layout is not Layout.R:
            for s in producers.get(dst, set()) - set(srcs):
                if s >= 0 and (s, dst) in broadcast:
                    reduced[s] = broadcast_features(s, names, prof, unit)
        return layout

    for flow in prof.flows:
        if flow.attn_flops > 0 and flow.src >= 0 and out[flow.src] is Layout.Q:
            raise ShardingError(
                f"layer {names[flow.src]!r} (style {leaf_styles[flow.src].value!r}) hands the attention in unit "
                f"{unit.fqn!r} sequence shards, but attention reads every position of the sequence: give it a "
                f"style whose output keeps whole sequences ('replicate' for a norm inside the attention)."
            )
    for i, leaf in enumerate(prof.leaves):  # first: the meeting after them would name no cause
        if leaf.per_head:
            _check_head_norm(names[i], leaf_styles[i], arrival(i), out[i])
    arrives_at = {i: arrival(i) for i in range(len(names))}
    hoisted = _hoist(unit, names, leaf_styles, arrives_at, producers, dtensor_out)
    for conversion in hoisted.values():
        for name in conversion.leaves:
            arrives_at[names.index(name)] = conversion.dst
    result: dict[str, LeafLayout] = {}
    for i, style in enumerate(leaf_styles):
        output = Layout.R if i in carried_leaves else out[i]
        layout = LeafLayout(
            fqn=names[i],
            style=style,
            arrives=arrives_at[i],
            output=output,
            dtensor_output=i in dtensor_out,
            out_heads=prof.leaves[i].out_heads,
            reduce_grad=reduced.get(i),
        )
        if (
            style is not TPStyle.REPLICATE
            or layout.arrives is not Layout.R
            or layout.output is not Layout.R
            or layout.reduce_grad
        ):
            result[names[i]] = layout
    unit_out = arrival(UNIT_OUTPUT)
    if (
        not last
        and out[UNIT_INPUT] is Layout.Q
        and unit_out is not Layout.Q
        and UNIT_INPUT in producers.get(UNIT_OUTPUT, ())
    ):
        detail = ", ".join(
            f"{_name(s, names, unit)} in {out[s].value}" for s in sorted(deciding(producers[UNIT_OUTPUT]))
        )
        raise ShardingError(
            f"the residual stream of unit {unit.fqn!r} is sequence-sharded (Q) but is summed with {detail} "
            f"(R replicated, F feature-sharded): give those layers styles whose output is reduced or sliced to "
            f"sequence shards (e.g. the attention's and the MLP's last projections 'row')."
        )
    if last and unit_out not in (Layout.R, Layout.F):
        raise ShardingError(
            f"the model's output leaves unit {unit.fqn!r} in layout {unit_out.value}; the loss needs "
            f"it replicated (or vocabulary-sharded)."
        )
    return unit_out, result, hoisted, carried


def _check_head_norm(name: str, style: TPStyle, arrives: Layout, output: Layout) -> None:
    """A norm of each attention head reads ``(..., heads, head_dim)`` views: feature
    shards there hold whole heads, which a conversion along the last dim would cut. In
    style ``heads`` it runs on the head shards a column-parallel projection writes and
    hands them on as they are; replicated, it reads a projection gathered where it is
    written (:func:`_gather_at_output`)."""
    if style is TPStyle.HEADS and (arrives is not Layout.F or output is not Layout.F):
        raise ShardingError(
            f"layer {name!r} (style 'heads') normalises each attention head on the head shards a "
            f"column-parallel projection writes, but its input arrives in layout {arrives.value} and its output "
            f"is wanted in {output.value}: give its projection 'column' and its readers head shards, or give it "
            f"'replicate'."
        )


def _child(unit: Unit, name: str) -> str:
    """The child of ``unit``'s module that holds leaf ``name`` (the leaf itself when it
    is a direct child)."""
    prefix = unit.prefix
    if not prefix or not name.startswith(prefix + "."):
        return name
    return prefix + "." + name[len(prefix) + 1 :].split(".")[0]


def _gather_at_output(
    i: int, consumers: set[int], producers: dict[int, set[int]], styles: list[TPStyle], leaves: tuple[Leaf, ...]
) -> bool:
    """Whether a sharded output is gathered where it is produced: every consumer is a leaf
    that needs it replicated and reads nothing else but replicated outputs of
    replicated leaves (a mixture-of-experts' experts read the norm's output and their
    router's). User code between them may read full sizes (transformers' GPT-2 reshapes
    the final norm's output with the sequence length of the input), so a replicated
    tensor is the safe thing to hand it. Fed only to column-parallel leaves it stays a
    DTensor, so their partial input gradients are reduce-scattered once, as Korthikanti
    et al. 2022 do."""
    if not consumers or any(c < 0 for c in consumers):
        return False

    def replicated(p: int) -> bool:
        return p >= 0 and styles[p] is TPStyle.REPLICATE and leaves[p].kind is LeafKind.OTHER

    return all(
        STYLE_IO[styles[c]][0] is Layout.R
        and i in producers.get(c, set())
        and all(replicated(p) for p in producers.get(c, set()) - {UNIT_INPUT, i})
        for c in consumers
    )


def _hoist(
    unit: Unit,
    names: list[str],
    styles: list[TPStyle],
    arrives_at: dict[int, Layout],
    producers: dict[int, set[int]],
    dtensors: set[int],
) -> dict[str, ModuleInput]:
    """Conversions moved from leaves up to the submodule that holds them.

    User code often reads sizes from a submodule's input (``b, s, _ = x.shape`` in an
    attention module) before its leaves run, so a sequence-sharded input must be gathered
    when it enters the attention module, not when it enters ``wq`` (torchtitan's
    ``PrepareModuleInput`` on ``attention``). The *entry* leaves of a child of the unit
    are those fed only from outside it; when they all convert alike, the conversion moves
    to the child's input. When they need a sequence-sharded input in different layouts
    (q column-parallel, k and v row-parallel), it is gathered at the child's input and
    each slices what it needs (a slice's backward gathers, so the gradients add up
    whole). When they are all column-parallel, the child receives a replicated DTensor
    that they consume directly, so the partial input gradients of q, k and v add up
    first and are reduced once (an all-reduce, or a reduce-scatter with sequence
    parallelism), as the planner prices it and as Megatron-LM does.
    """
    prefix = unit.prefix
    entries: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        if not prefix or not name.startswith(prefix + "."):
            continue
        child = prefix + "." + name[len(prefix) + 1 :].split(".")[0]
        if child == name:
            continue
        inside = [s for s in producers.get(i, ()) if s >= 0 and names[s].startswith(child + ".")]
        handed = producers.get(i, set()) - {UNIT_INPUT}
        if not inside and not (handed and handed <= dtensors):  # a DTensor needs no wrapping
            entries.setdefault(child, []).append(i)
    hoisted: dict[str, ModuleInput] = {}
    for child, leaves in entries.items():
        arriving = {arrives_at[i] for i in leaves}
        needed = {STYLE_IO[styles[i]][0] for i in leaves}
        if len(arriving) != 1:
            continue
        src, entry = arriving.pop(), tuple(names[i] for i in leaves)
        if len(needed) != 1:
            if src is Layout.Q:  # gathered where user code reads its sizes; each leaf slices what it needs
                hoisted[child] = ModuleInput(src=src, dst=Layout.R, dtensor=False, leaves=entry)
            continue
        dst = needed.pop()
        columns = all(styles[i] is TPStyle.COLUMN for i in leaves)
        if columns or src is not dst:
            hoisted[child] = ModuleInput(src=src, dst=dst, dtensor=columns, leaves=entry)
    return hoisted


def _shard_replicated_addends(
    styles: list[TPStyle], consumers: dict[int, set[int]], producers: dict[int, set[int]], out: dict[int, Layout]
) -> list[int]:
    """Under sequence parallelism, a replicated leaf whose output is summed into the
    sequence-sharded residual stream keeps its sequence shard (a local slice), so that
    the sum meets in one layout; the planner prices the same conversion at that leaf's
    output (R -> Q towards the unit's output: a slice forward, an all-gather backward).

    Such an addend feeds the unit's output beside the unit's input (the residual), or
    beside a partial output summed into it (a replicated mixture-of-experts MLP after a
    row-parallel attention projection); any other leaf it feeds must read the same sum
    (the unit's input reaches it too: OPT's final norm after a replicated attention's
    ``out_proj``), and then converts the sequence-sharded sum at its input. Returns those
    leaves: the runtime converts at the leaf's output, or at the output of the unit's
    child module that holds it when the leaf is inside one (transformers' experts return
    ``(tokens, hidden)``, their MoE block the ``(batch, seq, hidden)`` addend)."""
    meets = producers.get(UNIT_OUTPUT, set())
    partial = any(STYLE_IO[styles[s]][1] is Layout.P for s in meets if s >= 0)
    if not (partial or UNIT_INPUT in meets) or out.get(UNIT_INPUT) is not Layout.Q:
        return []
    found = [
        s
        for s in sorted(meets)
        if s >= 0
        and styles[s] is TPStyle.REPLICATE
        and all(c == UNIT_OUTPUT or UNIT_INPUT in producers.get(c, set()) for c in consumers.get(s, set()))
    ]
    for s in found:
        out[s] = Layout.Q
    return found


def _name(index: int, names: list[str], unit: Unit) -> str:
    return f"the input of {unit.fqn!r}" if index == UNIT_INPUT else repr(names[index])
