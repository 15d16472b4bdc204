"""Pipeline stages of a transformers decoder-only causal LM, run by the model's own forward.

transformers keeps a decoder's blocks in an ``nn.ModuleList`` and its forward loops over
all of them, so the generic stage skeleton (a dropped unit set to None, which autopar's
own models skip) cannot run it. One mechanism serves every such model, whatever its
family, because the stage runs the model's own forward whole:

- the block list keeps its length. A block another stage holds is replaced by a
  parameterless pass-through (:class:`_Elsewhere`), so the held blocks keep their index:
  their parameter names are the whole model's (checkpoints reshard across plans) and
  the per-layer index the forward reads (sliding-window layer types) is right;
- a dropped unit before the blocks is a stand-in: an embedding gives zeros of its
  output's shape, anything else passes its input on. The forward therefore builds the
  masks and the rotary or alibi position data from token ids of the full shape, as it
  does for the whole model; every stage has its own copy of the parameterless modules
  (rotary tables);
- on a stage after the first, the received hidden states replace the input of the
  first unit it holds, through a forward pre-hook on the module in that slot, the
  outermost (so a recompute wrapper checkpoints the received tensor) and the first to
  run (before FSDP's and tensor parallelism's own pre-hooks);
- on a stage before the last, the first pass-through after its blocks, or the stand-in
  of the first dropped unit after them, ends the forward and hands back the hidden
  states it was given; the final norm, the head and anything the model does to its
  logits (Gemma-2's soft-capping) run on the last stage only.

A pass-through returns its input as a one-tuple: loops that take ``outputs[0]`` of a
block (Falcon, BLOOM) get the tensor, loops that pass a block's output on get a tuple,
which the next pass-through unwraps and the first held block never sees (the pre-hook
replaces it).
"""

from __future__ import annotations

import copy
import functools
import types
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

_DUMMY_TOKEN = 0


class _Handoff(Exception):
    """Ends a stage's forward at the first unit after its share, carrying the hidden states."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__()
        self.hidden = hidden


def _first_tensor(args: tuple, kwargs: dict) -> Any:
    value = args[0] if args else kwargs.get("hidden_states", next(iter(kwargs.values()), None))
    return value[0] if isinstance(value, tuple) else value


class StandIn(nn.Module):
    """A parameterless module in the slot of a unit another stage holds: the runtime
    applies no tensor-parallel style or conversion to it."""


class _Elsewhere(StandIn):
    """A block held by another stage: passes its hidden states on, or, after this
    stage's share, ends the forward."""

    def __init__(self, ends_share: bool):
        super().__init__()
        self.ends_share = ends_share

    def forward(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor]:
        hidden = _first_tensor(args, kwargs)
        if self.ends_share:
            raise _Handoff(hidden)
        return (hidden,)


class _ZeroEmbedding(StandIn):
    """An embedding another stage holds: zeros of the shape it would give, in the dtype
    of the hidden states this stage received (what the embedding gave there: bf16 where
    mixed precision cast its weight, though the model was built in fp32), so the rotary
    tables the forward derives from them match the received states' dtype."""

    def __init__(self, dim: int, entry: _Entry):
        super().__init__()
        self.dim, self.entry = dim, entry

    def forward(self, ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.zeros((), dtype=self.entry.hidden.dtype, device=ids.device).expand(*ids.shape, self.dim)


class _PassOn(StandIn):
    """A non-block unit another stage holds: passes its input on before this stage's
    blocks, ends the forward after them."""

    def __init__(self, ends_share: bool):
        super().__init__()
        self.ends_share = ends_share

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        hidden = _first_tensor(args, kwargs)
        if self.ends_share:
            raise _Handoff(hidden)
        return hidden


class _Entry:
    """Where a later stage's received hidden states enter the model's forward: the
    input of the first unit it holds, replaced by a forward pre-hook registered at the
    first call (after tensor parallelism, recompute and FSDP have wrapped the slot)."""

    def __init__(self, fqn: str):
        self.fqn = fqn
        self.hidden: Any = None
        self._hooked = False

    def arm(self, stage: nn.Module, hidden: Any) -> None:
        if not self._hooked:
            stage.get_submodule(self.fqn).register_forward_pre_hook(self._replace, prepend=True, with_kwargs=True)
            self._hooked = True
        self.hidden = hidden

    def _replace(self, _module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        hidden, self.hidden = self.hidden, None
        if hidden is None:
            return None
        if args:
            return (hidden, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": hidden}


def make_stage(
    stage: nn.Module, model: nn.Module, blocks: str, units: tuple[str, ...], keep: tuple[str, ...], seq_len: int
) -> nn.Module:
    """Turn ``stage``, a skeleton copy of ``model`` whose dropped units are None (see
    ``autopar.runtime.pipeline.cut``), into a runnable stage holding the units in
    ``keep``, for sequences of ``seq_len`` (this rank's share under context parallelism);
    ``blocks`` is the FQN of the block list. Keywords bound to the stage's forward later
    (``position_ids``) reach the model's forward."""
    held = [i for i, u in enumerate(units) if u in keep]
    last = held[-1]
    entry = _Entry(units[held[0]]) if held[0] > 0 else None
    for i, unit in enumerate(units):
        if unit in keep:
            continue
        parent_name, _, child = unit.rpartition(".")
        parent = stage.get_submodule(parent_name) if parent_name else stage
        original = model.get_submodule(unit)
        after = i > last
        if parent_name == blocks:
            stand_in: nn.Module = _Elsewhere(ends_share=after)
        elif next(original.parameters(), None) is None:
            stand_in = _own_copy(original, model)  # parameterless (rotary tables, dropout): run on every stage
        elif isinstance(original, nn.Embedding) and not after:
            stand_in = _ZeroEmbedding(original.embedding_dim, entry)
        else:
            stand_in = _PassOn(ends_share=after)
        if parent_name == blocks:
            parent[int(child)] = stand_in
        else:
            setattr(parent, child, stand_in)
    stage.forward = types.MethodType(functools.partial(_forward, entry=entry, seq_len=seq_len), stage)
    return stage


def _own_copy(module: nn.Module, model: nn.Module) -> nn.Module:
    """This stage's copy of a parameterless module (hooks the stage registers stay its
    own). On the meta device its buffers have no values; transformers' rotary modules
    compute theirs from the config, so one is built anew (on the CPU, moved with the
    stage)."""
    if not any(b.is_meta for b in module.buffers()):
        return copy.deepcopy(module)
    try:
        with torch.device("cpu"):
            return type(module)(config=model.config)
    except TypeError:
        return copy.deepcopy(module)


def _forward(stage: nn.Module, x: torch.Tensor, *, entry: _Entry | None, seq_len: int, **kwargs: Any) -> Any:
    if entry is None:  # the stage holding the embeddings reads the token ids
        ids = x
    else:
        local = x.to_local() if isinstance(x, DTensor) else x
        ids = torch.full((local.shape[0], seq_len), _DUMMY_TOKEN, dtype=torch.long, device=local.device)
        entry.arm(stage, x)
    try:
        return type(stage).forward(stage, input_ids=ids, use_cache=False, **kwargs)
    except _Handoff as done:
        return done.hidden
    finally:
        if entry is not None:
            entry.hidden = None
