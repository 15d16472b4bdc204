"""``export()``: a plan written for one framework, by the target's name."""

from __future__ import annotations

import reprlib
from collections.abc import Callable
from pathlib import Path

from torch import nn

from autopar.export.accelerate import export_accelerate
from autopar.export.common import Export, ExportError, load_plan
from autopar.export.deepspeed import export_deepspeed
from autopar.export.experts_shape import require_experts
from autopar.export.megatron import export_megatron
from autopar.export.shape import ModelShape, shape_of
from autopar.export.torchtitan import export_torchtitan
from autopar.models.registry import build_named_model
from autopar.plan import Plan
from autopar.plan_checks import overflow

EXPORTERS: dict[str, Callable[[Plan, ModelShape | None], Export]] = {
    "megatron": export_megatron,
    "deepspeed": export_deepspeed,
    "torchtitan": export_torchtitan,
    "accelerate": export_accelerate,
}
"""Each target's exporter, by the name ``--to`` takes."""


def export(plan: Plan | str | Path, to: str, *, model: nn.Module | str | None = None) -> Export:
    """``plan`` (or the plan file it names) written for framework ``to``.

    Args:
        plan: a Plan or the path of a plan file.
        to: ``megatron``, ``deepspeed``, ``torchtitan`` or ``accelerate``.
        model: the model the plan was made for (on the meta device is enough), or the
            name of a registered one (``autopar models``, as ``--model`` takes it), to
            fill in its sizes; checked against the plan's fingerprint.

    Raises:
        ExportError: an unknown target, a model that is not the plan's (or neither a
            module nor a name), or a plan the
            target cannot run (accelerate with pipelining or expert parallelism, deepspeed
            with context parallelism, a sequence length the target cannot split, expert
            parallelism for a model without experts or with a count it does not divide), or a
            plan predicted not to fit;
            UnreadablePlanError (also an ExportError) for a missing or malformed plan file.
        ConfigError: a model name that is not registered.
    """
    exporter = exporter_for(to)
    loaded = load_plan(plan)
    problem = overflow(loaded.prediction, loaded.cluster.device.name)
    if problem:  # an estimate that does not fit
        raise ExportError(
            f"{problem}; export a plan that fits (autopar plan searches them, or estimate another configuration)."
        )
    if isinstance(model, str):
        model = build_named_model(model)
    elif model is not None and not isinstance(model, nn.Module):
        raise ExportError(
            f"model={reprlib.repr(model)} is not allowed: give the torch.nn.Module the plan was made for (on the meta "
            f"device) or a registered model's name (autopar models), or leave it out."
        )
    shape = shape_of(model, loaded) if model is not None else None
    if shape is not None:
        require_experts(loaded, shape)
    try:
        return exporter(loaded, shape)
    except ExportError as exc:
        raise ExportError(f"{exc} {_elsewhere(loaded, shape, to)}") from None


def _elsewhere(plan: Plan, shape: ModelShape | None, refused: str) -> str:
    """Which other targets export ``plan`` as it is (each exporter tried), so that a
    refusal never sends the user to a target that refuses the same plan."""
    takers = []
    for name, exporter in EXPORTERS.items():
        if name == refused:
            continue
        try:
            exporter(plan, shape)
        except ExportError:
            continue
        takers.append(name)
    if not takers:
        return "No other target exports this plan as it is either."
    listed = f"{', '.join(takers[:-1])} and {takers[-1]}" if len(takers) > 1 else takers[0]
    return f"This plan exports as it is to {listed}."


def exporter_for(to: str) -> Callable[[Plan, ModelShape | None], Export]:
    """The exporter of target ``to``; an ExportError naming the targets if there is none."""
    if to not in EXPORTERS:
        raise ExportError(f"unknown export target {to!r}; use one of {', '.join(EXPORTERS)}.")
    return EXPORTERS[to]
