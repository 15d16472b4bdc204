"""Memory per device: model states by ZeRO stage, activations by recompute mode.

Model states follow ZeRO (Rajbhandari et al. 2020) as autopar's runtime realises them in
PyTorch, per parameter held by a TP rank:

- fp32 master weight (4 bytes), fp32 gradient (4), optimizer state (Adam: two fp32
  moments, 8; SGD: one momentum, 4; Adafactor: factored, see
  :func:`autopar.cost.tensor_parallel.leaf_factored_numel`);
- with mixed precision a low-precision compute copy (2): the unsharded parameters of
  FSDP2 (ZeRO-2/3) or of its ``replicate`` (ZeRO-0/1, which DDP runs only in fp32);
- ZeRO-1 (``ZeroRedundancyOptimizer``) shards the optimizer state over ``dp``; ZeRO-2
  (FSDP2, ``reshard_after_forward=False``) also the master weights and gradients, and
  keeps the unsharded compute copy from forward to backward; ZeRO-3 (FSDP2) gathers a
  unit's parameters only while it runs (this unit and the prefetched next one).
  Under HSDP (``ParallelConfig.dp_shard``) ZeRO-2/3 shard over the shard group only
  (``dp_shard`` ranks) and replicate across the ``dp / dp_shard`` groups, so every
  sharded term is divided by ``dp_shard`` instead of ``dp`` (FSDP2's ``fully_shard`` on
  a 2-D mesh, ``Replicate`` x ``Shard(0)`` placements; Zhao et al. 2023, "PyTorch
  FSDP", section 3.2.2, hybrid sharding).
- DDP (ZeRO-0/1 in fp32 without pipelining or TP) rebuilds its gradient buckets once, in
  the pre-forward of an early step (``Reducer::rebuild_buckets``, in the order the
  gradients became ready): the new buckets are allocated while ``param.grad`` still
  views the old ones, so for a moment the stage holds its gradients twice. No
  activation is alive then, so the stage peaks at ``max(steady peak, model states +
  gradients)`` (measured: ``docs/cost-model.md``).
- ZeRO-0/1 under FSDP2's ``replicate`` without pipelining wrap each unit, as ZeRO-2 does,
  and all-reduce its gradients when its backward ends (in a step's last micro-batch;
  the earlier ones accumulate them): with one micro-batch the unit's compute-precision
  gradients and the flat fp32 buffer they are cast into are its transient, as ZeRO-2's
  reduce-scatter input (:func:`reduce_scatter_bytes`); accumulating, the fp32 buffer
  the accumulated gradients are copied into, and in the micro-batches before the last
  the unit's new compute-precision gradients (``StateBytes.before_last_bytes``). Under
  pipelining ``replicate`` wraps the whole stage as one group, whose post-backward runs
  once the stage's backward is over: with mixed precision every parameter's gradient in
  the compute precision (the unsharded low-precision parameter's ``.grad``) stays alive
  until then beside the fp32 gradients, which it is then cast and added into
  (:func:`held_grad_bytes`).
- A vocabulary-parallel embedding's weight gradient is computed whole, the full table
  on every rank of the tensor-parallel group (``UnitCost.whole_grad_numel``): a
  transient in the compute precision under ZeRO-2/3 (FSDP2 slices it to the shard
  before its reduce-scatter), part of :func:`held_grad_bytes` under a pipelined
  ``replicate`` and of the unit's transient under an unpipelined one, and
  under ZeRO-0/1 a whole fp32 gradient from its first backward to ``zero_grad``:
  ``replicate`` casts, accumulates and all-reduces the gradient in the placement it
  came in (whole), and without data parallelism (no wrapper) ``param.grad`` is the
  replicated table itself.
- Under pipeline parallelism ``torch.distributed.pipelining`` keeps FSDP2 parameters
  unsharded after backward and accumulates unsharded gradients until the last
  micro-batch (``PipelineStage`` sets ``reshard_after_backward`` and
  ``requires_gradient_sync`` to False), so ZeRO-2/3 then hold a full compute copy and a
  full fp32 gradient of their stage (a whole-computed weight's at its whole size: FSDP2
  accumulates the gradient in the placement it came in); the optimizer state and master
  weights stay sharded. With mixed precision a unit's gradients come in the compute
  precision and stay until its post-backward casts and adds them into the fp32 ones (the
  unit's transient). The sharded fp32 gradients are not counted: ``zero_grad`` freed the
  last step's, and the last micro-batch's backward makes each unit's by reduce-scattering
  its unsharded one, which is then freed (a ``dp``-th of it), with one micro-batch's
  activations alive, fewer than at the peak.
- Gradients reduced in bf16 (``ParallelConfig.reduce_dtype``, FSDP2's
  ``MixedPrecisionPolicy(reduce_dtype=bf16)`` under bf16 parameters): FSDP2 then casts
  nothing (``FSDPParam.init_dtype_attrs`` drops a reduce dtype equal to the parameter
  dtype), so the reduce-scatter input is bf16 (2 bytes per element instead of 4) and,
  under pipelining, the unsharded gradients accumulate in the bf16 parameters' ``.grad``
  itself: 2 bytes per parameter instead of 4, and the transient is autograd's new
  gradient of one tensor before it is added in (``AccumulateGrad``), not the unit's
  gradients before a cast. The reduced shard is cast to the fp32 sharded gradient as
  before (``foreach_reduce``), so the optimizer's bytes do not change. Megatron-LM's
  distributed optimizer counts the same two bytes: ``4 + 16/d`` bytes per parameter with
  16-bit weights and gradients against ``6 + 12/d`` with fp32 gradients (its
  ``docs/user-guide/features/dist_optimizer.md``).
- Multi-stage schedules (interleaved, zero-bubble) gather a rank's FSDP2 stages by
  explicit actions: torch 2.13 lowers them with ``UNSHARD`` and ``RESHARD`` steps that
  keep the next :data:`UNSHARDED_STAGES` stages the rank computes gathered and reshard
  the others (``_add_unshard_reshard``), so a rank holds the gathered copy of at most
  that many stages (:func:`resharded_copy_bytes`), ``replicate``'s compute-precision
  copy too (its ``UNSHARD`` gathers nothing, so the copy is made when the stage next
  computes; :func:`autopar.cost.pipeline.gathered_chunks`).
- Zero-bubble schedules run a stage's backward as an input-gradient pass ``I`` and a
  later weight-gradient pass ``W``. FSDP2's post-backward hook fires in ``I`` (it hangs
  on the stage's inputs), before ``W`` computes the weight gradients, so with mixed
  precision they wait in the unsharded parameters' ``.grad`` in the compute precision
  until the stage's next ``I`` (or the step's end) casts and adds them into the fp32
  gradient: every stage holds them between its ``W`` and its next ``I``, nearly all the
  step (:func:`deferred_weight_grad_bytes`). The pipeline's first stage is the exception:
  its inputs need no gradient, so torch runs its whole backward at ``W``.

Pure functions of numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from autopar.vocab import DType, Optimizer

if TYPE_CHECKING:
    from autopar.plan import ParallelConfig

MASTER_BYTES = 4.0
GRAD_BYTES = 4.0
UNSHARDED_STAGES = 3
"""Stages of a pipeline rank whose FSDP2 parameters a multi-stage schedule keeps gathered
at once: torch 2.13's ``_add_unshard_reshard`` (``max_active_stages=3``) gathers the next
three stages the rank computes and reshards the others."""
_OPT_BYTES = {Optimizer.ADAM: 8.0, Optimizer.SGD: 4.0}


@dataclass(frozen=True, kw_only=True)
class StateBytes:
    """Model-state bytes on one device, and the transient peaks they add: while a unit
    runs (``transient_bytes``, on top of the activations), in the micro-batches before a
    step's last where they hold less (``before_last_bytes``; None where the same) and at
    DDP's one-time bucket rebuild (``rebuild_bytes``, before any activation exists)."""

    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    transient_bytes: float
    rebuild_bytes: float = 0.0
    before_last_bytes: float | None = None


def compute_copy_bytes(dtype: DType) -> float:
    """Bytes per parameter of the low-precision copy used in compute (0 in fp32)."""
    return 0.0 if dtype is DType.FP32 else float(dtype.itemsize)


def reduce_scatter_bytes(unit_numel: float, dtype: DType, reduce_dtype: DType = DType.FP32) -> float:
    """Bytes ZeRO-2/3 hold while a unit of ``unit_numel`` parameters reduces its gradients
    (FSDP2): the flat reduce-scatter input in ``reduce_dtype`` and the unit's unsharded
    gradients, which come in the compute precision (fp32 without mixed precision) and are
    cast into it; or, while the unit computes, the previous unit's input, which FSDP2
    keeps until the next reduction (``reduce_scatter_max_input_buffers``, 1 by default in
    torch 2.13), beside the gradients the unit makes."""
    return unit_numel * (reduce_dtype.itemsize + (compute_copy_bytes(dtype) or GRAD_BYTES))


def uses_replicate(*, dp: int, pipelined: bool, tp: int, dtype: DType) -> bool:
    """Whether ZeRO-0/1 run FSDP2's ``replicate`` rather than DDP
    (``autopar.runtime.data_parallel``): with pipelining or tensor parallelism over
    data-parallel ranks, and in mixed precision always (its casts put the whole block in
    the low precision, where autocast beside DDP would keep an fp32 residual stream)."""
    return (dp > 1 and (pipelined or tp > 1)) or bool(compute_copy_bytes(dtype))


def config_state_bytes(
    config: ParallelConfig,
    optimizer: Optimizer,
    *,
    param_numel: float,
    factored_numel: float = 0.0,
    largest_unit_numel: float = 0.0,
    expert_numel: float = 0.0,
    whole_grad_numel: float = 0.0,
    largest_grad_numel: float = 0.0,
) -> StateBytes:
    """:func:`state_bytes` under ``config``'s precision, ZeRO stage and data-, tensor- and
    pipeline-parallel degrees; the state shards over ``config.state_shards`` ranks (the
    HSDP shard group, or ``dp * cp``). ``expert_numel``: of ``param_numel``, the expert
    parameters held (``1 / ep`` of the stacks): the shard group divides the state of
    every expert of its ``ep`` groups, ``ep`` times what one rank holds.
    ``whole_grad_numel``: the whole size of the split weights whose gradient is computed
    whole (``UnitCost.whole_grad_numel``); ``largest_grad_numel``: the largest gradient a
    unit makes at once (``UnitCost.largest_grad_numel``)."""
    return state_bytes(
        param_numel=param_numel,
        whole_grad_numel=whole_grad_numel,
        largest_grad_numel=largest_grad_numel,
        accumulates=config.num_microbatches > 1,
        shard_numel=param_numel + expert_numel * (config.ep - 1),
        factored_numel=factored_numel,
        largest_unit_numel=largest_unit_numel,
        dtype=config.dtype,
        reduce_dtype=config.reduce_dtype,
        optimizer=optimizer,
        zero_stage=config.zero_stage,
        dp=config.state_shards,
        pipelined=config.pp > 1,
        tp=config.tp,
    )


def state_bytes(
    *,
    param_numel: float,
    factored_numel: float,
    largest_unit_numel: float,
    dtype: DType,
    optimizer: Optimizer,
    zero_stage: int,
    dp: int,
    pipelined: bool,
    tp: int = 1,
    shard_numel: float | None = None,
    whole_grad_numel: float = 0.0,
    largest_grad_numel: float = 0.0,
    accumulates: bool = True,
    reduce_dtype: DType = DType.FP32,
) -> StateBytes:
    """Model-state memory of a pipeline stage on one device.

    Args:
        param_numel: parameters the device's TP shard of the stage holds.
        shard_numel: parameters whose sharded state the ``dp`` ranks divide
            (``param_numel`` when None; more under expert parallelism, where the shard
            group also holds the state of the experts other ranks compute).
        factored_numel: Adafactor state elements for those parameters.
        largest_unit_numel: parameters of the stage's largest unit (what ZeRO-3
            gathers at once, and what ZeRO-2/3 hold as unsharded gradients while they
            reduce-scatter).
        dtype: training precision.
        optimizer: which optimizer.
        zero_stage: 0-3.
        dp: ranks the sharded state is split over: the data- times the context-parallel
            degree, or under HSDP the shard group (``ParallelConfig.state_shards``).
        pipelined: the stage runs under a pipeline schedule (pp > 1).
        tp: tensor-parallel degree. ZeRO-0/1 with dp > 1 in fp32 run DDP, except with
            pipelining or tensor parallelism, where the runtime uses FSDP2's
            ``replicate`` (:func:`uses_replicate`): it gathers an unsharded copy of every
            parameter (fp32 params: a second fp32 copy) from forward to backward, and
            without pipelining reduces unit by unit (module docstring).
        whole_grad_numel: the whole size of the split weights among them whose gradient
            is computed whole (a vocabulary-parallel embedding's table; module docstring).
        largest_grad_numel: elements of the largest gradient a unit makes at once. Under
            ZeRO-0/1 without ``replicate`` a new gradient is made beside the one kept
            and then added to it (autograd's ``AccumulateGrad``; DDP copies it into its
            bucket), one tensor at a time: its transient, where a step accumulates
            (``accumulates``: more than one micro-batch) or DDP keeps the buckets; the
            same under ZeRO-2/3 pipelined with gradients accumulated in bf16.
        reduce_dtype: the precision ZeRO-2/3 reduce gradients in, and accumulate them in
            under pipelining (``ParallelConfig.reduce_dtype``; module docstring).
    """
    copy = compute_copy_bytes(dtype)
    beyond_shard = whole_grad_numel * (1 - 1 / tp)
    opt_full = factored_numel * 4.0 if optimizer is Optimizer.ADAFACTOR else param_numel * _OPT_BYTES[optimizer]
    widen = 1.0 if shard_numel is None or not param_numel else shard_numel / param_numel
    opt_sharded = opt_full * widen / dp
    unsharded_copy = copy if copy else MASTER_BYTES  # what FSDP2 gathers: the compute copy, or fp32 params
    if zero_stage <= 1:
        replicate = uses_replicate(dp=dp, pipelined=pipelined, tp=tp, dtype=dtype)
        params = param_numel * (MASTER_BYTES + (unsharded_copy if replicate else copy))
        ddp = dp > 1 and not replicate
        accumulated = largest_grad_numel * GRAD_BYTES if ddp or accumulates else 0.0
        before_last = None
        if replicate and pipelined:  # the stage's gradients are held_grad_bytes
            transient = 0.0
        elif replicate and accumulates:
            # per unit: the flat fp32 reduce input beside the accumulated gradients it
            # copies, then the reduced ones; before the last micro-batch the unit's new
            # gradients, which are added into the accumulated ones
            transient = (largest_unit_numel + beyond_shard) * GRAD_BYTES
            before_last = (largest_unit_numel + beyond_shard) * copy if copy else accumulated
        elif replicate:  # per unit: its gradients beside the flat buffer they are cast into
            transient = reduce_scatter_bytes(largest_unit_numel, dtype) + beyond_shard * unsharded_copy
        else:
            transient = accumulated
        return StateBytes(
            params_bytes=params,
            grads_bytes=(param_numel + beyond_shard) * GRAD_BYTES,
            optimizer_bytes=opt_full if zero_stage == 0 else opt_sharded,
            transient_bytes=transient,
            rebuild_bytes=param_numel * GRAD_BYTES if ddp else 0.0,
            before_last_bytes=before_last,
        )
    master = param_numel * widen * MASTER_BYTES / dp
    held = master + param_numel * unsharded_copy if gathers_through_step(zero_stage, pipelined) else master
    grads = param_numel * widen * GRAD_BYTES / dp
    whole_grad = whole_grad_numel * unsharded_copy  # sliced to the shard before the reduce-scatter
    if pipelined and reduce_dtype is not DType.FP32:  # accumulated in .grad itself, one new gradient at a time
        return StateBytes(
            params_bytes=held,
            grads_bytes=(param_numel + beyond_shard) * reduce_dtype.itemsize,
            optimizer_bytes=opt_sharded,
            transient_bytes=largest_grad_numel * copy if accumulates else 0.0,
        )
    if pipelined:
        return StateBytes(
            params_bytes=held,
            grads_bytes=(param_numel + beyond_shard) * GRAD_BYTES,
            optimizer_bytes=opt_sharded,
            # the unit's compute-precision gradients until its post-backward casts them
            transient_bytes=(largest_unit_numel + beyond_shard) * copy,
        )
    reduce_buffer = reduce_scatter_bytes(largest_unit_numel, dtype, reduce_dtype)
    if zero_stage == 2:
        return StateBytes(
            params_bytes=held,
            grads_bytes=grads,
            optimizer_bytes=opt_sharded,
            transient_bytes=reduce_buffer + whole_grad,
        )
    return StateBytes(
        params_bytes=held,
        grads_bytes=grads,
        optimizer_bytes=opt_sharded,
        transient_bytes=2 * largest_unit_numel * unsharded_copy + reduce_buffer + whole_grad,
    )


def held_grad_bytes(config: ParallelConfig, *, param_numel: float, whole_grad_numel: float = 0.0) -> float:
    """Bytes of the compute-precision gradients of ``param_numel`` parameters (and of the
    split weights whose gradient is whole, ``whole_grad_numel`` of them at their whole
    size) that ZeRO-0/1 under FSDP2's ``replicate`` hold until the stage's backward is
    over: under pipelining ``replicate`` wraps the stage as one group, and its
    post-backward, which casts each gradient to fp32 and adds it into the fp32 one (or
    reduces it), runs at the end (``FSDPParamGroup.post_backward``). Only with mixed
    precision: in fp32 the unsharded parameter's gradient is the fp32 gradient itself,
    already counted. Without pipelining each unit reduces its own (a transient,
    :func:`state_bytes`)."""
    copy = compute_copy_bytes(config.dtype)
    replicate = uses_replicate(dp=config.state_shards, pipelined=config.pp > 1, tp=config.tp, dtype=config.dtype)
    if config.zero_stage >= 2 or config.pp == 1 or not replicate or not copy:
        return 0.0
    return _compute_grad_bytes(config, param_numel, whole_grad_numel)


def fsdp_wrapped(config: ParallelConfig) -> bool:
    """Whether FSDP2 wraps the stages (``fully_shard`` for ZeRO-2/3, ``replicate`` for
    ZeRO-0/1; ``autopar.runtime.data_parallel``)."""
    dp, pipelined = config.state_shards, config.pp > 1
    return (dp > 1 and config.zero_stage >= 2) or uses_replicate(
        dp=dp, pipelined=pipelined, tp=config.tp, dtype=config.dtype
    )


def unit_freed_copy_bytes(config: ParallelConfig) -> float:
    """Bytes per parameter of the gathered copy a unit lets go of once its backward in a
    step's last micro-batch is over: without pipelining, FSDP2 under ZeRO-2 and
    ``replicate`` per unit reshard then (``autopar.runtime.pipeline._UnitReductionStage``),
    so the copy held since the unit's first forward is gone while the units before it
    run their backward, and gone for the optimizer step. 0 under pipelining (every
    unit's at once after the stage's last micro-batch), under ZeRO-3 (gathered only
    while a unit runs) and without an FSDP2 wrapper."""
    if config.pp > 1 or config.zero_stage == 3 or not fsdp_wrapped(config):
        return 0.0
    return compute_copy_bytes(config.dtype) or MASTER_BYTES


def kept_reduce_input_bytes(config: ParallelConfig, unit_numel: float) -> float:
    """Bytes of a unit's flat reduce-scatter input (``unit_numel`` parameters in
    ``config.reduce_dtype``) that FSDP2 keeps after the unit's reduction until the next
    unit's begins (``FSDPCommContext.reduce_scatter_states``, at most
    ``reduce_scatter_max_input_buffers`` of them, 1 by default in torch 2.13): under
    ZeRO-2 without pipelining, where each unit reduces once its backward is over, the
    backward of the unit before it runs beside it. 0 elsewhere: under pipelining the
    stage reduces as one after its last micro-batch, and ZeRO-3's transient, which
    gathers copies in the backward too, stays priced whole."""
    if config.pp > 1 or config.zero_stage != 2 or config.state_shards < 2:
        return 0.0
    return unit_numel * config.reduce_dtype.itemsize


def gathers_through_step(zero_stage: int, pipelined: bool) -> bool:
    """Whether FSDP2 keeps the parameters it gathers from a unit's first forward to its
    last backward: ZeRO-2 (no reshard after forward), and ZeRO-3 under pipelining
    (``PipelineStage`` keeps them gathered). ZeRO-0/1 hold whole parameters anyway."""
    return zero_stage == 2 or (zero_stage == 3 and pipelined)


def holds_gathered_params(config: ParallelConfig) -> bool:
    """Whether the rank holds FSDP2's gathered copies of its parameters through the step
    (:func:`gathers_through_step`): its parameter bytes in the prediction count them
    beside the shards, though between steps it holds only the shards."""
    return gathers_through_step(config.zero_stage, config.pp > 1)


def resharded_copy_bytes(config: ParallelConfig, stage_param_numels: list[float]) -> float:
    """Bytes of the gathered copies a multi-stage schedule keeps resharded on a rank whose
    stages hold ``stage_param_numels`` parameters each: those of all but its
    :data:`UNSHARDED_STAGES` largest stages (module docstring). The gathered copy is the
    compute-precision one, or under ZeRO-2/3 in fp32 a second fp32 copy; ``replicate``
    (ZeRO-0/1) frees its compute-precision copy at the same ``RESHARD`` steps, and in
    fp32 has no copy (measured: ``docs/cost-model.md``)."""
    return sum(sorted(stage_param_numels)[:-UNSHARDED_STAGES]) * gathered_copy_bytes(config)


def gathered_copy_bytes(config: ParallelConfig) -> float:
    """Bytes per parameter of the gathered copy a multi-stage schedule's ``UNSHARD`` and
    ``RESHARD`` steps make and free (:func:`resharded_copy_bytes`), 0 where they make
    none: no such schedule, no FSDP2 wrapper, or ``replicate`` in fp32."""
    if config.pp == 1 or not config.schedule.multi_stage or not fsdp_wrapped(config):
        return 0.0
    return compute_copy_bytes(config.dtype) or (MASTER_BYTES if config.zero_stage >= 2 else 0.0)


def deferred_weight_grad_bytes(config: ParallelConfig, *, param_numel: float, whole_grad_numel: float = 0.0) -> float:
    """Bytes of the compute-precision weight gradients a stage of ``param_numel``
    parameters (and of split weights whose gradient is whole, ``whole_grad_numel`` at
    their whole size) holds under a zero-bubble schedule between its ``W`` and its next
    ``I`` (module docstring): only where FSDP2 wraps it with mixed precision and reduces
    in fp32 (in fp32, or reducing in bf16, the gradient accumulates in place). The
    pipeline's first stage holds none."""
    copy = compute_copy_bytes(config.dtype)
    if config.pp == 1 or not config.schedule.zero_bubble or not fsdp_wrapped(config) or not copy:
        return 0.0
    if config.reduce_dtype is not DType.FP32:
        return 0.0
    return _compute_grad_bytes(config, param_numel, whole_grad_numel)


def _compute_grad_bytes(config: ParallelConfig, param_numel: float, whole_grad_numel: float) -> float:
    """Compute-precision gradients of ``param_numel`` parameters held by a tensor-parallel
    rank, those of split weights computed whole (``whole_grad_numel``) at their whole size."""
    return (param_numel + whole_grad_numel * (1 - 1 / config.tp)) * compute_copy_bytes(config.dtype)


def optimizer_state_bytes(optimizer: Optimizer) -> float:
    """Bytes of optimizer state per parameter (Adafactor's factored moments: none per
    parameter, as a lower bound)."""
    return _OPT_BYTES.get(optimizer, 0.0)


def optimizer_step_bytes(optimizer: Optimizer) -> float:
    """Bytes of memory traffic per parameter of one optimizer step: read and write the
    fp32 weight and each state, read the gradient, write the compute copy."""
    states = {Optimizer.ADAM: 2, Optimizer.SGD: 1, Optimizer.ADAFACTOR: 0}[optimizer]
    return 2 * MASTER_BYTES + GRAD_BYTES + states * 2 * 4.0 + 2.0
