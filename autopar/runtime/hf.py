"""Tensor-parallel styles for layers of Hugging Face transformers (placeholder)."""

from __future__ import annotations

from torch import nn

from autopar.runtime.layouts import LeafLayout


def styles_for(module: nn.Module, leaf: LeafLayout) -> list | None:
    """Styles for a transformers layer, or None for ordinary PyTorch layers."""
    return None
