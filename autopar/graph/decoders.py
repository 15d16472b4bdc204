"""Which models the runtime can cut into pipeline stages.

A stage drops the units other stages hold; a container that renumbers its children
(``nn.ModuleList``, ``nn.Sequential``) would rename the parameters, and a forward that
loops over it cannot skip missing blocks (:func:`uncuttable_unit`, which both the
planner's ``LayerGraph.cuttable`` and the runtime's refusal use). transformers holds a
decoder's blocks that way; a decoder-only causal LM (:func:`decoder_blocks`) is cut by
running its own forward on every stage (:mod:`autopar.runtime.decoder_stages`), which
keeps the list whole, so it may be split too.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from autopar.quiet import quiet_imports


def decoder_blocks(model: nn.Module, units: Iterable[str]) -> str | None:
    """The FQN of the ``nn.ModuleList`` holding the blocks of ``model`` if it is a
    transformers decoder-only causal LM (a class transformers' own causal-LM registry
    lists, not an encoder-decoder) with its blocks in one list; None for any other
    model. That is the layout :mod:`autopar.runtime.decoder_stages` cuts."""
    if not type(model).__module__.startswith("transformers.") or not causal_lm_class(type(model).__name__):
        return None
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return None
    parents = {u.rpartition(".")[0] for u in units if isinstance(_parent(model, u), nn.ModuleList)}
    return parents.pop() if len(parents) == 1 else None


def causal_lm_class(name: str) -> bool:
    """Whether ``name`` is a class transformers' own causal-LM registry lists (a
    decoder-only language model with its head, as ``AutoModelForCausalLM`` builds);
    False for any other name, or without transformers."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        return False
    return name in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


def transformers_class(name: str) -> bool:
    """Whether transformers (if installed) exports a model class named ``name``."""
    with quiet_imports():  # looking the class up imports its module, and torchao with it
        try:
            import transformers
        except ImportError:
            return False
        return isinstance(getattr(transformers, name, None), type)


def uncuttable_unit(model: nn.Module, units: Iterable[str]) -> tuple[str, str] | None:
    """The first of ``units`` (module FQNs) that sits in a container which renumbers its
    children, with that container's type name; None when the runtime can cut ``model``
    between any of its units (a transformers decoder-only causal LM always can)."""
    units = list(units)
    if decoder_blocks(model, units) is not None:
        return None
    for unit in units:
        parent = _parent(model, unit)
        if isinstance(parent, (nn.ModuleList, nn.Sequential)):
            return unit, type(parent).__name__
    return None


def _parent(model: nn.Module, unit: str) -> nn.Module:
    parent_name = unit.rpartition(".")[0]
    return model.get_submodule(parent_name) if parent_name else model
