"""Pipeline stages of transformers decoder-only LMs (GPT-2, Llama).

transformers' forward loops over every block of an ``nn.ModuleList``, so the generic
stage skeleton (blocks deleted from an ``nn.ModuleDict``, other units set to None) does
not run. For the families :func:`autopar.graph.decoders.decoder_parts` knows, a stage is
the same skeleton with the block list turned into an ``nn.ModuleDict`` of the kept blocks
under their original indices (so parameter names and checkpoint keys are those of the
whole model), and its ``forward`` replaced by the share of the model's forward it holds:
the embeddings on the first stage (GPT-2 adds learned positions and dropout), the
blocks with the causal mask (and, for Llama, the rotary position embeddings) that
transformers' own forward would pass them, then the final norm and the head on the
last stage. The mask and the positions come from ``transformers.masking_utils`` and the
model's own rotary module, as in ``GPT2Model.forward`` and ``LlamaModel.forward``
(transformers 5.x); the parity tests run each split against the unsplit model.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from autopar.graph.decoders import DecoderParts


def make_stage(
    stage: nn.Module, model: nn.Module, parts: DecoderParts, keep: tuple[str, ...], seq_len: int
) -> nn.Module:
    """Turn ``stage``, a skeleton copy of ``model`` (see ``autopar.runtime.pipeline.cut``),
    into a runnable stage holding the units in ``keep``, for sequences of ``seq_len``."""
    parent_name, _, attr = parts.blocks.rpartition(".")
    parent = stage.get_submodule(parent_name)
    kept = nn.ModuleDict({k: m for k, m in getattr(parent, attr).named_children() if f"{parts.blocks}.{k}" in keep})
    setattr(parent, attr, kept)
    rotary = RotaryOf(model.get_submodule(parts.rotary), stage.config) if parts.rotary else None
    stage.forward = types.MethodType(lambda self, x: _forward(self, x, parts, seq_len, rotary), stage)
    return stage


class RotaryOf:
    """The rotary embedding a stage's blocks need: the model's own module on the stage
    that holds it, else one built alike on the input's device (it holds only the
    frequencies computed from the config, no trained state)."""

    def __init__(self, template: nn.Module, config: Any):
        self._cls, self._config = type(template), config
        self._built: dict[torch.device, nn.Module] = {}

    def __call__(self, stage: nn.Module, parts: DecoderParts, shape: torch.Tensor, positions: torch.Tensor) -> Any:
        own = _find(stage, parts.rotary)
        if own is None:
            device = shape.device
            if device not in self._built:
                with torch.device(device):
                    self._built[device] = self._cls(config=self._config)
            own = self._built[device]
        return own(shape, positions)


def _find(root: nn.Module, fqn: str) -> nn.Module | None:
    module: Any = root
    for name in fqn.split("."):
        module = getattr(module, name, None)
        if module is None:
            return None
    return module


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _forward(
    stage: nn.Module, x: torch.Tensor, parts: DecoderParts, seq_len: int, rotary: RotaryOf | None
) -> torch.Tensor:
    from transformers.masking_utils import create_causal_mask

    device = _local(x).device
    positions = torch.arange(seq_len, device=device).unsqueeze(0)
    embed = _find(stage, parts.embeddings[0])
    if embed is not None:  # the first stage reads token ids
        hidden = embed(x)
        if parts.family == "gpt2":
            hidden = hidden + _find(stage, parts.embeddings[1])(positions)
            hidden = _find(stage, parts.dropout)(hidden)
    else:
        hidden = x
    local = _local(hidden)
    # the mask and rotary tables are for the whole sequence, whatever shard of it flows
    shape = torch.empty((local.shape[0], seq_len, 1), device=device, dtype=local.dtype)
    mask = create_causal_mask(
        config=stage.config, inputs_embeds=shape, attention_mask=None, cache=None, position_ids=positions
    )
    blocks = _find(stage, parts.blocks)
    if rotary is not None:
        cos_sin = rotary(stage, parts, shape, positions)
        for block in blocks.values():
            hidden = block(
                hidden, attention_mask=mask, position_embeddings=cos_sin, position_ids=positions, use_cache=False
            )
    else:
        for block in blocks.values():
            hidden = block(hidden, None, mask, None, use_cache=False, position_ids=positions)
    norm = _find(stage, parts.final_norm)
    if norm is not None:
        hidden = norm(hidden)
    head = _find(stage, parts.head)
    return head(hidden) if head is not None else hidden
