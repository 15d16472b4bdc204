"""Dynamic loss scaling for fp16 plans, agreed over every mesh axis.

fp16 has 5 exponent bits: gradients below about 6e-8 flush to zero. fp16 training
therefore multiplies the loss by a large scale before backward and divides the gradients
by it before the optimizer step; when a scaled gradient overflows, the step is skipped
and the scale halved, and after ``growth_interval`` clean steps the scale doubles
(Micikevicius et al. 2018, "Mixed Precision Training"; the rule and defaults of
``torch.amp.GradScaler``). ``GradScaler`` decides from one rank's tensors; here the
overflow flag is reduced over the whole world, so every rank of every stage, shard and
replica skips the same steps, and DTensor gradients (FSDP2 and tensor-parallel shards)
are unscaled in place. bf16 has fp32's exponent range and needs none of this.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

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
    _found_inf: bool | None = None  # this step's verdict once its gradients are unscaled

    def scaled(self, loss_fn: LossFn) -> LossFn:
        """``loss_fn`` times the scale current when it is called."""

        def scaled_loss(*args: Any, **kwargs: Any) -> torch.Tensor:
            return loss_fn(*args, **kwargs) * self.scale

        return scaled_loss

    def unscale_(self, grads: Iterable[torch.Tensor], device: torch.device) -> bool:
        """Divide this step's gradients by the scale (once per step; later calls return
        the first verdict) and return whether any rank found an inf or NaN. Every rank
        must call it: the verdict is all-reduced over the default group."""
        if self._found_inf is None:
            inv = 1.0 / self.scale
            flags = []
            for g in grads:
                g.mul_(inv)
                local = g.to_local() if isinstance(g, DTensor) else g
                flags.append((~torch.isfinite(local)).any().to(device))  # stays on the device: one sync below
            bad = torch.stack(flags).any() if flags else torch.zeros((), dtype=torch.bool, device=device)
            bad = bad.float().reshape(1)
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
            self._found_inf = bool(bad.item() > 0)
        return self._found_inf

    def update(self) -> bool:
        """End the step: back off after an overflow, grow after ``growth_interval`` clean
        steps; returns whether the optimizer should step. Call after ``unscale_``."""
        if self._found_inf is None:
            raise RuntimeError("LossScaler.update() before unscale_(): the step's gradients were never checked.")
        step = not self._found_inf
        self._found_inf = None
        if not step:
            self.scale *= self.backoff_factor
            self.clean_steps = 0
            return False
        self.clean_steps += 1
        if self.clean_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0
        return True

    def state(self) -> dict[str, float]:
        """What a checkpoint keeps."""
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def restore(self, state: Mapping[str, float]) -> None:
        """Continue from a checkpoint's ``state()``."""
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self._found_inf = None
