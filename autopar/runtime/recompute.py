"""Activation recomputation per unit, as the plan says.

``full`` wraps the unit in PyTorch's non-reentrant ``checkpoint_wrapper``: only its input
is kept and the whole forward reruns in backward (Chen et al. 2016). ``op`` wraps it the
same way with a selective checkpointing policy (``create_selective_checkpoint_contexts``)
that keeps the outputs of every other ``aten.mm``, of the attention kernels and of the
sequence-parallel reduce-scatters, and recomputes every other op: torchtitan's
per-operator policy, whose terms :mod:`autopar.cost.saved_ops` prices. ``selective`` keeps
every activation except the attention core's, which reruns (Korthikanti et al. 2022,
section 4.2): each ``F.scaled_dot_product_attention`` call inside the unit runs under a
non-reentrant checkpoint, so autograd keeps what the rest of the unit needs, as without
recomputation, and the core's own intermediates are rebuilt from q, k and v in backward.

Selective activation checkpointing with a policy saving every op but the core's was
used for ``selective`` before and measured worse than no recomputation: it caches the
output of *every* op in the unit, including those autograd never keeps (residual sums,
the partial and the all-reduced outputs of row-parallel layers), so a tp=4 GPT held
95 MiB per rank with it against 63 without (benchmarks/results/measured_2026-11-29.md,
gpt-56mib). The wrapper of ``full`` adds
``_checkpoint_wrapped_module`` to parameter names; :func:`clean_fqn` removes it
(``torch.distributed.checkpoint`` does the same). Attention written as explicit
matmuls and softmax (transformers' "eager" implementation) is not recognised: such a
unit keeps its scores, as without recomputation.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from autopar.plan import Plan
from autopar.vocab import Recompute

_SDPA = torch._C._nn.scaled_dot_product_attention
"""The builtin behind ``F.scaled_dot_product_attention``, which context parallelism
replaces during a step by a function calling it on DTensors
(:mod:`autopar.runtime.ring_attention`)."""

_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod.")


def clean_fqn(name: str) -> str:
    """A parameter or module name without wrapper prefixes (and DDP's leading ``module.``)."""
    if name.startswith("module."):
        name = name[len("module.") :]
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
            _replace_child(parent, child, checkpoint_wrapper(module))
        elif mode is Recompute.OP:
            _replace_child(parent, child, checkpoint_wrapper(module, context_fn=_per_op_contexts))
        else:
            module.forward = _recomputing_attention(module.forward)
    return modes


OP_SAVED = frozenset(
    {
        torch.ops.aten.mm.default,
        torch.ops.aten._scaled_dot_product_flash_attention.default,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
        torch.ops.aten._scaled_dot_product_efficient_attention.default,
        torch.ops.aten._scaled_dot_product_cudnn_attention.default,
        torch.ops.aten._scaled_dot_product_fused_attention_overrideable.default,
        torch.ops._c10d_functional.reduce_scatter_tensor.default,
        torch.ops.aten.max.default,
    }
)
"""Ops whose outputs ``op`` recomputation keeps (``aten.mm`` every other call): torchtitan's
list for its Llama blocks, with the CPU flash kernel so that a CPU run keeps what a GPU
run keeps; ``max`` is the absolute maximum FP8 scaling reads."""


def _per_op_contexts() -> tuple[Any, Any]:
    """A fresh pair of selective-checkpoint contexts for one run of one unit; the forward
    and its recomputation each count their matmuls from one, so both keep the same ones."""
    counts = {False: 0, True: 0}

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if func is torch.ops.aten.mm.default:
            counts[ctx.is_recompute] += 1
            if counts[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in OP_SAVED else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


class _CheckpointAttentionCore(TorchFunctionMode):
    """Runs each ``F.scaled_dot_product_attention`` under a non-reentrant checkpoint
    (the mode is off inside its own handler, so the call does not recurse)."""

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is _SDPA:
            return checkpoint(func, *args, use_reentrant=False, **kwargs)
        return func(*args, **kwargs)


def _recomputing_attention(forward: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        with _CheckpointAttentionCore():
            return forward(*args, **kwargs)

    return run


def _replace_child(parent: nn.Module, name: str, module: nn.Module) -> None:
    if isinstance(parent, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
        parent[int(name) if not isinstance(parent, nn.ModuleDict) else name] = module
    else:
        setattr(parent, name, module)
