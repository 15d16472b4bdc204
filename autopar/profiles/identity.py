"""Whether a layer profile measured the model being planned.

A layer profile's per-unit factors are measured over predicted time of *that* model's
units, and the cost model looks them up by unit signature, which for what runs before
the first block and after the last is only the joined module names: a tiny GPT's
embeddings and head would calibrate gpt2-small's (whose step it moved from 62.1 s to
97.9 s). So a profile records the model it measured (``ModelProfile.model_fingerprint``
and ``parameter_shapes``), and the planner applies it only to that model:

- same parameter names and shapes (the fingerprints agree): used; where the plan's
  micro-batch, sequence length or precision is not the measured one, the plan says so;
- the same model built for another sequence length (parameters differ only in
  dimensions that are the measured sequence length there and the planned one here, a
  position table; blocks and unit layout unchanged): used, with that said;
- a profile written before profiles recorded their model (no fingerprint): matched by
  its units (every distinct unit's name, signature and instances, a block's signature
  covering its parameter shapes) and used with a note saying so, since a block-for-block
  match can still hide other embedding or head sizes;
- anything else: :class:`ProfileModelError`, naming both models and what to do.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn

from autopar.errors import ConfigError
from autopar.graph.layer_graph import LayerGraph
from autopar.graph.units import strip_wrappers
from autopar.hardware.device import device_kind
from autopar.profiles.sections import ModelProfile

REMEDY = "profile this model with 'autopar profile model ...' or drop --profile"


class ProfileModelError(ConfigError):
    """A layer profile measured another model than the one being planned."""


@dataclass(frozen=True, kw_only=True)
class LayerProfileMatch:
    """A layer profile accepted for the planned model, and how it was matched.

    Attributes:
        origin: the report the layers section came from (a path or ``report #n``).
        layers: the section.
        legacy: the profile has no model fingerprint; it was matched by its units.
        resized: parameters sized by the sequence length that differ from the
            profiled model's (the model was built for another sequence length).
    """

    origin: str
    layers: ModelProfile
    legacy: bool = False
    resized: tuple[str, ...] = ()

    def notes(self, *, micro_batch: int, seq_len: int, dtype: str, device: str) -> tuple[str, ...]:
        """What a plan at ``micro_batch`` x ``seq_len`` in ``dtype`` on ``device`` (the
        cluster's device name) should say about this profile: nothing where it was
        measured at exactly that shape and precision of the model as planned, on the same
        kind of device (CPU processes or GPUs); else where it was measured and that it is
        applied here."""
        m = self.layers
        out = []
        if m.device_kind != device_kind(device):  # its factors carry the other's efficiency
            out.append(
                f"The layer profile of {m.model} in {self.origin} was measured on {m.device} ({m.device_kind}) and is "
                f"applied to the cluster's {device}: its per-unit factors (measured over predicted) carry that "
                f"device's efficiency over; profile the model on the cluster's devices for a prediction of them."
            )
        if self.legacy:
            out.append(
                f"The layer profile of {m.model} in {self.origin} was written before profiles recorded their model's "
                f"fingerprint: it was matched by its units' names and block signatures; profile again to record it."
            )
        if (m.batch, m.seq_len, m.dtype) != (micro_batch, seq_len, dtype):
            precision = f" ({m.dtype})" if m.dtype != dtype else ""
            applied = f" ({dtype})" if m.dtype != dtype else ""
            built = (
                f"; the profiled model was built for seq {m.seq_len} ({', '.join(self.resized)})"
                if self.resized
                else ""
            )
            out.append(
                f"The layer profile of {m.model} in {self.origin} was measured at batch {m.batch}, seq {m.seq_len}"
                f"{precision} and is applied at micro-batch {micro_batch}, seq {seq_len}{applied}: its per-unit "
                f"factors carry over through the device curves{built}."
            )
        return tuple(out)


def parameter_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape, as ``autopar.graph.model_fingerprint`` hashes them (tied
    parameters once, under their first name; wrapper levels of activation checkpointing
    and torch.compile left out), so two models with the same fingerprint have the same
    shapes and a difference can be named."""
    shapes: dict[str, tuple[int, ...]] = {}
    seen: set[int] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in seen:
            seen.add(id(p))
            shapes[strip_wrappers(name)] = tuple(int(s) for s in p.shape)
    return shapes


def match_layer_profile(
    found: tuple[str, ModelProfile] | None, model: nn.Module | LayerGraph, graph: LayerGraph
) -> LayerProfileMatch | None:
    """How the layer section ``found`` (its origin and section; None where the profile
    has none) applies to ``model``, planned as ``graph``: None where there is nothing to
    apply, else the match (see the module docstring for what is accepted).

    Raises:
        ProfileModelError: the section measured another model.
    """
    if found is None:
        return None
    origin, layers = found
    if layers.model_fingerprint == graph.fingerprint:
        return LayerProfileMatch(origin=origin, layers=layers)
    if not layers.model_fingerprint:
        why = _units_differ(layers, graph)
        if why is None:
            return LayerProfileMatch(origin=origin, layers=layers, legacy=True)
    elif not isinstance(model, nn.Module):
        why = "the plan's model is a LayerGraph, which does not list its parameter shapes"
    else:
        why, resized = _shapes_differ(layers, parameter_shapes(model), graph.seq_len)
        why = why or _units_differ(layers, graph)
        if why is None:
            return LayerProfileMatch(origin=origin, layers=layers, resized=resized)
    raise ProfileModelError(
        f"the layer profile in {origin} measured {_profiled(layers)} but the plan is for {graph.name} "
        f"({graph.num_params:,} parameters, fingerprint {graph.fingerprint}): {why}; a layer profile applies "
        f"only to the model it measured, at any batch and sequence length: {REMEDY}."
    )


def _profiled(layers: ModelProfile) -> str:
    """The profiled model's name, size and fingerprint, as the error names it."""
    if not layers.model_fingerprint:
        return f"{layers.model} (fingerprint not recorded: the profile predates it)"
    numel = sum(math.prod(s) for s in layers.parameter_shapes.values())
    return f"{layers.model} ({numel:,} parameters, fingerprint {layers.model_fingerprint})"


def _units_differ(layers: ModelProfile, graph: LayerGraph) -> str | None:
    """Why the profile's distinct units are not the graph's (each distinct unit's
    signature and its instances, in order), or None where they are the same."""
    instances: dict[int, list[str]] = {}
    for u in graph.units:
        instances.setdefault(u.profile, []).append(u.fqn)
    planned = {(graph.profiles[k].signature, tuple(fqns)) for k, fqns in instances.items()}
    measured = {(u.signature, tuple(u.instances)) for u in layers.units}
    if measured == planned:
        return None
    counts = {sig: len(fqns) for sig, fqns in planned}
    for sig, fqns in sorted(measured - planned):
        if sig in counts:
            return f"its unit {fqns[0]} has {len(fqns)} instance(s), the planned model's {counts[sig]}"
        return f"its unit {fqns[0]} (signature {sig}) is not a unit of the planned model"
    sig, fqns = sorted(planned - measured)[0]
    return f"the planned model's unit {fqns[0]} (signature {sig}) was not measured"


def _shapes_differ(
    layers: ModelProfile, planned: Mapping[str, tuple[int, ...]], seq_len: int
) -> tuple[str | None, tuple[str, ...]]:
    """Why the profiled parameters are not the planned model's, or None and the
    parameters that differ only in sequence-sized dimensions (the measured sequence
    length there, the planned one here)."""
    measured = layers.parameter_shapes
    if not measured:
        return "the profile does not list its parameter shapes", ()
    resized = []
    for name in sorted(set(measured) & set(planned)):
        a, b = measured[name], planned[name]
        if a == b:
            continue
        if len(a) != len(b) or any(x != y and (x, y) != (layers.seq_len, seq_len) for x, y in zip(a, b)):
            return f"their parameters differ (first: {name} {a} there, {b} here)", ()
        resized.append(name)
    only = sorted(set(measured) ^ set(planned))
    if only:
        where = "there" if only[0] in measured else "here"
        return f"{len(only)} parameter(s) are in one model only (first: {only[0]}, {where})", ()
    return None, tuple(resized)
