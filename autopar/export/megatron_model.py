"""The model's architecture as Megatron-LM flags: its sizes, norms, positions and attention
(multi-latent attention and its YaRN scaling among them), and what a mixture-of-experts
router does beyond the expert count (shared experts, dense blocks, score function, groups).
Megatron-LM builds the model from these flags, so what a flag cannot express is said in a
note rather than left to build another model in silence."""

from __future__ import annotations

import itertools

from autopar.export.common import Blocks
from autopar.export.experts_shape import Experts
from autopar.export.shape import ModelShape
from autopar.plan import Plan


def router_args(experts: Experts, notes: list[str]) -> list[str]:
    """Shared experts (gated or not), the blocks holding experts (``--moe-layer-freq`` as
    the pattern Megatron-LM evaluates, ``([0]*3+[1]*58)``: 1 a mixture-of-experts block),
    top-k weights left as the softmax over every expert (``--moe-router-pre-softmax``;
    Megatron renormalises them by default), and a sigmoid, biased, grouped or scaled
    router, as the model states them."""
    args = []
    if experts.shared_ffn_hidden_size is not None:
        args += ["--moe-shared-expert-intermediate-size", str(experts.shared_ffn_hidden_size)]
        if experts.shared_gate:
            args.append("--moe-shared-expert-gate")
    if not experts.renormalized and experts.top_k > 1 and experts.score_function == "softmax":
        args.append("--moe-router-pre-softmax")  # the softmax over all experts, not renormalised over the top-k
    if experts.layers is not None:
        runs = [(held, len(list(group))) for held, group in itertools.groupby(experts.layers)]
        args += ["--moe-layer-freq", "(" + "+".join(f"[{int(held)}]*{n}" for held, n in runs) + ")"]
    if experts.score_function != "softmax":
        args += ["--moe-router-score-function", experts.score_function]
        if not experts.renormalized and experts.top_k > 1:
            notes.append(
                "Megatron-LM renormalises a sigmoid router's top-k weights to sum to 1; the model leaves them as "
                "they are (norm_topk_prob false), which no flag selects"
            )
    if experts.expert_bias:
        args.append("--moe-router-enable-expert-bias")
    if experts.probs_on_input:
        args.append("--moe-apply-probs-on-input")
    if experts.groups is not None:
        args += ["--moe-router-num-groups", str(experts.groups[0]), "--moe-router-group-topk", str(experts.groups[1])]
        if experts.groups_by_best:
            notes.append(
                "Megatron-LM ranks a router's expert groups by the sum of their top experts' scores (DeepSeek-V3's "
                "rule); the model ranks them by their best expert (DeepSeek-V2's group_limited_greedy), which no "
                "flag selects"
            )
    if experts.scaling_factor is not None:
        args += ["--moe-router-topk-scaling-factor", f"{experts.scaling_factor:g}"]
    return args


def model_args(plan: Plan, blocks: Blocks, shape: ModelShape | None, info: list[str], notes: list[str]) -> list[str]:
    """The model's sizes: layers and sequence length from the plan, the rest from
    ``shape`` when the caller gave the model."""
    args = ["--seq-length", str(plan.model.seq_len)]
    if blocks.count:
        args = ["--num-layers", str(blocks.count), *args]
    if shape is None or shape.hidden_size is None:
        info.append(
            "the plan does not record the model's sizes: add --hidden-size, --num-attention-heads, "
            "--ffn-hidden-size, --max-position-embeddings (autopar export --model NAME or --model-config PATH "
            "fills them)"
        )
        return args
    sizes = {
        "--hidden-size": shape.hidden_size,
        "--num-attention-heads": shape.num_attention_heads,
        "--ffn-hidden-size": shape.ffn_hidden_size,
        "--max-position-embeddings": shape.max_position_embeddings,
    }
    args += [word for flag, value in sizes.items() if value is not None for word in (flag, str(value))]
    if shape.num_kv_heads is not None and shape.num_attention_heads not in (None, shape.num_kv_heads):
        args += ["--group-query-attention", "--num-query-groups", str(shape.num_kv_heads)]
    args += _attention_args(shape, info)
    if shape.unwritten:
        notes.append(
            f"the model has {', '.join(shape.unwritten)}, which these flags do not build: add them in a model spec "
            f"(Megatron-LM's --window-size and --window-attn-skip-freq, softmax_type, activation_func_clamp_value)"
        )
    geglu = bool(shape.gated_mlp) and shape.gated_activation not in (None, "silu", "swish")
    if geglu:
        info.append(
            f"the model's gated MLP multiplies by {shape.gated_activation} (GeGLU, not SwiGLU), which no "
            f"Megatron-LM flag selects (--swiglu is SiLU's): give the activation in a model spec"
        )
    if not shape.known_architecture:
        info.append(
            "add the architecture flags (--normalization, --swiglu, --position-embedding-type, "
            "--untie-embeddings-and-output-weights, --disable-bias-linear) that match the model"
        )
        return args
    if shape.normalization == "RMSNorm":
        args += ["--normalization", "RMSNorm"]
    if shape.norm_epsilon is not None:
        args += ["--norm-epsilon", f"{shape.norm_epsilon:g}"]
    if shape.gated_mlp and not geglu:
        args.append("--swiglu")
    if shape.rope_base is not None:
        args += ["--position-embedding-type", "rope", "--rotary-base", str(int(shape.rope_base))]
        args += _rope_args(shape, info)
    if shape.tied_embeddings is False:
        args.append("--untie-embeddings-and-output-weights")
    if shape.linear_bias is False:
        args.append("--disable-bias-linear")
        if shape.qkv_bias:
            args.append("--add-qkv-bias")
    return args


def _rope_args(shape: ModelShape, info: list[str]) -> list[str]:
    """Partial rotary embeddings and Llama 3's rope scaling; another scaling is said."""
    args = []
    if shape.rotary_percent is not None and shape.rotary_percent != 1.0:
        args += ["--rotary-percent", f"{shape.rotary_percent:g}"]
    if shape.rope_scaling is not None:
        kind, factor = shape.rope_scaling
        if kind == "llama3":
            args += ["--use-rope-scaling", "--rope-scaling-factor", f"{factor:g}"]
        elif kind == "yarn" and shape.latent_attention is not None:
            args += _yarn_args(factor, dict(shape.yarn), info)
        else:
            info.append(
                f"the model scales its rotary embeddings ({kind}, factor {factor:g}), which Megatron-LM's flags "
                f"express only for Llama 3's scaling: set it in the model's config"
            )
    return args


MLA_YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0, "original_max_position_embeddings": 4096.0}
"""What Megatron-LM's multi-latent attention takes for YaRN's numbers it has no flag for
(``MLATransformerConfig``, core_v0.16.1)."""


def _yarn_args(factor: float, yarn: dict[str, float], info: list[str]) -> list[str]:
    """A multi-latent attention's YaRN scaling (DeepSeek-V2/V3): its factor and softmax
    scales as flags; the numbers without one said where they differ from Megatron's."""
    args = ["--rope-type", "yarn", "--rotary-scaling-factor", f"{factor:g}"]
    for name in ("mscale", "mscale_all_dim"):
        if name in yarn:
            args += [f"--{name.replace('_', '-')}", f"{yarn[name]:g}"]
    differ = [f"{k}={yarn[k]:g}" for k, v in MLA_YARN_DEFAULTS.items() if k in yarn and yarn[k] != v]
    if differ:
        info.append(
            f"the model's YaRN scaling states {', '.join(differ)}, which Megatron-LM's flags do not set (its "
            f"multi-latent attention takes {', '.join(f'{k}={v:g}' for k, v in MLA_YARN_DEFAULTS.items())}): "
            f"set them in the model's config"
        )
    return args


def _attention_args(shape: ModelShape, info: list[str]) -> list[str]:
    """Multi-latent attention's sizes, else the head width where it is not ``hidden /
    heads``; and normalised queries and keys (a latent attention's latents)."""
    latent = shape.latent_attention
    if latent is not None:
        args = ["--multi-latent-attention"]
        if latent.q_lora_rank is not None:
            args += ["--q-lora-rank", str(latent.q_lora_rank)]
        args += ["--kv-lora-rank", str(latent.kv_lora_rank), "--qk-head-dim", str(latent.qk_head_dim)]
        args += ["--qk-pos-emb-head-dim", str(latent.qk_pos_emb_head_dim), "--v-head-dim", str(latent.v_head_dim)]
        return args + (["--qk-layernorm"] if latent.latent_norms else [])
    args = []
    heads, hidden = shape.num_attention_heads, shape.hidden_size
    if shape.head_dim is not None and heads and hidden and shape.head_dim * heads != hidden:
        args += ["--kv-channels", str(shape.head_dim)]
    if shape.qk_norm == "head":
        args.append("--qk-layernorm")
    elif shape.qk_norm == "projection":
        info.append(
            "the model normalises queries and keys over the whole projection (OLMo 2), Megatron-LM's "
            "--qk-layernorm over each head: give the norm in a model spec"
        )
    return args
