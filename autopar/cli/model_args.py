"""How the command line names a model: ``--model``, ``--model-config`` or ``--model-fn``,
with ``--seq-len`` or ``--sample-shape`` for its input, built on the meta device."""

from __future__ import annotations

import argparse
import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autopar.errors import ConfigError, first_line
from autopar.models.positions import longest_length_note, max_positions


@dataclass(frozen=True)
class LoadedModel:
    """A model built on the meta device, the planner's keywords describing its input,
    lines stating the defaults taken for it (printed with the result), and those of them
    that are warnings: a plan carries them among its notes (a sequence length taken from
    the model's maximum)."""

    model: Any
    inputs: dict[str, Any]
    notes: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()


def load_model(args: argparse.Namespace) -> LoadedModel:
    """The model named by ``--model``, ``--model-config`` or ``--model-fn`` (built on the
    meta device), and the keyword arguments that describe its input."""
    chosen = [x for x in (args.model, args.model_config, args.model_fn) if x]
    if len(chosen) != 1:
        raise ConfigError(
            "give exactly one of --model NAME, --model-config CONFIG.json|CHECKPOINT_DIR or --model-fn module:function."
        )
    seq_len = _seq_len(getattr(args, "seq_len", None))
    text = getattr(args, "sample_shape", None)
    shape = _sample_shape(text) if text is not None else None
    if args.model:
        return _named_model(args.model, seq_len, shape)
    if args.model_config:
        return _config_model(args.model_config, seq_len, shape, args.trust_remote_code)
    return _function_model(args.model_fn, seq_len, shape)


def _seq_len(value: int | None) -> int | None:
    """``--seq-len`` as given, refused when not positive (0 would otherwise read as
    "not given" and plan at the model's own length without a word)."""
    if value is not None and value < 1:
        raise ConfigError(
            f"--seq-len {value} is not allowed: give the tokens per sample, a positive integer, or leave it "
            f"out to use the model's own length."
        )
    return value


def _sample_shape(text: str) -> tuple[int, ...]:
    """``--sample-shape 3,224,224`` as a tuple of positive dimensions."""
    try:
        dims = tuple(int(d) for d in text.split(","))
    except ValueError:
        dims = ()
    if not dims or min(dims) < 1:
        raise ConfigError(
            f"--sample-shape {text!r} is not allowed: give one sample's dimensions as positive integers, "
            f"e.g. 3,224,224."
        )
    if math.prod(dims) > MAX_SAMPLE_ELEMENTS:
        raise ConfigError(
            f"--sample-shape {text!r} is {math.prod(dims):.3g} values per sample, more than 2^40, beyond any "
            f"device's memory; give one sample's real dimensions, e.g. 3,224,224."
        )
    return dims


MAX_SAMPLE_ELEMENTS = 2**40
"""The most values ``--sample-shape`` may give one sample (a tebibyte at a byte each:
beyond any device; much larger ones overflow torch's sizes with a C++ error)."""


def _no_sample_shape(shape: tuple[int, ...] | None, model: str) -> None:
    """Refuse ``--sample-shape`` for a model that takes token ids (it would be ignored)."""
    if shape is not None:
        raise ConfigError(f"--sample-shape is for models without token input; {model} takes token ids: give --seq-len.")


def _meta_sample(shape: tuple[int, ...]) -> dict[str, Any]:
    """The planner's ``sample_input`` for one sample of ``shape``, on the meta device."""
    import torch

    return {"sample_input": torch.zeros(1, *shape, device="meta")}


def _named_model(name: str, seq_len: int | None, shape: tuple[int, ...] | None) -> LoadedModel:
    """A registered model and its input: token models at ``--seq-len`` (their own length
    by default: the longest they were built for, said in a warning), others at
    ``--sample-shape`` (their own sample by default)."""
    from autopar.models.registry import build_named_model, get_named_model

    entry = get_named_model(name)
    if entry.input_kind == "tokens":
        _no_sample_shape(shape, name)
        if seq_len is not None:
            return LoadedModel(build_named_model(name), {"seq_len": seq_len})
        model = build_named_model(name)
        limit = max_positions(model) or (entry.seq_len, "seq_len")
        note = longest_length_note((entry.seq_len, limit[1]), "--seq-len")
        return LoadedModel(model, {"seq_len": entry.seq_len}, (note,), (note,))
    if seq_len is not None:
        raise ConfigError(
            f"--seq-len is for token models; {name} takes {entry.input_kind} of shape {entry.sample_shape}: "
            f"leave --seq-len out, or give --sample-shape."
        )
    if shape and not _takes(entry.input_kind, entry.sample_shape, shape):
        own = ",".join(map(str, entry.sample_shape))
        raise ConfigError(
            f"--sample-shape {','.join(map(str, shape))} does not fit {name}, which takes {entry.input_kind.rstrip('s')}s of shape "
            f"{entry.sample_shape} per sample; give --sample-shape {own} (its default), or leave it out."
        )
    sample = _meta_sample(shape) if shape else {"sample_input": entry.sample_input(1)}
    return LoadedModel(build_named_model(name), sample)


def _takes(kind: str, own: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """Whether a registered model whose sample is ``own`` takes samples of ``shape``:
    features of the same width (leading dimensions, a sequence of them, allowed), images
    of the same channels and rank (any height and width)."""
    if kind == "features":
        return shape[-1] == own[-1]
    return len(shape) == len(own) and shape[0] == own[0]


def _config_model(
    text: str, seq_len: int | None, shape: tuple[int, ...] | None, trust_remote_code: bool
) -> LoadedModel:
    """A Hugging Face model built from its config (a file or a checkpoint directory) on
    the meta device, fed token ids at ``--seq-len`` or images of ``--sample-shape``, the
    config's own sizes by default (said in a note, as is the class built when the config
    names none)."""
    from autopar.models.hf_config import build_hf_model, hf_input, load_hf_model

    hf = load_hf_model(text, trust_remote_code=trust_remote_code)
    model = build_hf_model(hf, "meta")
    feed = hf_input(model, hf.config, seq_len=seq_len, sample_shape=shape)
    longest = (feed.note,) if feed.note and seq_len is None and feed.seq_len is not None else ()
    return LoadedModel(model, feed.planner_inputs(), tuple(n for n in (hf.note, feed.note) if n), longest)


def _function_model(spec: str, seq_len: int | None, shape: tuple[int, ...] | None) -> LoadedModel:
    """The module ``--model-fn module:function`` returns, called with no arguments on the
    meta device, and its input: ``--seq-len`` or ``--sample-shape``."""
    import torch
    from torch import nn

    module_name, _, fn_name = spec.partition(":")
    if not fn_name:
        raise ConfigError(f"--model-fn {spec!r}: expected module:function, e.g. mypkg.models:build.")
    try:
        fn: Callable[[], Any] = getattr(importlib.import_module(module_name), fn_name)
    except (ImportError, AttributeError) as exc:
        local = Path(*module_name.split(".")).with_suffix(".py")
        hint = (
            f"; {local} is here, but this directory is not on Python's import path (set PYTHONPATH=. to add it)"
            if isinstance(exc, ModuleNotFoundError) and local.is_file()
            else ""
        )
        raise ConfigError(f"--model-fn {spec!r}: cannot import it ({exc}){hint}.") from None
    except Exception as exc:  # the module's own code failed as it was imported
        raise ConfigError(
            f"--model-fn {spec!r}: importing it failed ({type(exc).__name__}: {first_line(exc)})."
        ) from None
    except SystemExit as exc:  # a script's sys.exit at import: the process would end without a word
        raise ConfigError(
            f"--model-fn {spec!r}: importing it called sys.exit({exc.code!r}); give a module whose import builds "
            f"nothing and exits nothing (put script code under if __name__ == '__main__')."
        ) from None
    if seq_len is not None and shape is not None:
        raise ConfigError("give one of --seq-len (token models) or --sample-shape (others), not both.")
    if seq_len is None and shape is None:
        raise ConfigError("--model-fn needs --seq-len (token models) or --sample-shape C,H,W (one sample's shape).")
    try:
        with torch.device("meta"):
            model = fn()
    except Exception as exc:  # the user's own code: any failure is theirs to fix, said in one line
        raise ConfigError(
            f"--model-fn {spec!r} failed when called with no arguments ({type(exc).__name__}: {first_line(exc)}); "
            f"it must build the model by itself."
        ) from None
    except SystemExit as exc:
        raise ConfigError(
            f"--model-fn {spec!r} called sys.exit({exc.code!r}) instead of returning a torch.nn.Module."
        ) from None
    if not isinstance(model, nn.Module):
        raise ConfigError(f"--model-fn {spec!r} returned a {type(model).__name__}, not a torch.nn.Module.")
    if seq_len is not None and not any(isinstance(m, nn.Embedding) for m in model.modules()):
        raise ConfigError(
            f"--seq-len {seq_len} is for token models, but --model-fn {spec!r} built a {type(model).__name__} with no "
            f"nn.Embedding to take token ids; give --sample-shape with one sample's dimensions instead, e.g. 3,224,224."
        )
    return LoadedModel(model, {"seq_len": seq_len} if seq_len is not None else _meta_sample(shape))


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="a registered model name (see 'autopar models')")
    p.add_argument(
        "--model-config",
        help="a Hugging Face config.json, or a checkpoint directory holding one: the class its architectures "
        "names, built with random weights on meta (weights are not read)",
    )
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run the custom code a --model-config's auto_map names (models outside transformers)",
    )
    p.add_argument("--model-fn", help="module:function returning an nn.Module")
    p.add_argument("--seq-len", type=int, help="tokens per sample (token models)")
    p.add_argument("--sample-shape", help="one sample's shape for non-token models, e.g. 3,224,224")
