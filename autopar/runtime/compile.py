"""Compiled blocks: each block of a stage runs through ``torch.compile`` when the plan says so.

What is compiled: every unit of the stage that is a *block*, a child of the model's block
container (the ``ModuleList``/``ModuleDict``/``Sequential`` of repeated layers,
:mod:`autopar.graph.units`), as the stage holds it: with full recomputation that is the
checkpoint wrapper around the block, so the recomputed forward is compiled too. The
embeddings, the final norm and the head stay eager, as in torchtitan, which compiles per
block: blocks share one structure, so dynamo traces one graph and reuses it for every
block (its guards check the module's type and the inputs' shapes, not which block runs),
and compile time does not grow with depth. A model without a block container has no
blocks, and nothing is compiled. The backend is inductor's default; a graph break (an op
dynamo cannot trace) splits the block into compiled parts and eager code between them
rather than failing.

Order, torchtitan's: after tensor and expert parallelism (the block's parameters are
already DTensors, so the traced graph holds the collectives of its layouts) and after
activation checkpointing (the checkpointed region is traced as one), before FSDP2 or DDP
wrap the stage. The block's ``forward`` is replaced by the compiled one, in place: the
module keeps its type and its parameters their names, so data parallelism, checkpoints
and the tied-weight bookkeeping see the units as before, and the hooks FSDP2 registers
on the unit later run eagerly around the compiled forward.

Compilation happens at a block's first call (the first step) and again only when
shapes change; the backward's graph is compiled at the first backward through it. A
failure raises :class:`~autopar.runtime.errors.CompileError` with the compiler's own
first line and the original exception chained, naming the block (forward) or the blocks
whose backward it is (:func:`compile_failures`, around the step's schedule): the plan
can be remade with ``compile=False``. An ``async_tp`` plan compiles them with inductor's
micro-pipeline TP pass on, which fuses their sequence-parallel collectives into their
matmuls (:mod:`autopar.runtime.async_tp`). A measured dry run (fake tensors,
:mod:`autopar.runtime.dry_step`) runs the blocks eager: compiling needs real tensors,
and eager blocks keep the element-wise intermediates that compiled ones recompute
(:mod:`autopar.graph.compiled_saved`). Nor does dynamo compile under a dispatch mode,
which is how a CPU step measures its memory (:mod:`autopar.runtime.metrics`): a
compiled plan on CPU skips that measurement (:func:`autopar.runtime.parallelize` warns).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch._dynamo.exc import BackendCompilerFailed, InternalTorchDynamoError

from autopar.errors import first_line
from autopar.runtime.errors import CompileError

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)

COMPILE_FAILURES = (BackendCompilerFailed, InternalTorchDynamoError)
"""What dynamo and inductor raise when they fail, the backend's own exception reaching
the caller as ``BackendCompilerFailed`` (inductor's ``InductorError`` is one). An error
of the block's own code found while tracing (``TorchRuntimeError``: an op that fails on
its inputs' shapes) is not one of them: it passes through as it is, since running eager
would raise it too."""


def block_units(stage: nn.Module, units: list[str]) -> list[str]:
    """The units of ``stage`` that are blocks: those whose parent is a module container."""
    blocks = []
    for unit in units:
        parent_name, _, child = unit.rpartition(".")
        parent = stage.get_submodule(parent_name) if parent_name else stage
        if child and isinstance(parent, _CONTAINERS):
            blocks.append(unit)
    return blocks


def compile_blocks(stage: nn.Module, units: list[str], *, backend: str | Callable[..., Any] = "inductor") -> list[str]:
    """Compile the forward of every block among ``units`` (module FQNs on ``stage``) in
    place; returns the blocks compiled. ``backend`` is ``torch.compile``'s."""
    blocks = block_units(stage, units)
    for name in blocks:
        module = stage.get_submodule(name)
        module.forward = _reporting(torch.compile(module.forward, backend=backend), name)
    return blocks


def _reporting(compiled: Callable[..., Any], block: str) -> Callable[..., Any]:
    """``compiled`` raising :class:`CompileError` for ``block`` when compilation fails."""

    @functools.wraps(compiled)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return compiled(*args, **kwargs)
        except COMPILE_FAILURES as exc:
            raise CompileError(
                f"block {block!r} failed to compile with torch.compile ({_compiler_message(exc)}); "
                f"plan with --set compile=false (compile=False) to run eager."
            ) from exc

    return run


@contextlib.contextmanager
def compile_failures(blocks: list[str]) -> Iterator[None]:
    """Let a compiler failure of ``blocks`` (the compiled blocks whose forward and
    backward run inside) leave as :class:`CompileError`: the forward's, which names its
    block, is found under the ``RuntimeError`` a pipeline stage wraps every forward
    failure in; the backward's becomes one naming ``blocks``. Any other exception, and
    everything when ``blocks`` is empty, passes through unchanged."""
    try:
        yield
    except Exception as exc:
        if not blocks or isinstance(exc, CompileError):
            raise
        named = _in_chain(exc, (CompileError,))
        if named is not None:
            raise named from named.__cause__
        failure = _in_chain(exc, COMPILE_FAILURES)
        if failure is None:
            raise
        names = repr(blocks[0]) if len(blocks) == 1 else f"{blocks[0]!r} to {blocks[-1]!r}"
        raise CompileError(
            f"the backward of compiled blocks {names} failed to compile with torch.compile "
            f"({_compiler_message(failure)}); plan with --set compile=false (compile=False) to run eager."
        ) from failure


def _in_chain(exc: BaseException, types: tuple[type[BaseException], ...]) -> BaseException | None:
    """The first exception of ``types`` among ``exc`` and those it was raised from or
    while handling."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, types):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def _compiler_message(exc: Exception) -> str:
    """The compiler's own exception (what the backend raised, not dynamo's wrapper), as
    ``Type: first line of its message``."""
    inner = getattr(exc, "inner_exception", None) or exc
    return f"{type(inner).__name__}: {first_line(inner)}" if str(inner).strip() else type(inner).__name__
