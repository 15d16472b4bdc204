"""Tiny transformers decoder-only causal LMs of ten families, each with fixed initial
values: what the pipeline and tensor-parallel parity tests cut and compare against one
process. Dropout is off; sliding windows (Mistral, Gemma-2) are shorter than the
sequence so that the masks the stages build are not plain causal ones."""

from __future__ import annotations

import torch
from parity import SEQ, VOCAB

transformers = __import__("pytest").importorskip("transformers")

LAYERS = 4
HIDDEN, FFN, HEADS, KV_HEADS = 32, 64, 4, 2
COMMON = dict(vocab_size=VOCAB, use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
DECODER = dict(
    hidden_size=HIDDEN,
    intermediate_size=FFN,
    num_hidden_layers=LAYERS,
    num_attention_heads=HEADS,
    num_key_value_heads=KV_HEADS,
    max_position_embeddings=SEQ,
    **COMMON,
)

CONFIGS = {
    "llama": lambda t: t.LlamaForCausalLM(t.LlamaConfig(**DECODER)),
    "mistral": lambda t: t.MistralForCausalLM(t.MistralConfig(sliding_window=SEQ // 2, **DECODER)),
    "qwen2": lambda t: t.Qwen2ForCausalLM(t.Qwen2Config(**DECODER)),
    "gemma2": lambda t: t.Gemma2ForCausalLM(
        t.Gemma2Config(
            head_dim=HIDDEN // HEADS, sliding_window=SEQ // 2, query_pre_attn_scalar=HIDDEN // HEADS, **DECODER
        )
    ),
    "phi3": lambda t: t.Phi3ForCausalLM(
        t.Phi3Config(original_max_position_embeddings=SEQ, resid_pdrop=0.0, embd_pdrop=0.0, **DECODER)
    ),
    "gpt_neox": lambda t: t.GPTNeoXForCausalLM(
        t.GPTNeoXConfig(
            hidden_size=HIDDEN,
            intermediate_size=FFN,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            max_position_embeddings=SEQ,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            **COMMON,
        )
    ),
    "falcon": lambda t: t.FalconForCausalLM(
        t.FalconConfig(
            hidden_size=HIDDEN,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            max_position_embeddings=SEQ,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            **COMMON,
        )
    ),
    "bloom": lambda t: t.BloomForCausalLM(
        t.BloomConfig(
            hidden_size=HIDDEN, n_layer=LAYERS, n_head=HEADS, hidden_dropout=0.0, attention_dropout=0.0, **COMMON
        )
    ),
    "opt": lambda t: t.OPTForCausalLM(
        t.OPTConfig(
            hidden_size=HIDDEN,
            ffn_dim=FFN,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            max_position_embeddings=SEQ,
            word_embed_proj_dim=HIDDEN,
            dropout=0.0,
            attention_dropout=0.0,
            layerdrop=0.0,
            **COMMON,
        )
    ),
    "gpt2": lambda t: t.GPT2LMHeadModel(
        t.GPT2Config(
            n_embd=HIDDEN,
            n_layer=LAYERS,
            n_head=HEADS,
            n_positions=SEQ,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            **COMMON,
        )
    ),
}
FAMILIES = tuple(CONFIGS)


def build_decoder(family: str) -> torch.nn.Module:
    """The family's tiny model, the same values on every call."""
    torch.manual_seed(0)
    return CONFIGS[family](transformers)


def build_opt(hidden: int, layers: int = 2) -> torch.nn.Module:
    """An OPT of ``hidden`` features (4 heads, a 4x MLP), wide enough for the planner to
    split it, the same values on every call. GELU, not OPT's ReLU: with thousands of
    units a pre-activation within rounding of zero flips ReLU's gradient under another
    summation order, moving a weight by far more than the parity tolerance."""
    torch.manual_seed(0)
    return transformers.OPTForCausalLM(
        transformers.OPTConfig(
            hidden_size=hidden,
            ffn_dim=4 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=HEADS,
            max_position_embeddings=SEQ,
            word_embed_proj_dim=hidden,
            activation_function="gelu",
            dropout=0.0,
            attention_dropout=0.0,
            layerdrop=0.0,
            **COMMON,
        )
    )


COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "fc1", "dense_h_to_4h", "c_attn", "c_fc")
ROW = ("o_proj", "out_proj", "down_proj", "fc2", "dense_4h_to_h", "c_proj")
FUSED_QKV = {"phi3", "gpt_neox", "falcon", "bloom"}
"""Families whose attention (and Phi-3's gated MLP) projects q, k and v (gate and up)
with one fused linear layer: a plain column split does not cut it by heads (only
GPT-2's Conv1D c_attn is split by heads, autopar.runtime.hf), so their tensor-parallel
cases shard the MLP, the embedding and the head and keep attention replicated."""


def megatron_styles(family: str, model: torch.nn.Module) -> dict[str, str]:
    """Megatron-LM's tensor-parallel layout in the family's module names: q, k, v and
    the MLP's first layers column-parallel, the output projections row-parallel, the
    token embedding vocabulary-parallel and the head column-parallel."""
    embedding = model.get_input_embeddings()
    styles = {}
    for name, module in model.named_modules():
        leaf = name.rpartition(".")[2]
        if module is embedding:
            styles[name] = "vocab"
        elif name == "lm_head":
            styles[name] = "column"
        elif family in FUSED_QKV and (".attention" in name or ".self_attn" in name or ".self_attention" in name):
            continue
        elif family == "phi3" and ".mlp." in name:
            continue
        elif leaf in COLUMN:
            styles[name] = "column"
        elif leaf in ROW:
            styles[name] = "row"
    return styles
