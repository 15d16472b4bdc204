"""Steps whose loss or gradients are not finite are skipped on every rank at once.

One NaN on one rank poisons the whole model within a step: the gradient reduction
spreads it to every data-parallel replica, and the optimizer writes it into the weights
and their moments, after which every loss is NaN and nothing says why. So before each
optimizer step every rank checks its own share (its loss where it computes one, and its
local gradients: one max-norm pass over them, which an inf or NaN survives), and one
all-reduce of two numbers over the world gives every rank the same verdict and the
lowest ranks that saw a bad loss and bad gradients. A bad step is skipped everywhere (weights and
optimizer state stay those of the last good step), logged on rank 0 and recorded in
``job.metrics``; more than ``max_consecutive_skips`` in a row stop the job with a
:class:`~autopar.runtime.errors.NonFiniteError` naming the step, because a run that
cannot make progress should fail rather than spend its allocation.

Under fp16 the loss scaler's overflow check is this same verdict: an overflow skips the
step and halves the scale (:mod:`autopar.runtime.loss_scale`), and counts as a skip, so
a scale that decays without end also stops the job.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from autopar.runtime.errors import NonFiniteError

DEFAULT_MAX_CONSECUTIVE_SKIPS = 10
"""An fp16 plan starts at a loss scale of 2^16; ten overflows in a row bring it to 64,
below which no healthy model's gradients need it, and a bf16 or fp32 run that is bad ten
steps running is diverging, not unlucky."""

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """What every rank agreed about one step.

    Attributes:
        loss_rank: the lowest rank whose loss was inf or NaN; -1 when none.
        grads_rank: the lowest rank whose gradients held an inf or NaN; -1 when none
            (a data-parallel reduction spreads one rank's NaN to every replica, so the
            loss's rank is where to look first).
    """

    loss_rank: int
    grads_rank: int

    @property
    def finite(self) -> bool:
        """Whether the optimizer may step."""
        return self.loss_rank < 0 and self.grads_rank < 0

    def cause(self) -> str:
        """What was not finite and where, for people."""
        what = [
            f"{w} (first on rank {r})" for w, r in (("loss", self.loss_rank), ("gradients", self.grads_rank)) if r >= 0
        ]
        return f"non-finite {' and '.join(what)}"


def nonfinite(grads: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Whether any of this rank's gradients holds an inf or NaN: a 0-dim bool on
    ``device`` (no host sync). DTensors are checked on their local shard."""
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    if not local:
        return torch.zeros((), dtype=torch.bool, device=device)
    norms = torch._foreach_norm(local, float("inf"))  # inf and NaN survive a max of |g|
    return (~torch.isfinite(torch.stack([n.float() for n in norms]))).any().to(device)


def agree(loss_bad: torch.Tensor, grads_bad: torch.Tensor, device: torch.device) -> Verdict:
    """The world's verdict from this rank's flags (0-dim bools): one all-reduce (max) of
    two numbers, each ``world - rank`` where the flag is set, else 0."""
    rank, world = dist.get_rank(), dist.get_world_size()
    flags = torch.stack([loss_bad.to(device), grads_bad.to(device)]).float() * float(world - rank)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    loss, grads = (world - int(v) if v else -1 for v in flags.tolist())
    return Verdict(loss_rank=loss, grads_rank=grads)


@dataclass(kw_only=True)
class SkipCounter:
    """Counts skipped steps in a row and stops the job past the limit.

    Attributes:
        max_consecutive_skips: skips in a row allowed; one more raises.
        consecutive: skips since the last good step.
        first_skipped_step: the first step of the current run of skips (-1 when none).
    """

    max_consecutive_skips: int = DEFAULT_MAX_CONSECUTIVE_SKIPS
    consecutive: int = 0
    first_skipped_step: int = -1

    def admit(self, step: int, verdict: Verdict, *, loss_scale: float | None = None) -> bool:
        """Whether the optimizer steps after ``step``; logs a skip on rank 0 and raises
        :class:`NonFiniteError` on every rank once skips in a row pass the limit."""
        if verdict.finite:
            self.consecutive, self.first_skipped_step = 0, -1
            return True
        self.consecutive += 1
        if self.first_skipped_step < 0:
            self.first_skipped_step = step
        scale = f"; fp16 loss scale now {loss_scale:g}" if loss_scale is not None else ""
        if self.consecutive > self.max_consecutive_skips:
            raise NonFiniteError(
                f"steps {self.first_skipped_step}-{step}: {self.consecutive} steps in a row had {verdict.cause()}, "
                f"more than max_consecutive_skips={self.max_consecutive_skips}{scale}; the weights are those "
                f"before step {self.first_skipped_step}. Check the data of those steps, lower the learning rate "
                f"or resume from a checkpoint."
            )
        if dist.get_rank() == 0:
            log.warning(
                "autopar: step %d skipped on every rank: %s; %d in a row (the job stops after %d)%s",
                step,
                verdict.cause(),
                self.consecutive,
                self.max_consecutive_skips,
                scale,
            )
        return False
