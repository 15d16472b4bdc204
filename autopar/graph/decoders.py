"""Which models the runtime can cut into pipeline stages, and where a transformers
decoder-only language model keeps its parts.

A stage drops the units other stages hold; a container that renumbers its children
(``nn.ModuleList``, ``nn.Sequential``) would rename the parameters, and a forward that
loops over it cannot skip missing blocks (:func:`uncuttable_unit`, which both the
planner's ``LayerGraph.cuttable`` and the runtime's refusal use). transformers holds its
blocks that way; for the families named here autopar knows the forward (embeddings,
blocks, final norm, head) and runs a stage's share of it itself
(:mod:`autopar.runtime.decoder_stages`), so they may be split too.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True, kw_only=True)
class DecoderParts:
    """Module FQNs of a decoder-only LM's parts, and which forward it runs.

    Attributes:
        family: ``"gpt2"`` (learned positions added to the token embeddings, dropout)
            or ``"llama"`` (rotary position embeddings passed to every block).
        embeddings: the token embedding, then (GPT-2) the position embedding.
        dropout: the embedding dropout (GPT-2), or "".
        blocks: the ``nn.ModuleList`` of blocks.
        final_norm: the norm after the last block.
        head: the output projection.
        rotary: the rotary embedding module (Llama), or "".
    """

    family: str
    embeddings: tuple[str, ...]
    dropout: str
    blocks: str
    final_norm: str
    head: str
    rotary: str


_GPT2 = DecoderParts(
    family="gpt2",
    embeddings=("transformer.wte", "transformer.wpe"),
    dropout="transformer.drop",
    blocks="transformer.h",
    final_norm="transformer.ln_f",
    head="lm_head",
    rotary="",
)
_LLAMA = DecoderParts(
    family="llama",
    embeddings=("model.embed_tokens",),
    dropout="",
    blocks="model.layers",
    final_norm="model.norm",
    head="lm_head",
    rotary="model.rotary_emb",
)
_FAMILIES = {"GPT2LMHeadModel": _GPT2, "LlamaForCausalLM": _LLAMA}


def decoder_parts(model: nn.Module) -> DecoderParts | None:
    """The parts of a transformers ``GPT2LMHeadModel`` or ``LlamaForCausalLM`` (None for
    any other model), checked against the module tree so a renamed layout is not
    mistaken for a known one."""
    parts = _FAMILIES.get(type(model).__name__)
    if parts is None or not type(model).__module__.startswith("transformers"):
        return None
    names = {name for name, _ in model.named_modules()}
    needed = [
        *parts.embeddings,
        parts.blocks,
        parts.final_norm,
        parts.head,
        *filter(None, (parts.dropout, parts.rotary)),
    ]
    if not all(n in names for n in needed) or not isinstance(model.get_submodule(parts.blocks), nn.ModuleList):
        return None
    return parts


def uncuttable_unit(model: nn.Module, units: Iterable[str]) -> tuple[str, str] | None:
    """The first of ``units`` (module FQNs) that sits in a container which renumbers its
    children, with that container's type name; None when the runtime can cut ``model``
    between any of its units (a known transformers decoder always can)."""
    if decoder_parts(model) is not None:
        return None
    for unit in units:
        parent_name = unit.rpartition(".")[0]
        parent = model.get_submodule(parent_name) if parent_name else model
        if isinstance(parent, (nn.ModuleList, nn.Sequential)):
            return unit, type(parent).__name__
    return None
