"""The job's optimizer: one inner optimizer per local stage, state sharded for ZeRO-1.

With ``zero_stage == 1`` each data-parallel rank owns a balanced subset of the
parameters of all its local stages together (greedy by element count, the same on every
rank: partitioned stage by stage, every stage's largest weight went to the first rank,
and with interleaved stages its optimizer state grew by one weight per stage), keeps
optimizer state only for those, steps them, and broadcasts the updated values to the
other replicas:
ZeRO stage 1 (Rajbhandari et al. 2020), as ``ZeroRedundancyOptimizer`` does. It is
written here rather than wrapping ``ZeroRedundancyOptimizer`` because that class keeps a
rank-indexed state dict that must be consolidated onto one rank, which
``torch.distributed.checkpoint`` cannot reshard, and it broadcasts whole parameters,
which fails on tensor-parallel DTensors. Here each inner optimizer is a plain
``torch.optim`` optimizer over the owned parameters, so ``get_state_dict`` sees ordinary
per-FQN state and checkpoints reshard to any plan. With FSDP2 (stages 2, 3) the
parameters are already sharded DTensors and a plain optimizer over them is sharded too.
Expert weights under expert parallelism differ between the data-parallel ranks (each
holds its ``1 / ep`` of the experts); ZeRO-1 leaves them out of the partition, and every
rank steps its own.

Like torchtitan's ``OptimizersContainer``, the container is a ``torch.optim.Optimizer``
whose ``param_groups`` are the inner optimizers' groups, so learning-rate schedulers work.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from autopar.runtime.errors import JobError
from autopar.runtime.expert_parallel import is_expert_param


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def partition(params: list[nn.Parameter], dp: int) -> list[int]:
    """The owning data-parallel rank of each parameter: largest first, each to the rank
    with the fewest elements so far (ties to the lower rank); deterministic."""
    owner = [0] * len(params)
    load = [0] * dp
    order = sorted(range(len(params)), key=lambda i: (-_local(params[i]).numel(), i))
    for i in order:
        r = min(range(dp), key=lambda k: (load[k], k))
        owner[i] = r
        load[r] += _local(params[i]).numel()
    return owner


class _Part:
    """One stage module's parameters shared by the data-parallel ranks, the owned subset,
    the parameters only this rank's replicas hold (``local``: experts), and the inner
    optimizer over the owned and local ones."""

    def __init__(
        self,
        module: nn.Module,
        params: list[nn.Parameter],
        owners: list[int],
        me: int,
        make: Callable[[list[nn.Parameter]], Optimizer],
        local: tuple[nn.Parameter, ...] = (),
    ):
        self.module = module
        self.params = params
        self.owners = owners
        self.local = local
        owned = [p for p, o in zip(params, owners) if o == me] + list(local)
        self.inner: Optimizer | None = make(owned) if owned else None


class ShardedOptimizer(Optimizer):
    """Steps every local stage's parameters; ZeRO-1 when built with a data-parallel group.

    Args:
        modules: the local stage modules (their trainable parameters are optimised).
        optimizer_cls: a ``torch.optim`` class.
        kwargs: its settings (``lr=...``).
        dp_group: the data-parallel group to shard optimizer state over, or None.
        gate: called first by every ``step``; the step is skipped when it returns False
            (fp16 loss scaling after an overflow, the same verdict on every rank).
    """

    def __init__(
        self,
        modules: list[nn.Module],
        optimizer_cls: type[Optimizer],
        kwargs: dict[str, Any],
        dp_group: dist.ProcessGroup | None = None,
        gate: Callable[[], bool] | None = None,
    ):
        self._dp_group = dp_group
        self._gate = gate
        dp = dist.get_world_size(dp_group) if dp_group is not None else 1
        me = dist.get_rank(dp_group) if dp_group is not None else 0
        every: list[nn.Parameter] = []
        shared: list[list[nn.Parameter]] = []
        experts: list[tuple[nn.Parameter, ...]] = []
        for module in modules:
            trainable = [p for p in module.parameters() if p.requires_grad]
            shared.append([p for p in trainable if dp_group is None or not is_expert_param(p)])
            experts.append(tuple(p for p in trainable if dp_group is not None and is_expert_param(p)))
            every.extend(trainable)
        flat = [p for params in shared for p in params]
        owners = partition(flat, dp) if dp_group is not None else [0] * len(flat)
        self.parts: list[_Part] = []
        start = 0
        for module, params, local in zip(modules, shared, experts):
            mine = owners[start : start + len(params)]
            start += len(params)
            self.parts.append(_Part(module, params, mine, me, lambda ps: optimizer_cls(ps, **kwargs), local))
        if not every:
            raise JobError("the stage has no trainable parameters to optimise.")
        Optimizer.__init__(self, every, dict(kwargs))
        self.param_groups = [g for part in self.parts if part.inner is not None for g in part.inner.param_groups]

    @property
    def inner(self) -> list[Optimizer | None]:
        """The inner optimizer of each local stage (None where this rank owns nothing)."""
        return [part.inner for part in self.parts]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        """Step the owned parameters, then share the updated values (ZeRO-1); nothing
        when the gate says to skip this step."""
        if closure is not None:
            raise JobError("closures are not supported: call job.step(batch) for the loss, then opt.step().")
        if self._gate is not None and not self._gate():
            return
        for part in self.parts:
            if part.inner is not None:
                part.inner.step()
        if self._dp_group is not None:
            for part in self.parts:
                self._broadcast(part)

    def _broadcast(self, part: _Part) -> None:
        for owner in sorted(set(part.owners)):
            tensors = [_local(p).data for p, o in zip(part.params, part.owners) if o == owner]
            flat = torch.cat([t.reshape(-1) for t in tensors])
            dist.broadcast(flat, src=dist.get_global_rank(self._dp_group, owner), group=self._dp_group)
            offset = 0
            for t in tensors:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of every local parameter (owned or not).

        Gradients that are views of DDP's communication buckets
        (``gradient_as_bucket_view``) are zeroed in place even with ``set_to_none``:
        DDP keeps the buckets either way, and a gradient set to None comes back in the
        next step's first micro-batches as a fresh tensor beside them (DDP skips the
        buckets under ``no_sync``), so with gradient accumulation every gradient would
        be held twice until the last micro-batch copies it into its bucket.
        """
        for part in self.parts:
            in_buckets = isinstance(part.module, DistributedDataParallel) and part.module.gradient_as_bucket_view
            for p in (*part.params, *part.local):
                if p.grad is None:
                    continue
                if set_to_none and not in_buckets:
                    p.grad = None
                else:
                    p.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        """Refused: use ``job.save_checkpoint``, which reshards."""
        raise JobError(
            "the job's optimizer state is sharded; save it with job.save_checkpoint(path), which writes "
            "every rank's part with torch.distributed.checkpoint."
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Refused: use ``job.load_checkpoint``."""
        raise JobError("load the job's optimizer state with job.load_checkpoint(path).")
