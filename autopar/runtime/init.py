"""Materialising a model built on the meta device, shard by shard, with the values a
seeded single-process model would have.

The choice: *rank-independent seeded init of each unit, then slicing*. Every unit (an
embedding, a block, the head) has its own seed derived from the job seed and the unit's
name. To fill its shards a rank builds that one unit at full size, runs ``init_fn`` on it
under the unit's seed, and copies out the slice its sharded parameters hold
(``distribute_tensor(..., src_data_rank=None)``: each rank slices its own copy, no
communication). Values therefore do not depend on the plan, the rank or the order of
stages, and a single process gets the same ones from :func:`initialize`. Peak extra
memory is one unit at full size. The alternative, DTensor's offset-based RNG (each shard
draws its own part of the full tensor's random stream), needs a per-device Philox
generator and is not available on CPU.

A parameter tied across units (GPT-2's embedding and head) takes the value the last of
its units gives it, as it does when a single process initialises the units in order.
``to_empty`` allocates a new tensor per module and so unties parameters; ties are
restored right after it.
``init_fn(module)`` must set every parameter and buffer of the unit it is given; the
default calls ``reset_parameters()`` on each submodule that has one.
"""

from __future__ import annotations

import copy
import zlib
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from autopar.runtime.errors import PlanMismatchError
from autopar.runtime.recompute import clean_fqn
from autopar.runtime.tied import retie

InitFn = Callable[[nn.Module], None]


def default_init(module: nn.Module) -> None:
    """Call ``reset_parameters()`` on every submodule that defines it (PyTorch's
    per-layer defaults, e.g. Kaiming-uniform for ``nn.Linear``)."""
    for sub in module.modules():
        reset = getattr(sub, "reset_parameters", None)
        if callable(reset):
            reset()


def unit_seed(seed: int, unit: str) -> int:
    """The seed of one unit: a stable hash of the job seed and the unit's name."""
    return zlib.crc32(f"{seed}:{unit}".encode()) & 0x7FFFFFFF


def is_meta(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on the meta device."""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def initialize(
    model: nn.Module,
    units: tuple[str, ...],
    init_fn: InitFn | None = None,
    *,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> nn.Module:
    """Single-process reference: materialise ``model`` (if on meta) on ``device`` and
    initialise each unit in order under its seed; returns ``model``."""
    init_fn = init_fn or default_init
    if is_meta(model):
        to_empty_tied(model, device, tied_names(model))
    for unit in units:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(unit_seed(seed, unit))
            init_fn(model.get_submodule(unit))
    return model


class Materializer:
    """Keeps full-size meta copies of this rank's units (taken before sharding) and fills
    the sharded parameters once they exist."""

    def __init__(
        self, model: nn.Module, units: tuple[str, ...], local_units: tuple[str, ...], init_fn: InitFn | None, seed: int
    ):
        self._init_fn = init_fn or default_init
        self._seed = seed
        self._units = units
        owner = self._value_owners(model, units)
        self._tied = tied_names(model)
        self._sources: dict[str, tuple[str, str]] = {}
        needed: set[str] = set()
        for unit in local_units:
            for name, _ in _named_tensors(model.get_submodule(unit)):
                fqn = f"{unit}.{name}"
                src_unit, src_name = owner.get(fqn, (unit, fqn))
                self._sources[fqn] = (src_unit, src_name)
                needed.add(src_unit)
        self._pristine = {u: copy.deepcopy(model.get_submodule(u)) for u in needed}

    @staticmethod
    def _value_owners(model: nn.Module, units: tuple[str, ...]) -> dict[str, tuple[str, str]]:
        """For each tied parameter name: the (unit, name) whose init gives its value."""
        owners: dict[str, tuple[str, str]] = {}
        for fqns in tied_names(model):
            holders = [(units.index(_unit_of(f, units)), f) for f in fqns]
            _, last = max(holders)
            for f in fqns:
                owners[f] = (_unit_of(last, units), last)
        return owners

    def fill(self, stages: list[nn.Module], device: torch.device) -> None:
        """Allocate the stages' (sharded) storage on ``device`` and copy in each shard."""
        for stage in stages:
            to_empty_tied(stage, device, self._tied)
        full_units: dict[str, nn.Module] = {}
        for unit in sorted({u for u, _ in self._sources.values()}, key=self._units.index):
            full = copy.deepcopy(self._pristine[unit]).to_empty(device=device)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(unit_seed(self._seed, unit))
                self._init_fn(full)
            full_units[unit] = full
        for stage in stages:
            for name, target in _named_tensors(stage):
                fqn = clean_fqn(name)
                if fqn not in self._sources:
                    raise PlanMismatchError(
                        f"tensor {fqn!r} belongs to no unit of the plan, so it cannot be "
                        f"initialised; give it to a unit module."
                    )
                src_unit, src_name = self._sources[fqn]
                value = dict(_named_tensors(full_units[src_unit]))[src_name[len(src_unit) + 1 :]]
                _copy_shard(target, value)


def to_empty_tied(module: nn.Module, device: torch.device | str, tied: list[tuple[str, ...]]) -> None:
    """``module.to_empty(device=device)``, after which the names of each tied parameter in
    ``tied`` (:func:`tied_names` of the whole model, taken before tensor parallelism or
    ``to_empty`` replaced its parameters module by module) share one tensor again."""
    module.to_empty(device=device)
    for names in tied:
        retie(module, names)


def tied_names(model: nn.Module) -> list[tuple[str, ...]]:
    """The names of each parameter reachable under several names."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [tuple(n) for n in names.values() if len(n) > 1]


def _named_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(clean_fqn(n), t) for n, t in (*module.named_parameters(), *module.named_buffers())]


def _unit_of(fqn: str, units: tuple[str, ...]) -> str:
    return max((u for u in units if fqn.startswith(u + ".")), key=len)


@torch.no_grad()
def _copy_shard(target: torch.Tensor, full: torch.Tensor) -> None:
    if isinstance(target, DTensor):
        local = distribute_tensor(
            full.to(target.dtype), target.device_mesh, target.placements, src_data_rank=None
        ).to_local()
        target.to_local().copy_(local)
    else:
        target.copy_(full.to(target.dtype))
