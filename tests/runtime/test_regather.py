"""Keeping the shards of sequence-parallel gathers (``regather``): the same training as
one process, one all-gather per gathered input in the backward, and the memory the
planner predicts, measured."""

import pytest
import torch
import torch.distributed as dist
from parity import (
    LLAMA_CFG,
    assert_parity,
    batches,
    build,
    make_plan,
    megatron_styles,
    reference,
    run,
    token_loss,
    train,
)

import autopar
from autopar.models import Llama, LlamaConfig
from autopar.runtime.api import parallelize
from autopar.runtime.dry_run import dry_run

MIXED = {"layers.1": "full", "layers.2": "selective"}
"""A checkpointed unit (left alone), a selective one (its attention checkpointed inside
the hooks) and two that keep everything."""


def _plan(**config):
    return make_plan(
        "llama",
        tp=2,
        sequence_parallel=True,
        regather=True,
        styles=megatron_styles("llama", sequence_parallel=True),
        recompute=MIXED,
        **config,
    )


@pytest.mark.multiprocess
def test_training_with_kept_shards_equals_one_process():
    """Two TP ranks (gloo) keeping shards, four micro-batches a step: five steps' losses
    and parameters equal the single-process run's."""
    plan = _plan(num_microbatches=4)
    assert_parity(run(train, plan.config.world_size, "llama", plan), reference("llama", plan))


def test_each_gathered_input_is_gathered_once_again_in_the_backward(fake_world, monkeypatch):
    """On a fake two-rank group: per micro-batch, the backward all-gathers the
    attention's input once for wq, wk and wv, the MLP's once for w1 and w3, in each block
    that keeps its activations (3 of 4), and the head's input: 7; the checkpointed
    block's recomputed forward keeps its own copies."""
    plan = _plan()
    calls: list[int] = []
    original = dist.all_gather_single

    def counting(out, shard, group=None, async_op=False):
        calls.append(shard.numel())
        return original(out, shard, group=group, async_op=async_op)

    monkeypatch.setattr(dist, "all_gather_single", counting)
    job = parallelize(build("llama"), plan, loss_fn=token_loss, measure_memory=False)
    first, second = job.shard(batches("llama", 2, plan.config.global_batch_size))
    job.step(first)
    calls.clear()
    job.step(second)
    shard = plan.config.micro_batch_size * LLAMA_CFG.seq_len * LLAMA_CFG.dim // 2
    assert calls == [shard] * (7 * plan.config.num_microbatches)


CFG = LlamaConfig(vocab_size=8192, seq_len=2048, dim=1024, n_layers=4, n_heads=16, n_kv_heads=8, ffn_dim=2816)


def _meta_llama() -> Llama:
    with torch.device("meta"):
        return Llama(CFG)


def _estimate(regather: bool) -> autopar.Plan:
    config = {
        "dp": 2,
        "zero_stage": 2,
        "tp": 8,
        "pp": 1,
        "micro_batch_size": 2,
        "num_microbatches": 2,
        "dtype": "bf16",
        "recompute": "none",
        "sequence_parallel": True,
        "compile": False,
        "regather": regather,
    }
    return autopar.estimate(
        _meta_llama(), autopar.preset("dgx-h100", nodes=2), config, global_batch_size=8, seq_len=CFG.seq_len
    )


@pytest.mark.multiprocess
def test_kept_shards_save_what_the_planner_predicts():
    """Rank 0 of a tp=8, dp=2 plan, one step on fake tensors at full size: keeping the
    shards lowers the measured peak by exactly the hand count, 4 blocks x 2 gathers and
    the head's input, each ``2 x 2048 x 1024`` bf16 values (8 MiB) less its eighth;
    and the planner's allocation is within 3% of the measured peak, both ways."""
    peaks = []
    for regather in (False, True):
        report = dry_run(_meta_llama, _estimate(regather), ranks=[0], measure=True)
        assert report.ok, report.problems
        rank = report.ranks[0]
        peaks.append(rank.measured.peak_bytes)
        assert rank.measured.peak_bytes == pytest.approx(rank.predicted_allocated_bytes, rel=0.03)
    whole = 2 * 2048 * 1024 * 2
    assert peaks[0] - peaks[1] == 9 * whole * 7 // 8
