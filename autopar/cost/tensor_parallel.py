"""The cost of one unit under one tensor-parallel layout (a style per leaf).

Each style consumes and produces a tensor *layout* on the TP group
(:data:`autopar.vocab.STYLE_IO`):

=========  ===========  ============  =============================================
style      input        output        what runs where
=========  ===========  ============  =============================================
replicate  R (full)     R             every rank runs the whole leaf
column     R            F (features)  weight split over outputs, compute / t
row        F            P (partial)   weight split over inputs, compute / t
vocab      R (ids)      P             embedding rows split; every rank looks up all
sequence   Q (seq)      Q             a norm on a sequence shard, compute / t
=========  ===========  ============  =============================================

Where a producer's layout ``a`` differs from what a consumer needs ``b``, a collective
converts it (P->R all-reduce, P->Q reduce-scatter, Q->R all-gather, ...), and backward
runs the conjugate (Megatron-LM's f/g operators, Shoeybi et al. 2019; the sequence
parallel all-gather/reduce-scatter pairs of Korthikanti et al. 2022). A tensor is
converted once per target layout however many consumers need it, and the input
gradient of column-parallel consumers, which is a partial sum, is reduced once per
producer. Parameter-free glue between leaves (attention core, activations, residual
adds) runs in the producer's layout, or the consumer's when the producer's is partial.

For a standard transformer block this gives two all-reduces forward and two backward
(Megatron-LM), or two all-gathers and two reduce-scatters each way with sequence
parallelism, and activation memory matching Korthikanti et al. 2022, table 2: derived,
not hard-coded. :func:`evaluate_layout` is the reference the intra-op ILP must match.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.cost.comm import all_gather_s, all_reduce_s, all_to_all_s, reduce_scatter_s
from autopar.cost.kept_layouts import converted_input, kept_layout, out_layout, reduced_layouts
from autopar.cost.layout_copies import conversion_copy_s, reduction_copy_s
from autopar.cost.leaf import (
    BACKWARD_FACTOR,
    SHARDED,
    TPContext,
    allowed_styles,
    attention_backward_extra_s,
    glue_fwd_s,
    glue_layout,
    leaf_accumulate_s,
    leaf_factored_numel,
    leaf_fwd_s,
    leaf_param_numel,
)
from autopar.cost.loss import LOSS_PARALLEL_REDUCTIONS, held_output_bytes, loss_parallel_s, loss_working_bytes
from autopar.cost.regather import NO_REGATHER, Regather, regather_terms
from autopar.cost.saved_ops import kept_matmuls
from autopar.graph.layer_graph import UNIT_INPUT, UNIT_OUTPUT, Flow, UnitProfile
from autopar.vocab import STYLE_IO, Layout, TPStyle


def model_output_layout(profile: UnitProfile, styles: tuple[TPStyle, ...], ctx: TPContext) -> Layout:
    """The layout of the unit's output under ``styles``, as the runtime realises it
    (``autopar.runtime.layouts``): the boundary layout between units; the model's output
    vocabulary-sharded for a loss that can read it so (the loss then runs under
    ``loss_parallel``) where a column-parallel leaf produces it, else replicated. The
    search never gathers a column-parallel head's logits for a replicated loss, since
    the runtime would not."""
    layouts = ctx.output_layouts()
    if len(layouts) == 1:
        return layouts[0]
    column = any(
        f.dst == UNIT_OUTPUT and f.src != UNIT_INPUT and styles[f.src] is TPStyle.COLUMN for f in profile.flows
    )
    return Layout.F if column else Layout.R


def conversion_s(a: Layout, b: Layout, nbytes: float, ctx: TPContext) -> tuple[float, float]:
    """(forward, backward) seconds to turn a tensor of ``nbytes`` (full size) from
    layout ``a`` into ``b``, not counting partial-gradient reductions: the transfers and
    the copies around them (:mod:`autopar.cost.layout_copies`)."""
    f, bw = transfer_s(a, b, nbytes, ctx)
    cf, cb = conversion_copy_s(a, b, nbytes, ctx)
    return f + cf, bw + cb


def transfer_s(a: Layout, b: Layout, nbytes: float, ctx: TPContext) -> tuple[float, float]:
    """The collectives' share of :func:`conversion_s`: what asynchronous TP can hide
    behind a matmul (:func:`fused_hidden_s`)."""
    if a is b or ctx.tp == 1:
        return 0.0, 0.0
    sp, cl = ctx.span, ctx.cluster
    if a is Layout.R:
        return 0.0, all_gather_s(nbytes, sp, cl)  # slice; gather the sharded gradient
    if b is Layout.R:
        if a is Layout.P:
            return all_reduce_s(nbytes, sp, cl), 0.0  # Megatron's g: all-reduce, identity
        return all_gather_s(nbytes, sp, cl), 0.0  # gather; slice the full gradient
    if a is Layout.P:
        return reduce_scatter_s(nbytes, sp, cl), all_gather_s(nbytes, sp, cl)
    return all_to_all_s(nbytes / ctx.tp, sp, cl), all_to_all_s(nbytes / ctx.tp, sp, cl)  # F <-> Q


def reduction_s(a: Layout, nbytes: float, ctx: TPContext) -> float:
    """Backward seconds to reduce the partial input gradient that column-parallel
    consumers return for a replicated copy of a producer in layout ``a``."""
    return reduction_transfer_s(a, nbytes, ctx) + reduction_copy_s(a, nbytes, ctx)


def reduction_transfer_s(a: Layout, nbytes: float, ctx: TPContext) -> float:
    """The collective's share of :func:`reduction_s`."""
    if ctx.tp == 1:
        return 0.0
    if a in (Layout.R, Layout.P):
        return all_reduce_s(nbytes, ctx.span, ctx.cluster)  # Megatron's f operator
    return reduce_scatter_s(nbytes, ctx.span, ctx.cluster)  # sequence parallel: gather <-> scatter


def fused_hidden_s(transfer_s: float, matmul_s: float, ctx: TPContext, removed_copy_s: float = 0.0) -> float:
    """What asynchronous tensor parallelism saves of a sequence-parallel collective whose
    transfer takes ``transfer_s``, fused with the matmul beside it (torch's micro-pipeline
    TP, ``fused_all_gather_matmul`` and ``fused_matmul_reduce_scatter``; Wang et al. 2023,
    "Overlap Communication with Dependent Computation via Decomposition in Large Deep
    Learning Models"): the matmul runs in ``tp`` chunks, one per shard, and the transfer
    of each shard but the rank's own hides behind another chunk's matmul, so at most
    ``(tp - 1) / tp`` of the matmul's time hides the transfer; and ``removed_copy_s``, the
    copy the fusion makes unnecessary (a reduce-scatter's, :mod:`autopar.cost.layout_copies`).
    0 without asynchronous TP, or with no matmul to fuse with.

    Which matmul: an all-gather of a sequence-sharded tensor with all the column-parallel
    matmuls that read it (one fused op takes several weights); a reduce-scatter with the
    row-parallel matmul that made its input, or in backward with the input-gradient
    matmul of the one column-parallel reader (several readers' gradients are summed first,
    which the fusion does not match); the backward all-gather of a row-parallel output's
    gradient with that layer's input-gradient matmul (its weight gradient reads the
    gathered tensor as the right operand, which the fusion does not gather)."""
    if not ctx.async_tp or ctx.tp == 1 or matmul_s <= 0:
        return 0.0
    return removed_copy_s + min(transfer_s, matmul_s * (ctx.tp - 1) / ctx.tp)


def consumers(profile: UnitProfile) -> dict[int, tuple[int, ...]]:
    """Per producer, the leaves reading its output (each once)."""
    out: dict[int, list[int]] = {}
    for flow in profile.flows:
        if flow.dst >= 0 and flow.dst not in out.setdefault(flow.src, []):
            out[flow.src].append(flow.dst)
    return {src: tuple(dsts) for src, dsts in out.items()}


def matmul_s(profile: UnitProfile, ctx: TPContext, style: TPStyle) -> list[float]:
    """Each leaf's forward time as a ``style`` (column- or row-parallel) matmul, 0 where it
    cannot take it: what asynchronous TP hides a collective behind. A column matmul hides
    the all-gather of its input and, in backward, the reduce-scatter of its input gradient
    (a matmul of the same size); a row matmul the reduce-scatter of its output and the
    all-gather of its output gradient."""
    return [leaf_fwd_s(leaf, style, ctx) if style in allowed_styles(leaf, ctx) else 0.0 for leaf in profile.leaves]


@dataclass(frozen=True, kw_only=True)
class UnitCost:
    """Per micro-batch, per TP rank.

    Attributes:
        styles: the style of each leaf (profile order).
        output: the layout of the unit's output.
        fwd_compute_s, bwd_compute_s: compute time.
        fwd_comm_s, bwd_comm_s: tensor-parallel communication time.
        fwd_syncs, bwd_syncs: the blocking collectives behind that time, where the
            group's ranks wait for each other (:func:`autopar.cost.host.ranks_wait_s`).
        attn_fwd_s: forward time of the attention core (what selective recompute redoes).
        loss_fwd_compute_s, loss_fwd_comm_s, loss_fwd_syncs: the part of the forward
            that is the loss (the last unit's glue into its output, and a
            vocabulary-parallel loss's reductions): full recomputation does not rerun it,
            since the runtime checkpoints the unit's modules and the loss runs outside
            them.
        param_numel: parameters held.
        saved_bytes: activations kept for backward (no recomputation), attention core
            excluded; ``attn_saved_bytes``: the attention core's, but what an op after
            it saves too (its output, the output projection's input), which selective
            recomputation keeps. ``attn_output_bytes``: the cores' outputs, made again
            when selective recomputation reruns them.
        input_bytes: the unit's input as held (what full recomputation keeps).
        output_bytes: the unit's output as sent to the next pipeline stage.
        factored_numel: optimizer state elements of a factored optimizer (Adafactor:
            one row and one column vector per local weight matrix, vectors in full).
        working_bytes: backward working memory: the gradients of the largest tensor
            flowing in the unit (its output gradient and its input gradient), in the last
            unit the loss's backward beyond the one it returns (``loss_working_bytes``).
        loss_working_bytes, loss_saved_bytes: of ``working_bytes`` and ``saved_bytes``,
            what only the loss holds (its backward's working memory beyond the gradient
            it returns, :func:`loss_working_bytes`; the logits held, the
            log-probabilities), also under full recomputation (the loss runs
            outside the checkpoint). All but the logits are freed before the unit's
            backward starts and its FSDP2 gathers and reductions.
        held_output_bytes: of that, the logits, kept until the stage's backward ends.
        kv_bytes: the keys and values of the unit's attention cores on this rank (split
            by heads where the attention runs sharded): what a context-parallel ring
            exchanges (:mod:`autopar.cost.context_parallel`).
        expert_numel: of ``param_numel``, the expert parameters held (``1 / ep`` of the
            unit's expert stacks): their gradients are reduced, and their state
            sharded, over the ranks holding the same experts.
        op_kept_bytes: what per-operator selective recomputation keeps beyond the
            unit's input (:mod:`autopar.cost.saved_ops`): the kept matmuls' outputs as
            this layout leaves them (a row-parallel one's partial sums whole), the
            attention cores' outputs (their log-sum-exp, one fp32 per head and token,
            not counted) and the sequence-parallel reduce-scatters' shards; a leaf
            feeding the loss is left out, since the loss holds its output anyway.
        op_kept_compute_s, op_kept_comm_s, op_kept_syncs: the forward work behind those
            outputs, which that recomputation does not rerun: the kept matmuls and the
            attention cores; the reduce-scatters.
        whole_grad_numel: elements of the weights this layout splits whose gradient is
            nevertheless computed whole on every rank of the group: a vocabulary-parallel
            embedding's (torch 2.13's DTensor has no vocabulary-sharded strategy for
            ``embedding_dense_backward``, only sharding on the embedding dimension or the
            batch, so the gradient of a ``Shard(0)`` table comes out ``Replicate``, the
            whole table on each rank; :mod:`autopar.cost.memory` prices what that holds).
        largest_grad_numel: elements of the largest gradient the unit's backward makes
            at once, its largest local weight's: what a gradient accumulated into one
            already there holds beside it (a whole-computed table's is in
            ``whole_grad_numel``'s count already).
        regather: what keeping the shards of its sequence-parallel gathers saves and
            costs where the unit keeps its activations (:mod:`autopar.cost.regather`;
            nothing unless the plan does).
        wait_bytes: what a micro-batch past its input-gradient step and awaiting its
            weight-gradient step holds beyond its activations under a split backward
            (:func:`autopar.cost.pipeline.weight_wait_moment`): the output gradients of
            the unit's weighted ops as this layout leaves them (a column-parallel
            matmul's shard, a row-parallel one's partial sums whole;
            :attr:`autopar.graph.layer_graph.Leaf.weighted_out_bytes`), less what only
            the loss saved (its log-probabilities, freed when torch detaches the loss
            after that step; the logits stay held): negative for a loss whose saved
            tensors outweigh them.
    """

    styles: tuple[TPStyle, ...]
    output: Layout
    fwd_compute_s: float
    bwd_compute_s: float
    fwd_comm_s: float
    bwd_comm_s: float
    fwd_syncs: int
    bwd_syncs: int
    attn_fwd_s: float
    loss_fwd_compute_s: float
    loss_fwd_comm_s: float
    loss_fwd_syncs: int
    param_numel: float
    saved_bytes: float
    attn_saved_bytes: float
    input_bytes: float
    output_bytes: float
    factored_numel: float
    working_bytes: float
    loss_working_bytes: float
    loss_saved_bytes: float
    held_output_bytes: float
    kv_bytes: float = 0.0
    expert_numel: float = 0.0
    whole_grad_numel: float = 0.0
    largest_grad_numel: float = 0.0
    attn_output_bytes: float = 0.0
    op_kept_bytes: float = 0.0
    op_kept_compute_s: float = 0.0
    op_kept_comm_s: float = 0.0
    op_kept_syncs: int = 0
    regather: Regather = NO_REGATHER
    wait_bytes: float = 0.0

    @property
    def time_s(self) -> float:
        """Forward plus backward, compute plus communication: the ILP objective."""
        return self.fwd_compute_s + self.bwd_compute_s + self.fwd_comm_s + self.bwd_comm_s

    @property
    def fwd_s(self) -> float:
        """Forward time (what full recomputation redoes)."""
        return self.fwd_compute_s + self.fwd_comm_s


def in_layout(styles: tuple[TPStyle, ...], output: Layout, node: int) -> Layout:
    """Input layout a flow endpoint needs."""
    if node == UNIT_OUTPUT:
        return output
    return STYLE_IO[styles[node]][0]


def _shard(nbytes: float, layout: Layout, tp: int) -> float:
    return nbytes / tp if layout in SHARDED else nbytes


def producer_bytes(profile: UnitProfile) -> dict[int, float]:
    """Per producer, the largest tensor it sends along any flow (per sample): what a
    conversion of its output moves."""
    out: dict[int, float] = {}
    for flow in profile.flows:
        out[flow.src] = max(out.get(flow.src, 0.0), flow.tensor_bytes)
    return out


def evaluate_layout(profile: UnitProfile, styles: tuple[TPStyle, ...], output: Layout, ctx: TPContext) -> UnitCost:
    """The cost of one layout, computed directly (the reference for the ILP)."""
    b = ctx.micro_batch
    t = ctx.tp
    fwd_compute = sum(leaf_fwd_s(leaf, s, ctx) for leaf, s in zip(profile.leaves, styles))
    accumulate = sum(leaf_accumulate_s(leaf, s, ctx) for leaf, s in zip(profile.leaves, styles))
    attn_fwd = attn_bwd_extra = loss_fwd = loss_input = loss_saved = held = 0.0
    attn_sharded = False
    saved = sum(_shard(ctx.leaf_saved_bytes(profile, i, styles) * b, STYLE_IO[s][0], t) for i, s in enumerate(styles))
    meets = reduced_layouts(profile, styles, ctx)
    saved += sum(
        _shard(leaf.glue_kept_bytes * b, STYLE_IO[s][0], t)
        for i, (leaf, s) in enumerate(zip(profile.leaves, styles))
        if leaf.glue_kept_bytes and converted_input(profile, styles, ctx, meets, i)
    )
    wait = sum(
        _shard(leaf.weighted_out_bytes * b * ctx.row_skew(leaf), STYLE_IO[s][1], t)
        for leaf, s in zip(profile.leaves, styles)
    )
    attn_saved = 0.0
    conversions: dict[tuple[int, Layout], Layout] = {}
    partial: dict[int, Layout] = {}
    largest = producer_bytes(profile)
    kept = kept_matmuls(profile)
    into_loss = {f.src for f in profile.flows if ctx.last and f.dst == UNIT_OUTPUT}
    op_bytes = sum(_shard(largest.get(i, 0.0) * b, STYLE_IO[styles[i]][1], t) for i in kept if i not in into_loss)
    op_compute = sum(leaf_fwd_s(profile.leaves[i], styles[i], ctx) for i in kept)
    attn_out: dict[int, float] = {}
    for flow in profile.flows:
        a = out_layout(profile, styles, ctx, flow.src)
        need = in_layout(styles, output, flow.dst)
        g = glue_layout(a, need, head_broadcast=flow.head_broadcast)
        kept_in = kept_layout(profile, styles, ctx, meets, flow, need)  # where the glue keeps what it saves
        glue = glue_fwd_s(flow, g, ctx)
        fwd_compute += glue
        core = glue_fwd_s(flow, g, ctx, attention_only=True)
        attn_fwd += core
        attn_bwd_extra += attention_backward_extra_s(flow, g, ctx, core)
        if flow.attn_flops > 0:
            attn_out[flow.dst] = max(
                attn_out.get(flow.dst, 0.0), _shard(attention_output_bytes(profile, flow) * b, need, t)
            )
        kept = _shard(flow.saved(ctx.compile) * b, kept_in, t)
        attn_saved += _shard(flow.attn_saved_bytes * b, kept_in, t)
        attn_sharded |= flow.attn_flops > 0 and g in SHARDED
        if ctx.last and flow.dst == UNIT_OUTPUT:  # into the loss
            loss_fwd += glue
            loss_input = max(loss_input, _shard(flow.tensor_bytes * b, a, t))
            held += held_output_bytes(flow, a, need, ctx)
            loss_saved += kept
        else:
            saved += kept
        conversions[(flow.src, need)] = a
        if need is Layout.R and flow.dst >= 0 and styles[flow.dst] is TPStyle.COLUMN:
            partial[flow.src] = a
    fwd_comm = bwd_comm = 0.0
    fwd_syncs = bwd_syncs = 0
    op_comm, op_syncs = 0.0, 0
    column_mm = matmul_s(profile, ctx, TPStyle.COLUMN) if ctx.async_tp else []
    row_mm = matmul_s(profile, ctx, TPStyle.ROW) if ctx.async_tp else []
    readers = consumers(profile)

    def under_column(src: int, *, single: bool = False) -> float:  # the column-parallel matmuls reading src
        columns = [column_mm[d] for d in readers.get(src, ()) if styles[d] is TPStyle.COLUMN] if ctx.async_tp else []
        return 0.0 if single and len(columns) != 1 else sum(columns)

    gathers: list[tuple[float, tuple[int, ...]]] = []  # whole bytes, column-parallel readers
    for (src, need), a in conversions.items():
        tf, tb = transfer_s(a, need, largest[src] * b, ctx)
        cf, cb = conversion_copy_s(a, need, largest[src] * b, ctx)
        f, bw = tf + cf, tb + cb
        if a is Layout.Q and need is Layout.R:  # an all-gather into column-parallel matmuls
            f -= fused_hidden_s(tf, under_column(src), ctx)
            gathers.append((largest[src] * b, tuple(d for d in readers.get(src, ()) if styles[d] is TPStyle.COLUMN)))
        elif a is Layout.P and need is Layout.Q and src >= 0 and styles[src] is TPStyle.ROW and ctx.async_tp:
            f, bw = f - fused_hidden_s(tf, row_mm[src], ctx, cf), bw - fused_hidden_s(tb, row_mm[src], ctx)
        fwd_comm += f
        bwd_comm += bw
        fwd_syncs += f > 0
        bwd_syncs += bw > 0
        if a is Layout.P and need is Layout.Q and t > 1:  # a reduce-scatter: kept
            op_bytes += largest[src] * b / t
            op_comm += f
            op_syncs += f > 0
    for src, a in partial.items():
        r = reduction_s(a, largest[src] * b, ctx)
        if a is Layout.Q:  # the reduce-scatter of the column-parallel matmuls' input gradient
            transfer, copy = reduction_transfer_s(a, largest[src] * b, ctx), reduction_copy_s(a, largest[src] * b, ctx)
            r -= fused_hidden_s(transfer, under_column(src, single=True), ctx, copy)
        bwd_comm += r
        bwd_syncs += r > 0
    vocab_parallel = ctx.last and output is Layout.F
    loss_comm, loss_syncs = (loss_parallel_s(ctx), LOSS_PARALLEL_REDUCTIONS) if vocab_parallel else (0.0, 0)
    loss_working = loss_working_bytes(loss_input, ctx, vocab_parallel=vocab_parallel)
    fwd_comm += loss_comm
    fwd_syncs += loss_syncs
    params = sum(leaf_param_numel(leaf, s, t, ctx.ep) for leaf, s in zip(profile.leaves, styles))
    factored = sum(leaf_factored_numel(leaf, s, t) for leaf, s in zip(profile.leaves, styles))
    largest = max(
        (_shard(f.tensor_bytes * b, out_layout(profile, styles, ctx, f.src), t) for f in profile.flows), default=0.0
    )
    return UnitCost(
        styles=styles,
        output=output,
        fwd_compute_s=fwd_compute,
        bwd_compute_s=BACKWARD_FACTOR * fwd_compute + accumulate + attn_bwd_extra,
        fwd_comm_s=fwd_comm,
        bwd_comm_s=bwd_comm,
        fwd_syncs=fwd_syncs,
        bwd_syncs=bwd_syncs,
        attn_fwd_s=attn_fwd,
        loss_fwd_compute_s=loss_fwd,
        loss_fwd_comm_s=loss_comm,
        loss_fwd_syncs=loss_syncs,
        param_numel=params,
        saved_bytes=saved + loss_saved + held,
        attn_saved_bytes=attn_saved,
        input_bytes=_shard(profile.input_bytes * b, ctx.input_layout, t),
        output_bytes=_shard(profile.output_bytes * b, output if not ctx.last else Layout.R, t),
        factored_numel=factored,
        working_bytes=2 * largest + loss_working - loss_input,
        loss_working_bytes=loss_working,
        loss_saved_bytes=loss_saved + held,
        held_output_bytes=held,
        kv_bytes=profile.kv_bytes * b / (t if attn_sharded else 1),
        expert_numel=sum(leaf.expert_numel for leaf in profile.leaves) / ctx.ep,
        whole_grad_numel=sum(leaf.weight_numel for leaf, s in zip(profile.leaves, styles) if s is TPStyle.VOCAB)
        if t > 1
        else 0.0,
        largest_grad_numel=max(
            (leaf_param_numel(leaf, s, t, ctx.ep) for leaf, s in zip(profile.leaves, styles)), default=0.0
        ),
        attn_output_bytes=sum(attn_out.values()),
        op_kept_bytes=op_bytes + sum(attn_out.values()),
        op_kept_compute_s=op_compute + attn_fwd,
        op_kept_comm_s=op_comm,
        op_kept_syncs=op_syncs,
        regather=regather_terms(profile, styles, gathers, ctx),
        wait_bytes=wait - loss_saved,
    )


def attention_output_bytes(profile: UnitProfile, flow: Flow) -> float:
    """Per sample, the output of the attention core on ``flow``: its consumer's input
    (the output projection's features, at the bytes per feature of the producer's
    output, so a fused q/k/v projection counts its query part only); the flow's tensor
    where either end is not a leaf with features."""
    if flow.src < 0 or flow.dst < 0:
        return flow.tensor_bytes
    src, dst = profile.leaves[flow.src], profile.leaves[flow.dst]
    if not src.out_features or not dst.in_features:
        return flow.tensor_bytes
    return flow.tensor_bytes / src.out_features * dst.in_features
