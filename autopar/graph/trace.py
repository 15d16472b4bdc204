"""Trace one forward pass of a model without data and measure each unit.

No memory is allocated and no arithmetic is done: parameters are swapped for tensors
without data in the compute precision, and three hooks watch the pass. A model on the
meta device runs on meta tensors (PyTorch's C++ shape functions); any other model, or
a meta model with an op only fake tensors can run, on fake tensors
(``FakeTensorMode``), whose Python shape rules are slower but follow a real device:

- a dispatch mode counts each aten op's FLOPs (:func:`~autopar.graph.flops.op_flops`:
  the formulas of ``FlopCounterMode`` and those it lacks, such as grouped matmuls) and
  the bytes it reads and writes, and follows the data: every tensor remembers which
  leaves it came from, so the ops between two leaves become a
  :class:`~autopar.graph.layer_graph.Flow`. An op without a formula that combines a
  weight matrix with an activation of 2 or more dims (and is neither elementwise nor a
  lookup, join or copy such as an embedding) is recorded as uncounted: it likely does
  a matmul's arithmetic that the plan does not see;
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

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.errors import ModelError
from autopar.graph.attention_core import additive_mask, materialized_attention, through_norm
from autopar.graph.flops import EXPERT_MATMULS, op_flops
from autopar.graph.head_features import note_parts, note_pieces, read_by_leaf
from autopar.graph.layer_graph import UNIT_INPUT, UNIT_OUTPUT
from autopar.graph.op_kinds import FREE_OPS, PARTS_OPS, may_compute, parts_dim, shaped, whole_slice
from autopar.graph.segment import Op, Segment, SegmentTrace
from autopar.graph.tensor_info import Info, broadcast_of, expands_heads, keyed, nbytes_of, storage_key, tensors_in
from autopar.models.experts import experts_modules
from autopar.quiet import FAKE_TENSOR_LOGGER, quiet_loggers
from autopar.vocab import Attention


class _Recorder(TorchDispatchMode):
    """Counts FLOPs and bytes per op and follows the data between leaves."""

    def __init__(self, tracer: Tracer):
        super().__init__()
        self.tracer = tracer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = shaped(func, args, kwargs)
        seg = self.tracer.segment
        if seg is None:
            return out
        outs = tensors_in(out)
        if not outs:
            return out
        if func._overloadpacket in PARTS_OPS and not seg.leaf_stack:
            note_parts(seg, args[0], parts_dim(func, args, kwargs), whole_slice(func, args))
            note_pieces(seg, args[0], outs)
        ins = tensors_in((args, kwargs))
        in_infos = [seg.lookup(t) for t in ins]
        origins = frozenset().union(*(i.origins for i in in_infos)) if in_infos else frozenset()
        heads = max((i.attn_heads for i in in_infos), default=0)
        broadcast = broadcast_of(in_infos)
        if func.is_view or func._overloadpacket in FREE_OPS:
            pending = frozenset().union(*(i.pending for i in in_infos)) if in_infos else frozenset()
            if expands_heads(func, args, outs):
                broadcast = frozenset(o for o in origins if o >= 0)
            for t in outs:
                seg.register(t, Info(origins=origins, pending=pending, attn_heads=heads, broadcast=broadcast))
            return out
        counted = op_flops(func, args, kwargs, out)
        flops = counted if counted is not None else 0.0
        nbytes = float(sum(nbytes_of(t) for t in ins) + sum(nbytes_of(t) for t in outs))
        activations = keyed(t for t in ins if not self.tracer.is_parameter(t))
        if seg.leaf_stack:
            weights = float(sum(nbytes_of(t) for t in ins if self.tracer.is_parameter(t)))
            if counted is None and may_compute(func) and self.tracer.combines_matrices(ins):
                self.tracer.uncounted.add(str(func._overloadpacket))
            leaf = seg.leaves[seg.leaf_stack[-1]]
            leaf.charge(func, flops, nbytes - weights, weights, self.tracer.routed(func, ins))
            if weights and any(t.is_floating_point() and not self.tracer.is_parameter(t) for t in ins):
                leaf.weighted_out += nbytes_of(outs[0])  # where a weight meets an activation
            seg.compiled(func, activations, keyed(outs), leaf.add_compiled, never_recomputed=_kept(func, ins, outs))
            for t in outs:
                seg.register(t, Info(origins=frozenset({seg.leaf_stack[-1]}), pending=frozenset(), attn_heads=0))
            return out
        op = Op(
            flops=flops,
            nbytes=nbytes,
            attn=self.tracer.in_attention,
            origins=origins,
            attn_work=self.tracer.attn_work if self.tracer.in_attention else 1.0,
        )
        seg.compiled(func, activations, keyed(outs), op.add_compiled, never_recomputed=_kept(func, ins, outs))
        seg.ops.append(op)
        op_id = len(seg.ops) - 1
        pending = frozenset({op_id}).union(*(i.pending for i in in_infos)) if in_infos else frozenset({op_id})
        info = Info(origins=origins, pending=pending, attn_heads=heads, broadcast=broadcast)
        for t in outs:
            seg.register(t, info)
        if func._schema.is_mutable and args and isinstance(args[0], torch.Tensor):
            seg.written(args[0], info)
        seg.charge_waiting(op)
        seg.last_outputs = frozenset(storage_key(t) for t in outs)
        return out


def _kept(func: Any, ins: list[torch.Tensor], outs: list[torch.Tensor]) -> frozenset[int]:
    """The outputs of an op a compiled backward keeps rather than recomputes
    (:mod:`autopar.graph.compiled_saved`): a random op's, and those with fewer elements
    than the op's largest input (a reduction's: a norm's mean or its reciprocal
    deviation)."""
    largest = max((t.numel() for t in ins), default=0)
    seeded = torch.Tag.nondeterministic_seeded in func.tags
    return frozenset(k for t in outs if (seeded or t.numel() < largest) and (k := storage_key(t)) is not None)


class _AttentionInterceptor(TorchFunctionMode):
    """Replaces ``F.scaled_dot_product_attention`` by the chosen implementation."""

    def __init__(self, tracer: Tracer):
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        return self.tracer.attention_core(*args, **kwargs)


class Tracer:
    """Runs the traced forward; see the module docstring."""

    def __init__(self, *, attention: Attention, param_storages: set[int], expert_storages: set[int]):
        self.attention = attention
        self.param_storages = param_storages
        self.expert_storages = expert_storages
        self.segment: Segment | None = None
        self.in_attention = False
        self.attn_work = 1.0  # of the attention core's counted FLOPs, what a fused kernel computes
        self.attn_inputs: set[int] = set()
        self.seen_storages: set[int] = set()
        self.attn_outputs: dict[int, tuple[Op, float]] = {}  # saved attention outputs: their op, bytes
        self.glue_kept: dict[int, Segment] = {}  # storages a glue op saved, and the segment it ran in
        self.leaf_shares: set[tuple[int, int]] = set()  # (storage, leaf) of a leaf's input the glue keeps
        self.head_dim = 0
        self.heads = 0
        self.uncounted: set[str] = set()
        self.masked_attention = False  # an attention core with a mask, or not causal

    def combines_matrices(self, ins: list[torch.Tensor]) -> bool:
        """Whether ``ins`` hold a floating-point weight and an activation, both of 2 or
        more dims: what a matmul-like op reads."""
        matrices = [t for t in ins if t.dim() >= 2 and t.is_floating_point()]
        weights = [self.is_parameter(t) for t in matrices]
        return any(weights) and not all(weights)

    def routed(self, func: Any, ins: list[torch.Tensor]) -> torch.Tensor | None:
        """The activation a matmul through stacked expert weights reads (a 3-D
        parameter or a view of one), or None for any other op."""
        if func._overloadpacket not in EXPERT_MATMULS or not any(storage_key(t) in self.expert_storages for t in ins):
            return None
        return next((t for t in ins if t.is_floating_point() and not self.is_parameter(t)), None)

    def is_parameter(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is (a view of) a parameter: read once per call whatever the batch."""
        return storage_key(t) in self.param_storages

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
        if key in self.attn_outputs and not self.in_attention:
            op, nbytes = self.attn_outputs.pop(key)
            op.keep_outside_attention(nbytes)
        if key in self.param_storages:
            return t
        if key in self.seen_storages:
            # a leaf reading what the glue before it already keeps (the attention core's
            # output, read by the output projection): counted once, on the glue; noted on
            # the leaf, which keeps a copy of its own where a layout conversion comes between
            if seg.leaf_stack and self.glue_kept.get(key) is seg and (key, seg.leaf_stack[-1]) not in self.leaf_shares:
                self.leaf_shares.add((key, seg.leaf_stack[-1]))
                seg.leaves[seg.leaf_stack[-1]].glue_kept += float(storage.nbytes())
            return t
        self.seen_storages.add(key)
        nbytes = float(storage.nbytes())
        attn = self.in_attention and key not in self.attn_inputs
        if seg.leaf_stack:
            leaf = seg.leaves[seg.leaf_stack[-1]]
            leaf.saved += nbytes
            seg.saved.append((key, nbytes, attn, leaf.add_compiled_saved))
            return t
        self.glue_kept[key] = seg
        if seg.ops and key in seg.last_outputs:
            # an output the op just recorded keeps (attention's output and log-sum-exp, a
            # softmax's result): autograd packs those once the op has run. Left for the
            # next glue op, the attention core's landed after the output projection, on
            # the residual add, where tensor parallelism does not shard them
            op = seg.ops[-1]
            if attn:
                op.attn_saved += nbytes
                self.attn_outputs[key] = (op, nbytes)
            else:
                op.saved += nbytes
            seg.saved.append((key, nbytes, attn, op.add_compiled_saved))
        else:
            # autograd packs an op's inputs before the op reaches the dispatch mode: the
            # next glue op recorded is the one that saved this tensor
            seg.waiting.append((key, nbytes, attn))
        return t

    # -- attention ------------------------------------------------------------------
    def attention_core(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        seg = self.segment
        if seg is not None:
            for t in (q, k, v):
                info = seg.lookup(t)
                for o in info.origins:
                    if o >= 0 and o not in info.broadcast:  # a part shared by every head feeds none of them
                        seg.leaves[o].out_heads += 1  # counts the q/k/v inputs this leaf feeds
                        through_norm(seg, o, t)
            seg.kv_bytes += nbytes_of(k) + nbytes_of(v)  # what a context-parallel ring exchanges
            self.head_dim = int(q.shape[-1])
            self.heads = int(q.shape[-3])
        self.attn_inputs.update(t.untyped_storage()._cdata for t in (q, k, v))
        self.in_attention = True
        self.masked_attention |= not is_causal or attn_mask is not None
        # a fused kernel skips the tiles a causal mask removes; the flop count does not
        self.attn_work = 0.5 if self.attention is Attention.FLASH and is_causal and attn_mask is None else 1.0
        try:
            if attn_mask is not None and attn_mask.dtype == torch.bool:
                attn_mask = additive_mask(attn_mask, q.dtype)
            if self.attention is Attention.FLASH:
                kk, vv = k, v
                if q.shape[-3] != k.shape[-3]:
                    rep = q.shape[-3] // k.shape[-3]
                    kk = k.unsqueeze(-3).expand(*k.shape[:-2], rep, *k.shape[-2:]).reshape(q.shape[:-1] + k.shape[-1:])
                    vv = v.unsqueeze(-3).expand(*v.shape[:-2], rep, *v.shape[-2:]).reshape(q.shape[:-1] + v.shape[-1:])
                out = torch.ops.aten._scaled_dot_product_efficient_attention(
                    q, kk, vv, attn_mask, True, dropout_p, is_causal, scale=scale
                )[0]
            else:
                out = materialized_attention(q, k, v, attn_mask, dropout_p, is_causal, scale)
        finally:
            self.in_attention = False
        if seg is not None:
            info = seg.lookup(out)
            seg.register(
                out,
                Info(origins=info.origins, pending=info.pending, attn_heads=int(q.shape[-3]), broadcast=info.broadcast),
            )
        return out


@dataclass
class TraceResult:
    """Segment traces by segment name, and the head dimension and query heads of the
    attention seen."""

    traces: dict[str, SegmentTrace] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    head_dim: int = 0
    heads: int = 0
    calls: dict[str, list[str]] = field(default_factory=dict)
    """unit module FQN -> the segment open at each of its calls."""
    uncounted_ops: tuple[str, ...] = ()
    """aten ops without a FLOP formula that read a weight matrix (counted as 0 FLOPs)."""
    ring_attention: bool = True
    """Every attention core was causal without a mask: what a causal ring computes."""


PROLOGUE = "<prologue>"
EPILOGUE = "<epilogue>"


def run_trace(
    model: nn.Module,
    *,
    segments: dict[str, list[str]],
    blocks: list[str],
    signature_of: Callable[[str], str],
    make_inputs: Callable[[Callable[[torch.Tensor], torch.Tensor]], tuple[tuple, dict]],
    loss_fn: Callable[[Any], torch.Tensor] | None,
    compute_dtype: torch.dtype,
    attention: Attention,
    on_meta: bool,
) -> TraceResult:
    """Trace ``model`` once.

    ``segments`` maps a segment name to the module FQNs it holds: each block FQN of
    ``blocks`` maps to itself; ``PROLOGUE`` holds what runs before the first block and
    ``EPILOGUE`` what runs after the last (the loss included). A model without blocks
    is one ``PROLOGUE`` segment.
    """
    modules = dict(model.named_modules())
    fake = None if on_meta else FakeTensorMode(allow_non_fake_inputs=True)
    tensors = contextlib.nullcontext() if fake is None else fake

    def adopt(t: torch.Tensor) -> torch.Tensor:
        return t.to("meta") if fake is None else fake.from_tensor(t)

    params: dict[str, torch.Tensor] = {}
    param_storages: set[int] = set()
    expert_storages: set[int] = set()  # stacked 3-D weights of experts that expert parallelism splits
    experts = {id(p) for m in experts_modules(model).values() for p in m.parameters()}
    # One tensor per (shape, dtype, device): the weights' values are never read, and a
    # 1T-parameter model has thousands of parameters but a handful of shapes.
    by_shape: dict[tuple, torch.Tensor] = {}
    with tensors:
        for name, p in model.named_parameters(remove_duplicate=False):
            dtype = compute_dtype if p.is_floating_point() else p.dtype
            key = (tuple(p.shape), dtype, p.device)
            if key not in by_shape:
                device = "meta" if fake is None else p.device
                by_shape[key] = torch.empty(key[0], dtype=dtype, device=device).requires_grad_(p.is_floating_point())
                param_storages.add(by_shape[key].untyped_storage()._cdata)
            if p.dim() == 3 and id(p) in experts:
                expert_storages.add(by_shape[key].untyped_storage()._cdata)
            params[name] = by_shape[key]
        for name, b in model.named_buffers(remove_duplicate=False):
            params[name] = adopt(b)
        args, kwargs = make_inputs(adopt)
    tracer = Tracer(attention=attention, param_storages=param_storages, expert_storages=expert_storages)
    result = TraceResult()
    block_set = set(blocks)
    served: dict[str, str] = {}
    cache: dict[tuple, tuple[str, Any]] = {}

    def find_leaves(name: str) -> list[tuple[str, nn.Module]]:
        base = name if name in block_set else ""
        found = []
        for m in segments[name]:
            for sub_name, sub in modules[m].named_modules():
                full = f"{m}.{sub_name}" if sub_name else m
                if next(sub.parameters(recurse=False), None) is not None:
                    rel = full if not base else ("" if full == base else full[len(base) + 1 :])
                    found.append((rel, sub))
        return found

    leaves = {name: find_leaves(name) for name in segments}

    def open_segment(name: str, inputs: list[torch.Tensor], as_unit_input: bool) -> None:
        seg = Segment(name, leaves[name])
        seg.input_bytes = float(sum(nbytes_of(t) for t in inputs if t.is_floating_point() or not as_unit_input))
        if as_unit_input:
            for t in inputs:
                if t.is_floating_point():
                    seg.register(t, Info(origins=frozenset({UNIT_INPUT}), pending=frozenset(), attn_heads=0))
        tracer.segment = seg

    def close_segment(outputs: Any) -> None:
        seg = tracer.segment
        tracer.segment = None
        if seg is None:
            return
        outs = tensors_in(outputs)
        seg.output_bytes = float(sum(nbytes_of(t) for t in outs))
        seg.fusion.write(key for key, _ in keyed(outs))
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
        read_by_leaf(seg, tensors_in((args, kwargs)))
        heads = seg.consume(tensors_in((args, kwargs)), index)
        if heads:
            seg.leaves[index].in_heads = heads
        seg.leaf_stack.append(index)

    def leaf_post(mod, args, kwargs, output):
        seg = tracer.segment
        if seg is None or id(mod) not in seg.leaf_index:
            return
        index = seg.leaf_stack.pop()
        seg.leaves[index].out_bytes = float(sum(nbytes_of(t) for t in tensors_in(output)))
        for t in tensors_in(output):
            seg.register(t, Info(origins=frozenset({index}), pending=frozenset(), attn_heads=0))
            seg.leaf_outputs[id(t)] = (index, t)

    def block_pre(name: str):
        def hook(mod, args, kwargs):
            ins = tensors_in((args, kwargs))
            if tracer.segment is not None:
                close_segment(ins)
            open_segment(name, ins, as_unit_input=True)

        return hook

    def block_post(name: str):
        def hook(mod, args, kwargs, output):
            close_segment(output)
            if name == blocks[-1] and EPILOGUE in segments:
                open_segment(EPILOGUE, tensors_in(output), as_unit_input=True)

        return hook

    def cached_forward(name: str, original: Callable):
        sig = signature_of(name)

        def forward(*args, **kwargs):
            key = (sig, tuple((tuple(t.shape), t.dtype) for t in tensors_in((args, kwargs))))
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
    leaf_module_ids = {id(sub) for found in leaves.values() for _, sub in found}
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
            open_segment(PROLOGUE, tensors_in((args, kwargs)), as_unit_input=False)
        with (
            quiet_loggers((FAKE_TENSOR_LOGGER,), logging.CRITICAL),  # its traceback: the error below says it
            tensors,
            _Recorder(tracer),
            _AttentionInterceptor(tracer),
            torch.autograd.graph.saved_tensors_hooks(tracer.pack, lambda t: t),
        ):
            output = torch.func.functional_call(model, params, args, kwargs, strict=False)
            close_segment(loss_fn(output) if loss_fn is not None else output)
    except ModelError:
        raise
    except Exception as exc:
        raise ModelError(
            f"tracing {type(model).__name__} on {'meta' if on_meta else 'fake'} tensors failed: "
            f"{type(exc).__name__}: {str(exc).rstrip('.')}. "
            f"Check that the sample input (or seq_len) matches what the model's forward expects."
        ) from exc
    finally:
        for h in handles:
            h.remove()
        for mod in overridden:
            del mod.forward
    result.head_dim = tracer.head_dim
    result.heads = tracer.heads
    result.uncounted_ops = tuple(sorted(tracer.uncounted))
    result.ring_attention = not tracer.masked_attention
    return result
