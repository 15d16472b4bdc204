"""Dynamic loss scaling for fp16 plans, agreed over every mesh axis.

fp16 has 5 exponent bits: gradients below about 6e-8 flush to zero. fp16 training
therefore multiplies the loss by a large scale before backward and divides the gradients
by it before the optimizer step; when a scaled gradient overflows, the step is skipped
and the scale halved, and after ``growth_interval`` clean steps the scale doubles
(Micikevicius et al. 2018, "Mixed Precision Training"; the rule and defaults of
``torch.amp.GradScaler``). ``GradScaler`` decides from one rank's tensors; here the
overflow flag is the world's verdict on the step (:mod:`autopar.runtime.finite`), so
every rank of every stage, shard and replica skips the same steps, and DTensor gradients
(FSDP2 and tensor-parallel shards) are unscaled in place. bf16 has fp32's exponent range and needs none of this.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from autopar.runtime.finite import nonfinite

LossFn = Callable[..., torch.Tensor]


@dataclass(kw_only=True)
class LossScaler:
    """The scale and its schedule; one per job, the same on every rank.

    Attributes:
        scale: the current loss scale.
        growth_factor, backoff_factor, growth_interval: as ``torch.amp.GradScaler``.
        clean_steps: optimizer steps taken since the scale last changed.
    """

    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    clean_steps: int = 0
    _local_inf: torch.Tensor | None = None  # this rank's overflow flag once the step's gradients are unscaled

    def scaled(self, loss_fn: LossFn) -> LossFn:
        """``loss_fn`` times the scale current when it is called."""

        def scaled_loss(*args: Any, **kwargs: Any) -> torch.Tensor:
            return loss_fn(*args, **kwargs) * self.scale

        return scaled_loss

    def unscale_(self, grads: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
        """Divide this step's gradients by the scale (once per step; later calls return
        the first result) and return whether any of this rank's is inf or NaN, a 0-dim
        bool on ``device``. The world's verdict comes from :func:`autopar.runtime.finite.agree`."""
        if self._local_inf is None:
            grads = list(grads)
            inv = 1.0 / self.scale
            for g in grads:
                g.mul_(inv)
            self._local_inf = nonfinite(grads, device)
        return self._local_inf

    def update(self, found_inf: bool) -> None:
        """End the step with the world's verdict: back off after an overflow, grow after
        ``growth_interval`` clean steps."""
        self._local_inf = None
        if found_inf:
            self.scale *= self.backoff_factor
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0

    def state(self) -> dict[str, float]:
        """What a checkpoint keeps."""
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def restore(self, state: Mapping[str, float]) -> None:
        """Continue from a checkpoint's ``state()``."""
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self._local_inf = None
