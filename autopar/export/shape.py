"""The model's sizes and architecture, for the frameworks that build the model from
flags (Megatron-LM) or wrap its blocks by class (Accelerate's FSDP).

A plan records the model's units, parameter count and fingerprint, not its hidden size
or head count. When the caller passes the model the plan was made for, its config gives
them: autopar's own GPT and Llama (every registry model), or any Hugging Face model
(sizes only: its architecture flags vary too much to guess).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from autopar.export.common import ExportError, blocks_of
from autopar.graph.units import model_fingerprint
from autopar.models.gpt import GPTConfig
from autopar.models.llama import LlamaConfig
from autopar.plan import Plan


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
        linear_bias: the attention and MLP projections have biases.
        norm_epsilon: the norms' epsilon.
        block_class: class name of one transformer block (what FSDP wraps).
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
    norm_epsilon: float | None = None
    block_class: str | None = None
    known_architecture: bool = False


def shape_of(model: nn.Module, plan: Plan) -> ModelShape:
    """The shape of ``model``, which must be the model ``plan`` was made for (same
    parameter names and shapes); an ExportError otherwise."""
    found = model_fingerprint(model)
    if found != plan.model.fingerprint:
        raise ExportError(
            f"the model given ({type(model).__name__}, fingerprint {found}) is not the one the plan was made for "
            f"({plan.model.name}, fingerprint {plan.model.fingerprint}); pass the plan's model, or none."
        )
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
            rope_base=config.rope_theta,
            learned_positions=False,
            tied_embeddings=False,
            linear_bias=False,
            norm_epsilon=config.norm_eps,
            block_class=block_class,
            known_architecture=True,
        )
    return _hf_shape(config, block_class)


def _hf_shape(config: Any, block_class: str | None) -> ModelShape:
    """Sizes from a Hugging Face config's standard attribute names (``attribute_map``
    lets GPT-2's ``n_embd`` answer to ``hidden_size``)."""
    if config is None:
        return ModelShape(block_class=block_class)
    heads = _int(config, "num_attention_heads")
    return ModelShape(
        hidden_size=_int(config, "hidden_size"),
        num_attention_heads=heads,
        num_kv_heads=_int(config, "num_key_value_heads") or heads,
        ffn_hidden_size=_int(config, "intermediate_size"),
        vocab_size=_int(config, "vocab_size"),
        max_position_embeddings=_int(config, "max_position_embeddings"),
        block_class=block_class,
    )


def _int(config: Any, name: str) -> int | None:
    value = getattr(config, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _block_class(model: nn.Module, plan: Plan) -> str | None:
    """The class name of the plan's first transformer block in ``model``."""
    blocks = blocks_of(plan)
    if not blocks.count:
        return None
    try:
        return type(model.get_submodule(blocks.names[0])).__name__
    except AttributeError:
        return None
