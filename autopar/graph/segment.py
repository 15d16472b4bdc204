"""Book-keeping of the fake-tensor trace: what one segment of a model measured.

A segment is a block (or the prologue before the first block, or the epilogue after the
last). While it runs, every tensor remembers the leaves it came from and the parameter-
free ops since; when a leaf (or the segment's output) consumes a tensor, those ops are
charged to the flow from its origins to the consumer. :class:`SegmentTrace` is the result
and turns into a per-sample :class:`~autopar.graph.layer_graph.UnitProfile`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from autopar.graph.compiled_saved import compiled_saved_deltas
from autopar.graph.flops import MATMUL_OPS
from autopar.graph.fusion import Account, Fusion
from autopar.graph.head_features import head_count, unread_features
from autopar.graph.layer_graph import UNIT_INPUT, UNIT_OUTPUT, Flow, Leaf, LeafKind, UnitProfile
from autopar.graph.tensor_info import Info, broadcast_of, storage_key
from autopar.graph.units import is_conv1d, leaf_kind, matrix_shape


@dataclass
class Op:
    flops: float
    nbytes: float
    attn: bool
    origins: frozenset[int]
    calls: int = 1
    saved: float = 0.0
    attn_saved: float = 0.0
    attn_work: float = 1.0
    assigned: bool = False
    compiled_nbytes: float = 0.0
    kernels: int = 0
    settled: list[tuple[_FlowAcc, float]] = field(default_factory=list)

    def keep_outside_attention(self, nbytes: float) -> None:
        """``nbytes`` of this attention op's saved outputs are also saved by an op after
        the attention core (its output, which the output projection keeps): they stay
        when the core is recomputed, so they count as ``saved``, here and in the flows
        the op went to."""
        if not self.assigned:
            self.attn_saved -= nbytes
            self.saved += nbytes
        for acc, share in self.settled:
            acc.attn_saved -= nbytes * share
            acc.saved += nbytes * share

    def add_compiled_saved(self, nbytes: float) -> None:
        """What compiling adds to the bytes this op saves (:mod:`autopar.graph.
        compiled_saved`), charged to the flows it went to: known once the segment has
        run, when every op has gone to its flows (:meth:`Segment.finish`)."""
        for acc, share in self.settled:
            acc.compiled_saved += nbytes * share

    def add_compiled(self, nbytes: float, kernels: int) -> None:
        """Bytes and kernels of this op when compiled (:mod:`autopar.graph.fusion`):
        charged to the flows it went to, or kept until it goes to one."""
        if not self.assigned:
            self.compiled_nbytes += nbytes
            self.kernels += kernels
        for acc, share in self.settled:
            if self.attn:
                acc.compiled_attn_bytes += nbytes * share
                acc.compiled_attn_ops += kernels * share
            else:
                acc.compiled_glue_bytes += nbytes * share
                acc.compiled_glue_ops += kernels * share


@dataclass
class LeafAcc:
    name: str
    kind: LeafKind
    param_numel: int
    param_tensors: int
    weight_numel: int
    in_features: int
    out_features: int
    in_heads: int = 0
    out_heads: int = 0
    splits_by_heads: bool = False
    parts_in_heads: bool = False  # its output's features are cut within each head (a head-major q/k/v)
    cut: bool = False  # its output's features were cut into parts (output_in_parts, or unbound)
    leaf_read: set[tuple[int, int]] = field(default_factory=set)  # feature ranges of its output other leaves read
    head_norm_heads: int = 0  # a norm over each head's features: the heads it normalises
    credited: bool = False  # a norm before an attention: its projections were credited with its heads
    output_in_parts: bool = False
    fwd_flops: float = 0.0
    matmul_flops: float = 0.0
    fwd_bytes: float = 0.0
    weight_bytes: float = 0.0
    saved: float = 0.0
    glue_kept: float = 0.0
    out_bytes: float = 0.0
    weighted_out: float = 0.0
    ops: int = 0
    experts: int = 0
    expert_numel: int = 0
    expert_flops: float = 0.0
    row_bytes: float = 0.0
    dropless: bool = False
    compiled_bytes: float = 0.0
    kernels: int = 0
    compiled_saved: float = 0.0

    def add_compiled(self, nbytes: float, kernels: int) -> None:
        """Bytes and kernels of this leaf's ops when compiled (:mod:`autopar.graph.fusion`)."""
        self.compiled_bytes += nbytes
        self.kernels += kernels

    def add_compiled_saved(self, nbytes: float) -> None:
        """What compiling adds to the bytes this leaf saves (:mod:`autopar.graph.compiled_saved`)."""
        self.compiled_saved += nbytes

    def charge(self, func: Any, flops: float, activation_bytes: float, weight_bytes: float, routed: Any) -> None:
        """Add one op of the leaf's forward; ``routed`` is the activation an expert
        matmul reads (None for any other op): its first one's rows are tokens as
        dispatched, whose size per row prices expert parallelism's exchange."""
        self.fwd_flops += flops
        self.fwd_bytes += activation_bytes
        self.weight_bytes += weight_bytes
        self.ops += 1
        if func._overloadpacket in MATMUL_OPS:
            self.matmul_flops += flops
        if routed is not None:
            self.expert_flops += flops
            self.row_bytes = self.row_bytes or float(routed.shape[-1] * routed.element_size())
            self.dropless |= func._overloadpacket is not torch.ops.aten.bmm

    def routed_bytes(self, batch: int) -> float:
        """Tokens dispatched to the experts per sample (:class:`Leaf`)."""
        if not self.expert_flops or not self.expert_numel:
            return 0.0
        rows = self.expert_flops / (2 * self.expert_numel / self.experts)
        return rows * self.row_bytes / batch


@dataclass
class _FlowAcc:
    tensor_bytes: float = 0.0
    glue_flops: float = 0.0
    glue_bytes: float = 0.0
    saved: float = 0.0
    attn_flops: float = 0.0
    attn_work_flops: float = 0.0
    attn_bytes: float = 0.0
    attn_saved: float = 0.0
    glue_ops: float = 0.0
    attn_ops: float = 0.0
    compiled_glue_bytes: float = 0.0
    compiled_attn_bytes: float = 0.0
    compiled_glue_ops: float = 0.0
    compiled_attn_ops: float = 0.0
    compiled_saved: float = 0.0
    head_broadcast: bool | None = None


@dataclass
class SegmentTrace:
    """What the trace measured for one segment (per traced batch, not yet per sample;
    op counts and parameter bytes are per call and stay as they are)."""

    leaves: list[LeafAcc]
    flows: dict[tuple[int, int], _FlowAcc]
    input_bytes: float
    output_bytes: float
    kv_bytes: float = 0.0

    def to_profile(
        self,
        signature: str,
        batch: int,
        head_dim: int,
        heads: int = 0,
        *,
        vocab_size: int,
        keep: set[str] | None = None,
    ) -> UnitProfile:
        """Normalise to per-sample numbers, keeping only the leaves named in ``keep``
        (all when None); flows from or to dropped leaves are dropped too. ``head_dim`` and
        ``heads``: the attention's query head width and count (:func:`head_count`)."""
        index = {}
        for i, acc in enumerate(self.leaves):
            if keep is None or acc.name in keep:
                index[i] = len(index)
        remap = {UNIT_INPUT: UNIT_INPUT, UNIT_OUTPUT: UNIT_OUTPUT, **index}
        leaves = []
        for i, acc in enumerate(self.leaves):
            if i not in index:
                continue
            in_heads = head_count(acc.in_features, head_dim, 1, heads) if acc.in_heads and head_dim else 0
            out_heads = (
                head_count(acc.out_features, head_dim, acc.out_heads, heads) if acc.out_heads and head_dim else 0
            )
            out_heads = acc.head_norm_heads or out_heads
            leaves.append(
                Leaf(
                    name=acc.name,
                    kind=acc.kind,
                    param_numel=acc.param_numel,
                    param_tensors=acc.param_tensors,
                    weight_numel=acc.weight_numel,
                    in_features=acc.in_features,
                    out_features=acc.out_features,
                    in_heads=in_heads,
                    out_heads=out_heads,
                    fused=((acc.out_heads > 1 and not acc.parts_in_heads) or acc.output_in_parts)
                    and not acc.splits_by_heads,
                    vocab=vocab_size > 0
                    and (
                        (acc.kind is LeafKind.EMBEDDING and acc.in_features == vocab_size)
                        or (acc.kind is LeafKind.LINEAR and acc.out_features == vocab_size)
                    ),
                    fwd_flops=acc.fwd_flops / batch,
                    matmul_flops=acc.matmul_flops / batch,
                    fwd_bytes=acc.fwd_bytes / batch,
                    weight_bytes=acc.weight_bytes,
                    saved_bytes=acc.saved / batch,
                    glue_kept_bytes=acc.glue_kept / batch,
                    weighted_out_bytes=acc.weighted_out / batch,
                    compiled_saved_bytes=(acc.saved + acc.compiled_saved) / batch,
                    fwd_ops=acc.ops,
                    compiled_bytes=acc.compiled_bytes / batch,
                    compiled_ops=acc.kernels,
                    per_head=acc.head_norm_heads > 0,
                    broadcast_features=unread_features(acc)
                    if any(f.head_broadcast for (s, _), f in self.flows.items() if s == i)
                    else None,
                    **_expert_fields(acc, batch),
                )
            )
        flows = tuple(
            Flow(
                src=remap[s],
                dst=remap[d],
                tensor_bytes=f.tensor_bytes / batch,
                glue_flops=f.glue_flops / batch,
                glue_bytes=f.glue_bytes / batch,
                saved_bytes=f.saved / batch,
                compiled_saved_bytes=(f.saved + f.compiled_saved) / batch,
                attn_flops=f.attn_flops / batch,
                attn_work_flops=f.attn_work_flops / batch,
                attn_bytes=f.attn_bytes / batch,
                attn_saved_bytes=f.attn_saved / batch,
                glue_ops=f.glue_ops,
                attn_ops=f.attn_ops,
                compiled_glue_bytes=f.compiled_glue_bytes / batch,
                compiled_attn_bytes=f.compiled_attn_bytes / batch,
                compiled_glue_ops=f.compiled_glue_ops,
                compiled_attn_ops=f.compiled_attn_ops,
                head_broadcast=bool(f.head_broadcast),
            )
            for (s, d), f in sorted(self.flows.items())
            if s in remap and d in remap
        )
        return UnitProfile(
            signature=signature,
            leaves=tuple(leaves),
            flows=flows,
            input_bytes=self.input_bytes / batch,
            output_bytes=self.output_bytes / batch,
            kv_bytes=self.kv_bytes / batch,
        )


class Segment:
    """Book-keeping while one segment (prologue, a block, epilogue) runs."""

    def __init__(self, prefix: str, leaf_modules: list[tuple[str, nn.Module]]):
        self.prefix = prefix
        self.leaf_index: dict[int, int] = {}
        self.leaves: list[LeafAcc] = []
        for name, mod in leaf_modules:
            # remove_duplicate=False: while tracing, parameters of one shape are one fake
            # tensor (a norm's weight and bias), which parameters() would count once
            params = [p for _, p in mod.named_parameters(recurse=False, remove_duplicate=False)]
            kind = leaf_kind(mod)
            fin, fout, wnumel = matrix_shape(mod, kind)
            stacked = [p for p in params if p.dim() == 3]
            self.leaf_index[id(mod)] = len(self.leaves)
            self.leaves.append(
                LeafAcc(
                    name=name,
                    kind=kind,
                    param_numel=sum(p.numel() for p in params),
                    param_tensors=len(params),
                    weight_numel=wnumel,
                    in_features=fin,
                    out_features=fout,
                    splits_by_heads=is_conv1d(mod),
                    experts=int(stacked[0].shape[0]) if stacked else 0,
                    expert_numel=sum(p.numel() for p in stacked),
                )
            )
        self.info: dict[int, Info] = {}
        self.keep: list[torch.Tensor] = []
        self.by_storage: dict[int, list[torch.Tensor]] = {}
        self.pieces: dict[int, tuple[int, int, int]] = {}  # id of a piece of a leaf output: (leaf, start, stop)
        self.leaf_outputs: dict[int, tuple[int, torch.Tensor]] = {}  # the tensor kept: its id stays its own
        self.ops: list[Op] = []
        self.flows: dict[tuple[int, int], _FlowAcc] = {}
        self.leaf_stack: list[int] = []
        self.waiting: list[tuple[int, float, bool]] = []
        self.saved: list[tuple[int, float, bool, Callable[[float], None]]] = []
        """Each tensor autograd saved (storage key, bytes, in the attention core) and what
        it was charged to: where compiling's change is charged too."""
        self.last_outputs: frozenset[int] = frozenset()
        """Storages the last glue op wrote: what autograd saves of them is that op's."""
        self.input_bytes = 0.0
        self.output_bytes = 0.0
        self.kv_bytes = 0.0
        self.fusion = Fusion()

    def compiled(
        self,
        func: Any,
        inputs: list[tuple[int, float]],
        outputs: list[tuple[int, float]],
        account: Account,
        *,
        never_recomputed: frozenset[int] = frozenset(),
    ) -> None:
        """Charge ``account`` the bytes an op moves and the kernels it starts when the
        segment is compiled (:mod:`autopar.graph.fusion`; parameters left out of
        ``inputs``). ``never_recomputed``: the outputs a compiled backward does not
        recompute (:mod:`autopar.graph.compiled_saved`)."""
        if func._overloadpacket in MATMUL_OPS:
            self.fusion.library_kernel(inputs, outputs, account)
        else:
            self.fusion.fused_op(inputs, outputs, account, never_recomputed=never_recomputed)

    def register(self, t: torch.Tensor, info: Info) -> None:
        self.info[id(t)] = info
        self.keep.append(t)
        key = storage_key(t)
        if key is not None:
            self.by_storage.setdefault(key, []).append(t)

    def written(self, t: torch.Tensor, info: Info) -> None:
        """An op wrote ``info``'s data into ``t`` in place: every tensor sharing its
        storage (the tensor ``t`` is a slice of: transformers' DeepSeek-V3 copies each
        head's key parts into slices of one new key tensor) now carries it too."""
        key = storage_key(t)
        for other in self.by_storage.get(key, ()) if key is not None else ():
            if other is t or id(other) not in self.info:
                continue
            old = self.info[id(other)]
            self.info[id(other)] = Info(
                origins=old.origins | info.origins,
                pending=old.pending | info.pending,
                attn_heads=max(old.attn_heads, info.attn_heads),
                broadcast=broadcast_of([old, info]),
            )

    def lookup(self, t: torch.Tensor) -> Info:
        found = self.info.get(id(t))
        if found is None:
            return Info(origins=frozenset(), pending=frozenset(), attn_heads=0)
        return found

    def consume(self, tensors: Iterable[torch.Tensor], dst: int) -> int:
        """A leaf (or the segment output) consumes tensors: settle their flows.

        A tensor the segment never saw comes from outside: the unit's input. One the
        segment computed from constants alone (a loss's zero targets, a causal mask
        built with ``ones().tril()``) carries no activation, so it adds no flow: it
        used to count as the unit's input, which priced a conversion of the input for
        it (an all-gather of the epilogue's input when the logits stay sharded).
        Returns the largest attention-head tag among them."""
        heads = 0
        for t in tensors:
            info = self.info.get(id(t)) or Info(origins=frozenset({UNIT_INPUT}), pending=frozenset(), attn_heads=0)
            heads = max(heads, info.attn_heads)
            for o in info.origins:
                acc = self.flows.setdefault((o, dst), _FlowAcc())
                broadcast = o in info.broadcast
                acc.head_broadcast = broadcast if acc.head_broadcast is None else acc.head_broadcast and broadcast
            self._settle(info.pending, dst, info.origins)
        return heads

    def _settle(self, pending: frozenset[int], dst: int, consumed: frozenset[int]) -> None:
        """Charge the glue ops in ``pending`` (not yet charged) to flows ending at ``dst``;
        an op on constants alone goes with what the consumed tensor carries."""
        for op_id in sorted(pending):
            op = self.ops[op_id]
            if op.assigned:
                continue
            op.assigned = True
            srcs = op.origins or consumed or frozenset({UNIT_INPUT})
            share = 1.0 / len(srcs)
            for o in srcs:
                acc = self.flows.setdefault((o, dst), _FlowAcc())
                op.settled.append((acc, share))
                if op.attn:
                    acc.attn_flops += op.flops * share
                    acc.attn_work_flops += op.flops * share * op.attn_work
                    acc.attn_bytes += op.nbytes * share
                    acc.attn_ops += op.calls * share
                    acc.compiled_attn_bytes += op.compiled_nbytes * share
                    acc.compiled_attn_ops += op.kernels * share
                else:
                    acc.glue_flops += op.flops * share
                    acc.glue_bytes += op.nbytes * share
                    acc.glue_ops += op.calls * share
                    acc.compiled_glue_bytes += op.compiled_nbytes * share
                    acc.compiled_glue_ops += op.kernels * share
                acc.saved += op.saved * share
                acc.attn_saved += op.attn_saved * share

    def charge_waiting(self, op: Op) -> None:
        """Charge the saved tensors waiting for their op to ``op``."""
        for key, nbytes, attn in self.waiting:
            if attn:
                op.attn_saved += nbytes
            else:
                op.saved += nbytes
            self.saved.append((key, nbytes, attn, op.add_compiled_saved))
        self.waiting.clear()

    def finish(self) -> SegmentTrace:
        if self.waiting:  # saved by the segment's last op: charge them next to it
            origins = self.ops[-1].origins if self.ops else frozenset()
            self.ops.append(Op(flops=0.0, nbytes=0.0, attn=False, origins=origins, calls=0))
            self.charge_waiting(self.ops[-1])
        # glue whose result reached neither a leaf nor the output (e.g. masks) goes to the
        # output, with what reaches it
        leftovers = frozenset(i for i, op in enumerate(self.ops) if not op.assigned)
        if leftovers:
            self._settle(leftovers, UNIT_OUTPUT, frozenset(o for o, d in self.flows if d == UNIT_OUTPUT))
        deltas = compiled_saved_deltas([entry[:3] for entry in self.saved], self.fusion)
        for (*_, charge), delta in zip(self.saved, deltas):
            if delta:
                charge(delta)
        for (src, _), acc in self.flows.items():
            acc.tensor_bytes = self.input_bytes if src == UNIT_INPUT else self.leaves[src].out_bytes
        return SegmentTrace(
            leaves=self.leaves,
            flows=self.flows,
            input_bytes=self.input_bytes,
            output_bytes=self.output_bytes,
            kv_bytes=self.kv_bytes,
        )


def _expert_fields(acc: LeafAcc, batch: int) -> dict[str, Any]:
    """A leaf's mixture-of-experts fields: set only where matmuls ran through its
    stacked 3-D weights (a 1-D convolution's 3-D weight is not an expert stack)."""
    if not acc.expert_flops:
        return {}
    return {
        "experts": acc.experts,
        "expert_numel": acc.expert_numel,
        "expert_flops": acc.expert_flops / batch,
        "routed_bytes": acc.routed_bytes(batch),
        "dropless": acc.dropless,
    }
