"""``extract(model, ...)``: any ``nn.Module`` -> :class:`LayerGraph`.

Finds the units (:mod:`autopar.graph.units`), traces one forward and the loss without
data (:mod:`autopar.graph.trace`), and packages the per-sample measurements. Works the
same for a model on the meta device (a 1T-parameter GPT costs no memory) and a real one
(its weights are never read).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from autopar.errors import ModelError, check_positive_int
from autopar.graph.decoders import uncuttable_unit
from autopar.graph.layer_graph import LayerGraph, SharedParam, Unit, UnitProfile
from autopar.graph.trace import EPILOGUE, PROLOGUE, run_trace
from autopar.graph.units import _block_container, find_units, model_fingerprint, module_signature, unique_numel
from autopar.models.experts import routed_share, unsplit_experts
from autopar.vocab import Attention, DType

_TORCH_DTYPE = {DType.FP32: torch.float32, DType.BF16: torch.bfloat16, DType.FP16: torch.float16}


def torch_dtype(dtype: DType) -> torch.dtype:
    """The torch dtype of a precision."""
    return _TORCH_DTYPE[dtype]


def extract(
    model: nn.Module,
    *,
    seq_len: int | None = None,
    sample_input: Any = None,
    dtype: DType | str = DType.BF16,
    attention: Attention | str = Attention.FLASH,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
) -> LayerGraph:
    """Analyse ``model`` for planning.

    Args:
        model: any module, real or on the meta device.
        seq_len: for token models: trace one sample of ``seq_len`` token ids.
        sample_input: otherwise: a tensor, tuple of tensors or dict of keyword tensors
            whose first dimension is the batch (its values are never read).
        dtype: compute precision the activations are measured in.
        attention: implementation assumed for ``F.scaled_dot_product_attention``.
        loss_fn: ``output -> scalar``; by default cross-entropy over the vocabulary for
            token models (logits upcast to fp32, as Megatron-LM and Hugging Face do) and
            a sum otherwise.
    """
    dtype = DType(dtype)
    attention = Attention(attention)
    if not isinstance(model, nn.Module):
        raise ModelError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
    if (seq_len is None) == (sample_input is None):
        raise ModelError(
            "give exactly one of seq_len= (token models: the sequence length) or sample_input= "
            "(a tensor or tuple of tensors with the batch in dimension 0)."
        )
    vocab_size = _vocab_size(model)
    if seq_len is not None:
        check_positive_int("seq_len", seq_len)
        if vocab_size == 0:
            raise ModelError(
                f"seq_len={seq_len} was given but {type(model).__name__} has no nn.Embedding to take token "
                f"ids; pass sample_input= with a batch of its real inputs instead."
            )
    device = _model_device(model)

    def make_inputs(adopt: Callable[[torch.Tensor], torch.Tensor]) -> tuple[tuple, dict]:
        kwargs = training_kwargs(model)
        if seq_len is not None:
            return (torch.zeros(1, seq_len, dtype=torch.long, device=device),), kwargs
        if isinstance(sample_input, dict):
            kwargs.update({k: _traced_like(adopt, v, dtype) for k, v in sample_input.items()})
            return (), kwargs
        items = sample_input if isinstance(sample_input, (tuple, list)) else (sample_input,)
        return tuple(_traced_like(adopt, v, dtype) for v in items), kwargs

    batch = 1 if seq_len is not None else _batch_of(sample_input)
    if loss_fn is None:
        loss_fn = _default_loss(vocab_size)

    units = find_units(model)
    container = _block_container(model)
    blocks = [u for u in units if container is not None and _parent(u) == container] if container != "" else list(units)
    if not blocks:
        segments = {PROLOGUE: units}
    else:
        first, last = units.index(blocks[0]), units.index(blocks[-1])
        segments = {b: [b] for b in blocks}
        others = units[:first] + units[last + 1 :]
        if others:
            segments[PROLOGUE] = others
            segments[EPILOGUE] = others
    modules = dict(model.named_modules())
    signatures = {b: module_signature(modules[b]) for b in blocks}
    trace_with = functools.partial(
        run_trace,
        model,
        segments=segments,
        blocks=blocks,
        signature_of=signatures.__getitem__,
        make_inputs=make_inputs,
        loss_fn=loss_fn,
        compute_dtype=torch_dtype(dtype),
        attention=attention,
    )
    on_meta = device.type == "meta" and not _checks_for_fake_tensors(model)
    with unpacked_sequences():
        try:
            trace = trace_with(on_meta=on_meta)
        except ModelError:
            if not on_meta:
                raise
            trace = trace_with(on_meta=False)  # an op without a C++ meta kernel, or one reading data

    prologue_mods, epilogue_mods = [], []
    if blocks and (PROLOGUE in segments):
        for m in segments[PROLOGUE]:
            calls = trace.calls.get(m, [])
            (prologue_mods if calls and calls[0] == PROLOGUE else epilogue_mods).append(m)
    sequential = all(len(trace.calls.get(b, [])) == 1 for b in blocks)

    profiles: list[UnitProfile] = []
    profile_index: dict[int, int] = {}
    graph_units: list[Unit] = []

    def add_unit(display: str, mods: list[str], prefix: str, seg_name: str, keep_from: list[str] | None) -> None:
        seg = trace.traces.get(seg_name)
        if seg is None:
            raise ModelError(
                f"{display!r} never ran in the traced forward of {type(model).__name__}; autopar needs "
                f"every block of the model to run once per forward."
            )
        keep = None
        if keep_from is not None:
            keep = {leaf.name for leaf in seg.leaves if any(_under(leaf.name, m) for m in keep_from)}
        key = (id(seg), tuple(sorted(keep)) if keep is not None else None)
        if key not in profile_index:
            sig = signatures.get(seg_name, "+".join(mods))
            profile_index[key] = len(profiles)
            profiles.append(seg.to_profile(sig, batch, trace.head_dim, trace.heads, vocab_size=vocab_size, keep=keep))
        prof = profiles[profile_index[key]]
        graph_units.append(
            Unit(
                fqn=display,
                modules=tuple(mods),
                prefix=prefix,
                profile=profile_index[key],
                param_numel=prof.param_numel,
            )
        )

    if not blocks:
        add_unit(type(model).__name__, units, "", PROLOGUE, None)
    else:
        if prologue_mods:
            add_unit("+".join(prologue_mods), prologue_mods, "", PROLOGUE, prologue_mods)
        for b in blocks:
            add_unit(b, [b], b, b, None)
        if epilogue_mods:
            add_unit("+".join(epilogue_mods), epilogue_mods, "", EPILOGUE, epilogue_mods)
    seq = seq_len if seq_len is not None else _seq_of(sample_input)
    cuttable = uncuttable_unit(model, units) is None
    unsplit = unsplit_experts(model)
    shares = routed_share(model, unsplit)
    unrouted = sum(
        leaf.fwd_flops * (1 - share)
        for u in graph_units
        for leaf in profiles[u.profile].leaves
        for fqn, share in shares.items()
        if _under(u.leaf_fqn(leaf.name), fqn)
    )
    return LayerGraph(
        name=type(model).__name__,
        units=tuple(graph_units),
        profiles=tuple(profiles),
        shared=_shared_params(model, graph_units),
        num_params=unique_numel(model),
        seq_len=seq,
        dtype=dtype,
        attention=attention,
        sequential=sequential,
        fingerprint=model_fingerprint(model),
        vocab_size=vocab_size,
        cuttable=cuttable,
        uncounted_ops=trace.uncounted_ops,
        ring_attention=trace.ring_attention,
        unsplit_experts=unsplit,
        unrouted_flops=unrouted,
    )


def _parent(fqn: str) -> str:
    return fqn.rsplit(".", 1)[0] if "." in fqn else ""


def _under(name: str, module: str) -> bool:
    return name == module or name.startswith(module + ".")


def _vocab_size(model: nn.Module) -> int:
    sizes = [m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)]
    return max(sizes, default=0)


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _checks_for_fake_tensors(model: nn.Module) -> bool:
    """Whether ``model`` is a Hugging Face transformers model: their forward reads data
    (a mask's ``.all()``) unless it sees fake tensors, so they trace on fake tensors."""
    return any(cls.__module__.startswith("transformers.") for cls in type(model).__mro__)


@contextlib.contextmanager
def unpacked_sequences() -> Iterator[None]:
    """Within: transformers' check for packed sequences (several sequences in one row,
    told by position ids that restart) finds none, as it does on one sequence per row of
    real token ids, which is what the trace and the dry run feed. The check reads the
    position ids' values; on fake tensors it cannot, assumes packing, and builds an
    explicit causal mask, so SDPA ran with a mask where a real run calls it with
    ``is_causal=True`` and the kernel skips the masked half. A padding mask or a sliding
    window still builds its mask, as on a real run. Nothing changes where transformers'
    masking is not loaded."""
    masking = sys.modules.get("transformers.masking_utils")
    if masking is None or not hasattr(masking, "find_packed_sequence_indices"):
        yield
        return
    original = masking.find_packed_sequence_indices
    masking.find_packed_sequence_indices = lambda *args, **kwargs: None
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = original


def training_kwargs(model: nn.Module) -> dict[str, Any]:
    """Keyword arguments a training forward of ``model`` passes: ``use_cache=False``
    where the forward takes it (transformers models), since training keeps no key/value
    cache, and a cache carried from one forward into the next would tie their graphs."""
    return {"use_cache": False} if "use_cache" in _forward_params(model) else {}


def _forward_params(model: nn.Module) -> Sequence[str]:
    try:
        return list(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return []


def _traced_like(adopt: Callable[[torch.Tensor], torch.Tensor], value: Any, dtype: DType) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    t = adopt(value)
    if t.is_floating_point():
        t = t.to(torch_dtype(dtype))
    return t


def _batch_of(sample: Any) -> int:
    items = (
        list(sample.values())
        if isinstance(sample, dict)
        else (list(sample) if isinstance(sample, (tuple, list)) else [sample])
    )
    for item in items:
        if isinstance(item, torch.Tensor) and item.dim() >= 1:
            if item.shape[0] < 1:
                raise ModelError(
                    f"sample_input's batch dimension is {item.shape[0]} (shape {tuple(item.shape)}); give at least "
                    f"one sample, e.g. torch.zeros(1, 3, 224, 224)."
                )
            return int(item.shape[0])
    raise ModelError("sample_input holds no tensor with a batch dimension; give e.g. torch.zeros(1, 3, 224, 224).")


def _seq_of(sample: Any) -> int:
    items = (
        list(sample.values())
        if isinstance(sample, dict)
        else (list(sample) if isinstance(sample, (tuple, list)) else [sample])
    )
    for item in items:
        if isinstance(item, torch.Tensor) and item.dim() == 2 and not item.is_floating_point():
            return int(item.shape[1])
    return 1


def _logits_of(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        for item in output:
            if isinstance(item, torch.Tensor):
                return item
    raise ModelError(f"cannot find a tensor in the model output of type {type(output).__name__}; pass loss_fn=.")


def _default_loss(vocab_size: int) -> Callable[[Any], torch.Tensor]:
    def loss(output: Any) -> torch.Tensor:
        logits = _logits_of(output)
        if vocab_size and logits.dim() >= 2 and logits.shape[-1] == vocab_size:
            targets = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
            return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten())
        return logits.float().sum()

    return loss


def _shared_params(model: nn.Module, units: list[Unit]) -> tuple[SharedParam, ...]:
    """One entry per parameter that a second unit reaches again (tied weights)."""
    first: dict[int, tuple[int, str]] = {}
    found: list[SharedParam] = []
    modules = dict(model.named_modules())
    for i, unit in enumerate(units):
        for m in unit.modules:
            for name, p in modules[m].named_parameters():
                owner = f"{m}.{name}".rpartition(".")[0] if m else name.rpartition(".")[0]
                if id(p) not in first:
                    first[id(p)] = (i, owner)
                elif first[id(p)][0] != i:
                    a, a_owner = first[id(p)]
                    found.append(
                        SharedParam(
                            first_unit=a, second_unit=i, first_module=a_owner, second_module=owner, numel=p.numel()
                        )
                    )
    return tuple(found)
