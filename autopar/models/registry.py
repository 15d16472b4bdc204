"""Named model configurations for the CLI (``--model gpt3-175b``) and the benchmarks.

Sizes follow the papers that introduced them: GPT-2 (Radford et al. 2019), GPT-3
(Brown et al. 2020, table 2.1), the 530B and 1T GPTs of Narayanan et al. 2021
(table 1), Llama 2 (Touvron et al. 2023) and Llama 3 (Dubey et al. 2024), Mixtral 8x7B
(Jiang et al. 2024, table 1), BERT-large (Devlin et al. 2019).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from autopar.errors import ConfigError
from autopar.models.cnn import CNNConfig, ResNet
from autopar.models.gpt import GPT, GPTConfig
from autopar.models.llama import Llama, LlamaConfig
from autopar.models.mlp import MLPConfig, MLPStack
from autopar.models.moe import MoEConfig, MoELlama
from autopar.quiet import quiet_imports


@dataclass(frozen=True, kw_only=True)
class NamedModel:
    """A registered model: how to build it and what it eats.

    ``input_kind``: ``tokens`` (``(batch, seq)`` ids; plan with ``seq_len``),
    ``features`` (``(batch, in_dim)``) or ``image`` (``(batch, C, H, W)``).
    """

    name: str
    description: str
    build: Callable[[], nn.Module]
    input_kind: Literal["tokens", "features", "image"]
    seq_len: int = 0
    sample_shape: tuple[int, ...] = ()

    def sample_input(self, batch: int = 1, device: str | torch.device = "meta") -> torch.Tensor:
        """A sample batch for non-token models."""
        if self.input_kind == "tokens":
            return torch.zeros(batch, self.seq_len, dtype=torch.long, device=device)
        return torch.zeros(batch, *self.sample_shape, device=device)


def _gpt(name: str, desc: str, *, dim: int, layers: int, heads: int, seq: int = 2048, vocab: int = 50257) -> NamedModel:
    cfg = GPTConfig(vocab_size=vocab, seq_len=seq, dim=dim, n_layers=layers, n_heads=heads)
    return NamedModel(name=name, description=desc, build=lambda: GPT(cfg), input_kind="tokens", seq_len=seq)


def _llama(
    name: str, desc: str, *, dim: int, layers: int, heads: int, kv: int, ffn: int, vocab: int, seq: int, theta: float
) -> NamedModel:
    cfg = LlamaConfig(
        vocab_size=vocab,
        seq_len=seq,
        dim=dim,
        n_layers=layers,
        n_heads=heads,
        n_kv_heads=kv,
        ffn_dim=ffn,
        rope_theta=theta,
    )
    return NamedModel(name=name, description=desc, build=lambda: Llama(cfg), input_kind="tokens", seq_len=seq)


def _moe(
    name: str,
    desc: str,
    *,
    dim: int,
    layers: int,
    heads: int,
    kv: int,
    ffn: int,
    experts: int,
    top_k: int,
    vocab: int,
    seq: int,
    theta: float,
) -> NamedModel:
    cfg = MoEConfig(
        vocab_size=vocab,
        seq_len=seq,
        dim=dim,
        n_layers=layers,
        n_heads=heads,
        n_kv_heads=kv,
        ffn_dim=ffn,
        rope_theta=theta,
        n_experts=experts,
        top_k=top_k,
    )
    return NamedModel(name=name, description=desc, build=lambda: MoELlama(cfg), input_kind="tokens", seq_len=seq)


def _bert_large() -> nn.Module:
    """BERT-large from transformers, built with its optional imports' load-time logs held
    back (:func:`autopar.quiet.quiet_imports`)."""
    with quiet_imports():
        return _build_bert_large()


def _build_bert_large() -> nn.Module:
    try:
        from transformers import BertConfig, BertForMaskedLM
    except ImportError:
        raise ConfigError(
            "model 'bert-large' is built with Hugging Face transformers, which is not installed: "
            "pip install 'autopar[hf]'."
        ) from None
    return BertForMaskedLM(
        BertConfig(
            hidden_size=1024,
            num_hidden_layers=24,
            num_attention_heads=16,
            intermediate_size=4096,
            max_position_embeddings=512,
            vocab_size=30522,
        )
    )


def _registry() -> dict[str, NamedModel]:
    models = [
        _gpt("gpt2-small", "GPT-2 124M", dim=768, layers=12, heads=12, seq=1024),
        _gpt("gpt2-medium", "GPT-2 350M", dim=1024, layers=24, heads=16, seq=1024),
        _gpt("gpt2-large", "GPT-2 774M", dim=1280, layers=36, heads=20, seq=1024),
        _gpt("gpt2-xl", "GPT-2 1.5B", dim=1600, layers=48, heads=25, seq=1024),
        _gpt("gpt3-1.3b", "GPT-3 XL 1.3B", dim=2048, layers=24, heads=16),
        _gpt("gpt3-2.7b", "GPT-3 2.7B", dim=2560, layers=32, heads=32),
        _gpt("gpt3-6.7b", "GPT-3 6.7B", dim=4096, layers=32, heads=32),
        _gpt("gpt3-13b", "GPT-3 13B", dim=5120, layers=40, heads=40),
        _gpt("gpt3-175b", "GPT-3 175B", dim=12288, layers=96, heads=96, vocab=51200),
        _gpt("gpt-530b", "530B GPT (Megatron-Turing NLG shape)", dim=20480, layers=105, heads=128, vocab=51200),
        _gpt("gpt-1t", "1T GPT (Narayanan et al. 2021)", dim=25600, layers=128, heads=160, vocab=51200),
        _llama(
            "llama2-7b", "Llama 2 7B", dim=4096, layers=32, heads=32, kv=32, ffn=11008, vocab=32000, seq=4096, theta=1e4
        ),
        _llama(
            "llama2-70b",
            "Llama 2 70B",
            dim=8192,
            layers=80,
            heads=64,
            kv=8,
            ffn=28672,
            vocab=32000,
            seq=4096,
            theta=1e4,
        ),
        _llama(
            "llama3-8b", "Llama 3 8B", dim=4096, layers=32, heads=32, kv=8, ffn=14336, vocab=128256, seq=8192, theta=5e5
        ),
        _llama(
            "llama3.1-8b",
            "Llama 3.1 8B: Llama 3 8B's shape at its 128K-token context",
            dim=4096,
            layers=32,
            heads=32,
            kv=8,
            ffn=14336,
            vocab=128256,
            seq=131072,
            theta=5e5,
        ),
        _llama(
            "llama3-70b",
            "Llama 3 70B",
            dim=8192,
            layers=80,
            heads=64,
            kv=8,
            ffn=28672,
            vocab=128256,
            seq=8192,
            theta=5e5,
        ),
        _llama(
            "llama3-405b",
            "Llama 3 405B",
            dim=16384,
            layers=126,
            heads=128,
            kv=8,
            ffn=53248,
            vocab=128256,
            seq=8192,
            theta=5e5,
        ),
        _moe(
            "moe-tiny",
            "Mixture-of-experts Llama, 4 layers of 8 experts (top-2) of width 128",
            dim=64,
            layers=4,
            heads=4,
            kv=2,
            ffn=128,
            experts=8,
            top_k=2,
            vocab=256,
            seq=128,
            theta=1e4,
        ),
        _moe(
            "mixtral-8x7b",
            "Mixtral 8x7B shape (46.7B parameters, 12.9B active): 8 experts, top-2",
            dim=4096,
            layers=32,
            heads=32,
            kv=8,
            ffn=14336,
            experts=8,
            top_k=2,
            vocab=32000,
            seq=32768,
            theta=1e6,
        ),
        _moe(
            "mixtral-8x22b",
            "Mixtral 8x22B shape (141B parameters, 39B active): 8 experts, top-2",
            dim=6144,
            layers=56,
            heads=48,
            kv=8,
            ffn=16384,
            experts=8,
            top_k=2,
            vocab=32768,
            seq=65536,
            theta=1e6,
        ),
        NamedModel(
            name="bert-large",
            description="BERT-large 340M (Hugging Face transformers)",
            build=_bert_large,
            input_kind="tokens",
            seq_len=512,
        ),
        NamedModel(
            name="mlp-wide",
            description="MLP stack, 8 blocks of width 8192",
            input_kind="features",
            build=lambda: MLPStack(MLPConfig(in_dim=1024, dim=8192, ffn_dim=32768, n_layers=8, out_dim=1024)),
            sample_shape=(1024,),
        ),
        NamedModel(
            name="resnet-small",
            description="ResNet-style CNN, 3 stages, 224x224 images",
            input_kind="image",
            sample_shape=(3, 224, 224),
            build=lambda: ResNet(CNNConfig(image_size=224, width=64, stages=4, blocks_per_stage=2, num_classes=1000)),
        ),
    ]
    return {m.name: m for m in models}


def named_models() -> dict[str, NamedModel]:
    """Every registered model by name."""
    return _registry()


OTHER_SOURCES = "--model-config (a transformers config JSON) or --model-fn module:function"
"""The other ways the command lines that take ``--model`` take a model."""


def get_named_model(name: str, *, others: str = OTHER_SOURCES) -> NamedModel:
    """The registered model ``name``, or a ConfigError listing the known names and
    ``others``, the command line's other ways to give a model."""
    reg = _registry()
    if name not in reg:
        raise ConfigError(f"unknown model {name!r}; known models: {', '.join(reg)}. Or use {others}.")
    return reg[name]


def build_named_model(name: str, device: str | torch.device = "meta", *, others: str = OTHER_SOURCES) -> nn.Module:
    """Build registered model ``name`` on ``device`` (meta by default: no memory);
    ``others`` as :func:`get_named_model` takes it."""
    entry = get_named_model(name, others=others)
    with torch.device(device):
        return entry.build()
