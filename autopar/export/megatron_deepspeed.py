"""A model's sizes and architecture as Megatron-DeepSpeed's command-line flags.

Megatron-DeepSpeed forked Megatron-LM before several of its flags were renamed: key-value
heads are ``--num-key-value-heads``, rotary embeddings ``--use-rotary-position-embeddings``
with an integer ``--rotary-position-embeddings-theta`` (and ``--no-position-embedding``: the
two are independent there, and learned positions are on by default), the norm ``--normalization
rmsnorm`` with ``--layernorm-epsilon``. It requires ``--num-layers``, ``--hidden-size``,
``--num-attention-heads`` and ``--max-position-embeddings`` (at least ``--seq-length``).
Its experts are DeepSpeed-MoE layers: softmax top-k gating over ``--num-experts`` copies
of the block's MLP on every ``--expert-interval``-th layer (every other one by default).
"""

from __future__ import annotations

from autopar.export.common import Blocks
from autopar.export.shape import ModelShape
from autopar.plan import Plan

REQUIRED_SIZES = ("--hidden-size", "--num-attention-heads", "--ffn-hidden-size", "--max-position-embeddings")


def model_args(plan: Plan, blocks: Blocks, shape: ModelShape | None, notes: list[str]) -> list[str]:
    """Layers and sequence length from the plan, the rest from ``shape`` when the caller
    gave the model; what the flags cannot build goes in ``notes``."""
    seq = plan.model.seq_len
    args = ["--num-layers", str(blocks.count)] if blocks.count else []
    args += ["--seq-length", str(seq)]
    if shape is None or shape.hidden_size is None:
        notes.append(
            f"the plan does not record the model's sizes, which Megatron-DeepSpeed requires: add "
            f"{', '.join(REQUIRED_SIZES)} (autopar export --model NAME or --model-config PATH fills them)"
        )
        return args
    sizes = (shape.hidden_size, shape.num_attention_heads, shape.ffn_hidden_size)
    args += [w for flag, value in zip(REQUIRED_SIZES, sizes) if value is not None for w in (flag, str(value))]
    # required, and asserted to cover the sequence
    args += ["--max-position-embeddings", str(max(shape.max_position_embeddings or 0, seq))]
    if shape.num_kv_heads is not None and shape.num_attention_heads not in (None, shape.num_kv_heads):
        args += ["--num-key-value-heads", str(shape.num_kv_heads)]
    heads, hidden = shape.num_attention_heads, shape.hidden_size
    if shape.head_dim is not None and heads and shape.head_dim * heads != hidden:
        args += ["--kv-channels", str(shape.head_dim)]
    args += _experts_args(shape, notes)
    unbuilt = _unbuilt(shape)
    if unbuilt:
        notes.append(f"Megatron-DeepSpeed's flags do not build the model's {', '.join(unbuilt)}")
    if not shape.known_architecture:
        notes.append(
            "add the architecture flags (--normalization, --swiglu, --use-rotary-position-embeddings, "
            "--untie-embeddings-and-output-weights, --disable-bias-linear) that match the model"
        )
        return args
    if shape.normalization == "RMSNorm":
        args += ["--normalization", "rmsnorm"]
    if shape.norm_epsilon is not None:
        args += ["--layernorm-epsilon", f"{shape.norm_epsilon:g}"]
    if shape.gated_mlp and shape.gated_activation in (None, "silu", "swish"):
        args.append("--swiglu")
    if shape.rope_base is not None:
        args += ["--use-rotary-position-embeddings", "--rotary-position-embeddings-theta", str(int(shape.rope_base))]
        args.append("--no-position-embedding")  # else its Embedding adds a learned position table besides
        if shape.rotary_percent is not None and shape.rotary_percent < 1:
            args += ["--rotary-percent", f"{shape.rotary_percent:g}"]
    if shape.tied_embeddings is False:
        args.append("--untie-embeddings-and-output-weights")
    if shape.linear_bias is False:
        args.append("--disable-bias-linear")
    return args


def _experts_args(shape: ModelShape, notes: list[str]) -> list[str]:
    """DeepSpeed-MoE's flags for the model's routed experts (the plan runs them without
    expert parallelism: ``ep > 1`` under Megatron-DeepSpeed is refused before this)."""
    experts = shape.experts
    if experts is None:
        return []
    args = ["--num-experts", str(experts.count), "--topk", str(experts.top_k)]
    if experts.top_k == 2:  # DeepSpeed-MoE samples the second expert with noise unless told
        args.append("--disable-moe-top2-2nd-expert-sampling")
    holds = experts.layers
    interval = 1 if holds is None else _interval(holds)
    if interval is None:
        held = ", ".join(str(i) for i, h in enumerate(holds or ()) if h)
        notes.append(
            f"the model's experts sit on blocks {held}, which no --expert-interval (every N-th layer) selects: "
            f"wrote every layer (more expert parameters than the model has)"
        )
        interval = 1
    args += ["--expert-interval", str(interval), "--create-moe-param-group"]
    if experts.capacity_factor is None:
        args.append("--disable-moe-token-dropping")
    else:
        args += ["--moe-train-capacity-factor", f"{experts.capacity_factor:g}"]
        notes.append(
            "DeepSpeed-MoE counts an expert's capacity over a rank's micro-batch (capacity factor x tokens x top-k / "
            "experts, at least --moe-min-capacity, 4 by default), the plan's model per sample: the same slots in all, "
            "but a token is dropped when its expert's micro-batch buffer is full rather than its sample's"
        )
    if experts.ffn_hidden_size is not None and experts.ffn_hidden_size != shape.ffn_hidden_size:
        notes.append(
            f"DeepSpeed-MoE copies the block's MLP (--ffn-hidden-size {shape.ffn_hidden_size}) as each expert; the "
            f"model's experts are {experts.ffn_hidden_size} wide"
        )
    return args


def _interval(holds: tuple[bool, ...]) -> int | None:
    """N when the blocks holding experts are every N-th counting from 1 (DeepSpeed-MoE's
    ``layer_num % N == 0``), else None."""
    for every in range(1, len(holds) + 1):
        if all(held == ((i + 1) % every == 0) for i, held in enumerate(holds)):
            return every
    return None


def _unbuilt(shape: ModelShape) -> list[str]:
    """What of the model's architecture Megatron-DeepSpeed has no flag for."""
    unbuilt = list(shape.unwritten)
    if shape.latent_attention is not None:
        unbuilt.append("multi-latent attention")
    if shape.qk_norm not in (None, "none"):
        unbuilt.append("normalised queries and keys")
    if shape.qkv_bias and shape.linear_bias is False:
        unbuilt.append("query, key and value biases (without the other linear biases)")
    if shape.gated_mlp and shape.gated_activation not in (None, "silu", "swish"):
        unbuilt.append(f"gated MLP with {shape.gated_activation} (--swiglu is SiLU's)")
    if shape.rope_scaling is not None:
        unbuilt.append(f"{shape.rope_scaling[0]} rope scaling")
    experts = shape.experts
    if experts is not None:
        if experts.shared_ffn_hidden_size is not None:
            unbuilt.append("shared experts")
        if experts.score_function not in (None, "softmax") or experts.expert_bias or experts.groups:
            unbuilt.append("router (DeepSpeed-MoE gates with a softmax over all experts)")
    return unbuilt
