"""FP8 matmuls (``ParallelConfig.fp8``): the blocks' linear layers train through torchao's float8.

What is converted: on every stage, the ``nn.Linear`` leaves of the stage's *blocks*
(the children of the block container, :func:`autopar.runtime.compile.block_units`)
whose in and out features are both multiples of 16 (what FP8 tensor-core matmuls
require) become torchao ``Float8Linear`` modules: each matmul of the forward and of
the backward casts its two operands to FP8 (e4m3 for input and weight, e5m2 for the
output gradient) with one dynamic scale per tensor (its absolute maximum, torchao's
default "tensorwise" recipe) and accumulates in high precision. The embeddings, the
final norm and the head stay in bf16, as do the mixture-of-experts expert stacks
(3-D weights, not ``nn.Linear``) and any linear with a dimension that is not a
multiple of 16 (a small router, for one). This is the set the cost model prices in
FP8. ``Float8Linear`` is an ``nn.Linear`` that keeps the module's own ``weight`` and
``bias`` parameters, so parameter names, shapes and checkpoints are unchanged and a
checkpoint reshards across plans with and without FP8.

Order, torchtitan's: the model is converted before it is parallelized, so right after
the stage is cut and before tensor parallelism, activation checkpointing, compiled
blocks and FSDP2/DDP; the weights stay in their (fp32 master, bf16 compute) dtypes
and are cast to FP8 inside each matmul, after FSDP2 gathers them.

Where the device has no FP8 tensor cores (a CPU, a CUDA device below compute
capability 8.9) torchao *emulates* FP8: operands are rounded to FP8 values and then
multiplied in high precision, which checks the numerics but brings no speed; the
runtime warns once. torchao is imported only when the plan asks for FP8; without it
the job stops with :class:`~autopar.runtime.errors.FP8Error` before any collective.

torchao's float8 layers save their inputs in bf16. A plan priced for Megatron-LM's
kernels (``activations='sequence-first'``) counts them in FP8, as Transformer Engine
keeps them (:func:`autopar.cost.fp8.saved_bytes`), so this runtime would hold more than
its prediction: it is refused before any rank starts (:func:`check_saved_inputs`).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import nn

from autopar.cost.fp8 import ALIGNMENT
from autopar.errors import ConfigError
from autopar.plan import Plan
from autopar.quiet import quiet_imports
from autopar.runtime.compile import block_units
from autopar.runtime.errors import FP8Error

FP8_CAPABILITY = (8, 9)
"""The first CUDA compute capability with FP8 tensor cores (Ada, then Hopper)."""

EMULATION_WARNING = (
    "fp8=True on {device}, which has no FP8 tensor cores: torchao emulates FP8 (operands rounded to FP8, "
    "multiplied in high precision), so the numerics are FP8's but nothing is faster; run on a CUDA device "
    "of compute capability >= 8.9 (H100, H200) for FP8 speed."
)


def emulated(device: torch.device) -> bool:
    """Whether FP8 matmuls on ``device`` must be emulated (no FP8 tensor cores)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return True
    return torch.cuda.get_device_capability(device) < FP8_CAPABILITY


def float8_api() -> Any:
    """torchao's ``torchao.float8`` module, imported now; :class:`FP8Error` without it."""
    try:
        with quiet_imports():
            return importlib.import_module("torchao.float8")
    except ImportError as exc:
        raise FP8Error(
            f"fp8=True needs torchao's float8 training, which cannot be imported here ({exc}); "
            f"run `pip install torchao`, or plan with fp8=False."
        ) from exc


def convertible(module: nn.Module) -> bool:
    """A linear layer that FP8 matmuls can run: both dimensions multiples of 16."""
    return (
        isinstance(module, nn.Linear) and module.in_features % ALIGNMENT == 0 and module.out_features % ALIGNMENT == 0
    )


def convert_blocks(stage: nn.Module, units: list[str], *, emulate: bool, float8: Any = None) -> list[str]:
    """Swap the convertible linears of the blocks among ``units`` (module FQNs on
    ``stage``) for torchao ``Float8Linear`` in place, tensorwise dynamic scaling;
    returns the FQNs (on ``stage``) of the converted linears. ``float8`` is
    :func:`float8_api`'s module (imported when not given)."""
    float8 = float8 if float8 is not None else float8_api()
    config = float8.Float8LinearConfig(emulate=emulate)
    converted: list[str] = []
    for block in block_units(stage, units):

        def keep(module: nn.Module, fqn: str, block: str = block) -> bool:
            if not convertible(module):
                return False
            converted.append(f"{block}.{fqn}")
            return True

        float8.convert_to_float8_training(stage.get_submodule(block), module_filter_fn=keep, config=config)
    return converted


def check_saved_inputs(plan: Plan) -> None:
    """Refuse an FP8 plan priced for Megatron-LM's kernels (module docstring)."""
    if plan.config.fp8 and plan.settings.megatron_kernels:
        raise ConfigError(
            "fp8=True priced for Megatron-LM's kernels (activations='sequence-first') keeps the FP8 layers' inputs "
            "in FP8, as Transformer Engine does; autopar's runtime (torchao) keeps them in bf16 and would hold more "
            "than predicted. Plan again without --activations sequence-first to run it here, or export it to megatron."
        )


def check_fp8(compile_blocks: bool, device: torch.device) -> Any:
    """The checks of an FP8 plan that need no collective; returns torchao's float8
    module. An FP8Error when torchao is missing, or when the blocks would be compiled
    around emulated FP8: inductor compiles torchao's emulation, but its fused casts move
    the gradients away from the eager emulation's by far more than rounding order
    would, so it is not a check of FP8 numerics (torchtitan refuses it too)."""
    float8 = float8_api()
    if compile_blocks and emulated(device):
        raise FP8Error(
            f"fp8=True with compile=True on {device}: FP8 is emulated there (no FP8 tensor cores) and compiled "
            f"emulation does not reproduce the eager one; plan with compile=False, or run on a CUDA device of "
            f"compute capability >= 8.9."
        )
    return float8
