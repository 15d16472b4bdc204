"""The model a ``profile model`` command measures: a registered name, a transformers
config, or a ``module:function``, built on the device, with the input its units take."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from profiler.errors import SettingsError

if TYPE_CHECKING:
    from autopar.models.registry import NamedModel

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""``--dtype``'s choices as torch dtypes."""


def load_model(args: argparse.Namespace, device: torch.device) -> tuple[nn.Module, Any, str]:
    """The model and one batch of inputs that ``--model``/``--model-fn``/``--model-config``
    and the shape options describe, built on ``device`` in ``--dtype``."""
    from autopar.models.positions import check_seq_len
    from autopar.models.registry import get_named_model

    if args.batch < 1:
        raise SettingsError(f"--batch {args.batch} must be >= 1.")
    seq_len, shape = _checked_shapes(args.seq_len, args.input_shape)
    if args.model_config:
        return _config_model(args, seq_len, shape, device)
    if args.model:
        entry = get_named_model(args.model)
        seq_len, shape = _registry_input(entry, seq_len, shape)
        if args.seq_len is None and seq_len is not None:
            print(f"seq_len {seq_len} ({entry.name}'s registered length; pass --seq-len to change)", file=sys.stderr)
        build, name = entry.build, entry.name
        hint = "profile a smaller model, or on a device with more memory"
    else:
        build, name = _model_function(args.model_fn), args.model_fn
        hint = "--model-fn must name a function that returns the model, called with no arguments"
    model = _built(build, device, name, hint)
    if seq_len is not None:
        check_seq_len(seq_len, model)
    model = model.to(_DTYPES[args.dtype]).train()
    vocab = max((m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)), default=0)
    if shape:
        sample = torch.randn(args.batch, *shape, device=device)
    elif seq_len and vocab:
        sample = torch.randint(0, vocab, (args.batch, seq_len), device=device)
    else:
        raise SettingsError("give --seq-len (a token model: the sequence length) or --input-shape (e.g. 3,224,224).")
    return model, sample, name


def _config_model(
    args: argparse.Namespace, seq_len: int | None, shape: tuple[int, ...] | None, device: torch.device
) -> tuple[nn.Module, dict[str, torch.Tensor], str]:
    """The Hugging Face model ``--model-config`` names, built from its config on ``device``
    in ``--dtype``, and one batch of its keyword inputs: token ids at ``--seq-len`` or
    images of ``--input-shape``, the config's own sizes by default (said on stderr, as is
    the class built when the config names none)."""
    from autopar.models.hf_config import hf_input, load_hf_model
    from autopar.models.positions import check_seq_len

    hf = load_hf_model(args.model_config, trust_remote_code=args.trust_remote_code)
    model = _built(hf.build, device, args.model_config, "profile a smaller model, or on a device with more memory")
    feed = hf_input(model, hf.config, seq_len=seq_len, sample_shape=shape, shape_flag="--input-shape")
    for note in (hf.note, feed.note):
        if note:
            print(note, file=sys.stderr)
    if feed.seq_len is not None:
        check_seq_len(feed.seq_len, model)
    model = model.to(_DTYPES[args.dtype]).train()
    return model, feed.sample(args.batch, device), args.model_config


def _checked_shapes(seq_len: int | None, shape: tuple[int, ...] | None) -> tuple[int | None, tuple[int, ...] | None]:
    """``--seq-len`` and ``--input-shape`` as given, refused when not positive (a zero
    length would read as "not given", a negative one fail inside torch)."""
    if seq_len is not None and seq_len < 1:
        raise SettingsError(
            f"--seq-len {seq_len} is not allowed: give the tokens per sample, a positive integer, or leave it "
            f"out to use the model's own length."
        )
    if shape is not None and (not shape or min(shape) < 1):
        raise SettingsError(
            f"--input-shape {','.join(map(str, shape))!r} is not allowed: give one sample's dimensions as positive "
            f"integers, e.g. 3,224,224."
        )
    return seq_len, shape


def _registry_input(
    entry: NamedModel, seq_len: int | None, shape: tuple[int, ...] | None
) -> tuple[int | None, tuple[int, ...] | None]:
    """A registered model's input: token models at ``--seq-len`` (their own length by
    default), others at ``--input-shape`` (their own sample's by default); the option
    that does not apply to the model is refused rather than ignored."""
    if entry.input_kind == "tokens":
        if shape is not None:
            raise SettingsError(
                f"--input-shape is for models without token input; {entry.name} takes token ids: give --seq-len."
            )
        return (entry.seq_len if seq_len is None else seq_len), None
    if seq_len is not None:
        raise SettingsError(
            f"--seq-len is for token models; {entry.name} takes {entry.input_kind} of shape {entry.sample_shape}: "
            f"leave it out, or give --input-shape."
        )
    return None, shape or entry.sample_shape


def _model_function(spec: str) -> Callable[[], Any]:
    """The function ``--model-fn module:function`` names."""
    module_name, _, fn_name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module_name), fn_name)
    except (ImportError, AttributeError) as exc:
        raise SettingsError(f"--model-fn {spec!r}: cannot import it ({exc}); write module:function.") from None


def _built(build: Callable[[], Any], device: torch.device, name: str, hint: str) -> nn.Module:
    """``build()`` on ``device``. A failure of it (the user's own function, or a model too
    large for the device) is one line naming the model and ending in ``hint``, and so is
    something else than a module returned."""
    from autopar.errors import AutoparError

    try:
        with torch.device(device):
            model = build()
    except AutoparError:
        raise
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [""])[0]
        raise SettingsError(f"building {name!r} on {device} failed ({type(exc).__name__}: {first}); {hint}.") from None
    if not isinstance(model, nn.Module):
        raise SettingsError(f"{name!r} built a {type(model).__name__}, not a torch.nn.Module; {hint}.")
    return model
