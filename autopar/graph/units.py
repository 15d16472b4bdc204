"""Finding a model's units (what pipeline stages hold) and leaves (where TP styles go).

Units are found structurally, for any ``nn.Module``: the *block container* is the
``ModuleList``/``ModuleDict``/``Sequential`` whose children hold the most parameters
(GPT-2's ``transformer.h``, Llama's ``model.layers``, a plain ``nn.Sequential``). Every
child of the container is a unit, and so is every other child of the modules on the
path from the root to the container (embeddings before, final norm and head after).
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from autopar.graph.layer_graph import LeafKind

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def find_units(model: nn.Module) -> list[str]:
    """Unit FQNs in registration order (the trace reorders them by execution)."""
    container = _block_container(model)
    if container is None:
        return [""]
    units: list[str] = []

    def expand(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            fqn = f"{prefix}.{name}" if prefix else name
            if fqn == container:
                units.extend(f"{fqn}.{n}" for n, _ in child.named_children())
            elif container.startswith(fqn + "."):
                expand(child, fqn)
            else:
                units.append(fqn)

    if container == "":
        units.extend(n for n, _ in model.named_children())
    else:
        expand(model, "")
    return units


def _block_container(model: nn.Module) -> str | None:
    best, best_params, best_depth = None, 0, 0
    for fqn, module in model.named_modules():
        if not isinstance(module, _CONTAINERS):
            continue
        children = list(module.children())
        # a ModuleList/ModuleDict never runs itself, so even one child is a block of it
        # (a one-layer model); a one-child Sequential runs and may stay a unit of its own
        if len(children) < (2 if isinstance(module, nn.Sequential) else 1):
            continue
        params = sum(_numel(c) for c in children)
        depth = fqn.count(".") + (1 if fqn else 0)
        if params > best_params or (params == best_params and depth < best_depth):
            best, best_params, best_depth = fqn, params, depth
    if best is None and len(list(model.children())) >= 2:
        return ""
    return best


def _numel(module: nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for p in module.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is transformers' ``Conv1D`` (GPT-2's projection: a linear layer
    with a transposed ``(in, out)`` weight), whose fused ``c_attn`` the runtime splits by
    heads (``autopar.runtime.hf``)."""
    return (
        type(module).__name__ == "Conv1D"
        and type(module).__module__.startswith("transformers")
        and getattr(module, "weight", None) is not None
        and module.weight.dim() == 2
    )


def leaf_kind(module: nn.Module) -> LeafKind:
    """Classify a module that owns parameters directly."""
    if isinstance(module, nn.Linear):
        return LeafKind.LINEAR
    if is_conv1d(module):
        return LeafKind.LINEAR
    if isinstance(module, nn.Embedding):
        return LeafKind.EMBEDDING
    name = type(module).__name__
    own = list(module.parameters(recurse=False))
    if (isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or name.endswith(("LayerNorm", "RMSNorm"))) and all(
        p.dim() == 1 for p in own
    ):
        return LeafKind.NORM
    return LeafKind.OTHER


def matrix_shape(module: nn.Module, kind: LeafKind) -> tuple[int, int, int]:
    """``(in_features, out_features, weight_numel)`` of a linear or embedding leaf.

    ``weight_numel`` counts what column/row/vocab splits shard: the weight (the bias
    stays replicated under a row split and is sharded under a column split; the
    difference is one vector and is charged as replicated).
    """
    if kind is LeafKind.LINEAR:
        w = module.weight
        if isinstance(module, nn.Linear):
            return int(w.shape[1]), int(w.shape[0]), int(w.numel())
        return int(w.shape[0]), int(w.shape[1]), int(w.numel())
    if kind is LeafKind.EMBEDDING:
        return int(module.weight.shape[0]), int(module.weight.shape[1]), int(module.weight.numel())
    return 0, 0, 0


def module_signature(module: nn.Module) -> str:
    """Identical for structurally identical modules (same classes, parameter names,
    shapes and dtypes), so repeated blocks are analysed once."""
    parts = [type(module).__qualname__]
    for name, sub in module.named_modules():
        parts.append(f"{name}:{type(sub).__qualname__}")
    for name, p in module.named_parameters():
        parts.append(f"{name}:{tuple(p.shape)}:{p.dtype}")
    for name, b in module.named_buffers():
        parts.append(f"b:{name}:{tuple(b.shape)}:{b.dtype}")
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:16]


def model_fingerprint(model: nn.Module) -> str:
    """A short hash of the model's parameter names and shapes (tied weights once).

    The runtime compares it with the plan's, so a plan is never applied to another model.
    """
    parts = []
    seen: set[int] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        parts.append(f"{strip_wrappers(name)}:{tuple(p.shape)}")
    return hashlib.sha1("|".join(sorted(parts)).encode()).hexdigest()[:16]


def strip_wrappers(name: str) -> str:
    """Parameter names as the unwrapped model has them (activation checkpointing and
    torch.compile insert a submodule level)."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def unique_numel(model: nn.Module) -> int:
    """Parameters of the model, tied weights counted once."""
    return _numel(model)


def tensor_nbytes(t: torch.Tensor) -> int:
    """Bytes of a tensor's elements (its view, not its storage)."""
    return t.numel() * t.element_size()
