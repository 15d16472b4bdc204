"""Context parallelism: each sample's sequence split over the ``cp`` ranks.

A step's batch is split over ``dp`` as without context parallelism; then every tensor
with the sequence in dimension 1 (token ids, targets) is cut into ``2 * cp`` equal
chunks and cp rank ``r`` keeps chunks ``r`` and ``2 * cp - 1 - r`` (torch's head-tail
load balancing, ``_HeadTailLoadBalancer``): under a causal mask every rank then attends
over the same number of (query, key) pairs. The positions of those tokens, the same
permutation of ``0 .. s - 1``, are bound to every stage's forward (``positions=`` for
autopar's models, ``position_ids=`` for transformers decoders), so position embeddings
and rotary angles are those of the whole sequence. The attention itself runs as a ring
over the group (:mod:`autopar.runtime.ring_attention`); every other layer is per token
and runs on the local tokens unchanged.

The loss function's token mean on a rank is the mean over its ``s / cp`` tokens; every
rank holds as many, so the mean of the ranks' losses is the whole sequence's, and
averaging gradients over the ``dp x cp`` ranks (the ``dp_cp`` mesh) gives the gradient of
that mean (:mod:`autopar.runtime.data_parallel`).

Checked before any collective (:func:`check_context_parallel`): the sequence length
splits into ``2 * cp`` chunks, the forward takes positions, no sliding window narrower than
the sequence is configured, and every attention core of a
trial forward (``2 * cp`` tokens, without gradients) is ``F.scaled_dot_product_attention``
with ``is_causal=True`` and no mask, the only attention the causal ring computes.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer
from torch.overrides import TorchFunctionMode

from autopar.graph.extract import training_kwargs, unpacked_sequences
from autopar.models.moe import MoEFeedForward
from autopar.plan import Plan
from autopar.runtime.errors import ContextParallelError
from autopar.runtime.ring_attention import check_ring_call

SEQ_DIM = 1
"""The sequence dimension of a batch's token ids and targets."""


def local_positions(seq_len: int, cp: int, rank: int, device: torch.device | str) -> torch.Tensor:
    """Positions (long, ``seq_len / cp``) of the tokens cp rank ``rank`` holds, in its order."""
    order = _HeadTailLoadBalancer(seq_len, cp, device)._generate_indices()[0]
    return order.view(cp, -1)[rank].long()


def check_sequence(inputs: Any, seq_len: int, cp: int) -> None:
    """Refuse a batch whose (first) input does not hold the plan's ``seq_len`` tokens per
    sample: the positions bound to the stages are those of ``seq_len``."""
    first = inputs[0] if isinstance(inputs, tuple) else inputs
    if isinstance(first, torch.Tensor) and (first.dim() <= SEQ_DIM or first.shape[SEQ_DIM] != seq_len):
        raise ContextParallelError(
            f"with cp={cp} job.step needs whole sequences of the plan's seq_len={seq_len} tokens (each cp rank "
            f"keeps its part); got inputs of shape {tuple(first.shape)}. Pass (batch, {seq_len}) token ids, or "
            f"make a plan for this sequence length."
        )


def shard_sequence(value: Any, positions: torch.Tensor, seq_len: int) -> Any:
    """``value`` (a tensor or a tuple of them) with every tensor whose dimension 1 is the
    sequence reduced to the tokens at ``positions``; other values pass unchanged."""
    if isinstance(value, torch.Tensor):
        if value.dim() > SEQ_DIM and value.shape[SEQ_DIM] == seq_len:
            return value.index_select(SEQ_DIM, positions.to(value.device))
        return value
    if isinstance(value, (tuple, list)):
        return tuple(shard_sequence(v, positions, seq_len) for v in value)
    return value


def position_keyword(model: nn.Module) -> str:
    """The forward's keyword for explicit positions: ``positions`` (autopar's models) or
    ``position_ids`` (transformers); ContextParallelError when it takes neither."""
    params = inspect.signature(type(model).forward).parameters
    for name in ("positions", "position_ids"):
        if name in params:
            return name
    raise ContextParallelError(
        f"cp > 1 needs the positions of each rank's tokens, but {type(model).__name__}.forward takes neither "
        f"'positions' nor 'position_ids'; add one of them (positions of the tokens given) or use cp=1."
    )


def bind_positions(stage: nn.Module, keyword: str, positions: torch.Tensor) -> None:
    """Make every call of ``stage`` pass this rank's token positions: 1-D for
    ``positions``; for transformers ``(1, s / cp)`` ``position_ids`` and an all-ones
    ``attention_mask``. Without a mask transformers reads position ids that jump (rank
    0's head and tail) as packed sequences and masks attention across the jump; the
    all-ones mask says the tokens are one sequence, so its SDPA call stays causal
    without a mask."""
    if keyword == "positions":
        stage.forward = functools.partial(stage.forward, positions=positions)
        return
    ones = torch.ones(1, positions.numel(), dtype=torch.long, device=positions.device)
    stage.forward = functools.partial(stage.forward, position_ids=positions.unsqueeze(0), attention_mask=ones)


def _check_window(model: nn.Module, cp: int, seq_len: int) -> None:
    """Refuse sliding-window attention narrower than the sequence (a transformers config's
    ``sliding_window``): the ring attends causally over the whole sequence, and the trial
    forward's few tokens fit in any window."""
    config = getattr(model, "config", None)
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) is False or not isinstance(window, int) or window >= seq_len:
        return
    raise ContextParallelError(
        f"cp={cp}: {type(model).__name__} has sliding-window attention (sliding_window={window} < seq_len="
        f"{seq_len}), which the causal ring does not compute; use cp=1, or sequences of at most {window} tokens."
    )


class _AttentionCalls(TorchFunctionMode):
    """Records ``(attn_mask, is_causal)`` of each ``F.scaled_dot_product_attention`` call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, bool]] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            bound = {**dict(zip(("query", "key", "value", "attn_mask", "dropout_p", "is_causal"), args)), **kwargs}
            self.calls.append((bound.get("attn_mask"), bool(bound.get("is_causal", False))))
        return func(*args, **kwargs)


def check_context_parallel(model: nn.Module, plan: Plan) -> None:
    """Refuse a ``cp > 1`` plan the runtime cannot run on ``model`` (see the module docstring)."""
    cp, seq_len = plan.config.cp, plan.model.seq_len
    if cp == 1:
        return
    if seq_len % (2 * cp):
        raise ContextParallelError(
            f"seq_len={seq_len} does not split into 2 x cp = {2 * cp} equal chunks (head-tail load balancing "
            f"gives each cp rank two); use a sequence length divisible by {2 * cp}, or a cp dividing {seq_len // 2}."
        )
    if any(isinstance(m, MoEFeedForward) for m in model.modules()):
        raise ContextParallelError(
            f"cp={cp}: capacity-bounded experts (MoEFeedForward) fill each sample's buffers in token order over the "
            f"whole sequence, which no rank holding {seq_len // cp} of its tokens can do; use cp=1."
        )
    position_keyword(model)
    _check_window(model, cp, seq_len)
    device = next(iter(model.parameters())).device
    probe = _AttentionCalls()
    # a real forward of 2 x cp tokens (on the meta device for a meta model): under fake
    # tensors transformers takes the forward for a trace and builds an explicit mask; on
    # meta its check for packed sequences cannot read the positions, which are one
    # sequence per row here as on a real run
    with torch.no_grad(), torch.random.fork_rng(devices=[]), unpacked_sequences(), probe:
        model(torch.zeros(1, 2 * cp, dtype=torch.long, device=device), **training_kwargs(model))
    if not probe.calls:
        raise ContextParallelError(
            f"cp={cp}: {type(model).__name__} computes no F.scaled_dot_product_attention (a materialized "
            f"attention cannot run as a ring); use SDPA with is_causal=True, or cp=1."
        )
    for attn_mask, is_causal in probe.calls:
        check_ring_call(attn_mask, is_causal)
