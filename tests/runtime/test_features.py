"""ZeRO stages, schedules, recomputation, global-norm clipping and mixed precision,
each against the single-process reference (tolerances in parity.py)."""

from collections import Counter

import pytest
import torch
from parity import assert_parity, batches, build, make_plan, megatron_styles, reference, run, token_loss, train
from torch.utils._python_dispatch import TorchDispatchMode

import autopar
from autopar.runtime.api import parallelize

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_zero_stages(zero):
    """dp=2 with SGD momentum (so there is optimizer state to shard)."""
    plan = make_plan("gpt", dp=2, zero_stage=zero)
    results = run(train, 2, "gpt", plan, 5, None, None, None, 0.9)
    assert_parity(results, reference("gpt", plan, momentum=0.9))
    total = sum(p.numel() for p in build("gpt").parameters())
    state = [r.extra["optimizer_state_numel"] for r in results]
    if zero == 0:
        assert state == [total, total]  # every replica keeps all momentum buffers
    else:
        assert sum(state) == total and max(state) < total  # each rank keeps its share only


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved-1f1b", "interleaved-zb"])
def test_schedules(schedule):
    v = 2 if schedule in ("interleaved-1f1b", "interleaved-zb") else 1
    plan = make_plan("gpt", pp=2, schedule=schedule, virtual_stages=v, num_microbatches=4)
    assert_parity(run(train, 2, "gpt", plan), reference("gpt", plan))


def test_interleaved_stages_with_lighter_ends():
    """6 blocks over 2 ranks x 2 stages: the blocks do not divide by 4, the 8 units do, so
    the first and the last stage hold one block and the embedding or the head (the
    planner's rule for interleaved stages); it trains like one process."""
    plan = make_plan("gpt-6-blocks", pp=2, schedule="interleaved-1f1b", virtual_stages=2, num_microbatches=4)
    assert [len(s) for s in plan.stages] == [3, 2, 2, 3]  # the embedding is two modules, the head two
    assert plan.stages[0][-1] == "layers.0" and plan.stages[-1][0] == "layers.5"
    assert_parity(run(train, 2, "gpt-6-blocks", plan), reference("gpt-6-blocks", plan))


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func._opname] += 1
        return func(*args, **(kwargs or {}))


def _count_recompute(rank, world, plan):
    job = parallelize(build("gpt"), plan, loss_fn=token_loss)
    calls = Counter()
    for stage in job.stages:
        for name in ("layers.0", "layers.1", "layers.2"):
            block = stage.get_submodule(name)
            block = getattr(block, "_checkpoint_wrapped_module", block)  # count the wrapped block's own runs
            block.register_forward_pre_hook(lambda m, a, n=name: calls.update([n]))
    counts = None
    for batch in job.shard(batches("gpt", 2, plan.config.global_batch_size)):
        calls.clear()
        # early stop would end a rerun once backward has what it needs (not w2's output)
        with torch.utils.checkpoint.set_checkpoint_early_stop(False), _CountOps() as mode:
            job.step(batch)
        counts = mode.counts
    return dict(calls), counts["mm"] + counts["addmm"], counts["_scaled_dot_product_flash_attention_for_cpu"]


def test_recompute_per_block():
    """layers.0 recomputes fully, layers.1 selectively (attention core only), the rest
    not at all: results equal the reference, the fully recomputed block's forward runs
    twice per micro-batch and the others' once, selective recompute reruns attention
    but no matmul, full reruns both."""
    per_block = {"layers.0": "full", "layers.1": "selective"}
    plan = make_plan("gpt", pp=2, recompute=per_block)
    assert_parity(run(train, 2, "gpt", plan), reference("gpt", plan))
    none = make_plan("gpt", num_microbatches=2)
    mixed = make_plan("gpt", num_microbatches=2, recompute=per_block)
    ((_, mm0, sdpa0),) = run(_count_recompute, 1, none)
    ((calls, mm1, sdpa1),) = run(_count_recompute, 1, mixed)
    m = 2
    with _CountOps() as mode:  # the matmuls of one block forward on one micro-batch
        build("gpt").layers["0"](torch.zeros(mixed.config.micro_batch_size, 16, 32))
    block_mm = mode.counts["mm"] + mode.counts["addmm"]
    assert calls == {"layers.0": 2 * m, "layers.1": m, "layers.2": m}
    assert sdpa1 - sdpa0 == 2 * m  # layers.0 and layers.1 rerun attention
    assert mm1 - mm0 == block_mm * m  # only layers.0 reruns its linears


def test_global_norm_clipping_across_all_axes():
    """2x2x2 mesh (FSDP2 ZeRO-3, Megatron TP with SP, interleaved 1F1B, tied embedding
    and head on different pipeline ranks) with clipping active every step: the norm
    each rank computes equals the single process's clip_grad_norm_, so do the updates."""
    plan = make_plan(
        "gpt",
        dp=2,
        tp=2,
        pp=2,
        zero_stage=3,
        schedule="interleaved-1f1b",
        virtual_stages=2,
        sequence_parallel=True,
        styles=megatron_styles("gpt", sequence_parallel=True),
    )
    ref = reference("gpt", plan, clip=0.05)
    assert all(n > 0.05 for n in ref.grad_norms)  # clipping is active
    assert_parity(run(train, 8, "gpt", plan, 5, 0.05, timeout_s=120), ref)


def test_global_norm_with_sequence_parallel_tp_alone():
    """tp=2 with sequence parallelism and no data parallelism: the sequence-parallel norm
    weights' gradients are partial sums over tp that no data-parallel wrapper reduces.
    Reducing one needs both tp ranks; only the first counts it. The second skipped the
    reduction and waited in the world all-reduce, the first in the tp one: a hang until
    the process group's timeout. Now both reduce, and the norm and updates match one
    process's clip_grad_norm_."""
    plan = make_plan("gpt", dp=1, tp=2, sequence_parallel=True, styles=megatron_styles("gpt", sequence_parallel=True))
    ref = reference("gpt", plan, clip=0.05)
    assert all(n > 0.05 for n in ref.grad_norms)  # clipping is active
    assert_parity(run(train, 2, "gpt", plan, 5, 0.05, timeout_s=120), ref)


BF16_RTOL = 2e-2
"""bf16 keeps 8 bits of mantissa (relative precision 2^-8 = 3.9e-3 per rounding); the
losses of a few steps accumulate several roundings per matmul, so 2e-2 relative."""


@pytest.mark.parametrize("zero,tp", [(0, 1), (2, 2)])
def test_bf16_mixed_precision_smoke(zero, tp):
    """bf16 compute with fp32 master weights: FSDP2's MixedPrecisionPolicy, under
    ``replicate`` per unit (zero 0) and ``fully_shard`` with TP (zero 2); losses track the fp32 reference within bf16
    precision, and parameters stay fp32."""
    styles = megatron_styles("gpt") if tp > 1 else None
    plan = make_plan("gpt", dp=2, tp=tp, zero_stage=zero, dtype="bf16", styles=styles)
    results = run(train, 2 * tp, "gpt", plan, 3)
    ref = reference("gpt", plan, steps=3)
    for res in results:
        torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(ref.losses), rtol=BF16_RTOL, atol=0)
        assert res.extra["dtypes"] == {"torch.float32"}
        assert res.losses != ref.losses  # bf16 really ran: an fp32 run would match to ~1e-7


def _peak(rank, world, plan):
    job = parallelize(build("gpt"), plan, loss_fn=token_loss, measure_memory=True)
    opt = job.optimizer(torch.optim.SGD, lr=0.1)
    for batch in job.shard(batches("gpt", 3, plan.config.global_batch_size)):
        job.step(batch)
        opt.step()
        opt.zero_grad()
    return job.metrics[-1].peak_memory_bytes


def test_selective_recompute_never_holds_more_than_none_under_tensor_parallelism():
    """Selective recomputation drops the attention core's intermediates, so it can only
    lower the peak: with Megatron TP (tp=2) every block selective holds at most what no
    recomputation holds, and the losses still equal the reference. (Selective activation
    checkpointing that cached every other op's output held 1.5x more here.)"""
    styles = megatron_styles("gpt")
    blocks = [f"layers.{i}" for i in range(4)]
    selective = make_plan("gpt", tp=2, micro_batch_size=4, styles=styles, recompute=dict.fromkeys(blocks, "selective"))
    none = make_plan("gpt", tp=2, micro_batch_size=4, styles=styles, recompute=dict.fromkeys(blocks, "none"))
    assert none.config.recompute is autopar.Recompute.NONE  # the units not listed recompute nothing either
    assert_parity(run(train, 2, "gpt", selective), reference("gpt", selective))
    assert max(run(_peak, 2, selective)) <= max(run(_peak, 2, none))


LLAMA_OP = {f"layers.{i}": "op" for i in range(4)}


def _count_llama_ops(rank, world, plan):
    job = parallelize(build("llama"), plan, loss_fn=token_loss)
    for batch in job.shard(batches("llama", 2, plan.config.global_batch_size)):
        with torch.utils.checkpoint.set_checkpoint_early_stop(False), _CountOps() as mode:
            job.step(batch)
    return mode.counts["mm"], mode.counts["_scaled_dot_product_flash_attention_for_cpu"]


@pytest.mark.parametrize(
    "axes",
    [
        {"tp": 2, "sequence_parallel": True, "styles": megatron_styles("llama", sequence_parallel=True)},
        {"pp": 2, "schedule": "1f1b", "num_microbatches": 4},
    ],
    ids=["tp2-sp", "pp2"],
)
def test_per_operator_recompute_trains_like_one_process(axes):
    """``op`` on every block of a Llama, on 2 ranks with tensor and sequence parallelism
    or with a pipeline: losses and parameters equal the single process's."""
    plan = make_plan("llama", recompute=LLAMA_OP, **axes)
    assert_parity(run(train, 2, "llama", plan), reference("llama", plan))


def test_per_operator_recompute_reruns_every_second_matmul_and_no_attention():
    """A Llama block runs seven bias-free matmuls (wq wk wv wo w1 w3 w2): ``op`` keeps the
    first, third, fifth and seventh and reruns the other three in backward, and keeps
    the attention's output, so it never reruns attention."""
    none = make_plan("llama", num_microbatches=2)
    op = make_plan("llama", num_microbatches=2, recompute=LLAMA_OP)
    ((mm_none, sdpa_none),) = run(_count_llama_ops, 1, none)
    ((mm_op, sdpa_op),) = run(_count_llama_ops, 1, op)
    blocks, m = 4, 2
    assert mm_op - mm_none == 3 * blocks * m
    assert sdpa_op == sdpa_none
