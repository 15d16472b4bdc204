"""Run one unit of a model (forward and backward) on its own, with real tensors.

``autopar.graph`` splits a model into units: what runs before the first block
(embeddings), each block, and what runs after the last block (final norm, head, loss).
Identical blocks cost the same, so each distinct unit is run once, in isolation:

- a block is called with the inputs it received in a real forward (captured once);
- the prologue is the model's forward up to the first block, where a hook stops it;
- the epilogue is the model's forward with every block short-circuited to return a
  cached output (the last one a fresh leaf tensor), so only the code after the last
  block, and the loss, do work (the same trick ``autopar.graph`` plays on fake tensors).

A runner calls ``lap.begin(phase)`` and ``lap.end(phase)`` around exactly the unit's
forward and backward, so one runner serves the clock, the FLOP counter and the memory
probe alike. Runners whose unit is one call (a block, a model without blocks) can also
run it ``recompute=True``: under the non-reentrant checkpoint that full recomputation
wraps a unit in (``autopar.runtime.recompute``), so the backward includes the rerun
forward, as in training.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.checkpoint import checkpoint

from profiler.errors import MeasurementError

Phase = Literal["fwd", "bwd"]


class Lap(Protocol):
    """Watches one forward and one backward."""

    def begin(self, phase: Phase) -> None:
        """Called right before the phase's work."""

    def end(self, phase: Phase) -> None:
        """Called right after the phase's work."""


class _Stop(Exception):
    """Raised by a hook to end a forward early, carrying the block's inputs."""

    def __init__(self, args: tuple, kwargs: dict):
        super().__init__("forward stopped at the first block")
        self.args, self.kwargs = args, kwargs


def tensors(tree: Any) -> list[torch.Tensor]:
    """Every tensor in a nested structure."""
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _shapes(args: tuple, kwargs: dict) -> tuple:
    return tuple((tuple(t.shape), t.dtype) for t in tensors((args, kwargs)))


def _clear_grads(module: nn.Module, inputs: list[torch.Tensor]) -> None:
    for p in module.parameters():
        p.grad = None
    for t in inputs:
        t.grad = None


def _backward(outputs: Any, grads: list[torch.Tensor] | None) -> None:
    outs = [t for t in tensors(outputs) if t.requires_grad]
    if not outs:
        return
    if grads is None:
        torch.autograd.backward(outs)
    else:
        torch.autograd.backward(outs, grads[: len(outs)])


def backward_lap(lap: Lap, outputs: Any, grads: list[torch.Tensor] | None) -> None:
    """The backward phase: ``outputs`` with ``grads`` (None: a scalar loss)."""
    lap.begin("bwd")
    _backward(outputs, grads)
    lap.end("bwd")


def _call(fn: Callable[..., Any], args: tuple, kwargs: dict, recompute: bool) -> Any:
    """``fn(*args, **kwargs)``, under a non-reentrant checkpoint with ``recompute``."""
    if recompute:
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)
    return fn(*args, **kwargs)


def output_grads(outputs: Any) -> list[torch.Tensor]:
    """Fixed random gradients for the outputs that need one (drawn once, reused)."""
    return [torch.randn_like(t) for t in tensors(outputs) if t.requires_grad]


@dataclass
class Captured:
    """What a forward of the whole model recorded: each distinct block's inputs (with
    which of them needed gradients) and each distinct block's output (as a leaf)."""

    inputs: dict[str, tuple[tuple, dict, tuple[bool, ...]]]
    outputs: dict[tuple, Any]


class ShortCircuit:
    """Replaces blocks' ``forward`` so that repeated blocks return a cached output.

    ``key_of[fqn]`` identifies identical blocks (``autopar.graph``'s profile index).
    """

    def __init__(self, modules: dict[str, nn.Module], key_of: dict[str, Any]):
        self.modules = modules
        self.key_of = key_of
        self.cache: dict[tuple, Any] = {}
        self.inputs: dict[str, tuple[tuple, dict, tuple[bool, ...]]] = {}
        self.override: dict[str, Callable[[Any], Any]] = {}
        self._originals: dict[str, Callable] = {}

    def __enter__(self) -> ShortCircuit:
        for fqn in self.key_of:
            mod = self.modules[fqn]
            self._originals[fqn] = mod.forward
            mod.forward = self._wrap(fqn, mod.forward)
        return self

    def __exit__(self, *exc: Any) -> None:
        for fqn in self._originals:
            del self.modules[fqn].forward
        self._originals.clear()

    def _wrap(self, fqn: str, original: Callable) -> Callable:
        def forward(*args: Any, **kwargs: Any) -> Any:
            key = (self.key_of[fqn], _shapes(args, kwargs))
            if key in self.cache:
                out = self.cache[key]
            else:
                needs = tuple(t.requires_grad for t in tensors((args, kwargs)))
                self.inputs[fqn] = (tree_map(_detached, args), tree_map(_detached, kwargs), needs)
                out = tree_map(_as_leaf, original(*args, **kwargs))
                self.cache[key] = out
            hook = self.override.get(fqn)
            return hook(out) if hook is not None else out

        return forward


def _detached(x: Any) -> Any:
    return x.detach() if isinstance(x, torch.Tensor) else x


def _as_leaf(x: Any) -> Any:
    """A detached copy that still says whether the original needed a gradient, so the
    blocks after a short-circuited one see the same ``requires_grad`` as in training."""
    return x.detach().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x


def capture(model: nn.Module, inputs: tuple[tuple, dict], blocks: dict[str, Any]) -> Captured:
    """Run the model's forward once, running each distinct block for real and
    stopping after the last block (the head and loss are not needed here)."""
    modules = dict(model.named_modules())
    last = list(blocks)[-1]
    with ShortCircuit(modules, blocks) as sc:
        handle = modules[last].register_forward_hook(lambda m, a, kw, out: _raise_stop(), with_kwargs=True)
        try:
            model(*inputs[0], **inputs[1])
        except _Stop:
            pass
        finally:
            handle.remove()
    return Captured(inputs=sc.inputs, outputs=sc.cache)


def _raise_stop() -> None:
    raise _Stop((), {})


class BlockRunner:
    """A block called on its captured inputs."""

    recomputable = True

    def __init__(self, module: nn.Module, captured: tuple[tuple, dict, tuple[bool, ...]]):
        self.module = module
        args, kwargs, needs = captured
        flat = tensors((args, kwargs))
        marks = dict(zip(map(id, flat), needs))
        self.args = tree_map(lambda x: _leaf(x, marks), args)
        self.kwargs = tree_map(lambda x: _leaf(x, marks), kwargs)
        self.leaves = [t for t in tensors((self.args, self.kwargs)) if t.requires_grad]
        self.grads: list[torch.Tensor] | None = None

    def run(self, lap: Lap, *, recompute: bool = False) -> None:
        """One forward and backward (with ``recompute``, the forward rerun in backward)."""
        _clear_grads(self.module, self.leaves)
        lap.begin("fwd")
        out = _call(self.module, self.args, self.kwargs, recompute)
        lap.end("fwd")
        self.grads = self.grads if self.grads is not None else output_grads(out)
        backward_lap(lap, out, self.grads)


def _leaf(x: Any, marks: dict[int, bool]) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().requires_grad_(marks.get(id(x), False) and x.is_floating_point())
    return x


class PrologueRunner:
    """The model's forward up to the first block (stopped there by a hook)."""

    recomputable = False

    def __init__(self, model: nn.Module, inputs: tuple[tuple, dict], first_block: nn.Module):
        self.model, self.inputs, self.first = model, inputs, first_block
        self.grads: list[torch.Tensor] | None = None

    def run(self, lap: Lap) -> None:
        """One forward and backward."""
        _clear_grads(self.model, [])
        handle = self.first.register_forward_pre_hook(_stop_with_inputs, with_kwargs=True)
        try:
            lap.begin("fwd")
            self.model(*self.inputs[0], **self.inputs[1])
        except _Stop as stop:
            out = (stop.args, stop.kwargs)
        else:
            raise MeasurementError(
                f"{type(self.model).__name__}'s forward never called its first block, so what runs "
                f"before it cannot be timed apart; profile a model whose blocks run in forward."
            )
        finally:
            handle.remove()
        lap.end("fwd")
        self.grads = self.grads if self.grads is not None else output_grads(out)
        backward_lap(lap, out, self.grads)


def _stop_with_inputs(module: nn.Module, args: tuple, kwargs: dict) -> None:
    raise _Stop(args, kwargs)


class EpilogueRunner:
    """The model's forward with every block short-circuited, timed from the last
    block's (cached) output to the loss, and the loss's backward."""

    recomputable = False

    def __init__(
        self,
        model: nn.Module,
        inputs: tuple[tuple, dict],
        loss_fn: Callable[[Any], torch.Tensor],
        blocks: dict[str, Any],
        captured: Captured,
    ):
        self.model, self.inputs, self.loss_fn = model, inputs, loss_fn
        self.blocks = blocks
        self.captured = captured
        self.last = list(blocks)[-1]

    def run(self, lap: Lap) -> None:
        """One forward and backward."""
        _clear_grads(self.model, [])

        def fresh(out: Any) -> Any:
            leaf = tree_map(
                lambda x: x.detach().requires_grad_(x.is_floating_point()) if isinstance(x, torch.Tensor) else x, out
            )
            lap.begin("fwd")
            return leaf

        with ShortCircuit(dict(self.model.named_modules()), self.blocks) as sc:
            sc.cache.update(self.captured.outputs)
            sc.override[self.last] = fresh
            loss = self.loss_fn(self.model(*self.inputs[0], **self.inputs[1]))
        lap.end("fwd")
        backward_lap(lap, loss, None)


class WholeRunner:
    """A model without blocks: the whole forward, the loss, and its backward."""

    recomputable = True

    def __init__(self, model: nn.Module, inputs: tuple[tuple, dict], loss_fn: Callable[[Any], torch.Tensor]):
        self.model, self.inputs, self.loss_fn = model, inputs, loss_fn

    def run(self, lap: Lap, *, recompute: bool = False) -> None:
        """One forward and backward (with ``recompute``, the model's forward rerun in
        backward; the loss is not part of the checkpoint, as in training)."""
        _clear_grads(self.model, [])
        lap.begin("fwd")
        loss = self.loss_fn(_call(self.model, self.inputs[0], self.inputs[1], recompute))
        lap.end("fwd")
        backward_lap(lap, loss, None)
