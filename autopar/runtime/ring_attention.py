"""Ring attention for context parallelism, scoped to a training step.

Under :func:`ring_attention` every ``F.scaled_dot_product_attention`` call sees its
query, key and value as this rank's sequence shard (dimension 2) of the context-parallel
group, the shards being in torch's head-tail order (:mod:`autopar.runtime.context_parallel`).
The context replaces ``F.scaled_dot_product_attention`` by a function that wraps them as
``Shard(2)`` DTensors on the ``cp`` mesh, as torch's ``context_parallel`` does, and
DTensor dispatches the attention kernel the call resolves to onto torch's ring
algorithm (``_templated_ring_attention`` and its backward, Liu et al. 2023): forward,
one all-gather of the K/V shards over the group (torch's default rotate method
``allgather``) and a causal, load-balanced merge of the partial results by their
log-sum-exp; backward, the same all-gather of K/V and the dK/dV partial sums
passed around the ring (all-to-all shifts).

torch registers ring handlers for the CUDA kernels only (flash, memory-efficient,
cuDNN); those run as they are. On the CPU, SDPA resolves to
``aten._scaled_dot_product_flash_attention_for_cpu`` (and its backward), which has no
context-parallel handler; :func:`_cpu_flash_ring` and :func:`_cpu_flash_ring_backward`
give it one that runs torch's same ring functions with the CPU kernel, so a gloo job
runs the algorithm an NCCL job runs. The CPU kernel's log-sum-exp is ``(b, heads, s)``
(a strided view of a ``(b, s, heads)`` buffer), the layout torch's ``_SDPAMerger``
expects of the flash kernels: it unsqueezes the last dimension and chunks dimension 2;
the backward kernel reads it through its strides.

A module attribute, not a function mode: recomputation reruns the forward inside
backward, where autograd carries no Python function mode, and must reach the ring again
(a selectively recomputed core reruns the builtin on the saved DTensors, which DTensor
sends to the ring by itself). Everything the context installs (the function, the
handlers, torch's ring options: load balancing on, rotate method all-gather) is
restored when it exits; a step runs inside it, forward and backward.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.experimental._context_parallel import _attention as cp_attention

from autopar.runtime.errors import ContextParallelError

SEQ_DIM = 2
"""The sequence dimension of SDPA's (batch, heads, seq, head_dim) operands."""

_aten = torch.ops.aten
_CPU_FORWARD = _aten._scaled_dot_product_flash_attention_for_cpu.default
_CPU_BACKWARD = _aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _local(t: Any) -> Any:
    return t._local_tensor if isinstance(t, DTensor) else t


def _sharded(local: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """``local`` as this rank's ``Shard(2)`` part of an evenly sharded DTensor."""
    shape = list(local.shape)
    shape[SEQ_DIM] *= mesh.size()
    stride = torch.empty(shape, device="meta").stride()
    spec = DTensorSpec(mesh, (Shard(SEQ_DIM),), tensor_meta=TensorMeta(torch.Size(shape), stride, local.dtype))
    return DTensor(local, spec, requires_grad=False)


class _WaitedRotater:
    """One of torch's ring rotaters whose every exchange is waited for as soon as it is
    issued, so that no gloo collective of the ring is in flight when the next one starts
    or when the buffers it reads and writes are replaced."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def exchange_buffers(self, curr_buffer: torch.Tensor) -> None:
        self._inner.exchange_buffers(curr_buffer)
        self._inner.next_buffer()

    def next_buffer(self) -> torch.Tensor:
        return self._inner.next_buffer()


@contextlib.contextmanager
def _waited_exchanges() -> Iterator[None]:
    """Torch's ring functions with their exchanges waited at once (:class:`_WaitedRotater`).
    The CPU path runs on gloo, where a rank of the full test suite twice aborted with a
    corrupted heap inside the ring backward's asynchronous exchanges (the all-gather of
    K/V and the all-to-all of dK/dV in flight together). The CPU path gives up the overlap
    of exchange and attention that :mod:`autopar.cost.context_parallel` prices from
    torch's schedule, which the GPU path keeps."""
    create = cp_attention._create_rotater
    cp_attention._create_rotater = lambda *args, **kwargs: _WaitedRotater(create(*args, **kwargs))
    try:
        yield
    finally:
        cp_attention._create_rotater = create


def _cpu_flash_ring(op_call: Any, args: tuple, kwargs: dict) -> tuple[DTensor, DTensor]:
    query, key, value, *rest = args
    dropout_p = rest[0] if len(rest) > 0 else kwargs.get("dropout_p", 0.0)
    is_causal = rest[1] if len(rest) > 1 else kwargs.get("is_causal", False)
    mesh = query.device_mesh
    with _waited_exchanges():
        out, lse = cp_attention._templated_ring_attention(
            mesh.get_group(),
            SEQ_DIM,
            _CPU_FORWARD,
            query=_local(query),
            key=_local(key),
            value=_local(value),
            is_causal=is_causal,
            dropout_p=dropout_p,
            scale=kwargs.get("scale"),
        )
    return _sharded(out, mesh), _sharded(lse, mesh)


def _cpu_flash_ring_backward(op_call: Any, args: tuple, kwargs: dict) -> tuple[DTensor, ...]:
    grad_out, query, key, value, out, lse, dropout_p, is_causal = args
    mesh = query.device_mesh
    with _waited_exchanges():
        grads = cp_attention._templated_ring_attention_backward(
            mesh.get_group(),
            SEQ_DIM,
            _CPU_BACKWARD,
            grad_out=_local(grad_out),
            grad_out_name="grad_out",
            query=_local(query),
            key=_local(key),
            value=_local(value),
            out=_local(out),
            logsumexp=_local(lse),
            is_causal=is_causal,
            dropout_p=dropout_p,
            scale=kwargs.get("scale"),
        )
    return tuple(_sharded(g, mesh) for g in grads)


CPU_HANDLERS = {_CPU_FORWARD: _cpu_flash_ring, _CPU_BACKWARD: _cpu_flash_ring_backward}


_SDPA = torch._C._nn.scaled_dot_product_attention
"""The builtin ``F.scaled_dot_product_attention`` is, while no step runs."""


def _ring_sdpa(
    mesh: DeviceMesh,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` on this rank's sequence shards of the ``mesh``'s
    ranks: the builtin on ``Shard(2)`` DTensors, which DTensor sends to the ring."""
    kwargs = {"dropout_p": dropout_p, "scale": scale, "enable_gqa": enable_gqa}
    if _shapes_only(query):  # no values to exchange; the local result has the ring's shapes
        return _SDPA(query, key, value, attn_mask, is_causal=is_causal, **kwargs)
    check_ring_call(attn_mask, is_causal)
    q, k, v = (DTensor.from_local(t, mesh, [Shard(SEQ_DIM)], run_check=False) for t in (query, key, value))
    return _SDPA(q, k, v, is_causal=True, **kwargs).to_local()


def _shapes_only(t: torch.Tensor) -> bool:
    """Whether ``t`` has no values (meta or fake): a forward run for its shapes and
    memory alone, as a measured dry run's (:mod:`autopar.runtime.dry_step`)."""
    return t.is_meta or isinstance(t, FakeTensor)


def check_ring_call(attn_mask: Any, is_causal: bool) -> None:
    """Refuse an attention call the causal, load-balanced ring cannot compute."""
    if attn_mask is not None or not is_causal:
        raise ContextParallelError(
            f"context parallelism got an F.scaled_dot_product_attention call with attn_mask="
            f"{'a tensor' if attn_mask is not None else None}, is_causal={is_causal}; the ring runs causal "
            f"attention without a mask only. Use is_causal=True and no mask, or a plan with cp=1."
        )


@contextlib.contextmanager
def ring_attention(mesh: DeviceMesh) -> Iterator[None]:
    """Within the context, SDPA calls attend over the whole sequence of the ``mesh``'s
    ranks (see the module docstring); nothing is left installed after it."""
    dispatcher = DTensor._op_dispatcher
    handlers = dispatcher._custom_op_handlers
    options = cp_attention._cp_options
    saved = (options.enable_load_balance, options.rotate_method)
    cuda = mesh.device_type != "cpu"
    previous = F.scaled_dot_product_attention
    try:
        options.enable_load_balance = True
        options.rotate_method = cp_attention._RotateMethod.ALL_GATHER
        if cuda:
            cp_attention._enable_cp_dtensor_dispatcher()
        else:
            dispatcher._custom_op_handlers = {**handlers, **CPU_HANDLERS}
        F.scaled_dot_product_attention = functools.partial(_ring_sdpa, mesh)
        yield
    finally:
        F.scaled_dot_product_attention = previous
        if cuda:
            cp_attention._disable_cp_dtensor_dispatcher()
        dispatcher._custom_op_handlers = handlers
        options.enable_load_balance, options.rotate_method = saved
