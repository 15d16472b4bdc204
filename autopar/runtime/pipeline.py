"""Pipeline parallelism: cut the model to this rank's stages and run the plan's schedule.

Stage ``i`` of the plan runs on pipeline rank ``i % pp``, or in a V under ``zbv``
and ``dualpipev`` (``Plan.stage_of_rank``). A stage
module is a skeleton copy of the model that shares the kept units (no weights copied) and
lacks the others: a block is deleted from its ``nn.ModuleDict`` (the others keep their
names, so parameter FQNs and checkpoint keys are the same on every plan), any other unit
is set to ``None``, which the model's forward skips (transformers decoders, whose forward
cannot skip blocks, run their share of the forward through
:mod:`autopar.runtime.decoder_stages`). The stages then run with
``torch.distributed.pipelining``'s ``PipelineStage`` (holding only the messages in
flight, :class:`BoundedStage`) and ``ScheduleGPipe``,
``Schedule1F1B``, ``ScheduleInterleaved1F1B`` (Narayanan et al. 2021),
``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble`` (Qi et al. 2023) or
``ScheduleDualPipeV`` (DeepSeek-AI 2024); only the first
stage gets inputs and only the last gets targets. With ``pp == 1`` the same machinery
runs one stage, so micro-batching, gradient scaling by ``1/num_microbatches`` and the
data-parallel gradient sync of the last micro-batch are shared by every plan.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining._backward import stage_backward
from torch.distributed.pipelining._utils import _make_tensor_from_meta
from torch.distributed.pipelining.stage import _RecvInfo

from autopar.graph.decoders import decoder_blocks, uncuttable_unit
from autopar.plan import Plan
from autopar.runtime.decoder_stages import make_stage
from autopar.runtime.errors import PipelineError
from autopar.vocab import SPLIT_BACKWARD_EAGER, SPLIT_BACKWARD_RECOMPUTE, Recompute, Schedule

SCHEDULES = {
    Schedule.GPIPE: ScheduleGPipe,
    Schedule.ONE_F_ONE_B: Schedule1F1B,
    Schedule.INTERLEAVED_1F1B: ScheduleInterleaved1F1B,
    Schedule.INTERLEAVED_ZB: ScheduleInterleavedZeroBubble,
    Schedule.ZBV: ScheduleZBVZeroBubble,
    Schedule.DUALPIPEV: ScheduleDualPipeV,
}


def check_schedule(plan: Plan) -> None:
    """Refuse micro-batch counts the schedule cannot run (checked before any collective)."""
    cfg = plan.config
    m, pp = cfg.num_microbatches, cfg.pp
    if cfg.schedule is Schedule.ONE_F_ONE_B and pp > 1 and m < pp:
        raise PipelineError(
            f"schedule '1f1b' with pp={pp} needs num_microbatches >= pp, got {m}: the pipeline "
            f"never fills. Use num_microbatches >= {pp} or schedule 'gpipe'."
        )
    if cfg.schedule is Schedule.DUALPIPEV and pp > 1 and m < 2 * pp:
        raise PipelineError(
            f"schedule 'dualpipev' with pp={pp} needs num_microbatches >= 2 * pp (one per stage of its V), "
            f"got {m}. Use num_microbatches >= {2 * pp} or schedule 'zbv'."
        )
    if cfg.schedule.zero_bubble and cfg.zero_stage == 3 and cfg.dp_cp > 1:
        raise PipelineError(
            f"schedule {cfg.schedule.value!r} with zero_stage=3 is refused: with FSDP2 resharding after forward, "
            f"torch 2.13's split backward (input gradients, weight gradients later) trained to wrong losses in "
            f"autopar's parity test. Use zero_stage <= 2 or schedule 'interleaved-1f1b'."
        )
    if cfg.schedule.zero_bubble and cfg.compile and pp > 1:
        raise PipelineError(
            f"schedule {cfg.schedule.value!r} with compiled blocks is refused: {SPLIT_BACKWARD_EAGER}. Plan with "
            f"--set compile=false (compile=False) or schedule 'interleaved-1f1b'."
        )
    modes = {cfg.recompute, *plan.layer_strategies.recompute.values()}
    if cfg.schedule.zero_bubble and pp > 1 and Recompute.OP in modes:
        raise PipelineError(
            f"schedule {cfg.schedule.value!r} with recompute 'op' is refused: {SPLIT_BACKWARD_RECOMPUTE}. Plan with "
            f"recompute 'none' or 'selective', or schedule 'interleaved-1f1b'."
        )
    if cfg.schedule in (Schedule.INTERLEAVED_1F1B, Schedule.INTERLEAVED_ZB):
        rounds = max(1, m // pp)
        if m % rounds:
            raise PipelineError(
                f"schedule {cfg.schedule.value!r} with pp={pp} runs micro-batches in rounds of pp; "
                f"num_microbatches={m} is not a multiple of its {rounds} rounds. Use a multiple of {pp}."
            )


def check_cuttable(model: nn.Module, plan: Plan) -> None:
    """Refuse a pipeline split the model's structure cannot take (before any collective)."""
    found = uncuttable_unit(model, plan.model.units) if plan.config.num_stages > 1 else None
    if found is not None:
        unit, container = found
        raise PipelineError(
            f"unit {unit!r} sits in a {container}, which renumbers its children when one is removed, "
            f"so pipeline stages would rename parameters (and a transformers model's forward cannot skip missing "
            f"blocks). Hold the blocks in an nn.ModuleDict keyed '0'..'L-1' whose forward skips None parts (as "
            f"autopar.models do), or use a plan with pp=1."
        )


def cut(model: nn.Module, keep: tuple[str, ...], units: tuple[str, ...], seq_len: int) -> nn.Module:
    """A stage module holding only the units in ``keep`` (shared with ``model``).

    ``model`` itself is returned when it keeps every unit. A transformers decoder-only
    causal LM (:func:`autopar.graph.decoders.decoder_blocks`) runs its own forward for
    its share, for sequences of ``seq_len`` (:mod:`autopar.runtime.decoder_stages`).
    Call :func:`check_cuttable` first.
    """
    if set(keep) == set(units):
        return model
    drop = [u for u in units if u not in keep]
    memo: dict[int, Any] = {id(model.get_submodule(u)): model.get_submodule(u) for u in keep}
    for u in drop:  # dropped units are not copied: their slots are emptied right after
        memo[id(model.get_submodule(u))] = None
    for p in model.parameters():  # parameters are shared, never copied
        memo.setdefault(id(p), p)
    stage = copy.deepcopy(model, memo)
    for u in drop:
        parent_name, _, child = u.rpartition(".")
        parent = stage.get_submodule(parent_name) if parent_name else stage
        if isinstance(parent, nn.ModuleDict):
            del parent[child]
        else:
            setattr(parent, child, None)
    blocks = decoder_blocks(model, units)
    return make_stage(stage, model, blocks, units, keep, seq_len) if blocks is not None else stage


def tensor_outputs(stage: nn.Module) -> None:
    """Make ``stage`` return tensors only: pipelining moves tensors between stages and
    into the loss, so a structured output (transformers' ``ModelOutput``, a dict) is
    reduced to its ``logits``, or to its only tensor."""
    stage.register_forward_hook(_to_tensors)


def _to_tensors(_module: nn.Module, _args: Any, output: Any) -> Any:
    if isinstance(output, torch.Tensor) or (
        isinstance(output, (tuple, list)) and all(isinstance(o, torch.Tensor) for o in output)
    ):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    values = list(output.values()) if isinstance(output, dict) else []
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if len(tensors) == 1:
        return tensors[0]
    raise PipelineError(
        f"the model returned a {type(output).__name__}, which pipeline stages cannot pass on: return "
        f"a tensor or a tuple of tensors (or an output with a 'logits' tensor)."
    )


class _UnitReductionStage(PipelineStage):
    """A ``PipelineStage`` whose FSDP2 module reduces each unit's gradients as its
    backward ends, overlapped with the backward of the units before it.

    ``PipelineStage`` runs every micro-batch's backward with FSDP2's gradient sync and
    resharding switched off and reduces every unit at once after the last
    (``perform_reduce_grad``): the reduction waits for the whole backward, the stage's
    unsharded gradients pile up across micro-batches, and ZeRO-3's parameters stay
    gathered from one backward to the next forward. Without pipelining the planner
    prices per-unit reductions overlapped with the backward
    (:func:`autopar.cost.data_parallel.tail_s`), as DDP's buckets do. This stage runs
    them: ZeRO-2/3 (``sync_each_microbatch``) reduce-scatter each micro-batch's
    gradients into the sharded ones, ZeRO-3 reshards after every backward and gathers
    again for the next micro-batch, and ZeRO-2 keeps its parameters gathered until the
    last one; ``replicate`` (ZeRO-0/1) accumulates the unsharded gradients and
    all-reduces each unit's during the last micro-batch's backward, as DDP does under
    ``no_sync``. The final ``perform_reduce_grad`` then finds no unsharded gradient
    left and only reshards and scales.
    """

    def __init__(self, *args: Any, sync_each_microbatch: bool, reshard_each_microbatch: bool, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._sync_each_microbatch = sync_each_microbatch
        self._reshard_each_microbatch = reshard_each_microbatch

    def backward_maybe_with_nosync(self, backward_type: str, bwd_kwargs: dict, last_backward: bool = False) -> Any:
        if backward_type != "full" or not isinstance(self.submod, FSDPModule):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)
        sync = self._sync_each_microbatch or last_backward
        self.submod.set_is_last_backward(sync)
        self.submod.set_requires_gradient_sync(sync)
        self.submod.set_reshard_after_backward(self._reshard_each_microbatch or last_backward)
        grads = stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"])
        return grads, None


class BoundedStage(PipelineStage):
    """A ``PipelineStage`` that holds only the messages its schedule has in flight.

    torch 2.13's ``PipelineStage`` allocates, at its first step, a receive buffer for
    every micro-batch's input and for every micro-batch's output gradient, and keeps
    them for its life: with 128 micro-batches a stage holds 128 of each, whatever the
    schedule. Here a buffer is allocated when its receive is posted and the stage lets
    go of it once consumed: an input after the forward that reads it (the forward's
    saved input keeps it until that micro-batch's backward, as its activation), an
    output gradient after the backward that reads it. The schedules post each receive
    right before the step that reads it, so a stage holds the inputs and outputs of its
    micro-batches in flight and at most one message on its way
    (:func:`autopar.cost.pipeline.stage_buffer_bytes`). The last stage also detaches
    each micro-batch's loss after its backward, which would otherwise keep that
    micro-batch's received input alive until the step ends.
    """

    def _setup_forward_recv_info(self, num_microbatches: int, has_backward: bool) -> None:
        super()._setup_forward_recv_info(1, has_backward)  # one micro-batch's infos, as the template
        template = self.args_recv_info[0]
        for chunk in range(num_microbatches):
            self.args_recv_info[chunk] = tuple(_unallocated(info) for info in template)

    def _create_grad_recv_info(self, act_send_info: dict) -> tuple[_RecvInfo, ...]:
        return tuple(_unallocated(info) for info in super()._create_grad_recv_info(act_send_info))

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        self._allocate(self.args_recv_info[fwd_chunk_id])
        return super().get_fwd_recv_ops(fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        if self.has_backward and not self.is_last:
            self._allocate(self.grad_recv_info[bwd_chunk_id])
        return super().get_bwd_recv_ops(bwd_chunk_id)

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        output = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        _release(self.args_recv_info[fwd_chunk_id])
        return output

    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        result = super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
        _release(self.grad_recv_info.get(bwd_chunk_id, ()))
        loss = args[0] if args else kwargs.get("loss")
        if isinstance(loss, torch.Tensor) and not loss._is_view():
            # the schedule keeps every micro-batch's loss until the step ends; its spent
            # graph would keep the stage's received input alive through the leaf's
            # AccumulateGrad node (torch detaches the stage output, not the loss)
            loss.detach_()
        return result

    def _allocate(self, infos: tuple[_RecvInfo, ...]) -> None:
        for info in infos:
            if not info.is_root_arg and info.buffer is None and info.tensor_meta is not None:
                info.buffer = _make_tensor_from_meta(info.tensor_meta, self.device)


def _unallocated(info: _RecvInfo) -> _RecvInfo:
    if info.is_root_arg or info.buffer is None:
        return info
    return _RecvInfo(info.input_name, info.source, None, info.tensor_meta)


def _release(infos: tuple[_RecvInfo, ...]) -> None:
    for info in infos:
        if not info.is_root_arg:
            info.buffer = None


def build_stages(
    modules: list[nn.Module], indices: tuple[int, ...], plan: Plan, device: torch.device, group: Any
) -> list[PipelineStage]:
    """One ``PipelineStage`` per local stage module. Without pipelining, a stage that
    FSDP2 wraps reduces each unit's gradients during the backward
    (:class:`_UnitReductionStage`); with ``pp > 1`` a :class:`BoundedStage` keeps
    ``PipelineStage``'s single reduction after the last micro-batch, as the planner's
    pipelined memory and time terms assume."""
    cfg = plan.config
    if cfg.pp == 1:
        sharded = cfg.zero_stage >= 2 and cfg.dp_cp > 1
        return [
            _UnitReductionStage(
                m,
                i,
                cfg.num_stages,
                device,
                group=group,
                sync_each_microbatch=sharded,
                reshard_each_microbatch=sharded and cfg.zero_stage == 3,
            )
            for m, i in zip(modules, indices)
        ]
    return [BoundedStage(m, i, cfg.num_stages, device, group=group) for m, i in zip(modules, indices)]


def recv_buffers(stages: list[PipelineStage]) -> list[torch.Tensor]:
    """The receive buffers ``stages`` hold now: between steps none
    (:class:`BoundedStage` allocates each when its receive is posted and lets go of it
    once consumed)."""
    return [
        info.buffer
        for stage in stages
        for infos in (*stage.args_recv_info.values(), *stage.grad_recv_info.values())
        for info in infos
        if info.buffer is not None
    ]


def build_schedule(
    stages: list[PipelineStage],
    plan: Plan,
    loss_fn: Callable[..., torch.Tensor],
    *,
    num_microbatches: int | None = None,
) -> Any:
    """The plan's schedule over this rank's stages. Without pipelining (``pp == 1``)
    it is 1F1B over one stage: each micro-batch's backward runs before the next forward,
    plain gradient accumulation with one micro-batch of activations alive, as the
    planner's memory model assumes (GPipe would keep all of them). ``num_microbatches``:
    run that many instead of the plan's (a measured dry run's shortened step,
    :func:`autopar.runtime.dry_step.measured_microbatches`)."""
    cfg = plan.config
    kind = cfg.schedule if cfg.pp > 1 else Schedule.ONE_F_ONE_B
    cls = SCHEDULES[kind]
    target = stages if kind.multi_stage else stages[0]
    m = cfg.num_microbatches if num_microbatches is None else num_microbatches
    return cls(target, n_microbatches=m, loss_fn=loss_fn, scale_grads=True)
