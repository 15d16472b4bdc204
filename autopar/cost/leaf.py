"""What one leaf or one glue op costs on one tensor-parallel rank: compute time,
parameters and optimizer state, per micro-batch, under each style.

A style shards a leaf's work and weights (:data:`autopar.vocab.STYLE_IO` says which
layouts it reads and writes); glue between leaves runs in the layout of the tensor it
works on, its work divided by ``t`` where that layout is sharded. What converting
between layouts costs is in :mod:`autopar.cost.tensor_parallel`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from autopar.cost import fp8
from autopar.cost.comm import GroupSpan
from autopar.cost.compute import ComputeRates, work_s
from autopar.cost.host import accumulate_s, dispatch_s, kernel_s, tp_dispatch_s
from autopar.graph.layer_graph import Flow, Leaf, LeafKind, UnitProfile
from autopar.hardware.cluster import Cluster
from autopar.hardware.device import HostEffects
from autopar.vocab import DType, Layout, TPStyle

BACKWARD_FACTOR = 2.0
"""Backward costs twice the forward: a GEMM's backward computes both the input and the
weight gradient (Narayanan et al. 2021, section 5.1); a memory-bound op reads the output
gradient and its saved input and writes the input gradient, about twice its traffic."""

FUSED_ATTENTION_BACKWARD_FACTOR = 2.5
"""A fused attention kernel's backward computes 2.5 times its forward's FLOPs: it
recomputes the scores and runs four more matmuls of their size (Dao 2023,
FlashAttention-2, whose benchmarks count 2.5x). Applied where the device states the
kernel's rate (``Roofline.attention_efficiency``, quoted in that convention)."""

VOCAB_MULTIPLE = 128
"""Megatron-LM pads the vocabulary to a multiple of 128 x tp (``make_vocab_size_divisible_by``)."""

SHARDED = (Layout.F, Layout.Q)
"""Layouts that split a tensor over the group: work on them is divided by ``t``."""


@dataclass(frozen=True, kw_only=True)
class TPContext:
    """Everything a layout's cost depends on besides the layout.

    Attributes:
        tp: tensor-parallel degree.
        span: where the TP group's devices are.
        cluster: the links.
        rates: the device's roofline in the compute precision.
        micro_batch: samples per micro-batch on this rank: a context-parallel rank
            holds ``1 / cp`` of each sample's tokens, so ``micro_batch_size / cp`` (every
            per-sample size of the layer graph, attention included, scales with it:
            load-balanced ring attention gives each rank ``1 / cp`` of the work).
        tokens: tokens per sample (the loss-parallel reductions move one float each).
        boundary: the layout of activations between units (R, or Q with sequence
            parallelism).
        first: the unit takes the model's inputs (token ids: replicated).
        last: the unit ends in the loss.
        loss_parallel: the loss is a cross-entropy over a vocabulary that can run on
            vocabulary shards (``loss_parallel``).
        sequence_parallel: norms may take the ``sequence`` style.
        compute_scale: measured over predicted compute time of this unit (1 without a
            profile): a profiled layer keeps its measured efficiency at every shape.
        recompute_fraction: what rerunning this unit's forward in backward (full
            recomputation) costs, as a fraction of its forward compute (1 without a
            profile; :func:`autopar.profiles.recompute_calibration`).
        host: the device's host effects (framework time per op and per
            tensor-parallel leaf, exposed weight traffic; :mod:`autopar.cost.host`).
        cp: context-parallel degree; ``cp_span``: where its ring's ranks are.
        dtype: the compute precision (what keys and values are exchanged in).
        ep: expert-parallel degree: a rank holds ``1 / ep`` of each expert stack and
            runs its experts on the rows all ``ep`` ranks route to them; ``ep_span``:
            where the group's ranks are.
        routing_imbalance: the busiest rank's routed rows over the mean under expert
            parallelism, for dropless experts (:attr:`autopar.cost.model.CostModel.routing_imbalance`).
        compile: the unit runs compiled: its element-wise work moves the bytes and
            starts the kernels of the fused kernels the trace modelled
            (:mod:`autopar.graph.fusion`) rather than those of its eager ops.
        fp8: the unit's linear layers multiply in FP8 where the runtime converts them
            (:mod:`autopar.cost.fp8`).
        fused_attention: attention cores run one fused (flash) kernel, at the device's
            attention rate (:meth:`autopar.cost.compute.ComputeRates.in_fused_attention`).
        async_tp: the unit's sequence-parallel collectives run fused with the matmuls
            beside them (:func:`autopar.cost.tensor_parallel.fused_hidden_s`).
        regather: the unit keeps its shard of each input it gathers for column-parallel
            matmuls and gathers it again in the backward where it keeps its activations
            (``ParallelConfig.regather``; :func:`autopar.cost.regather.regather_terms`).
        batch_first: activations are laid out ``(batch, sequence, features)``, as the
            runtime lays them, so sequence-parallel collectives copy around the
            transfer (:mod:`autopar.cost.layout_copies`); False for Megatron-LM's
            sequence-first layout, which also prices its kernels' FP8 inputs
            (:attr:`fp8_inputs_kept_in_fp8`).
    """

    tp: int
    span: GroupSpan
    cluster: Cluster
    rates: ComputeRates
    micro_batch: float
    tokens: int
    boundary: Layout
    first: bool
    last: bool
    loss_parallel: bool
    sequence_parallel: bool
    compute_scale: float = 1.0
    recompute_fraction: float = 1.0
    host: HostEffects = field(default_factory=HostEffects.none)
    cp: int = 1
    cp_span: GroupSpan = field(default_factory=lambda: GroupSpan(size=1, per_node=1, nodes=1))
    dtype: DType = DType.BF16
    ep: int = 1
    ep_span: GroupSpan = field(default_factory=lambda: GroupSpan(size=1, per_node=1, nodes=1))
    routing_imbalance: float = 1.0
    compile: bool = False
    fp8: bool = False
    fused_attention: bool = False
    async_tp: bool = False
    regather: bool = False
    batch_first: bool = True

    @property
    def fp8_inputs_kept_in_fp8(self) -> bool:
        """The unit's FP8 linear layers keep their inputs in FP8: priced for Megatron-LM's
        kernels (sequence-first activations), whose Transformer Engine layers do
        (:func:`autopar.cost.fp8.saved_bytes`); autopar's runtime keeps them in bf16."""
        return self.fp8 and not self.batch_first

    def row_skew(self, leaf: Leaf) -> float:
        """The busiest rank's routed rows of ``leaf`` over the mean: ``routing_imbalance``
        for dropless experts under expert parallelism, else 1 (fixed-capacity experts and
        every other leaf run the same rows on every rank). Their compute, exchanged
        bytes and kept activations all scale by it."""
        return self.routing_imbalance if leaf.experts and leaf.dropless and self.ep > 1 else 1.0

    def leaf_saved_bytes(self, profile: UnitProfile, index: int, styles: tuple[TPStyle, ...]) -> float:
        """Activation bytes leaf ``index`` of ``profile`` keeps per sample under ``styles``
        (:func:`autopar.cost.fp8.saved_bytes`); of dropless experts under expert
        parallelism, the busiest rank's: ``routing_imbalance`` times the mean, as its
        rows are (its router's few per-token bytes scaled with them)."""
        return self.row_skew(profile.leaves[index]) * fp8.saved_bytes(
            profile,
            index,
            styles,
            self.tp,
            compiled=self.compile,
            itemsize=self.dtype.itemsize,
            inputs_in_fp8=self.fp8_inputs_kept_in_fp8,
        )

    @property
    def input_layout(self) -> Layout:
        """Layout of the unit's input."""
        return Layout.R if self.first else self.boundary

    def output_layouts(self) -> tuple[Layout, ...]:
        """Layouts the unit's output may take (which one, :func:`model_output_layout`)."""
        if self.last:
            return (Layout.R, Layout.F) if self.loss_parallel and self.tp > 1 else (Layout.R,)
        return (self.boundary,)


def padded(n: int, tp: int) -> int:
    """``n`` rounded up to Megatron-LM's vocabulary multiple for ``tp``."""
    if n % tp == 0:
        return n
    step = VOCAB_MULTIPLE * tp
    return math.ceil(n / step) * step


def allowed_styles(leaf: Leaf, ctx: TPContext) -> tuple[TPStyle, ...]:
    """Styles ``leaf`` may take at this TP degree (divisibility of features and heads;
    vocabulary dimensions may be padded)."""
    styles = leaf.styles(sequence_parallel=ctx.sequence_parallel)
    t = ctx.tp
    if t == 1:
        return (TPStyle.REPLICATE,)
    out = []
    for s in styles:
        if s is TPStyle.COLUMN:
            ok = (leaf.out_features % t == 0 or leaf.vocab) and (leaf.out_heads == 0 or leaf.out_heads % t == 0)
        elif s is TPStyle.ROW:
            ok = leaf.in_features % t == 0 and (leaf.in_heads == 0 or leaf.in_heads % t == 0)
        elif s is TPStyle.HEADS:
            ok = leaf.out_heads % t == 0
        else:
            ok = True
        if ok:
            out.append(s)
    return tuple(out)


def leaf_param_numel(leaf: Leaf, style: TPStyle, tp: int, ep: int = 1) -> float:
    """Parameters of ``leaf`` held by one TP rank under ``style``; of an expert stack,
    ``1 / ep`` (expert parallelism)."""
    if leaf.experts and ep > 1:
        return leaf.param_numel - leaf.expert_numel * (1 - 1 / ep)
    if style in (TPStyle.COLUMN, TPStyle.ROW, TPStyle.VOCAB) and tp > 1:
        weight = leaf.weight_numel
        if leaf.vocab:
            rows = leaf.in_features if leaf.kind is LeafKind.EMBEDDING else leaf.out_features
            weight = weight / rows * padded(rows, tp)
        return weight / tp + (leaf.param_numel - leaf.weight_numel)
    return float(leaf.param_numel)


def leaf_factored_numel(leaf: Leaf, style: TPStyle, tp: int) -> float:
    """Elements of a factored second moment (Shazeer & Stern 2018) for ``leaf``'s local
    shard: rows + columns of the weight matrix, the other parameters in full."""
    if leaf.kind not in (LeafKind.LINEAR, LeafKind.EMBEDDING) or leaf.weight_numel == 0:
        return float(leaf.param_numel)
    rows, cols = leaf.out_features, leaf.in_features
    if style in (TPStyle.COLUMN, TPStyle.VOCAB):
        rows = rows / tp if style is TPStyle.COLUMN else rows
        cols = cols / tp if style is TPStyle.VOCAB else cols
    elif style is TPStyle.ROW:
        cols = cols / tp
    return rows + cols + (leaf.param_numel - leaf.weight_numel)


def leaf_fwd_s(leaf: Leaf, style: TPStyle, ctx: TPContext) -> float:
    """Forward compute time of ``leaf`` for one micro-batch on one TP rank: its kernel
    time (the weights read once per call; :func:`autopar.cost.host.kernel_s`) plus the
    framework's time to dispatch its ops (:mod:`autopar.cost.host`)."""
    shard = ctx.tp if style in (TPStyle.COLUMN, TPStyle.ROW, TPStyle.SEQUENCE, TPStyle.HEADS) else 1
    scale = ctx.micro_batch / shard
    # parameters are read once per call; a column/row/vocab split shards them (a norm's
    # sequence split does not). An embedding's whole table counts: its dense backward
    # writes a gradient the size of the table, which the backward factor charges.
    weights = leaf.weight_bytes / (ctx.tp if style in (TPStyle.COLUMN, TPStyle.ROW, TPStyle.VOCAB) else 1)
    matmul = leaf.matmul_flops
    if leaf.experts and ctx.ep > 1:
        # a rank reads 1/ep of the stack, and runs the rows routed to it: the busiest
        # rank's share of dropless rows sets the pace
        weights -= weights * leaf.expert_numel / leaf.param_numel * (1 - 1 / ctx.ep)
        matmul += leaf.expert_flops * (ctx.row_skew(leaf) - 1)
    overhead = dispatch_s(ctx.host, leaf.kernels(ctx.compile)) + tp_dispatch_s(
        ctx.host, sharded=style is not TPStyle.REPLICATE and ctx.tp > 1
    )
    activations = leaf.moved_bytes(ctx.compile) * scale
    r = ctx.rates
    if ctx.fp8 and fp8.converted(leaf, style, ctx.tp):
        itemsize = ctx.dtype.itemsize
        weight_numel = weights / itemsize
        activations += fp8.cast_bytes(leaf, activations, weight_numel, itemsize=itemsize, compiled=ctx.compile)
        r = r.in_fp8()
    return ctx.compute_scale * (
        overhead
        + kernel_s(
            matmul_flops=matmul * scale,
            other_flops=(leaf.fwd_flops - leaf.matmul_flops) * scale,
            activation_bytes=activations,
            weight_bytes=weights,
            r=r,
            host=ctx.host,
        )
    )


def leaf_accumulate_s(leaf: Leaf, style: TPStyle, ctx: TPContext) -> float:
    """Time per micro-batch to accumulate ``leaf``'s fp32 weight gradient where that is a
    pass of its own (:func:`autopar.cost.host.accumulate_s`)."""
    return accumulate_s(
        ctx.host, param_numel=leaf_param_numel(leaf, style, ctx.tp, ctx.ep), bytes_per_s=ctx.rates.bytes_per_s
    )


def glue_layout(a: Layout, b: Layout, *, head_broadcast: bool = False) -> Layout:
    """The layout glue between a producer (``a``) and a consumer (``b``) runs in: the
    consumer's where the producer's is partial, or replicated and broadcast over the
    attention's heads (:attr:`autopar.graph.layer_graph.Flow.head_broadcast`: its share
    of the attention runs on the heads the consumer's shard reads)."""
    return b if a is Layout.P or (head_broadcast and a is Layout.R) else a


def kernel_rated(ctx: TPContext) -> bool:
    """Whether the unit's attention cores run at the fused kernel's stated rate (flash
    attention on a device that states it): on the FLOPs the kernel computes, with
    :data:`FUSED_ATTENTION_BACKWARD_FACTOR`."""
    return ctx.fused_attention and ctx.rates.attention_flops_per_s > 0


def attention_backward_factor(ctx: TPContext) -> float:
    """The attention core's backward over its forward: the fused kernel's where it runs
    at its stated rate, else :data:`BACKWARD_FACTOR`, every op's."""
    return FUSED_ATTENTION_BACKWARD_FACTOR if kernel_rated(ctx) else BACKWARD_FACTOR


def glue_fwd_s(flow: Flow, layout: Layout, ctx: TPContext, *, attention_only: bool = False) -> float:
    """Forward time of a flow's glue (or only its attention core) in ``layout``."""
    scale = ctx.micro_batch / (ctx.tp if layout in SHARDED else 1)
    attn_bytes, attn_ops = flow.attention(ctx.compile)
    rated = kernel_rated(ctx)
    flops = flow.fused_attention_flops if rated else flow.attn_flops
    attn_rates = ctx.rates.in_fused_attention() if rated else ctx.rates
    attn = work_s(matmul_flops=flops * scale, other_flops=0.0, nbytes=attn_bytes * scale, r=attn_rates)
    attn += dispatch_s(ctx.host, attn_ops)
    if attention_only:
        return ctx.compute_scale * attn
    glue_bytes, glue_ops = flow.glue(ctx.compile)
    rest = work_s(matmul_flops=0.0, other_flops=flow.glue_flops * scale, nbytes=glue_bytes * scale, r=ctx.rates)
    return ctx.compute_scale * (attn + rest + dispatch_s(ctx.host, glue_ops))


def attention_backward_extra_s(flow: Flow, layout: Layout, ctx: TPContext, attn_fwd_s: float | None = None) -> float:
    """What a flow's attention core's backward takes beyond the :data:`BACKWARD_FACTOR`
    every unit's forward is charged (:func:`attention_backward_factor`), from its forward
    ``attn_fwd_s`` where the caller has it."""
    extra = attention_backward_factor(ctx) - BACKWARD_FACTOR
    if not extra or flow.attn_flops <= 0:
        return 0.0
    return extra * (glue_fwd_s(flow, layout, ctx, attention_only=True) if attn_fwd_s is None else attn_fwd_s)


def glue_step_s(flow: Flow, layout: Layout, ctx: TPContext) -> float:
    """Forward plus backward of a flow's glue in ``layout``: what the layout searches
    charge for it (:func:`autopar.cost.tensor_parallel.evaluate_layout` sums the same
    terms by direction)."""
    return (1 + BACKWARD_FACTOR) * glue_fwd_s(flow, layout, ctx) + attention_backward_extra_s(flow, layout, ctx)
