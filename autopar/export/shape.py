"""The model's sizes and architecture, for the frameworks that build the model from
flags (Megatron-LM) or wrap its blocks by class (Accelerate's FSDP).

A plan records the model's units, parameter count and fingerprint, not its hidden size
or head count. When the caller passes the model the plan was made for, its config gives
them: autopar's own GPT, Llama and mixture-of-experts Llama (every registry model), or
any Hugging Face model (sizes, the architecture where its config and blocks state it,
and the routed experts where its config counts them, as Mixtral's does: read by
:mod:`autopar.export.experts_shape`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from autopar.export.common import ExportError, blocks_of, config_float, config_int
from autopar.export.experts_shape import Experts, hf_experts, moe_experts
from autopar.model_match import model_problem
from autopar.models.gpt import GPTConfig
from autopar.models.llama import LlamaConfig
from autopar.models.moe import MoEConfig
from autopar.plan import Plan


@dataclass(frozen=True, kw_only=True)
class LatentAttention:
    """Multi-latent attention (DeepSeek-V2/V3): queries and keys/values projected through
    low-rank latents, each head's query and key a part without positions and a rotary
    part, as Megatron-LM's flags name the sizes; ``latent_norms``: the latents are
    normalised (DeepSeek's ``q_a_layernorm`` and ``kv_a_layernorm``)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_head_dim: int
    qk_pos_emb_head_dim: int
    v_head_dim: int
    latent_norms: bool


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """Sizes and architecture of a transformer; ``None`` where unknown.

    Attributes:
        hidden_size, num_attention_heads, num_kv_heads, ffn_hidden_size, vocab_size,
        max_position_embeddings: sizes as Megatron-LM names them.
        normalization: ``LayerNorm`` or ``RMSNorm``.
        gated_mlp: a SwiGLU MLP (three projections) rather than a GELU one.
        rope_base: rotary position embeddings with this base; ``None`` with
            ``learned_positions`` means learned absolute positions.
        learned_positions: a learned position embedding table.
        tied_embeddings: the output head shares the token embedding's weight.
        linear_bias: the attention's output projection and the MLP have biases.
        qkv_bias: the query, key and value projections have biases (Qwen2's alone do).
        head_dim: features per attention head where the config states them (they need
            not be ``hidden_size / num_attention_heads``: Gemma, Qwen3).
        qk_norm: queries and keys are normalised before the attention: ``head`` per
            head (Qwen3, Gemma 3), ``projection`` over the whole projection (OLMo 2),
            ``none``.
        rotary_percent: the fraction of each head's features rotary embeddings rotate
            (GPT-NeoX's ``rotary_pct``, ``partial_rotary_factor``).
        rope_scaling: the config's rope scaling (``rope_type`` and ``factor``), if any.
        yarn: YaRN's other numbers where the config scales that way (``mscale``,
            ``mscale_all_dim``, ``beta_fast``, ``beta_slow``,
            ``original_max_position_embeddings``: those it states).
        gated_activation: the activation of a gated MLP (``silu``: SwiGLU; a GELU:
            GeGLU, Gemma's).
        norm_epsilon: the norms' epsilon.
        block_class: class name of one transformer block (what FSDP wraps).
        experts: the routed experts; ``None`` for a model without experts (or none that
            its config counts).
        latent_attention: its multi-latent attention's sizes; ``None`` for another.
        unwritten: what the config states of its attention and MLP that flag-built models
            take in a spec rather than from sizes (sliding-window layers, attention sinks,
            a clamped SwiGLU), each as a phrase.
        known_architecture: the architecture fields above were read from a model autopar
            knows, not left unknown.
    """

    hidden_size: int | None = None
    num_attention_heads: int | None = None
    num_kv_heads: int | None = None
    ffn_hidden_size: int | None = None
    vocab_size: int | None = None
    max_position_embeddings: int | None = None
    normalization: str | None = None
    gated_mlp: bool | None = None
    rope_base: float | None = None
    learned_positions: bool | None = None
    tied_embeddings: bool | None = None
    linear_bias: bool | None = None
    qkv_bias: bool | None = None
    head_dim: int | None = None
    qk_norm: str | None = None
    rotary_percent: float | None = None
    rope_scaling: tuple[str, float] | None = None
    yarn: tuple[tuple[str, float], ...] = ()
    gated_activation: str | None = None
    norm_epsilon: float | None = None
    block_class: str | None = None
    experts: Experts | None = None
    latent_attention: LatentAttention | None = None
    unwritten: tuple[str, ...] = ()
    known_architecture: bool = False


def check_plans_model(model: nn.Module, plan: Plan, *, advice: str = "pass the plan's model, or none") -> None:
    """Refuse ``model`` (an ExportError ending in ``advice``) unless it is the model
    ``plan`` was made for (:func:`autopar.model_match.model_problem`)."""
    problem = model_problem(model, plan.model)
    if problem:
        raise ExportError(f"{problem}; {advice}.")


def shape_of(model: nn.Module, plan: Plan) -> ModelShape:
    """The shape of ``model``, which must be the model ``plan`` was made for
    (:func:`check_plans_model`)."""
    check_plans_model(model, plan)
    block_class = _block_class(model, plan)
    config = getattr(model, "config", None)
    if isinstance(config, GPTConfig):
        return ModelShape(
            hidden_size=config.dim,
            num_attention_heads=config.n_heads,
            num_kv_heads=config.n_heads,
            ffn_hidden_size=config.ffn_dim,
            vocab_size=config.vocab_size,
            max_position_embeddings=config.seq_len,
            normalization="LayerNorm",
            gated_mlp=False,
            learned_positions=True,
            tied_embeddings=config.tie_embeddings,
            linear_bias=True,
            qkv_bias=True,
            qk_norm="none",
            norm_epsilon=config.norm_eps,
            block_class=block_class,
            known_architecture=True,
        )
    if isinstance(config, LlamaConfig):
        return ModelShape(
            hidden_size=config.dim,
            num_attention_heads=config.n_heads,
            num_kv_heads=config.n_kv_heads,
            ffn_hidden_size=config.ffn_dim,
            vocab_size=config.vocab_size,
            max_position_embeddings=config.seq_len,
            normalization="RMSNorm",
            gated_mlp=True,
            gated_activation="silu",
            rope_base=config.rope_theta,
            learned_positions=False,
            tied_embeddings=False,
            linear_bias=False,
            qkv_bias=False,
            qk_norm="none",
            norm_epsilon=config.norm_eps,
            block_class=block_class,
            experts=moe_experts(config) if isinstance(config, MoEConfig) else None,
            known_architecture=True,
        )
    return _hf_shape(config, block_class, _first_block(model, plan), _blocks(model, plan))


def _hf_shape(
    config: Any, block_class: str | None, block: nn.Module | None, blocks: list[nn.Module] | None = None
) -> ModelShape:
    """Sizes from a Hugging Face config's standard attribute names (``attribute_map``
    lets GPT-2's ``n_embd`` answer to ``hidden_size``), and the architecture where the
    config and one built block state it (:func:`_hf_architecture`)."""
    if config is None:
        return ModelShape(block_class=block_class)
    heads = config_int(config, "num_attention_heads")
    return ModelShape(
        hidden_size=config_int(config, "hidden_size"),
        num_attention_heads=heads,
        num_kv_heads=config_int(config, "num_key_value_heads") or heads,
        ffn_hidden_size=config_int(config, "intermediate_size_mlp")
        or config_int(config, "intermediate_size"),  # Llama 4's dense
        vocab_size=config_int(config, "vocab_size"),
        max_position_embeddings=config_int(config, "max_position_embeddings"),
        head_dim=config_int(config, "head_dim"),
        rotary_percent=_rotary_percent(config),
        rope_scaling=_rope_scaling(config),
        yarn=_yarn(config),
        block_class=block_class,
        experts=hf_experts(config, blocks or []),
        latent_attention=_latent_attention(config, block),
        unwritten=_unwritten(config, block),
        **(_hf_architecture(config, block) if block is not None else {}),
    )


def _unwritten(config: Any, block: nn.Module | None) -> tuple[str, ...]:
    """What the config states that Megatron-LM's size flags do not build: sliding-window
    attention on some layers (``layer_types``), attention sinks (a block's ``sinks``
    parameter, gpt-oss), a clamped SwiGLU (``swiglu_limit``)."""
    found = []
    kinds = getattr(config, "layer_types", None) or []
    window = config_int(config, "sliding_window")
    sliding = sum(1 for kind in kinds if kind == "sliding_attention")
    if window and sliding:
        found.append(f"sliding-window attention (window {window}) on {sliding} of its {len(kinds)} layers")
    if block is not None and any(name.rsplit(".", 1)[-1] == "sinks" for name, _ in block.named_parameters()):
        found.append("attention sinks (a learned logit per head)")
    if (limit := config_float(config, "swiglu_limit")) is not None:
        found.append(f"a SwiGLU clamped at {limit:g}")
    return tuple(found)


def _latent_attention(config: Any, block: nn.Module | None) -> LatentAttention | None:
    """The sizes of a multi-latent attention, where the config states its key/value
    latent (DeepSeek-V2/V3's ``kv_lora_rank``), and whether ``block`` normalises the
    latents; None otherwise."""
    kv = config_int(config, "kv_lora_rank")
    sizes = [config_int(config, n) for n in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")]
    if kv is None or any(v is None for v in sizes):
        return None
    nope, rope, v = sizes
    names = [name for name, _ in block.named_modules()] if block is not None else []
    return LatentAttention(
        q_lora_rank=config_int(config, "q_lora_rank"),
        kv_lora_rank=kv,
        qk_head_dim=nope,
        qk_pos_emb_head_dim=rope,
        v_head_dim=v,
        latent_norms=any(name.endswith("kv_a_layernorm") for name in names),
    )


_GATES = ("gate_proj", "gate_up_proj")
"""Names of the gate projection of a gated (SwiGLU-style) MLP in transformers' decoders."""
_UNGATED_ACTS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast", "relu")
"""Activations that transformers' decoders use only in ungated MLPs."""


def _hf_architecture(config: Any, block: nn.Module) -> dict[str, Any]:
    """The architecture fields of a transformers decoder, read without knowing its family:
    the norm class and the gate and attention projections from a built block, the rest
    from the config's standard names. ``known_architecture`` only when every field was
    stated (no guess: an unstated one leaves the flags to the user, who is told)."""
    leaves = dict(block.named_modules())
    norms = {type(m).__name__ for m in leaves.values()}
    normalization = (
        "RMSNorm" if any(n.endswith("RMSNorm") for n in norms) else "LayerNorm" if "LayerNorm" in norms else None
    )
    act = next(
        (a for k in ("hidden_act", "hidden_activation", "activation_function") if (a := getattr(config, k, None))),
        None,
    )
    # a gate module, or a gate weight stacked over experts (Mixtral's experts in transformers 5)
    names = [*leaves, *(name for name, _ in block.named_parameters())]
    gated = True if any(name.rsplit(".", 1)[-1] in _GATES for name in names) else None
    if gated is None and act in _UNGATED_ACTS:
        gated = False
    rope = getattr(config, "rope_theta", None) or (getattr(config, "rope_parameters", None) or {}).get("rope_theta")
    learned = (
        config_int(config, "n_positions") is not None or getattr(config, "position_embedding_type", None) == "absolute"
    )
    query = next((m for name, m in leaves.items() if name.endswith(("q_proj", "c_attn"))), None)
    output = next((m for name, m in leaves.items() if name.endswith(_OUTPUT_PROJECTIONS)), query)
    fields = {
        "normalization": normalization,
        "norm_epsilon": next(
            (v for k in ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon") if (v := getattr(config, k, None))),
            None,
        ),
        "gated_mlp": gated,
        "rope_base": float(rope) if rope and not learned else None,
        "learned_positions": learned if learned or rope else None,
        "tied_embeddings": getattr(config, "tie_word_embeddings", None),
        "linear_bias": getattr(output, "bias", None) is not None if output is not None else None,
    }
    stated = all(v is not None for k, v in fields.items() if k != "rope_base")
    extra = {
        "qkv_bias": getattr(query, "bias", None) is not None if query is not None else None,
        "qk_norm": _qk_norm(leaves, query),
        "gated_activation": act if gated else None,
    }
    return {**fields, **extra, "known_architecture": stated}


_OUTPUT_PROJECTIONS = ("o_proj", "out_proj", "attn.c_proj", "attention.dense", "self_attention.dense")
"""Names of the attention's output projection in transformers' decoders (Llama's, OPT's,
GPT-2's, GPT-NeoX's, Falcon's)."""


def _qk_norm(leaves: dict[str, nn.Module], query: nn.Module | None) -> str:
    """How a block normalises its queries (and keys) before the attention: ``head``
    (a norm over one head's features), ``projection`` (over the whole query projection's
    output), ``none``."""
    norm = next((m for name, m in leaves.items() if name.endswith("q_norm")), None)
    if norm is None:
        return "none"
    width = getattr(norm, "weight", None)
    whole = getattr(query, "out_features", None)
    return "projection" if width is not None and whole is not None and width.numel() == whole else "head"


_YARN_FIELDS = ("mscale", "mscale_all_dim", "beta_fast", "beta_slow", "original_max_position_embeddings")


def _yarn(config: Any) -> tuple[tuple[str, float], ...]:
    """The numbers of a YaRN rope scaling the config states (:data:`_YARN_FIELDS`)."""
    scaling = getattr(config, "rope_scaling", None) or getattr(config, "rope_parameters", None) or {}
    if (scaling.get("rope_type") or scaling.get("type")) != "yarn":
        return ()
    return tuple(
        (name, float(scaling[name]))
        for name in _YARN_FIELDS
        if isinstance(scaling.get(name), (int, float)) and not isinstance(scaling.get(name), bool)
    )


def _rope_scaling(config: Any) -> tuple[str, float] | None:
    """The config's rope scaling as (type, factor); None without one (or a default one)."""
    scaling = getattr(config, "rope_scaling", None) or getattr(config, "rope_parameters", None) or {}
    kind = scaling.get("rope_type") or scaling.get("type")
    factor = scaling.get("factor")
    if not kind or kind == "default" or not isinstance(factor, (int, float)):
        return None
    return str(kind), float(factor)


def _rotary_percent(config: Any) -> float | None:
    """The fraction of each head rotary embeddings rotate, where the config states it
    (GPT-NeoX's ``rotary_pct``, ``partial_rotary_factor``, or that in transformers 5's
    ``rope_parameters``)."""
    stated = config_float(config, "partial_rotary_factor") or config_float(config, "rotary_pct")
    factor = (getattr(config, "rope_parameters", None) or {}).get("partial_rotary_factor")
    return stated or (float(factor) if isinstance(factor, (int, float)) else None)


def _block_class(model: nn.Module, plan: Plan) -> str | None:
    """The class name of the plan's first transformer block in ``model``."""
    block = _first_block(model, plan)
    return type(block).__name__ if block is not None else None


def _blocks(model: nn.Module, plan: Plan) -> list[nn.Module]:
    """The plan's transformer blocks in ``model``, in order (none where a name is not
    found)."""
    try:
        return [model.get_submodule(name) for name in blocks_of(plan).names]
    except AttributeError:
        return []


def _first_block(model: nn.Module, plan: Plan) -> nn.Module | None:
    """The plan's first transformer block in ``model``; None when it has none."""
    blocks = blocks_of(plan)
    if not blocks.count:
        return None
    try:
        return model.get_submodule(blocks.names[0])
    except AttributeError:
        return None
