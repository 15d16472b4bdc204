"""One measured training step of one rank of a big plan, on fake tensors.

:func:`autopar.runtime.dry_run.dry_run` applies a plan for a rank of the full world
against PyTorch's fake process group, the model left on meta. To measure what that rank
would allocate, the same job then runs one real step (forward and backward of every
micro-batch through the plan's schedule, then the optimizer step) with its parameters
turned into fake tensors (``torch._subclasses.FakeTensorMode``: shapes, dtypes and
storages without data; FSDP2 refuses meta parameters, not fake ones). The runtime's own
code runs: the FSDP2 gathers and reductions, DTensor's redistributions, the pipeline's
receive buffers, recomputation, the optimizer's state. A :class:`FakeBytesMeter` counts
the fake storages the step allocates and frees, as :class:`~autopar.runtime.metrics.TensorBytesMeter`
counts real ones.

What only a peer could supply is supplied locally (:func:`local_pipeline_metadata`):

- ``PipelineStage`` learns the shapes it receives from its neighbours in a first
  exchange of metadata. A stage's input is the output its predecessor announced when an
  earlier rank of this dry run ran it (ranks run in pipeline order); under an
  interleaved schedule the predecessor of a rank's later stages runs after it, so that
  input is assumed equal to the nearest boundary already announced (the same hidden
  state between blocks in a transformer) and checked once the predecessor has run. The
  gradient a stage receives has the shape of its own output.
- The schedule's warm-up vote (``.item()`` of a reduced flag) is skipped: the stages
  infer their shapes dynamically, which is what the vote decides when no static shapes
  are given.

Under context parallelism the step feeds this rank's ``s / cp`` tokens of each sample;
attention on fake tensors runs locally (:mod:`autopar.runtime.ring_attention`), so the
K/V shards a real ring gathers for one attention core at a time are not counted.

The step runs fewer micro-batches than the plan where the others would repeat, byte for
byte, one that ran (:func:`measured_microbatches`): without pipelining each micro-batch's
forward and backward end before the next begins, so the first (no gradient yet), one
in the middle (the accumulated gradients alive) and the last (the data-parallel
reduction) are every state the step passes through; under 1F1B a rank runs ``pp - r``
warm-up forwards, then alternates a backward and a forward with the same micro-batches
in flight, then drains, so ``pp + 2`` micro-batches hold every phase, each steady
alternation after the first backward alike. GPipe's and the interleaved schedules'
peaks grow with, or are ordered by, the micro-batch count; they run them all. What the
shortened step leaves out is a scalar loss per micro-batch skipped (the schedule keeps
every loss to the step's end); the whole batch's token ids are allocated, as a whole
step would read them.

Compiled blocks (``compile=True``) run eager: ``parallelize`` does not compile them
without real tensors, so the step keeps the element-wise intermediates a compiled block
would recompute in its backward (:mod:`autopar.graph.compiled_saved`). transformers'
models see one unpadded sequence per row, as on real token ids, and call SDPA causal
without a mask, as a real run does (:func:`autopar.graph.extract.unpacked_sequences`);
an attention whose value heads are narrower than its query's runs the memory-efficient
kernel a GPU runs it in, not the CPU's math path (:mod:`autopar.runtime.dry_attention`).
The finite check and the loss's reduction for reporting (8 bytes each) are not run. DDP
(ZeRO 0 and 1 with dp > 1, where the real run uses it) needs real tensors, so the fake
step runs FSDP2's ``replicate``, the same all-reduce: DDP's gradient buckets, which it
keeps between steps, are not counted after the step (at the peak the gradients are).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed.pipelining import schedules, stage
from torch.distributed.pipelining._utils import _derive_grad_metas, _StageBackwardMeta, _StageForwardMeta
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._sharding_prop import ShardingPropagator

from autopar.graph.extract import unpacked_sequences
from autopar.parallel_config import ParallelConfig
from autopar.plan import Plan
from autopar.runtime.dry_attention import gpu_attention
from autopar.runtime.job import Job
from autopar.runtime.metrics import OPTIMIZER, TensorBytesMeter
from autopar.runtime.pipeline import build_schedule
from autopar.vocab import Schedule


@dataclass(frozen=True, kw_only=True)
class StepMemory:
    """What one rank's measured step allocated.

    Attributes:
        peak_bytes: tensor bytes at the step's peak (forward, backward, optimizer step),
            with the parameters, gradients and optimizer state alive from its start.
        held_bytes: tensor bytes alive after the step (parameters, optimizer state; the
            gradients were released by ``zero_grad``).
        seconds: wall time of the measured step here.
        peak_phase_bytes: ``peak_bytes`` by when those bytes were allocated
            (``autopar.runtime.metrics.BEFORE_STEP``, ``FORWARD``, ``BACKWARD``,
            ``OPTIMIZER``): what the step held from its start (parameters and optimizer
            state), what its forwards left alive (activations, gathered parameters,
            logits) and its backwards (gradients, recomputed activations).
    """

    peak_bytes: int
    held_bytes: int
    seconds: float
    peak_phase_bytes: Mapping[str, int] = field(default_factory=dict)


@dataclass
class PipelineMetadata:
    """Stage boundaries announced during a dry run, shared by the ranks it runs.

    Attributes:
        announced: stage index -> the metadata of its output, as its ``PipelineStage``
            sent it.
        assumed: (stage whose output was needed, stage whose output stood in for it).
    """

    announced: dict[int, Any] = field(default_factory=dict)
    assumed: list[tuple[int, int]] = field(default_factory=list)

    def problems(self) -> list[str]:
        """Assumed boundaries whose real metadata, announced later, differs."""
        out = []
        for needed, used in self.assumed:
            real = self.announced.get(needed)
            if real is not None and real != self.announced[used]:
                out.append(
                    f"stage {needed + 1}'s input was assumed to be stage {used}'s output, but stage {needed} "
                    f"announced {real}: its measured peak is not reliable; dry-run its pipeline rank alone"
                )
        return out

    def unchecked(self) -> list[int]:
        """Stages whose assumed input was never announced (their rank was not run)."""
        return sorted({needed + 1 for needed, _ in self.assumed if needed not in self.announced})


@contextlib.contextmanager
def local_pipeline_metadata(known: PipelineMetadata) -> Iterator[None]:
    """Within: ``PipelineStage`` exchanges metadata with ``known`` instead of its peers,
    and schedules skip their warm-up vote (module docstring)."""

    def send(self: stage.PipelineStage, meta: Any, dst_stage: int) -> None:
        if isinstance(meta, _StageForwardMeta):
            known.announced[self.stage_index] = meta

    def recv(self: stage.PipelineStage, src_stage: int) -> Any:
        if src_stage == self.stage_index + 1:  # the gradient of this stage's output
            return _StageBackwardMeta(backward_metas=_derive_grad_metas(self._stage_meta.outputs))
        if src_stage not in known.announced:
            earlier = [k for k in known.announced if k < src_stage]
            if not earlier:
                raise RuntimeError(f"no stage before stage {self.stage_index} announced its output")
            known.assumed.append((src_stage, max(earlier)))
            return known.announced[max(earlier)]
        return known.announced[src_stage]

    def warmup(self: Any, stages: list[Any], has_backward: bool, p2p_done: bool) -> None:
        for s in stages:
            s._inference_mode = stage.InferenceMode.DYNAMIC

    saved = (
        stage.PipelineStage._send_meta,
        stage.PipelineStage._recv_meta,
        schedules._PipelineSchedule._warmup_p2p,
    )
    stage.PipelineStage._send_meta = send  # type: ignore[method-assign]
    stage.PipelineStage._recv_meta = recv  # type: ignore[method-assign]
    schedules._PipelineSchedule._warmup_p2p = warmup  # type: ignore[method-assign]
    try:
        yield
    finally:
        (
            stage.PipelineStage._send_meta,
            stage.PipelineStage._recv_meta,
            schedules._PipelineSchedule._warmup_p2p,
        ) = saved


class FakeBytesMeter(TensorBytesMeter):
    """:class:`TensorBytesMeter` over the fake tensors of one ``FakeTensorMode``, less
    DTensor's shape propagation: to learn an op's output shape, DTensor runs the op once
    on fake tensors of the *global* shape (``ShardingPropagator._propagate_tensor_meta_non_cached``,
    on each new op signature), in the fake mode it finds active, which in a measured step
    is this one. On a device those are never allocated (DTensor runs them in a fake mode
    of its own there), so they are not counted: a vocabulary-sized one (the logits of
    the whole vocabulary) had made the first micro-batch's loss the step's peak."""

    def __init__(self, mode: FakeTensorMode, live: list[torch.Tensor]):
        self.mode = mode
        self._propagating = 0
        # a fake tensor's storage is a meta storage (resizes are matched on it)
        super().__init__(torch.device("meta"), live)

    def __enter__(self) -> FakeBytesMeter:
        propagate = self._propagate = ShardingPropagator._propagate_tensor_meta_non_cached
        meter = self

        def shape_only(prop: ShardingPropagator, op_schema: Any) -> Any:
            meter._propagating += 1
            try:
                return propagate(prop, op_schema)
            finally:
                meter._propagating -= 1

        ShardingPropagator._propagate_tensor_meta_non_cached = shape_only  # type: ignore[method-assign]
        try:
            return super().__enter__()
        except BaseException:
            ShardingPropagator._propagate_tensor_meta_non_cached = propagate  # type: ignore[method-assign]
            raise

    def __exit__(self, *exc: Any) -> Any:
        try:
            return super().__exit__(*exc)
        finally:
            ShardingPropagator._propagate_tensor_meta_non_cached = self._propagate  # type: ignore[method-assign]

    def _track(self, t: Any) -> None:
        if self._propagating:
            return
        if isinstance(t, DTensor):
            t = t.to_local()
        if isinstance(t, FakeTensor) and t.fake_mode is self.mode:
            storage = t.untyped_storage()
            if storage._cdata not in self._bytes:
                self._watch(storage)


OPTIMIZERS = {"adam": torch.optim.AdamW, "sgd": torch.optim.SGD, "adafactor": torch.optim.Adafactor}
"""The torch optimizer whose state the plan's optimizer stands for."""


def measured_microbatches(config: ParallelConfig) -> int:
    """Micro-batches a measured step runs: the plan's, or fewer where the rest would
    repeat one that ran (module docstring): 3 without pipelining, ``pp + 2`` under 1F1B."""
    m = config.num_microbatches
    if config.pp == 1:
        return min(m, 3)
    if config.schedule is Schedule.ONE_F_ONE_B:
        return min(m, config.pp + 2)
    return m


def measure_step(job: Job, plan: Plan, mode: FakeTensorMode | None, *, microbatches: int | None = None) -> StepMemory:
    """Run one step of ``job`` and count its tensor bytes: on the fake tensors of ``mode``
    (the job parallelized with ``materialize=False, fake_mode=mode``, run inside
    :func:`local_pipeline_metadata`), or with ``mode`` None on the job's real ones (the
    same count on a real run, to check the fake one). ``microbatches``: how many the step
    runs (the plan's when None; :func:`measured_microbatches`). The optimizer state is
    created first, by one optimizer step on zero gradients, so the measured step runs
    with it alive, as every step after the first does."""
    cfg = plan.config
    m = cfg.num_microbatches if microbatches is None else microbatches
    if m != cfg.num_microbatches:  # the schedule runs before any step: its stages take the new count
        old = job._p.schedule
        job._p.schedule = build_schedule(job._p.pipeline_stages, plan, old._loss_fn, num_microbatches=m)
    seq = plan.model.seq_len // cfg.cp  # a cp rank's share
    with mode if mode is not None else contextlib.nullcontext():
        opt = job.optimizer(OPTIMIZERS[plan.settings.optimizer.value], lr=1e-4)
        inner = [o for o in opt.inner if o is not None]
        for p in job.parameters():
            p.grad = torch.zeros_like(p)
        for o in inner:
            o.step()
        opt.zero_grad()
        # the whole batch's token ids, of which the step reads its micro-batches' rows
        # (views of it: the meter counts the whole batch, as a whole step's would)
        batch = torch.zeros(cfg.micro_batch_size * cfg.num_microbatches, seq, dtype=torch.long)
        tokens = batch[: cfg.micro_batch_size * m]
        live = job._live_tensors()
        meter = FakeBytesMeter(mode, live) if mode is not None else TensorBytesMeter(torch.device("cpu"), live)
        del live
        start = time.perf_counter()
        unpacked = unpacked_sequences() if mode is not None else contextlib.nullcontext()
        attention = gpu_attention() if mode is not None else contextlib.nullcontext()
        with meter, unpacked, attention:
            job._run_schedule((tokens,), tokens, [])
            meter.phase = OPTIMIZER
            for o in inner:
                o.step()
        seconds = time.perf_counter() - start
        opt.zero_grad()
        return StepMemory(
            peak_bytes=meter.peak_bytes,
            held_bytes=meter.current_bytes,
            seconds=seconds,
            peak_phase_bytes=meter.peak_phase_bytes,
        )
