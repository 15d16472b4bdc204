"""Context parallelism (``cp``): each sample's sequence split over the cp ranks in
torch's head-tail order, attention run as a ring over them, gradients averaged over
``dp x cp``. Runs against one process: the same losses, gradient norms and weights."""

import functools

import pytest
import torch
from parity import (
    GPT_CFG,
    LOSS_ATOL,
    SEQ,
    assert_parity,
    build,
    make_plan,
    megatron_styles,
    reference,
    run,
    step_collectives,
    token_loss,
    train,
    with_cp,
)
from test_checkpoint import MOMENTUM, SAVE_AT, STEPS
from test_checkpoint import _train as checkpoint_train
from torch.distributed.distributed_c10d import _resolve_process_group

from autopar.runtime.api import parallelize

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_context_parallel_trains_like_one_process(name):
    """cp=2 alone (2 ranks), SGD with momentum and clipping: learned positions (GPT) and
    rotary angles with grouped-query attention (Llama) of the whole sequence."""
    plan = make_plan(name, cp=2)
    assert plan.config.cp == 2
    results = run(train, 2, name, plan, 5, 0.5, None, None, 0.9)
    assert_parity(results, reference(name, plan, clip=0.5, momentum=0.9))


@pytest.mark.parametrize("sp", [False, True])
def test_context_parallel_over_tensor_parallelism_trains_like_one_process(sp):
    """4 ranks: tp=2 (Megatron styles: each rank's ring carries its half of the heads)
    inside cp=2; with sequence parallelism the norms run on a tp shard of the cp shard."""
    styles = megatron_styles("llama", sequence_parallel=sp)
    plan = make_plan("llama", cp=2, tp=2, sequence_parallel=sp, styles=styles)
    assert_parity(run(train, 4, "llama", plan, 5, 0.5), reference("llama", plan, clip=0.5))


@pytest.mark.parametrize("name,mode", [("gpt", "full"), ("llama", "selective")])
def test_context_parallel_with_recomputation_trains_like_one_process(name, mode):
    """Every block recomputes in backward (full: the whole block; selective: the
    attention core, rerun on its saved DTensors): the recomputed attention is the ring
    again, not a local one."""
    plan = make_plan(name, cp=2, recompute={f"layers.{i}": mode for i in range(4)})
    assert_parity(run(train, 2, name, plan, 5, 0.5), reference(name, plan, clip=0.5))


def test_context_parallel_under_pipelining_trains_like_one_process():
    """4 ranks: pp=2 over cp=2; stages pass s / cp tokens and the tied embedding and head
    are reduced between the pipeline ranks of each cp rank."""
    plan = make_plan("gpt", cp=2, pp=2)
    assert_parity(run(train, 4, "gpt", plan, 5, 0.5), reference("gpt", plan, clip=0.5))


def test_context_parallel_with_sharded_data_parallelism_trains_like_one_process():
    """4 ranks: ZeRO-3 over dp=2 x cp=2 flattened: each rank holds a quarter of every
    parameter and of the momentum."""
    plan = make_plan("gpt", cp=2, dp=2, zero_stage=3)
    results = run(train, 4, "gpt", plan, 5, 0.5, None, None, 0.9)
    assert_parity(results, reference("gpt", plan, clip=0.5, momentum=0.9))
    total = sum(p.numel() for p in build("gpt").parameters())
    assert [r.extra["optimizer_state_numel"] for r in results] == [total // 4] * 4


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_sharded_states_over_context_parallel_ranks_alone_train_like_one_process(zero_stage):
    """2 ranks: ZeRO over cp=2 with no data parallelism (what a long-context job on one
    node plans when tp x cp fills it): the optimizer (and under ZeRO-2/3 FSDP2) shards
    over the cp pair, each rank holds half of the momentum."""
    plan = make_plan("gpt", cp=2, zero_stage=zero_stage)
    assert (plan.config.dp, plan.config.state_shards) == (1, 2)
    results = run(train, 2, "gpt", plan, 5, 0.5, None, None, 0.9)
    assert_parity(results, reference("gpt", plan, clip=0.5, momentum=0.9))
    total = sum(p.numel() for p in build("gpt").parameters())
    assert [r.extra["optimizer_state_numel"] for r in results] == [total // 2] * 2


def test_hsdp_with_context_parallelism_trains_like_one_process():
    """8 ranks: dp=4 in 2 replicate groups of shard groups of 2 data-parallel ranks, each
    with its cp=2 ring: FSDP2 shards over 2 x 2 = 4 ranks and replicates across the 2
    groups, so each rank keeps a quarter of the momentum and trains like one process."""
    plan = make_plan("gpt", cp=2, dp=4, zero_stage=3, dp_shard=2)
    assert (plan.config.state_shards, plan.config.replicate_size) == (4, 2)
    results = run(train, 8, "gpt", plan, 5, 0.5, None, None, 0.9)
    assert_parity(results, reference("gpt", plan, clip=0.5, momentum=0.9))
    total = sum(p.numel() for p in build("gpt").parameters())
    assert [r.extra["optimizer_state_numel"] for r in results] == [total // 4] * 8


def _ring_collective(func, args):
    """A functional collective torch's ring issues, by op and group size."""
    if func.namespace == "_c10d_functional" and func._opname in ("all_gather_into_tensor", "all_to_all_single"):
        return func._opname, _resolve_process_group(args[-1]).size()
    return None


def _tokens_and_collectives(rank, world, plan):
    job = parallelize(build("gpt"), plan, loss_fn=token_loss, measure_memory=False)
    tokens = []
    for module in job.stages[0].modules():
        if type(module).__name__ == "Attention":
            module.register_forward_hook(lambda _m, args, _out: tokens.append(tuple(args[0].shape)))
    counts = step_collectives(job, plan, _ring_collective)
    return job._p.positions.tolist(), set(tokens), counts


def test_each_rank_holds_its_head_and_tail_and_the_ring_gathers_once_per_attention():
    """cp=2, s=16: the sequence splits into 4 chunks of 4, rank 0 holds chunks 0 and 3,
    rank 1 chunks 1 and 2, and every attention input holds 8 tokens. Per attention core
    and micro-batch (4 layers x 2), the forward all-gathers K/V once over the group of 2;
    the backward all-gathers them once more and passes the dK/dV partial sums with one
    all-to-all per ring step (2 steps), torch's algorithm."""
    results = run(_tokens_and_collectives, 2, make_plan("gpt", cp=2))
    expected = [[0, 1, 2, 3, 12, 13, 14, 15], [4, 5, 6, 7, 8, 9, 10, 11]]
    cores = GPT_CFG.n_layers * 2
    for rank, (positions, tokens, counts) in enumerate(results):
        assert positions == expected[rank]
        assert tokens == {(2, SEQ // 2, GPT_CFG.dim)}  # micro-batches of 2 samples, half of their tokens
        assert counts == {("all_gather_into_tensor", 2): 2 * cores, ("all_to_all_single", 2): 2 * cores}, rank


@pytest.mark.parametrize("family,pp", [("llama", 1), ("gpt2", 2)])
def test_a_transformers_decoder_with_context_parallelism_matches_one_process(family, pp):
    """Tiny transformers decoders with cp=2: Llama alone (rotary angles from its tokens'
    ``position_ids``), GPT-2 under pp=2 (learned positions; each stage runs the model's
    own forward on s / cp tokens). Their SDPA attention (causal, no mask) runs as the ring."""
    from hf_decoders import build_decoder
    from test_models import as_reference_shapes, hf_reference, hf_train, make

    build = functools.partial(build_decoder, family)
    plan = with_cp(make(build(), pp=pp), 2)
    ref = hf_reference(build, plan, steps=3)
    results = run(hf_train, plan.config.world_size, build, plan, 3, timeout_s=120)
    assert_parity(as_reference_shapes(results, ref), ref)


def test_a_checkpoint_saved_under_context_parallelism_resumes_under_another_plan(tmp_path):
    """Saved by ZeRO-3 over dp=2 x cp=2 (each rank a quarter of every parameter and of
    the momentum); resumed by cp=2 alone (DDP over the cp pair): the resumed run continues
    the uninterrupted single-process run."""
    saver = make_plan("gpt", dp=2, cp=2, zero_stage=3)
    loader = make_plan("gpt", cp=2, num_microbatches=4)
    assert saver.config.global_batch_size == loader.config.global_batch_size
    ref = reference("gpt", saver, steps=STEPS, momentum=MOMENTUM)
    first = run(checkpoint_train, 4, saver, str(tmp_path), False, STEPS, SAVE_AT, timeout_s=120)
    second = run(checkpoint_train, 2, loader, str(tmp_path), True, STEPS, None, timeout_s=120)
    for losses, _, _ in first:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref.losses[:SAVE_AT]), rtol=0, atol=LOSS_ATOL)
    for losses, start, position in second:
        assert start == SAVE_AT and position == STEPS
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref.losses[SAVE_AT:]), rtol=0, atol=LOSS_ATOL)


def test_a_dry_run_shards_over_data_and_context_parallel_ranks():
    """The measured dry run (fake process group and tensors, each rank's s / cp tokens)
    applies ZeRO-3 over dp=2 x cp=2: a rank holds a quarter of every fp32 parameter, as
    the plan's prediction says (and as it says for dp=4 alone)."""
    from autopar.runtime.dry_run import dry_run

    plan = make_plan("gpt", dp=2, cp=2, zero_stage=3)
    report = dry_run(lambda: build("gpt", "meta"), plan, measure=True)
    assert not report.problems
    (rank,) = report.ranks
    assert rank.coordinate == (0, 0, 0, 0)
    fp32_bytes = 4 * sum(p.numel() for p in build("gpt").parameters())
    assert rank.param_bytes == fp32_bytes / 4
    assert plan.prediction.stages[0].memory.params_bytes == pytest.approx(fp32_bytes / 4, rel=1e-12)
    assert rank.measured is not None and rank.measured.peak_bytes > rank.param_bytes
