"""Asynchronous tensor parallelism (``ParallelConfig.async_tp``): torch's micro-pipeline TP in the compiled blocks.

Under sequence parallelism a block's column-parallel matmuls start from an all-gather of
the sequence shards and its row-parallel matmuls end in a reduce-scatter. Inductor's
micro-pipeline TP pass (``torch._inductor.config._micro_pipeline_tp``, a post-grad pass
over each compiled graph) replaces such a collective and its matmul by one fused op
that splits the matmul into chunks and moves each chunk through symmetric memory while
another is multiplied, so the transfer hides behind compute. It is what torchtitan's
``enable_async_tensor_parallel`` turns on, in the same two steps:

- the tensor-parallel group is registered for symmetric memory
  (:func:`enable_async_tp`, when the job is built, before any block compiles). torch
  2.13 marks ``enable_symm_mem_for_group`` deprecated ("no need to call"), but the pass
  still fuses only for groups it registered (``is_symm_mem_enabled_for_group``), so it
  is called, its FutureWarning silenced, as torchtitan does;
- the pass is switched on around each training step (:func:`micro_pipeline_tp`), where
  every compilation of the job happens: a block's forward compiles at its first call
  and its backward at the first backward through it (again when shapes change), and
  inductor reads the flag then. Outside the step the previous value is back, so other
  compiled code in the process is left as it was; torch keeps inductor's settings per
  thread (a ``ContextVar``) and autograd hands the step's to its device threads.

Symmetric memory and the fused ops exist for CUDA devices only: on any other device the
job stops in one line before any collective (:func:`check_async_tp`). A dry run
compiles nothing and runs the collectives synchronously; its report says so.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch
from torch._inductor import config as inductor_config
from torch.distributed.device_mesh import DeviceMesh

from autopar.runtime.errors import AsyncTPError


def check_async_tp(device: torch.device) -> None:
    """Refuse an ``async_tp`` plan on ``device`` unless it is a CUDA device: the fused
    all-gather/reduce-scatter matmuls run on symmetric memory, which only CUDA has."""
    if device.type != "cuda":
        raise AsyncTPError(
            f"async_tp=True needs CUDA devices (torch's symmetric memory and its fused all-gather/reduce-scatter "
            f"matmuls), not {device.type}; plan with --set async_tp=false (async_tp=False) to run on {device.type}."
        )


def enable_async_tp(tp_mesh: DeviceMesh, device: torch.device) -> str:
    """Register the tensor-parallel group of ``tp_mesh`` for symmetric memory, so that
    inductor's micro-pipeline pass fuses its collectives; returns the group's name.
    Refused off CUDA (:func:`check_async_tp`)."""
    check_async_tp(device)
    from torch.distributed import _symmetric_memory

    name = tp_mesh.get_group().group_name
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        _symmetric_memory.enable_symm_mem_for_group(name)
    return name


@contextlib.contextmanager
def micro_pipeline_tp() -> Iterator[None]:
    """Inductor's micro-pipeline TP pass on inside, the previous setting restored on
    exit: wraps a step of an ``async_tp`` job, where its blocks compile."""
    with inductor_config.patch(_micro_pipeline_tp=True):
        yield
