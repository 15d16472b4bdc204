"""A plain MLP stack: input projection, residual MLP blocks, output projection.

Small enough to train on CPU in tests, and with the unit layout the runtime relies on
(blocks in an ``nn.ModuleDict``; ``inp``/``out`` may be ``None`` on a pipeline stage).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, kw_only=True)
class MLPConfig:
    """Sizes: inputs of ``in_dim`` features, ``n_layers`` blocks of width ``dim`` with a
    hidden layer of ``ffn_dim``, ``out_dim`` outputs. ``widths`` optionally overrides
    ``ffn_dim`` per block (a model whose layers differ)."""

    in_dim: int = 64
    dim: int = 256
    ffn_dim: int = 1024
    n_layers: int = 4
    out_dim: int = 16
    widths: tuple[int, ...] = ()


class MLPBlock(nn.Module):
    """``x + fc2(gelu(fc1(norm(x))))``."""

    def __init__(self, dim: int, ffn_dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class MLPStack(nn.Module):
    """Features ``(batch, in_dim)`` (or ``(batch, seq, in_dim)``) -> ``(..., out_dim)``."""

    def __init__(self, cfg: MLPConfig):
        super().__init__()
        self.config = cfg
        widths = cfg.widths or (cfg.ffn_dim,) * cfg.n_layers
        self.inp: nn.Linear | None = nn.Linear(cfg.in_dim, cfg.dim)
        self.layers = nn.ModuleDict({str(i): MLPBlock(cfg.dim, w) for i, w in enumerate(widths)})
        self.out: nn.Linear | None = nn.Linear(cfg.dim, cfg.out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x) if self.inp is not None else x
        for layer in self.layers.values():
            h = layer(h)
        return self.out(h) if self.out is not None else h
