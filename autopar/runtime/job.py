"""The Job: one rank's part of a parallel training run, built by ``autopar.parallelize``.

It runs a training step over every micro-batch and every mesh axis and returns the mean
loss on all ranks, builds the optimizer the plan's ZeRO stage asks for, hands each
data-parallel rank its slice of the global batches, clips gradients by their global
norm, saves and loads resharding checkpoints, and records per-step metrics.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import loss_parallel
from torch.optim import Optimizer

from autopar.errors import ConfigError
from autopar.plan import Plan
from autopar.runtime import checkpoint as ckpt
from autopar.runtime.async_tp import micro_pipeline_tp
from autopar.runtime.compile import compile_failures
from autopar.runtime.context_parallel import check_sequence, shard_sequence
from autopar.runtime.errors import JobError
from autopar.runtime.expert_parallel import SharedWeightSync
from autopar.runtime.finite import SkipCounter, Verdict, agree, nonfinite
from autopar.runtime.grad_norm import clip_, global_grad_norm
from autopar.runtime.loss_scale import LossScaler
from autopar.runtime.mesh import MESH_AXES, MeshDims
from autopar.runtime.metrics import MemoryMeter, StepMetrics
from autopar.runtime.optimizer import ShardedOptimizer
from autopar.runtime.pipeline import recv_buffers
from autopar.runtime.ring_attention import ring_attention
from autopar.runtime.tied import TiedGradSync, TiedParam, named_params
from autopar.vocab import MeshAxis


@dataclass(kw_only=True)
class JobParts:
    """What ``parallelize`` built for this rank (the Job's private inputs).

    Attributes:
        plan: the plan being run.
        mesh: the (pp, dp, cp, tp) device mesh.
        stages: the local stage modules (wrapped for data parallelism), in stage order.
        stage_indices: their indices in the plan's pipeline.
        schedule: the ``torch.distributed.pipelining`` schedule over them.
        pipeline_stages: the schedule's ``PipelineStage`` of each local stage.
        tied: parameters shared across pipeline ranks.
        tied_sync: sums those parameters' gradients.
        loss_parallel: the loss runs on vocabulary-sharded logits.
        shared_sync: averages the gradients of non-expert weights of the experts modules
            over the ep group (:mod:`autopar.runtime.expert_parallel`).
        dp_cp_group: the ranks holding the same weights (``dp`` x ``cp``): the loss is
            averaged over them.
        positions: under context parallelism the positions of the tokens this rank
            holds (:mod:`autopar.runtime.context_parallel`); None otherwise.
        device: where this rank computes.
        memory: the peak-memory meter.
        scaler: the dynamic loss scale of an fp16 plan (None otherwise); the schedule's
            loss is already multiplied by it.
        skips: counts steps skipped for non-finite values (:mod:`autopar.runtime.finite`).
        compiled_blocks: the blocks of the local stages that run compiled
            (:mod:`autopar.runtime.compile`), named when their backward fails to compile.
        async_tp: the steps run with inductor's micro-pipeline TP pass on, so the blocks
            compile with their tensor-parallel collectives fused into their matmuls
            (:mod:`autopar.runtime.async_tp`).
        metrics: one record per step.
    """

    plan: Plan
    mesh: DeviceMesh
    stages: list[nn.Module]
    stage_indices: tuple[int, ...]
    schedule: Any
    pipeline_stages: list[Any]
    tied: tuple[TiedParam, ...]
    tied_sync: TiedGradSync
    shared_sync: SharedWeightSync
    loss_parallel: bool
    dp_cp_group: Any
    positions: torch.Tensor | None
    device: torch.device
    memory: MemoryMeter
    scaler: LossScaler | None = None
    skips: SkipCounter = field(default_factory=SkipCounter)
    compiled_blocks: tuple[str, ...] = ()
    async_tp: bool = False
    metrics: list[StepMetrics] = field(default_factory=list)


class Job:
    """One rank's view of a parallel training job. Build it with ``autopar.parallelize``."""

    def __init__(self, parts: JobParts):
        self._p = parts
        self.plan = parts.plan
        self.mesh = parts.mesh
        self.dims = MeshDims.of(parts.plan)
        self.coordinate: dict[str, int] = {axis: parts.mesh[axis].get_local_rank() for axis in MESH_AXES}
        self._optimizer: ShardedOptimizer | None = None
        self._data_position = 0
        self._step = 0
        self._loss_bad: torch.Tensor | None = None  # this rank's loss of the last step was not finite
        self._verdict: Verdict | None = None  # the world's verdict on the last step, once asked

    # ----- what this rank holds -------------------------------------------------------
    @property
    def stages(self) -> list[nn.Module]:
        """The local stage modules (wrapped for data parallelism)."""
        return list(self._p.stages)

    @property
    def is_first_stage(self) -> bool:
        """Whether this rank runs the pipeline's first stage (it reads the inputs)."""
        return 0 in self._p.stage_indices

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank runs the last stage (it reads the targets and computes the loss)."""
        return self.plan.config.num_stages - 1 in self._p.stage_indices

    def named_parameters(self) -> dict[str, nn.Parameter]:
        """This rank's parameters by model FQN (wrapper prefixes removed; DTensors
        where sharded)."""
        out: dict[str, nn.Parameter] = {}
        for stage in self._p.stages:
            out.update(named_params(stage))
        return out

    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters."""
        return list(self.named_parameters().values())

    @property
    def metrics(self) -> list[StepMetrics]:
        """One record per ``step`` call: wall time, peak memory, loss."""
        return list(self._p.metrics)

    @property
    def data_position(self) -> int:
        """Global batches consumed so far (restored by ``load_checkpoint``)."""
        return self._data_position

    # ----- optimizer ------------------------------------------------------------------
    def optimizer(self, optimizer_cls: type[Optimizer], **kwargs: Any) -> ShardedOptimizer:
        """The optimizer over this rank's parameters, sharded as the plan's ZeRO stage says."""
        if self._optimizer is not None:
            raise JobError("job.optimizer() was already called; keep the optimizer it returned.")
        zero1 = self.plan.config.zero_stage == 1 and self.dims.dp_cp > 1
        group = self._p.dp_cp_group if zero1 else None
        self._optimizer = ShardedOptimizer(self._p.stages, optimizer_cls, kwargs, dp_group=group, gate=self._gate)
        return self._optimizer

    def _step_verdict(self) -> Verdict:
        """Whether the last step's loss and gradients are finite on every rank, asked
        once per step (an fp16 step's gradients are unscaled on the way)."""
        if self._verdict is None:
            grads = [p.grad for p in self.parameters() if p.grad is not None]
            device = self._p.device
            scaler = self._p.scaler
            grads_bad = scaler.unscale_(grads, device) if scaler is not None else nonfinite(grads, device)
            loss_bad = self._loss_bad if self._loss_bad is not None else torch.zeros((), dtype=torch.bool)
            self._verdict = agree(loss_bad, grads_bad, device)
        return self._verdict

    def _gate(self) -> bool:
        """The optimizer's gate: step only when every rank's loss and gradients are
        finite; a skip updates the fp16 scale, is recorded in ``metrics``, and past the
        limit stops the job (:class:`~autopar.runtime.finite.SkipCounter`)."""
        verdict = self._step_verdict()
        self._verdict, self._loss_bad = None, None
        if self._p.scaler is not None:
            self._p.scaler.update(found_inf=not verdict.finite)
        step = self._step - 1
        metrics = self._p.metrics
        if not verdict.finite and metrics and metrics[-1].step == step:
            metrics[-1] = dataclasses.replace(metrics[-1], skipped=True, skip_reason=verdict.cause())
        return self._p.skips.admit(step, verdict, loss_scale=self.loss_scale)

    @property
    def loss_scale(self) -> float | None:
        """The current fp16 loss scale (None for other precisions)."""
        return self._p.scaler.scale if self._p.scaler is not None else None

    # ----- data -----------------------------------------------------------------------
    def shard(self, batches: Iterable[Any]) -> Iterator[Any]:
        """This data-parallel rank's contiguous slice of each global batch.

        Batches already consumed before a resumed checkpoint are skipped, so iterating
        the same loader again continues where the saved run stopped.
        """
        dp, rank = self.dims.dp, self.coordinate["dp"]
        for index, batch in enumerate(batches):
            if index < self._data_position:
                continue
            self._data_position = index + 1
            yield _slice(batch, dp, rank)

    # ----- training -------------------------------------------------------------------
    def step(self, batch: tuple[Any, torch.Tensor]) -> float:
        """Forward and backward over every micro-batch of this rank's ``(inputs, targets)``;
        returns the mean loss over the global batch, the same on every rank.

        Under context parallelism the batch holds whole sequences; this rank keeps its
        part of each (:func:`~autopar.runtime.context_parallel.shard_sequence`).

        Gradients accumulate into ``.grad`` (averaged over the global batch); call
        ``clip_grad_norm_``, ``opt.step()`` and ``opt.zero_grad()`` after.
        """
        inputs, targets = _unpack(batch)
        self._verdict, self._loss_bad = None, None
        cfg = self.plan.config
        expected = cfg.micro_batch_size * cfg.num_microbatches
        rows = _rows(inputs)
        if rows != expected:
            raise ConfigError(
                f"job.step got a batch of {rows} samples on this data-parallel rank; the plan runs "
                f"micro_batch_size x num_microbatches = {cfg.micro_batch_size} x {cfg.num_microbatches} "
                f"= {expected}. Pass global batches of {expected * cfg.dp} through job.shard(loader)."
            )
        inputs = _to(inputs, self._p.device)
        targets = _to(targets, self._p.device)
        if self._p.positions is not None:
            check_sequence(inputs, self.plan.model.seq_len, self.dims.cp)
            inputs, targets = (shard_sequence(v, self._p.positions, self.plan.model.seq_len) for v in (inputs, targets))
        losses: list[torch.Tensor] = []
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        start = time.perf_counter()
        with self._p.memory.track(self._live_tensors()):
            self._run_schedule(args, targets, losses)
        self._p.tied_sync.sync(self.named_parameters())
        self._p.shared_sync.sync()
        loss = self._mean_loss(losses)
        wall = time.perf_counter() - start
        self._p.metrics.append(
            StepMetrics(step=self._step, wall_time_s=wall, loss=loss, peak_memory_bytes=self._p.memory.peak_bytes())
        )
        self._step += 1
        return loss

    def _run_schedule(self, args: tuple[Any, ...], targets: torch.Tensor, losses: list[torch.Tensor]) -> None:
        """Forward and backward of every micro-batch through this rank's stages: inputs
        on the first stage, targets and ``losses`` on the last."""
        cp = ring_attention(self.mesh[MeshAxis.CP.value]) if self.dims.cp > 1 else contextlib.nullcontext()
        parallel_loss = loss_parallel() if self._p.loss_parallel else contextlib.nullcontext()
        fused_tp = micro_pipeline_tp() if self._p.async_tp else contextlib.nullcontext()
        with cp, parallel_loss, fused_tp, compile_failures(list(self._p.compiled_blocks)):
            # return_outputs=False: the last stage would otherwise keep every micro-batch's
            # output (the logits) until the step ends, which the planner does not budget
            if self.is_first_stage and self.is_last_stage:
                self._p.schedule.step(*args, target=targets, losses=losses, return_outputs=False)
            elif self.is_first_stage:
                self._p.schedule.step(*args, return_outputs=False)
            elif self.is_last_stage:
                self._p.schedule.step(target=targets, losses=losses, return_outputs=False)
            else:
                self._p.schedule.step(return_outputs=False)

    def _live_tensors(self) -> list[torch.Tensor]:
        params = self.parameters()
        grads = [p.grad for p in params if p.grad is not None]
        state = [
            t
            for o in (self._optimizer.inner if self._optimizer is not None else [])
            if o is not None
            for st in o.state.values()
            for t in st.values()
            if isinstance(t, torch.Tensor)
        ]
        return [*params, *grads, *state, *recv_buffers(self._p.pipeline_stages)]

    def _mean_loss(self, losses: list[torch.Tensor]) -> float:
        if losses:
            values = [(x.full_tensor() if hasattr(x, "full_tensor") else x).detach().float() for x in losses]
            local = torch.stack(values).mean().reshape(1)
            if self._p.scaler is not None:  # the schedule ran the scaled loss
                local /= self._p.scaler.scale
        else:
            local = torch.zeros(1)
        self._loss_bad = ~torch.isfinite(local).all()
        local = local.to(self._p.device)
        if self.dims.pp > 1:
            dist.all_reduce(local, group=self.mesh["pp"].get_group())
        if self.dims.dp_cp > 1:  # every cp rank holds as many tokens: the mean of their means is the sequence's
            dist.all_reduce(local, group=self._p.dp_cp_group)
            local /= self.dims.dp_cp
        return float(local)

    def grad_norm(self) -> float:
        """The L2 norm of the whole model's gradient (every stage, every shard, tied
        parameters once); the same on every rank. Under fp16 loss scaling the
        gradients are unscaled first. inf (fp16) or NaN when some rank's loss or
        gradient was not finite: the optimizer will skip this step."""
        if not self._step_verdict().finite:
            return self._nonfinite_norm()
        return float(global_grad_norm(self.named_parameters(), self._norm_coordinate(), self._duplicates()))

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale all gradients so their global norm is at most ``max_norm``; returns the
        norm before clipping (as ``torch.nn.utils.clip_grad_norm_``). Under fp16 loss
        scaling the gradients are unscaled first. When some rank's loss or gradient was
        not finite it returns inf (fp16) or NaN and leaves them: the optimizer skips
        that step."""
        if not self._step_verdict().finite:
            return self._nonfinite_norm()
        params = self.named_parameters()
        norm = global_grad_norm(params, self._norm_coordinate(), self._duplicates())
        clip_(params, norm, max_norm)
        return float(norm)

    def _norm_coordinate(self) -> dict[str, int]:
        """The mesh coordinate, and the ep rank (the place in the ep group of
        ``ep`` consecutive ``dp_cp`` ranks) under expert parallelism."""
        dp_cp_rank = self.coordinate[MeshAxis.DP.value] * self.dims.cp + self.coordinate[MeshAxis.CP.value]
        return {**self.coordinate, MeshAxis.EP.value: dp_cp_rank % self.dims.ep}

    def _nonfinite_norm(self) -> float:
        return float("inf") if self._p.scaler is not None else float("nan")

    def _duplicates(self) -> frozenset[str]:
        return frozenset(f for t in self._p.tied for f in t.fqns[1:])

    # ----- checkpoints ----------------------------------------------------------------
    def save_checkpoint(self, path: str, *, step: int) -> str:
        """Save model, optimizer, data position, RNG and an fp16 plan's loss scale under
        ``path/step-<step>`` atomically; returns that directory."""
        scale = self._p.scaler.state() if self._p.scaler is not None else None
        return ckpt.save(
            self._checkpoint_parts(),
            path,
            step=step,
            data_position=self._data_position,
            global_batch_size=self.plan.config.global_batch_size,
            loss_scale=scale,
        )

    def load_checkpoint(self, path: str, *, step: int | None = None, weights_only: bool = False) -> int:
        """Load the latest (or the given) step saved under ``path`` by any plan; returns
        the step it was saved at. The job's metrics count on from the batches consumed
        (:attr:`data_position`), which is where a loop's step index resumes. Call after
        ``job.optimizer(...)``: a checkpoint with optimizer state is refused before it (the
        state would be lost), unless ``weights_only``."""
        state = ckpt.load(
            self._checkpoint_parts(),
            path,
            step=step,
            weights_only=weights_only,
            global_batch_size=self.plan.config.global_batch_size,
        )
        self._data_position = state.data_position
        self._step = state.data_position
        if self._p.scaler is not None and state.loss_scale is not None:
            self._p.scaler.restore(state.loss_scale)
        return state.step

    def _checkpoint_parts(self) -> ckpt.CheckpointParts:
        inner = self._optimizer.inner if self._optimizer is not None else [None] * len(self._p.stages)
        return ckpt.CheckpointParts(
            modules=list(self._p.stages),
            optimizers=list(inner),
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            aliases=tuple(t.fqns for t in self._p.tied),
            summary=self.plan.config.short(),
            model=self.plan.model.name,
            model_fingerprint=self.plan.model.fingerprint,
        )


def _unpack(batch: Any) -> tuple[Any, torch.Tensor]:
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise ConfigError(
            f"job.step expects a batch (inputs, targets); got {type(batch).__name__}"
            f"{f' of length {len(batch)}' if isinstance(batch, (tuple, list)) else ''}."
        )
    return batch[0], batch[1]


def _rows(inputs: Any) -> int:
    first = inputs[0] if isinstance(inputs, tuple) else inputs
    return int(first.shape[0])


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return tuple(_to(v, device) for v in value)
    return value


def _slice(batch: Any, dp: int, rank: int) -> Any:
    if isinstance(batch, torch.Tensor):
        if batch.shape[0] % dp:
            raise ConfigError(
                f"a global batch of {batch.shape[0]} samples does not split over dp={dp} ranks; use a multiple of {dp}."
            )
        return batch.chunk(dp)[rank]
    if isinstance(batch, (tuple, list)):
        return tuple(_slice(b, dp, rank) for b in batch)
    return batch
