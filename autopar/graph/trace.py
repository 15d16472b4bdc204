"""Trace one forward pass of a model on fake tensors and measure each unit.

No memory is allocated and no arithmetic is done: parameters are swapped for fake
tensors (``FakeTensorMode``) in the compute precision, and three hooks watch the pass:

- a dispatch mode counts each aten op's FLOPs (PyTorch's own ``flop_registry``, the
  formulas of ``FlopCounterMode``) and the bytes it reads and writes, and follows the
  data: every tensor remembers which leaves it came from, so the ops between two leaves
  become a :class:`~autopar.graph.layer_graph.Flow`;
- ``saved_tensors_hooks`` records every tensor autograd keeps for backward, counted
  once per storage and never for parameters: the activation memory *measured* from the
  model's own code rather than assumed by formula;
- a function mode intercepts ``F.scaled_dot_product_attention`` to apply the chosen
  attention implementation (flash: q, k, v, output and log-sum-exp kept; materialized:
  scores and probabilities kept) and to mark the attention core, which selective
  recomputation drops.

Repeated blocks are traced once: the first block of each structure is traced, and
later identical blocks return its (fake) output without running.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from autopar.errors import ModelError
from autopar.graph.layer_graph import UNIT_INPUT, UNIT_OUTPUT, Flow, Leaf, LeafKind, UnitProfile
from autopar.graph.units import leaf_kind, matrix_shape
from autopar.vocab import Attention

_MATMUL_OPS = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.baddbmm,
               torch.ops.aten.convolution, torch.ops.aten._scaled_dot_product_flash_attention,
               torch.ops.aten._scaled_dot_product_efficient_attention}


_FREE_OPS = {torch.ops.aten._unsafe_view, torch.ops.aten.lift_fresh}
"""Ops that move no data although PyTorch does not tag them as views."""


@dataclass
class _Info:
    origins: frozenset[int]
    pending: frozenset[int]
    attn_heads: int
    nbytes: int


@dataclass
class _Op:
    flops: float
    nbytes: float
    attn: bool
    origins: frozenset[int]
    saved: float = 0.0
    attn_saved: float = 0.0
    assigned: bool = False


@dataclass
class _LeafAcc:
    name: str
    kind: LeafKind
    param_numel: int
    weight_numel: int
    in_features: int
    out_features: int
    in_heads: int = 0
    out_heads: int = 0
    fwd_flops: float = 0.0
    matmul_flops: float = 0.0
    fwd_bytes: float = 0.0
    saved: float = 0.0
    out_bytes: float = 0.0


@dataclass
class _FlowAcc:
    tensor_bytes: float = 0.0
    glue_flops: float = 0.0
    glue_bytes: float = 0.0
    saved: float = 0.0
    attn_flops: float = 0.0
    attn_bytes: float = 0.0
    attn_saved: float = 0.0


@dataclass
class SegmentTrace:
    """What the trace measured for one segment (per traced batch, not yet per sample)."""

    leaves: list[_LeafAcc]
    flows: dict[tuple[int, int], _FlowAcc]
    input_bytes: float
    output_bytes: float

    def to_profile(self, signature: str, batch: int, head_dim: int, *, vocab_size: int,
                   keep: set[str] | None = None) -> UnitProfile:
        """Normalise to per-sample numbers, keeping only the leaves named in ``keep``
        (all when None); flows from or to dropped leaves are dropped too."""
        index = {}
        for i, acc in enumerate(self.leaves):
            if keep is None or acc.name in keep:
                index[i] = len(index)
        remap = {UNIT_INPUT: UNIT_INPUT, UNIT_OUTPUT: UNIT_OUTPUT, **index}
        leaves = []
        for i, acc in enumerate(self.leaves):
            if i not in index:
                continue
            in_heads = acc.in_features // head_dim if acc.in_heads and head_dim else 0
            out_heads = acc.out_features // head_dim // max(acc.out_heads, 1) if acc.out_heads and head_dim else 0
            leaves.append(Leaf(
                name=acc.name, kind=acc.kind, param_numel=acc.param_numel, weight_numel=acc.weight_numel,
                in_features=acc.in_features, out_features=acc.out_features, in_heads=in_heads, out_heads=out_heads,
                vocab=vocab_size > 0 and (acc.kind is LeafKind.EMBEDDING and acc.in_features == vocab_size
                                          or acc.kind is LeafKind.LINEAR and acc.out_features == vocab_size),
                fwd_flops=acc.fwd_flops / batch, matmul_flops=acc.matmul_flops / batch,
                fwd_bytes=acc.fwd_bytes / batch, saved_bytes=acc.saved / batch))
        flows = tuple(
            Flow(src=remap[s], dst=remap[d], tensor_bytes=f.tensor_bytes / batch, glue_flops=f.glue_flops / batch,
                 glue_bytes=f.glue_bytes / batch, saved_bytes=f.saved / batch, attn_flops=f.attn_flops / batch,
                 attn_bytes=f.attn_bytes / batch, attn_saved_bytes=f.attn_saved / batch)
            for (s, d), f in sorted(self.flows.items()) if s in remap and d in remap)
        return UnitProfile(signature=signature, leaves=tuple(leaves), flows=flows,
                           input_bytes=self.input_bytes / batch, output_bytes=self.output_bytes / batch)


class _Segment:
    """Book-keeping while one segment (prologue, a block, epilogue) runs."""

    def __init__(self, prefix: str, leaf_modules: list[tuple[str, nn.Module]]):
        self.prefix = prefix
        self.leaf_index: dict[int, int] = {}
        self.leaves: list[_LeafAcc] = []
        for name, mod in leaf_modules:
            kind = leaf_kind(mod)
            fin, fout, wnumel = matrix_shape(mod, kind)
            self.leaf_index[id(mod)] = len(self.leaves)
            self.leaves.append(_LeafAcc(name=name, kind=kind,
                                        param_numel=sum(p.numel() for p in mod.parameters(recurse=False)),
                                        weight_numel=wnumel, in_features=fin, out_features=fout))
        self.info: dict[int, _Info] = {}
        self.keep: list[torch.Tensor] = []
        self.ops: list[_Op] = []
        self.flows: dict[tuple[int, int], _FlowAcc] = {}
        self.leaf_stack: list[int] = []
        self.waiting: list[tuple[float, bool]] = []
        self.input_bytes = 0.0
        self.output_bytes = 0.0

    def register(self, t: torch.Tensor, info: _Info) -> None:
        self.info[id(t)] = info
        self.keep.append(t)

    def lookup(self, t: torch.Tensor) -> _Info:
        found = self.info.get(id(t))
        if found is None:
            return _Info(origins=frozenset(), pending=frozenset(), attn_heads=0, nbytes=_nbytes(t))
        return found

    def consume(self, tensors: Iterable[torch.Tensor], dst: int) -> int:
        """A leaf (or the segment output) consumes tensors: settle their flows.

        Returns the largest attention-head tag among them."""
        heads = 0
        for t in tensors:
            info = self.lookup(t)
            heads = max(heads, info.attn_heads)
            for o in info.origins or frozenset({UNIT_INPUT}):
                self.flows.setdefault((o, dst), _FlowAcc())
            self._settle(info.pending, dst)
        return heads

    def _settle(self, pending: frozenset[int], dst: int) -> None:
        """Charge the glue ops in ``pending`` (not yet charged) to flows ending at ``dst``."""
        for op_id in sorted(pending):
            op = self.ops[op_id]
            if op.assigned:
                continue
            op.assigned = True
            srcs = op.origins or frozenset({UNIT_INPUT})
            share = 1.0 / len(srcs)
            for o in srcs:
                acc = self.flows.setdefault((o, dst), _FlowAcc())
                if op.attn:
                    acc.attn_flops += op.flops * share
                    acc.attn_bytes += op.nbytes * share
                else:
                    acc.glue_flops += op.flops * share
                    acc.glue_bytes += op.nbytes * share
                acc.saved += op.saved * share
                acc.attn_saved += op.attn_saved * share

    def charge_waiting(self, op: _Op) -> None:
        """Charge the saved tensors waiting for their op to ``op``."""
        for nbytes, attn in self.waiting:
            if attn:
                op.attn_saved += nbytes
            else:
                op.saved += nbytes
        self.waiting.clear()

    def finish(self) -> SegmentTrace:
        if self.waiting:  # saved by the segment's last op: charge them next to it
            origins = self.ops[-1].origins if self.ops else frozenset()
            self.ops.append(_Op(flops=0.0, nbytes=0.0, attn=False, origins=origins))
            self.charge_waiting(self.ops[-1])
        # glue whose result reached neither a leaf nor the output (e.g. masks) goes to the output
        leftovers = frozenset(i for i, op in enumerate(self.ops) if not op.assigned)
        if leftovers:
            self._settle(leftovers, UNIT_OUTPUT)
        for (src, _), acc in self.flows.items():
            acc.tensor_bytes = self.input_bytes if src == UNIT_INPUT else self.leaves[src].out_bytes
        return SegmentTrace(leaves=self.leaves, flows=self.flows, input_bytes=self.input_bytes,
                            output_bytes=self.output_bytes)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _tensors(obj: Any) -> list[torch.Tensor]:
    flat, _ = tree_flatten(obj)
    return [x for x in flat if isinstance(x, torch.Tensor)]


class _Recorder(TorchDispatchMode):
    """Counts FLOPs and bytes per op and follows the data between leaves."""

    def __init__(self, tracer: "Tracer"):
        super().__init__()
        self.tracer = tracer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105 - PyTorch protocol
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        seg = self.tracer.segment
        if seg is None:
            return out
        outs = _tensors(out)
        if not outs:
            return out
        ins = _tensors((args, kwargs))
        in_infos = [seg.lookup(t) for t in ins]
        origins = frozenset().union(*(i.origins for i in in_infos)) if in_infos else frozenset()
        heads = max((i.attn_heads for i in in_infos), default=0)
        if func.is_view or func._overloadpacket in _FREE_OPS:
            pending = frozenset().union(*(i.pending for i in in_infos)) if in_infos else frozenset()
            for t in outs:
                seg.register(t, _Info(origins=origins, pending=pending, attn_heads=heads, nbytes=_nbytes(t)))
            return out
        formula = flop_registry.get(func._overloadpacket)
        flops = float(formula(*args, **kwargs, out_val=out)) if formula is not None else 0.0
        nbytes = float(sum(_nbytes(t) for t in ins) + sum(_nbytes(t) for t in outs))
        if seg.leaf_stack:
            leaf = seg.leaves[seg.leaf_stack[-1]]
            leaf.fwd_flops += flops
            leaf.fwd_bytes += nbytes
            if func._overloadpacket in _MATMUL_OPS:
                leaf.matmul_flops += flops
            for t in outs:
                seg.register(t, _Info(origins=frozenset({seg.leaf_stack[-1]}), pending=frozenset(), attn_heads=0,
                                      nbytes=_nbytes(t)))
            return out
        op = _Op(flops=flops, nbytes=nbytes, attn=self.tracer.in_attention, origins=origins)
        seg.ops.append(op)
        op_id = len(seg.ops) - 1
        pending = frozenset({op_id}).union(*(i.pending for i in in_infos)) if in_infos else frozenset({op_id})
        for t in outs:
            seg.register(t, _Info(origins=origins, pending=pending, attn_heads=heads, nbytes=_nbytes(t)))
        seg.charge_waiting(op)
        return out


class _AttentionInterceptor(TorchFunctionMode):
    """Replaces ``F.scaled_dot_product_attention`` by the chosen implementation."""

    def __init__(self, tracer: "Tracer"):
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: D105 - PyTorch protocol
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        return self.tracer.attention_core(*args, **kwargs)


class Tracer:
    """Runs the traced forward; see the module docstring."""

    def __init__(self, *, attention: Attention, param_storages: set[int]):
        self.attention = attention
        self.param_storages = param_storages
        self.segment: _Segment | None = None
        self.in_attention = False
        self.attn_inputs: set[int] = set()
        self.seen_storages: set[int] = set()
        self.head_dim = 0

    # -- saved tensors --------------------------------------------------------------
    def pack(self, t: torch.Tensor) -> torch.Tensor:
        seg = self.segment
        if seg is None:
            return t
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return t
        key = storage._cdata
        if key in self.param_storages or key in self.seen_storages:
            return t
        self.seen_storages.add(key)
        nbytes = float(storage.nbytes())
        if seg.leaf_stack:
            seg.leaves[seg.leaf_stack[-1]].saved += nbytes
        else:
            # autograd packs an op's inputs before the op reaches the dispatch mode: the
            # next glue op recorded is the one that saved this tensor
            seg.waiting.append((nbytes, self.in_attention and key not in self.attn_inputs))
        return t

    # -- attention ------------------------------------------------------------------
    def attention_core(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        seg = self.segment
        if seg is not None:
            for t in (q, k, v):
                for o in seg.lookup(t).origins:
                    if o >= 0:
                        seg.leaves[o].out_heads += 1  # counts the q/k/v inputs this leaf feeds
            self.head_dim = int(q.shape[-1])
        self.attn_inputs.update(t.untyped_storage()._cdata for t in (q, k, v))
        self.in_attention = True
        try:
            if self.attention is Attention.FLASH:
                kk, vv = k, v
                if q.shape[-3] != k.shape[-3]:
                    rep = q.shape[-3] // k.shape[-3]
                    kk = k.unsqueeze(-3).expand(*k.shape[:-2], rep, *k.shape[-2:]).reshape(q.shape[:-1] + k.shape[-1:])
                    vv = v.unsqueeze(-3).expand(*v.shape[:-2], rep, *v.shape[-2:]).reshape(q.shape[:-1] + v.shape[-1:])
                out = torch.ops.aten._scaled_dot_product_efficient_attention(
                    q, kk, vv, attn_mask, True, dropout_p, is_causal, scale=scale)[0]
            else:
                out = _materialized_attention(q, k, v, attn_mask, dropout_p, is_causal, scale)
        finally:
            self.in_attention = False
        if seg is not None:
            info = seg.lookup(out)
            seg.register(out, _Info(origins=info.origins, pending=info.pending, attn_heads=int(q.shape[-3]),
                                    nbytes=_nbytes(out)))
        return out


def _materialized_attention(q, k, v, attn_mask, dropout_p, is_causal, scale):
    """Attention that stores its scores and probabilities, as an unfused kernel does."""
    if q.shape[-3] != k.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k = k.repeat_interleave(rep, dim=-3)
        v = v.repeat_interleave(rep, dim=-3)
    s = torch.matmul(q, k.transpose(-2, -1)) * (scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]))
    if is_causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~mask, float("-inf"))
    elif attn_mask is not None:
        s = s + attn_mask if attn_mask.dtype != torch.bool else s.masked_fill(~attn_mask, float("-inf"))
    p = torch.softmax(s, dim=-1)
    if dropout_p > 0:
        p = F.dropout(p, dropout_p)
    return torch.matmul(p, v)


@dataclass
class TraceResult:
    """Segment traces by segment name, and the head dimension of the attention seen."""

    traces: dict[str, SegmentTrace] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    head_dim: int = 0
    calls: dict[str, list[str]] = field(default_factory=dict)
    """unit module FQN -> the segment open at each of its calls."""


PROLOGUE = "<prologue>"
EPILOGUE = "<epilogue>"


def run_trace(model: nn.Module, *, segments: dict[str, list[str]], blocks: list[str],
              signature_of: Callable[[str], str], make_inputs: Callable[[FakeTensorMode], tuple[tuple, dict]],
              loss_fn: Callable[[Any], torch.Tensor] | None, compute_dtype: torch.dtype,
              attention: Attention) -> TraceResult:
    """Trace ``model`` once.

    ``segments`` maps a segment name to the module FQNs it holds: each block FQN of
    ``blocks`` maps to itself; ``PROLOGUE`` holds what runs before the first block and
    ``EPILOGUE`` what runs after the last (the loss included). A model without blocks
    is one ``PROLOGUE`` segment.
    """
    modules = dict(model.named_modules())
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    params: dict[str, torch.Tensor] = {}
    param_storages: set[int] = set()
    # One fake tensor per (shape, dtype, device): the weights' values are never read, and
    # a 1T-parameter model has thousands of parameters but a handful of shapes.
    by_shape: dict[tuple, torch.Tensor] = {}
    with fake:
        for name, p in model.named_parameters(remove_duplicate=False):
            dtype = compute_dtype if p.is_floating_point() else p.dtype
            key = (tuple(p.shape), dtype, p.device)
            if key not in by_shape:
                by_shape[key] = torch.empty(key[0], dtype=dtype, device=p.device).requires_grad_(p.is_floating_point())
                param_storages.add(by_shape[key].untyped_storage()._cdata)
            params[name] = by_shape[key]
        for name, b in model.named_buffers(remove_duplicate=False):
            params[name] = fake.from_tensor(b)
        args, kwargs = make_inputs(fake)
    tracer = Tracer(attention=attention, param_storages=param_storages)
    result = TraceResult()
    block_set = set(blocks)
    served: dict[str, str] = {}
    cache: dict[tuple, tuple[str, Any]] = {}

    def leaves_of(name: str) -> list[tuple[str, nn.Module]]:
        base = name if name in block_set else ""
        found = []
        for m in segments[name]:
            for sub_name, sub in modules[m].named_modules():
                full = f"{m}.{sub_name}" if sub_name else m
                if any(True for _ in sub.parameters(recurse=False)):
                    rel = full if not base else ("" if full == base else full[len(base) + 1:])
                    found.append((rel, sub))
        return found

    def open_segment(name: str, inputs: list[torch.Tensor], as_unit_input: bool) -> None:
        seg = _Segment(name, leaves_of(name))
        seg.input_bytes = float(sum(_nbytes(t) for t in inputs if t.is_floating_point() or not as_unit_input))
        if as_unit_input:
            for t in inputs:
                if t.is_floating_point():
                    seg.register(t, _Info(origins=frozenset({UNIT_INPUT}), pending=frozenset(), attn_heads=0,
                                          nbytes=_nbytes(t)))
        tracer.segment = seg

    def close_segment(outputs: Any) -> None:
        seg = tracer.segment
        tracer.segment = None
        if seg is None:
            return
        outs = _tensors(outputs)
        seg.output_bytes = float(sum(_nbytes(t) for t in outs))
        seg.consume(outs, UNIT_OUTPUT)
        if seg.prefix in served:
            result.traces[seg.prefix] = result.traces[served[seg.prefix]]
        else:
            result.traces[seg.prefix] = seg.finish()
        result.order.append(seg.prefix)

    def leaf_pre(mod, args, kwargs):
        seg = tracer.segment
        if seg is None or id(mod) not in seg.leaf_index:
            return
        index = seg.leaf_index[id(mod)]
        heads = seg.consume(_tensors((args, kwargs)), index)
        if heads:
            seg.leaves[index].in_heads = heads
        seg.leaf_stack.append(index)

    def leaf_post(mod, args, kwargs, output):
        seg = tracer.segment
        if seg is None or id(mod) not in seg.leaf_index:
            return
        index = seg.leaf_stack.pop()
        seg.leaves[index].out_bytes = float(sum(_nbytes(t) for t in _tensors(output)))
        for t in _tensors(output):
            seg.register(t, _Info(origins=frozenset({index}), pending=frozenset(), attn_heads=0, nbytes=_nbytes(t)))

    def block_pre(name: str):
        def hook(mod, args, kwargs):
            ins = _tensors((args, kwargs))
            if tracer.segment is not None:
                close_segment(ins)
            open_segment(name, ins, as_unit_input=True)
        return hook

    def block_post(name: str):
        def hook(mod, args, kwargs, output):
            close_segment(output)
            if name == blocks[-1] and EPILOGUE in segments:
                open_segment(EPILOGUE, _tensors(output), as_unit_input=True)
        return hook

    def cached_forward(name: str, original: Callable):
        sig = signature_of(name)

        def forward(*args, **kwargs):
            key = (sig, tuple((tuple(t.shape), t.dtype) for t in _tensors((args, kwargs))))
            if key in cache:
                served[name], output = cache[key]
                return output
            output = original(*args, **kwargs)
            cache[key] = (name, output)
            return output
        return forward

    def unit_pre(name: str):
        def hook(mod, args):
            result.calls.setdefault(name, []).append(tracer.segment.prefix if tracer.segment else "")
        return hook

    handles = []
    for name in {m for mods in segments.values() for m in mods}:
        handles.append(modules[name].register_forward_pre_hook(unit_pre(name)))
    overridden: list[nn.Module] = []
    leaf_module_ids = {id(sub) for name in segments for _, sub in leaves_of(name)}
    for mod in modules.values():
        if id(mod) in leaf_module_ids:
            handles.append(mod.register_forward_pre_hook(leaf_pre, with_kwargs=True))
            handles.append(mod.register_forward_hook(leaf_post, with_kwargs=True))
    for name in blocks:
        mod = modules[name]
        handles.append(mod.register_forward_pre_hook(block_pre(name), with_kwargs=True, prepend=True))
        handles.append(mod.register_forward_hook(block_post(name), with_kwargs=True))
        mod.forward = cached_forward(name, mod.forward)
        overridden.append(mod)
    try:
        if PROLOGUE in segments:
            open_segment(PROLOGUE, _tensors((args, kwargs)), as_unit_input=False)
        with fake, _Recorder(tracer), _AttentionInterceptor(tracer), \
                torch.autograd.graph.saved_tensors_hooks(tracer.pack, lambda t: t):
            output = torch.func.functional_call(model, params, args, kwargs, strict=False)
            close_segment(loss_fn(output) if loss_fn is not None else output)
    except ModelError:
        raise
    except Exception as exc:
        raise ModelError(f"tracing {type(model).__name__} on fake tensors failed: {type(exc).__name__}: {exc}. "
                         f"Check that the sample input (or seq_len) matches what the model's forward expects.") from exc
    finally:
        for h in handles:
            h.remove()
        for mod in overridden:
            del mod.forward
    result.head_dim = tracer.head_dim
    return result
