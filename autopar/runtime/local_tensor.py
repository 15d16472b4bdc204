"""DTensor activations handed to user code as local tensors that it may modify in place.

``DTensor.to_local`` returns a view made inside a custom autograd Function. Autograd
refuses to modify such a view in place (it could not rewrite that Function's backward),
so model code that adds into a layer's output (transformers' Falcon: ``mlp_output +=
attention_output``, beside a row-parallel MLP) fails. :func:`to_local` passes the view
through an identity Function whose output is a fresh tensor object sharing the storage
and the version counter: no copy, in-place ops are recorded on top of it as usual, and
autograd still notices a modified tensor that some backward saved.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


class _Fresh(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad


def to_local(x: DTensor) -> torch.Tensor:
    """``x.to_local()`` (its gradient converted back as DTensor does) that user code may
    modify in place."""
    local = x.to_local()
    return _Fresh.apply(local) if local.requires_grad else local


def local_output(_module: torch.nn.Module, _args: tuple, out: object) -> object:
    """A forward hook: a DTensor output handed on as :func:`to_local` hands it."""
    return to_local(out) if isinstance(out, DTensor) else out
