"""Activation recomputation per unit, as the plan says.

``full`` wraps the unit in PyTorch's non-reentrant ``checkpoint_wrapper``: only its input
is kept and the whole forward reruns in backward (Chen et al. 2016). ``selective`` keeps
every activation except the attention core's, which reruns (Korthikanti et al. 2022,
section 4.2), through selective activation checkpointing: a policy marks which ops'
outputs to save. The wrapper adds ``_checkpoint_wrapped_module`` to parameter names;
:func:`clean_fqn` removes it (``torch.distributed.checkpoint`` does the same).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from autopar.plan import Plan
from autopar.vocab import Recompute

_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod.")

ATTENTION_CORE_OPS: frozenset = frozenset(
    op for op in (
        getattr(torch.ops.aten, name, None) for name in (
            "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
            "_scaled_dot_product_attention_math", "bmm", "baddbmm", "_softmax", "native_dropout")
    ) if op is not None)
"""Ops that make up an attention core: fused SDPA kernels, and the batched matmuls,
softmax and dropout of an unfused one (e.g. transformers' eager attention). Linear layers
use ``mm``/``addmm``, never ``bmm``, so their outputs stay saved."""


def clean_fqn(name: str) -> str:
    """A parameter or module name without wrapper prefixes (and DDP's leading ``module.``)."""
    if name.startswith("module."):
        name = name[len("module."):]
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def apply_recompute(stage: nn.Module, units: list[str], plan: Plan) -> dict[str, Recompute]:
    """Wrap each of ``units`` (module FQNs on ``stage``) that recomputes; return the
    mode of every unit."""
    modes = {u: plan.layer_strategies.recompute_of(u, plan.config.recompute) for u in units}
    for unit, mode in modes.items():
        if mode is Recompute.NONE:
            continue
        parent_name, _, child = unit.rpartition(".")
        parent = stage.get_submodule(parent_name) if parent_name else stage
        module = parent.get_submodule(child)
        if mode is Recompute.FULL:
            wrapped = checkpoint_wrapper(module)
        else:
            wrapped = checkpoint_wrapper(module, context_fn=functools.partial(
                create_selective_checkpoint_contexts, _save_all_but_attention_core))
        _replace_child(parent, child, wrapped)
    return modes


def _save_all_but_attention_core(_ctx, op, *_args, **_kwargs) -> CheckpointPolicy:
    core = getattr(op, "overloadpacket", op) in ATTENTION_CORE_OPS
    return CheckpointPolicy.PREFER_RECOMPUTE if core else CheckpointPolicy.MUST_SAVE


def _replace_child(parent: nn.Module, name: str, module: nn.Module) -> None:
    if isinstance(parent, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
        parent[int(name) if not isinstance(parent, nn.ModuleDict) else name] = module
    else:
        setattr(parent, name, module)
