"""A reference GPT (GPT-2/GPT-3 style): learned positions, pre-LayerNorm, GELU MLP.

Written for autopar's tests, benchmarks and demo, with the layout the runtime relies on:
blocks live in an ``nn.ModuleDict`` keyed ``"0".."L-1"`` so a pipeline stage can drop
blocks and keep the original parameter names, every optional part (embeddings, final
norm, head) may be ``None`` on a stage, and attention infers its local head count from
the projection's output size so tensor parallelism can shard heads. The architecture is
Radford et al. 2019 (GPT-2) / Brown et al. 2020 (GPT-3) without dropout by default.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from autopar.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Sizes of a GPT. ``ffn_dim`` defaults to ``4 * dim``."""

    vocab_size: int = 50257
    seq_len: int = 1024
    dim: int = 768
    n_layers: int = 12
    n_heads: int = 12
    ffn_dim: int = 0
    dropout: float = 0.0
    tie_embeddings: bool = True
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "dim", "n_layers", "n_heads"):
            if getattr(self, name) < 1:
                raise ConfigError(f"GPTConfig.{name}={getattr(self, name)!r} must be >= 1.")
        if self.dim % self.n_heads:
            raise ConfigError(
                f"GPTConfig: dim={self.dim} is not divisible by n_heads={self.n_heads}; pick n_heads dividing dim."
            )
        if self.ffn_dim == 0:
            object.__setattr__(self, "ffn_dim", 4 * self.dim)

    @property
    def head_dim(self) -> int:
        """Dimension of one attention head."""
        return self.dim // self.n_heads


class Attention(nn.Module):
    """Causal multi-head self-attention through ``F.scaled_dot_product_attention``."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.dropout = cfg.dropout
        self.wq = nn.Linear(cfg.dim, cfg.dim)
        self.wk = nn.Linear(cfg.dim, cfg.dim)
        self.wv = nn.Linear(cfg.dim, cfg.dim)
        self.wo = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    """Two linear layers with GELU between them."""

    def __init__(self, dim: int, ffn_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, ffn_dim)
        self.w2 = nn.Linear(ffn_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.attention_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = MLP(cfg.dim, cfg.ffn_dim)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attention(self.attention_norm(x)))
        return x + self.dropout(self.feed_forward(self.ffn_norm(x)))


class GPT(nn.Module):
    """Token ids ``(batch, seq)`` -> logits ``(batch, seq, vocab)``."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_embeddings: nn.Embedding | None = nn.Embedding(cfg.seq_len, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.norm: nn.LayerNorm | None = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2L)."""
        if self.tok_embeddings is not None and self.tok_embeddings.weight.device.type == "meta":
            return
        std = 0.02
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                scale = (2 * self.config.n_layers) ** -0.5 if name.endswith(("wo.weight", "w2.weight")) else 1.0
                nn.init.normal_(p, mean=0.0, std=std * scale)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """``positions``: the positions of ``x``'s tokens (default ``0 .. s - 1``); a
        context-parallel rank holds a permuted part of the sequence."""
        if self.tok_embeddings is not None:
            pos = positions if positions is not None else torch.arange(x.shape[1], device=x.device)
            h = self.tok_embeddings(x)
            if self.pos_embeddings is not None:
                h = h + self.pos_embeddings(pos)
        else:
            h = x
        for layer in self.layers.values():
            h = layer(h)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h
