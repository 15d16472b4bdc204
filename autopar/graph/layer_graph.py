"""LayerGraph: what the planner knows about a model, as plain numbers.

A model is a sequence of *units* (embeddings, each block, final norm, head: what a
pipeline stage holds whole). Each unit has a :class:`UnitProfile`, shared by identical
units (a 96-block GPT has three profiles: embeddings, block, head). A profile lists the
unit's *leaves* (modules with parameters, where tensor-parallel styles apply) and the
*flows* between them (the tensors and the parameter-free "glue" ops in between: attention
core, activations, residual adds), so that resharding and glue costs can be priced per
layout. Every size is **per sample** at the traced sequence length, in the compute
precision: the cost model scales by the micro-batch size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from functools import cached_property
from typing import TYPE_CHECKING

from autopar.vocab import Attention, DType, TPStyle

if TYPE_CHECKING:
    import networkx as nx

UNIT_INPUT = -1
"""Flow endpoint: the unit's input (the previous unit's output)."""
UNIT_OUTPUT = -2
"""Flow endpoint: the unit's output (or, for the last unit, the loss)."""


class LeafKind(StrEnum):
    """What a leaf is, which decides the tensor-parallel styles it allows."""

    LINEAR = "linear"
    EMBEDDING = "embedding"
    NORM = "norm"
    OTHER = "other"


@dataclass(frozen=True, kw_only=True)
class Leaf:
    """A module with parameters inside a unit.

    Attributes:
        name: FQN relative to the unit (``"attention.wq"``; ``""`` when the unit is the leaf).
        kind: see :class:`LeafKind`.
        param_numel: parameters of this leaf (all of them).
        param_tensors: its parameter tensors (a linear with a bias: 2), each of which
            FSDP2 copies, views and reduces apart in every collective call.
        weight_numel: parameters a column/row/vocab split shards (the weight, and the
            bias of a column split); the rest stay replicated.
        in_features, out_features: matrix sizes (embedding: vocabulary rows, dim).
        in_heads, out_heads: attention heads this leaf's input comes from (a row split
            must divide them) and its output feeds (a column split must divide them); 0
            when it touches no attention.
        fused: the leaf computes several projections in one matrix: it feeds more than
            one of an attention's q, k and v (the ``query_key_value`` of GPT-NeoX and
            Falcon), or the forward takes parts of its output's features (Phi-3's
            ``qkv_proj`` and ``gate_up_proj``). A plain column split would not cut it
            where the parts meet, so it may be replicated or row-split only (GPT-2's
            ``c_attn``, which the runtime splits by heads, is not marked).
        vocab: True for a vocabulary dimension (embedding rows, LM head outputs), which
            may be padded to a multiple of 128 x tp as Megatron-LM does.
        fwd_flops, fwd_bytes: forward FLOPs and activation bytes moved, per sample.
        weight_bytes: parameter bytes its forward reads, per call (not per sample): a
            micro-batch reads its weights once, so a small-batch layer is bound by them
            while its activation traffic grows with the batch.
        saved_bytes: activation bytes this leaf saves for backward, per sample.
        glue_kept_bytes: what the leaf would save too but the glue before it keeps already
            (the attention core's output, which the output projection reads), per sample:
            counted on the glue, not in ``saved_bytes``. A layout conversion between the
            two (a row-parallel projection slicing a replicated attention's output) hands
            the leaf a new tensor, which it then keeps beside the glue's
            (:func:`autopar.cost.tensor_parallel.evaluate_layout`).
        weighted_out_bytes: output bytes of the leaf's ops that read a parameter and an
            activation (its matmuls, a norm's scaling), per sample: the gradients torch's
            split backward keeps from a micro-batch's input-gradient step to its
            weight-gradient step (``stage_backward_input`` saves them at each node where a
            weight's path meets the input's). A weight computed from parameters first
            (Gemma's ``1 + weight``) is not followed.
        matmul_flops: the part of ``fwd_flops`` done by matrix multiplies (tensor cores).
        fwd_ops: aten ops its forward dispatches, per call (not per sample): what a
            per-op framework overhead is charged on.
        experts: experts stacked in the leaf's 3-D weights (a mixture-of-experts
            layer: transformers' ``MixtralExperts``, autopar's ``MoEFeedForward``); 0
            for any other leaf. ``expert_numel``: the parameters of those weights (a
            router in the same module is not part of them).
        expert_flops: the part of ``matmul_flops`` that runs through the stacked
            weights, per sample.
        routed_bytes: the tokens dispatched to the experts per sample (rows times
            their features, in the compute precision): what expert parallelism sends
            to other ranks and back. The rows are ``expert_flops`` over two FLOPs per
            expert parameter: every routed row meets each weight of its expert once.
        dropless: the experts run every routed row whatever the routing (grouped or
            per-expert matmuls): the busiest rank sets the pace under expert
            parallelism. False for fixed-capacity buffers (a batched matmul over the
            whole stack), which are balanced by construction.
        compiled_bytes, compiled_ops: what ``fwd_bytes`` and ``fwd_ops`` become when
            the unit is compiled (:mod:`autopar.graph.fusion`): the bytes its fused
            kernels move, and the kernels it starts, matmuls included. None: as in
            eager mode (a graph built by hand).
        compiled_saved_bytes: what ``saved_bytes`` becomes when the unit is compiled
            (:mod:`autopar.graph.compiled_saved`); None: as in eager mode.
        per_head: a norm over each attention head's features between a projection and
            the attention (Qwen3's and Gemma 3's ``q_norm`` and ``k_norm``): it runs on
            the head shards a column-parallel projection writes (style ``heads``), and
            ``out_heads`` counts the heads it normalises.
        broadcast_features: the range ``(start, stop)`` of its output features that
            reach an attention only broadcast over its heads (DeepSeek-V3's
            ``kv_a_proj_with_mqa``: its rotary key part, one head's worth shared by
            every head, beside the latent its other leaves read): where the heads are
            sharded, those features' gradient is a partial sum over the shards, which
            the runtime reduces. None: no such features, or not one range the trace
            could name.
    """

    name: str
    kind: LeafKind
    param_numel: int
    weight_numel: int
    in_features: int
    out_features: int
    in_heads: int
    out_heads: int
    vocab: bool
    fwd_flops: float
    matmul_flops: float
    fwd_bytes: float
    saved_bytes: float
    glue_kept_bytes: float = 0.0
    weighted_out_bytes: float = 0.0
    weight_bytes: float = 0.0
    fwd_ops: int = 0
    param_tensors: int = 1
    fused: bool = False
    experts: int = 0
    expert_numel: int = 0
    expert_flops: float = 0.0
    routed_bytes: float = 0.0
    dropless: bool = False
    compiled_bytes: float | None = None
    compiled_ops: int | None = None
    compiled_saved_bytes: float | None = None
    per_head: bool = False
    broadcast_features: tuple[int, int] | None = None

    def saved(self, compiled: bool) -> float:
        """Activation bytes kept for backward per sample, eager or compiled."""
        return _compiled_or_eager(self.saved_bytes, self.compiled_saved_bytes, compiled)

    def moved_bytes(self, compiled: bool) -> float:
        """Activation bytes the forward moves per sample, eager or compiled."""
        return self.compiled_bytes if compiled and self.compiled_bytes is not None else self.fwd_bytes

    def kernels(self, compiled: bool) -> int:
        """Ops (eager) or kernels (compiled) the forward dispatches per call."""
        return self.compiled_ops if compiled and self.compiled_ops is not None else self.fwd_ops

    def styles(self, *, sequence_parallel: bool) -> tuple[TPStyle, ...]:
        """Tensor-parallel styles this kind of leaf allows (divisibility aside)."""
        if self.kind is LeafKind.LINEAR:
            return (TPStyle.REPLICATE, TPStyle.ROW) if self.fused else (TPStyle.REPLICATE, TPStyle.COLUMN, TPStyle.ROW)
        if self.kind is LeafKind.EMBEDDING:
            return (TPStyle.REPLICATE, TPStyle.VOCAB)
        if self.kind is LeafKind.NORM and self.per_head:
            return (TPStyle.REPLICATE, TPStyle.HEADS)
        if self.kind is LeafKind.NORM and sequence_parallel:
            return (TPStyle.REPLICATE, TPStyle.SEQUENCE)
        return (TPStyle.REPLICATE,)


@dataclass(frozen=True, kw_only=True)
class Flow:
    """Tensors flowing from one leaf (or the unit input) to another (or the unit output),
    with the parameter-free ops between them.

    ``tensor_bytes`` is the size of the producer's output that reaches the consumer
    (what a resharding collective moves). ``attn_*`` is the part of the glue inside an
    attention core (``F.scaled_dot_product_attention``), which selective recomputation
    drops from memory and recomputes. ``compiled_*`` are the glue's and the attention
    core's bytes and kernels when the unit is compiled (:mod:`autopar.graph.fusion`),
    and ``saved_bytes`` then (:mod:`autopar.graph.compiled_saved`; the attention core's
    stay); None: as in eager mode. ``attn_work_flops``: of ``attn_flops`` (the flop counter's,
    the full score and value products, as model-FLOP utilization counts them), what a
    fused attention kernel computes: half under a causal mask, whose masked tiles it
    skips (None: all of them). ``head_broadcast``: the producer's tensor reaches the
    consumer only broadcast over the attention's heads (one head's worth, expanded to
    all: DeepSeek-V3's rotary key part), so head shards read it whole, and its gradient
    from them is a partial sum over the shards.
    """

    src: int
    dst: int
    tensor_bytes: float
    glue_flops: float
    glue_bytes: float
    saved_bytes: float
    attn_flops: float
    attn_bytes: float
    attn_saved_bytes: float
    glue_ops: float = 0.0
    attn_ops: float = 0.0
    compiled_glue_bytes: float | None = None
    compiled_attn_bytes: float | None = None
    compiled_glue_ops: float | None = None
    compiled_attn_ops: float | None = None
    attn_work_flops: float | None = None
    compiled_saved_bytes: float | None = None
    head_broadcast: bool = False

    def saved(self, compiled: bool) -> float:
        """Bytes kept for backward per sample outside the attention core, eager or compiled."""
        return _compiled_or_eager(self.saved_bytes, self.compiled_saved_bytes, compiled)

    @property
    def fused_attention_flops(self) -> float:
        """What a fused attention kernel computes of ``attn_flops``."""
        return self.attn_flops if self.attn_work_flops is None else self.attn_work_flops

    def glue(self, compiled: bool) -> tuple[float, float]:
        """The glue's bytes per sample and ops per call, eager or compiled."""
        if compiled and self.compiled_glue_bytes is not None:
            return self.compiled_glue_bytes, self.compiled_glue_ops or 0.0
        return self.glue_bytes, self.glue_ops

    def attention(self, compiled: bool) -> tuple[float, float]:
        """The attention core's bytes per sample and ops per call, eager or compiled."""
        if compiled and self.compiled_attn_bytes is not None:
            return self.compiled_attn_bytes, self.compiled_attn_ops or 0.0
        return self.attn_bytes, self.attn_ops


@dataclass(frozen=True, kw_only=True)
class UnitProfile:
    """Per-sample costs of one kind of unit.

    ``input_bytes``/``output_bytes``: the activation entering and leaving the unit (what
    pipeline point-to-point sends, and what full recomputation keeps). ``kv_bytes``: the
    keys and values entering its attention cores (what a context-parallel ring exchanges).
    """

    signature: str
    leaves: tuple[Leaf, ...]
    flows: tuple[Flow, ...]
    input_bytes: float
    output_bytes: float
    kv_bytes: float = 0.0

    @cached_property
    def param_numel(self) -> int:
        """Parameters of the unit."""
        return sum(leaf.param_numel for leaf in self.leaves)

    @cached_property
    def param_tensors(self) -> int:
        """Parameter tensors of the unit (what FSDP2's per-tensor work scales with)."""
        return sum(leaf.param_tensors for leaf in self.leaves)

    @cached_property
    def fwd_flops(self) -> float:
        """Forward FLOPs per sample (leaves and glue)."""
        return sum(leaf.fwd_flops for leaf in self.leaves) + sum(f.glue_flops + f.attn_flops for f in self.flows)

    @cached_property
    def saved_bytes(self) -> float:
        """Activation bytes kept for backward without recomputation, per sample, unsharded."""
        return sum(leaf.saved_bytes for leaf in self.leaves) + sum(
            f.saved_bytes + f.attn_saved_bytes for f in self.flows
        )

    @cached_property
    def experts(self) -> int:
        """The experts of the unit's mixture-of-experts layers (their greatest common
        divisor where layers differ; 0 without one): what an expert-parallel degree
        must divide."""
        return math.gcd(*(leaf.experts for leaf in self.leaves if leaf.experts))

    @cached_property
    def has_attention(self) -> bool:
        """Whether the unit runs an attention core (selective recompute applies)."""
        return any(f.attn_flops > 0 or f.attn_saved_bytes > 0 for f in self.flows)


@dataclass(frozen=True, kw_only=True)
class Unit:
    """One unit of the model, in execution order.

    Attributes:
        fqn: display name (a block's FQN; the joined module names of a prologue or
            epilogue, which run before the first and after the last block and are
            never split by a pipeline).
        modules: the module FQNs the unit holds (what ``Plan.stages`` lists).
        prefix: what leaf names of its profile are relative to (a block's FQN, or
            ``""`` when leaf names are full FQNs).
        profile: index into ``LayerGraph.profiles``.
        param_numel: parameters of the unit.
    """

    fqn: str
    modules: tuple[str, ...]
    prefix: str
    profile: int
    param_numel: int

    @property
    def is_block(self) -> bool:
        """Whether the unit is one of the model's repeated blocks (not a prologue or an
        epilogue, nor a model without blocks): what compiled plans compile."""
        return bool(self.prefix)

    def leaf_fqn(self, leaf_name: str) -> str:
        """The model-level FQN of one of this unit's leaves."""
        if not self.prefix:
            return leaf_name
        return f"{self.prefix}.{leaf_name}" if leaf_name else self.prefix


@dataclass(frozen=True, kw_only=True)
class SharedParam:
    """A parameter held by two units (tied embeddings): a pipeline that puts them on
    different stages keeps a copy on each and all-reduces its gradient.

    ``first_module`` and ``second_module`` are the FQNs of the modules that own it
    directly in each unit (their tensor-parallel styles decide whether one rank can
    keep the two as one tensor)."""

    first_unit: int
    second_unit: int
    first_module: str
    second_module: str
    numel: int


@dataclass(frozen=True, kw_only=True)
class LayerGraph:
    """The model as the planner sees it.

    Attributes:
        name: model class name.
        units: in execution order.
        profiles: distinct unit profiles (``Unit.profile`` indexes this).
        shared: parameters shared between units.
        num_params: unique parameters of the model.
        seq_len: tokens per sample (1 for non-sequence models).
        dtype: the compute precision the sizes are in.
        attention: the attention implementation assumed.
        sequential: every unit runs once, in order (pipelining needs it).
        fingerprint: identifies the model's parameter names and shapes.
        vocab_size: the vocabulary of token models (0 otherwise).
        cuttable: autopar's runtime can cut the model into pipeline stages (no unit sits
            in an ``nn.ModuleList`` or ``nn.Sequential``, which renumber their children
            when one is removed).
        uncounted_ops: aten ops that read a weight matrix but have no FLOP formula
            (:mod:`autopar.graph.flops`): counted as free, so the plan says so.
        unsplit_experts: classes of modules with weights stacked over experts that
            expert parallelism cannot split (:func:`autopar.models.experts.unsplit_experts`):
            priced as dense layers, so the plan says so.
        ring_attention: every attention core of the traced forward was
            ``F.scaled_dot_product_attention`` causal without a mask, the only attention a
            causal ring computes (context parallelism needs it; a sliding window narrower
            than the sequence, or a bidirectional encoder, builds a mask or is not causal).
        unrouted_flops: forward FLOPs per sample that unsplit experts run on tokens not
            routed to them (:func:`autopar.models.experts.routed_share`): hardware work,
            not model FLOPs.
    """

    name: str
    units: tuple[Unit, ...]
    profiles: tuple[UnitProfile, ...]
    shared: tuple[SharedParam, ...]
    num_params: int
    seq_len: int
    dtype: DType
    attention: Attention
    sequential: bool
    fingerprint: str
    vocab_size: int = 0
    cuttable: bool = True
    uncounted_ops: tuple[str, ...] = ()
    unsplit_experts: tuple[str, ...] = ()
    ring_attention: bool = True
    unrouted_flops: float = 0.0

    def profile_of(self, unit_index: int) -> UnitProfile:
        """The profile of unit ``unit_index``."""
        return self.profiles[self.units[unit_index].profile]

    @cached_property
    def fwd_flops_per_sample(self) -> float:
        """Forward FLOPs of one sample through the whole model (loss included): what the
        hardware runs."""
        return sum(self.profiles[u.profile].fwd_flops for u in self.units)

    @property
    def model_fwd_flops_per_sample(self) -> float:
        """Forward FLOPs of one sample that the model's math asks for, as model-FLOP
        utilization counts them: :attr:`fwd_flops_per_sample` less what experts run on
        tokens not routed to them (``unrouted_flops``)."""
        return self.fwd_flops_per_sample - self.unrouted_flops

    @property
    def unit_names(self) -> tuple[str, ...]:
        """Unit display names in order."""
        return tuple(u.fqn for u in self.units)

    @property
    def module_names(self) -> tuple[str, ...]:
        """Every top-level module FQN in order (what ``Plan.stages`` lists)."""
        return tuple(m for u in self.units for m in u.modules)

    def to_networkx(self) -> nx.DiGraph:
        """Units and leaves as a directed graph: unit -> next unit edges carry the
        activation bytes per sample; leaf -> leaf edges the flow sizes. networkx is
        imported here, not with the module: planning never needs it, and it would add
        a third of a second to ``import autopar``."""
        import networkx as nx

        g = nx.DiGraph(name=self.name, seq_len=self.seq_len)
        for i, unit in enumerate(self.units):
            prof = self.profiles[unit.profile]
            g.add_node(
                unit.fqn, kind="unit", params=prof.param_numel, fwd_flops=prof.fwd_flops, saved_bytes=prof.saved_bytes
            )
            for leaf in prof.leaves:
                name = unit.leaf_fqn(leaf.name)
                if name != unit.fqn:
                    g.add_node(
                        name,
                        kind=leaf.kind.value,
                        unit=unit.fqn,
                        params=leaf.param_numel,
                        fwd_flops=leaf.fwd_flops,
                        saved_bytes=leaf.saved_bytes,
                    )
            for flow in prof.flows:
                src = _endpoint(unit, prof, flow.src)
                dst = _endpoint(unit, prof, flow.dst)
                if src != dst:
                    g.add_edge(src, dst, tensor_bytes=flow.tensor_bytes, glue_flops=flow.glue_flops)
            if i + 1 < len(self.units):
                g.add_edge(unit.fqn, self.units[i + 1].fqn, tensor_bytes=prof.output_bytes)
        return g


def _compiled_or_eager(eager: float, compiled: float | None, want_compiled: bool) -> float:
    return compiled if want_compiled and compiled is not None else eager


def _endpoint(unit: Unit, prof: UnitProfile, index: int) -> str:
    if index < 0:
        return unit.fqn
    return unit.leaf_fqn(prof.leaves[index].name)
