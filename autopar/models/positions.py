"""How long a sequence a model takes: the positions its config says it was built for, a
rotary model's context stretched by ``rope_scaling``, and the check every planning entry
point makes before tracing a model at a sequence length."""

from __future__ import annotations

from autopar.errors import ConfigError, check_positive_int

POSITION_FIELDS = ("max_position_embeddings", "n_positions", "seq_len")
"""Where a model's ``config`` gives the longest sequence it was built for: Hugging Face
configs (``n_positions`` in GPT-2's), then autopar's own GPT and Llama configs."""


def max_positions(model: object) -> tuple[int, str] | None:
    """The longest sequence ``model`` was built for and the config field that says so, or
    None for a model without such a config (then any length is taken)."""
    config = getattr(model, "config", None)
    for field in POSITION_FIELDS:
        value = getattr(config, field, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value, field
    return None


def longest_length_note(limit: tuple[int, str], flag: str, config: object = None) -> str:
    """What a plan says when it was made for the longest sequence its model was built for
    (``limit``, from :func:`max_positions`) because no length was given; ``flag`` is how
    the caller gives one (``--seq-len``, ``seq_len=``). Where the model's ``config``
    stretches its rotary context further (:func:`rope_context`), that length is the
    config's, not the model's maximum, and the note says how far it goes."""
    scaled = rope_context(config) if config is not None else None
    what = f"the model's maximum (config.{limit[1]})"
    if scaled is not None and scaled[0] > limit[0]:
        what = f"the length its config gives (config.{limit[1]}; its {scaled[1]} takes up to {scaled[0]})"
    return (
        f"Planned for seq_len {limit[0]}, {what}, as no sequence length was given; "
        f"pass {flag} with your training length: memory, FLOPs and the chosen plan depend on it."
    )


ROPE_SCALING_TYPES = ("linear", "dynamic", "yarn", "longrope", "llama3")
"""Hugging Face ``rope_scaling`` types that stretch a rotary model's context: by
transformers' definition a ``factor`` of x handles x times the pre-trained length, which
is ``original_max_position_embeddings`` (yarn, longrope, llama3; transformers fills in
``max_position_embeddings`` when absent) or ``max_position_embeddings`` (linear and
dynamic, which have no other)."""


def _rope_parameters(config: object) -> list[dict]:
    """A config's rotary parameters (transformers 5's ``rope_parameters``, else the
    older ``rope_scaling``), one dict per layer type where they are given so (Gemma 3)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(params, dict):
        return []
    nested = [value for value in params.values() if isinstance(value, dict)]
    return nested or [params]


def _is_rotary(model: object, limit: int) -> bool:
    """Whether ``model`` places tokens by rotary embeddings (its config has RoPE
    parameters) and holds no learned position table (an ``nn.Embedding`` of ``limit`` to
    ``limit + 2`` rows, as GPT-2's ``wpe``, BERT's and OPT's, which no config can stretch)."""
    config = getattr(model, "config", None)
    if not (_rope_parameters(config) or getattr(config, "rope_theta", None)):
        return False
    from torch import nn

    if not isinstance(model, nn.Module):
        return True
    return not any(isinstance(m, nn.Embedding) and limit <= m.num_embeddings <= limit + 2 for m in model.modules())


def _rope_type(params: dict) -> str | None:
    """The scaling type of one set of rotary parameters (``rope_type``, formerly ``type``)."""
    return params.get("rope_type") or params.get("type")


def _number(value: object) -> float | None:
    """``value`` as a float where it is a positive number, else None."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
    return float(value) if ok else None


def rope_context(config: object) -> tuple[int, str] | None:
    """The context a rotary model's ``rope_scaling`` configures, ``factor`` x the
    pre-trained length (see :data:`ROPE_SCALING_TYPES`), and how it was found; None
    without a scaling of those types (a longrope one without ``factor`` stretches to
    ``max_position_embeddings``, which the config already says)."""
    best = None
    for params in _rope_parameters(config):
        kind = _rope_type(params)
        factor = _number(params.get("factor"))
        field = "original_max_position_embeddings"
        original = _number(getattr(config, field, None)) or _number(params.get(field))
        if original is None:
            field, original = "max_position_embeddings", _number(getattr(config, "max_position_embeddings", None))
        if kind not in ROPE_SCALING_TYPES or factor is None or original is None:
            continue
        length = int(factor * original)
        if best is None or length > best[0]:
            best = (length, f"rope_scaling {kind}: factor {factor:g} x {field} {int(original)}")
    return best


def check_seq_len(seq_len: object, model: object) -> int:
    """Return ``seq_len`` if it is a positive integer no longer than the positions
    ``model`` was built for, else raise ConfigError: a longer sequence indexes past a
    learned position table, or past the context a rotary model was configured for. That
    context is ``max_position_embeddings`` or, with ``rope_scaling``, the longer of it and
    :func:`rope_context` (Qwen2.5's yarn factor 4 x 32768 = 131072)."""
    length = check_positive_int("seq_len", seq_len)
    limit = max_positions(model)
    if limit is None or length <= limit[0]:
        return length
    name, field = type(model).__name__, f"config.{limit[1]}"
    if limit[1] != "max_position_embeddings" or not _is_rotary(model, limit[0]):  # a table, or autopar's own
        raise ConfigError(
            f"seq_len={length} is longer than the {limit[0]} positions {name} was built for "
            f"({field}); give seq_len <= {limit[0]}, or a model configured for longer sequences."
        )
    config = getattr(model, "config", None)
    scaled = rope_context(config)
    kinds = sorted({str(_rope_type(p) or "default") for p in _rope_parameters(config)} - {"default"})
    if scaled is None and kinds:  # a longrope without factor: max_position_embeddings is its stretched context
        raise ConfigError(
            f"seq_len={length} is longer than the {limit[0]} positions {name} was built for ({field}, with "
            f"rope_scaling {'/'.join(kinds)}); give seq_len <= {limit[0]}, or raise max_position_embeddings or "
            f"rope_scaling's factor in the config."
        )
    if scaled is None:
        raise ConfigError(
            f"seq_len={length} is longer than the {limit[0]} positions {name} was built for ({field}; its rotary "
            f"embedding has no rope_scaling); give seq_len <= {limit[0]}, or raise max_position_embeddings or "
            f"add rope_scaling to the config (e.g. yarn, factor {-(-length // limit[0]):g} x "
            f"original_max_position_embeddings {limit[0]})."
        )
    if length <= scaled[0]:
        return length
    most = max(limit[0], scaled[0])
    raise ConfigError(
        f"seq_len={length} is longer than the {most} positions {name} is configured for ({field} is {limit[0]}; "
        f"{scaled[1]} = {scaled[0]}); give seq_len <= {most}, or raise rope_scaling's factor or "
        f"max_position_embeddings in the config."
    )
