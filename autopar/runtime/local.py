"""Run a plan for a few steps on local processes and measure it.

What the demo, the notebooks and the measured benchmarks share: fork one process per
rank (:func:`autopar.runtime.spmd.run_spmd`), ``parallelize`` the model, train a few
steps on seeded random data, and time each step between barriers (so the slowest rank
sets it). Peak memory is measured in a separate short run, because counting live
storages slows steps down 2-3x.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autopar.plan import Plan
from autopar.runtime.spmd import SPMDSettings, run_spmd

BatchFn = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
"""``(global_batch_size, seed) -> (inputs, targets)``: one global batch."""


@dataclass(frozen=True, kw_only=True)
class LocalRun:
    """What a local run measured.

    Attributes:
        step_times_s: wall time of each measured step (after warm-up), max over ranks.
        losses: the mean loss of every step, warm-up included.
        peak_memory_bytes: peak bytes the framework allocated, per rank (empty when not
            measured).
    """

    step_times_s: tuple[float, ...]
    losses: tuple[float, ...]
    peak_memory_bytes: tuple[int, ...] = ()

    @property
    def median_step_s(self) -> float:
        """Median step time."""
        return statistics.median(self.step_times_s)


def token_batches(vocab_size: int, seq_len: int) -> BatchFn:
    """Random token ids and next-token targets for a token model."""

    def make(batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        x = torch.randint(0, vocab_size, (batch, seq_len), generator=g)
        return x, torch.randint(0, vocab_size, (batch, seq_len), generator=g)

    return make


def cross_entropy(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy in fp32 (the loss the planner assumes for token models)."""
    logits = output if isinstance(output, torch.Tensor) else output.logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, -2).float(), target.flatten())


def _worker(
    rank: int,
    world: int,
    build: Callable[[], nn.Module],
    plan: Plan,
    batch_fn: BatchFn,
    loss_fn: Callable,
    steps: int,
    warmup: int,
    measure_memory: bool,
    lr: float,
    sample_input: Any,
) -> dict[str, Any]:
    from autopar.runtime.api import parallelize

    torch.manual_seed(0)
    job = parallelize(build(), plan, loss_fn=loss_fn, measure_memory=measure_memory, sample_input=sample_input)
    opt = job.optimizer(torch.optim.AdamW, lr=lr)
    batches = [batch_fn(plan.config.global_batch_size, 1000 + i) for i in range(steps)]
    times, losses = [], []
    for i, batch in enumerate(job.shard(batches)):
        dist.barrier()
        start = time.perf_counter()
        losses.append(job.step(batch))
        opt.step()
        opt.zero_grad()
        dist.barrier()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    peak = job.metrics[-1].peak_memory_bytes if measure_memory else 0  # the steady state: the last step
    return {"times": times, "losses": losses, "peak": peak}


def run_locally(
    build: Callable[[], nn.Module],
    plan: Plan,
    batch_fn: BatchFn,
    *,
    loss_fn: Callable = cross_entropy,
    steps: int = 6,
    warmup: int = 2,
    measure_memory: bool = True,
    lr: float = 1e-3,
    settings: SPMDSettings | None = None,
    sample_input: Any = None,
) -> LocalRun:
    """Train ``plan`` for ``steps`` steps on ``plan.config.world_size`` local processes.

    ``build`` makes the model on every rank (seeded identically). With
    ``measure_memory`` a second, three-step run records each rank's peak allocation in
    its last step (the first steps also allocate optimizer state and communication
    buckets once).

    ``sample_input`` is handed to :func:`autopar.runtime.api.parallelize`: one
    micro-batch of inputs (e.g. ``batch_fn(plan.config.micro_batch_size, 0)[0]``),
    needed when the plan shards layers of a model that takes no token ids (an MLP, a
    CNN), whose tensor-parallel layouts come from tracing one forward. Token models
    need none: they are traced with the plan's sequence length.
    """
    world = plan.config.world_size
    settings = settings or SPMDSettings(timeout_s=600)
    timed = run_spmd(
        _worker, world, build, plan, batch_fn, loss_fn, steps, warmup, False, lr, sample_input, settings=settings
    )
    peaks: tuple[int, ...] = ()
    if measure_memory:
        metered = run_spmd(
            _worker, world, build, plan, batch_fn, loss_fn, 3, 0, True, lr, sample_input, settings=settings
        )
        peaks = tuple(r["peak"] for r in metered)
    step_times = tuple(max(r["times"][i] for r in timed) for i in range(len(timed[0]["times"])))
    return LocalRun(step_times_s=step_times, losses=tuple(timed[0]["losses"]), peak_memory_bytes=peaks)
