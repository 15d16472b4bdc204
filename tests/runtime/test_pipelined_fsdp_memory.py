"""The planner's peak memory against a measured dry run for pipelined ZeRO-2 under the
schedules whose FSDP2 behaviour differs from a plain backward (autopar.cost.memory):
zero-bubble schedules defer each stage's weight gradients past FSDP2's post-backward,
multi-stage schedules keep at most three stages of a rank gathered, and the pipelined
gradient is accumulated unsharded (a vocabulary-parallel embedding's whole)."""

from collections.abc import Callable

import pytest
import torch
from torch import nn

import autopar
from autopar.models.gpt import GPT, GPTConfig
from autopar.runtime.dry_run import dry_run

pytestmark = pytest.mark.multiprocess

CFG = GPTConfig(vocab_size=8192, seq_len=128, dim=1024, n_layers=16, n_heads=16, tie_embeddings=False)
"""Blocks of 12.6M parameters and short sequences: the model states, not the
activations, make the peak, so their terms are what the comparison sees."""


def _meta_gpt() -> GPT:
    with torch.device("meta"):
        return GPT(CFG)


def _assert_rank0_priced(plan: autopar.Plan, rel: float, build: Callable[[], nn.Module] = _meta_gpt) -> None:
    """Rank 0's measured peak is the planner's allocation within ``rel``. Only rank 0
    runs, so the inputs of its later stages are assumed, not checked (a reported
    problem, not a failure)."""
    report = dry_run(build, plan, ranks=[0], measure=True)
    rank = report.ranks[0]
    assert rank.measured is not None, report.problems
    assert rank.measured.peak_bytes == pytest.approx(rank.predicted_allocated_bytes, rel=rel), (
        rank.measured.peak_bytes,
        rank.predicted_allocated_bytes,
    )


@pytest.mark.parametrize(
    "config",
    [
        {"dp": 8, "tp": 1, "schedule": "interleaved-zb", "virtual_stages": 2},
        {"dp": 8, "tp": 1, "schedule": "interleaved-zb", "virtual_stages": 4},
        {"dp": 8, "tp": 1, "schedule": "interleaved-1f1b", "virtual_stages": 4},
        {"dp": 4, "tp": 2, "schedule": "1f1b"},
        {"dp": 8, "tp": 1, "schedule": "1f1b", "reduce_dtype": "bf16"},
        {"dp": 8, "tp": 1, "schedule": "interleaved-zb", "virtual_stages": 2, "reduce_dtype": "bf16"},
        {"dp": 4, "tp": 2, "schedule": "1f1b", "reduce_dtype": "bf16"},
    ],
    ids=[
        "zero-bubble-v2",
        "zero-bubble-v4",
        "interleaved-v4",
        "1f1b-vocab-parallel",
        "1f1b-bf16",
        "zb-v2-bf16",
        "1f1b-vocab-parallel-bf16",
    ],
)
def test_pipelined_zero2_peak_is_priced(config):
    """Rank 0 of a pp=2 ZeRO-2 plan in bf16, one step on fake tensors at the full world
    size: the planner's allocation is within 3% of the measured peak. Before the
    deferred weight gradients, the three-stage gather limit, the whole fp32 gradient of
    a vocabulary-parallel table and the unsharded-only pipelined gradient were priced,
    measured over predicted was 1.07, 1.07, 0.91 and 0.95. Reducing in bf16
    (``reduce_dtype``), the gradients accumulate in the bf16 ``.grad`` itself: the
    runtime made to reduce in fp32 measured 1.34 and 1.47 times the 1F1B and zero-bubble
    predictions."""
    config = {"pp": 2, "micro_batch_size": 1, "num_microbatches": 4, "zero_stage": 2, "dtype": "bf16"} | config
    config["recompute"] = "none"
    devices = config["dp"] * config["pp"] * config["tp"]
    cluster = autopar.preset("dgx-h100", nodes=devices // 8)
    plan = autopar.estimate(_meta_gpt(), cluster, config, global_batch_size=config["dp"] * 4, seq_len=CFG.seq_len)
    _assert_rank0_priced(plan, rel=0.03)


@pytest.mark.parametrize(
    "config",
    [{"dp": 8, "tp": 1}, {"dp": 4, "tp": 2, "sequence_parallel": True}],
    ids=["replicate", "replicate-tp2-sp"],
)
def test_interleaved_zero1_peak_is_priced(config):
    """Rank 0 of a pp=2 x v=4 interleaved 1F1B plan under ZeRO-1 in bf16 (FSDP2's
    ``replicate``, one step on fake tensors at the full world size) is priced within 1%.
    What the prediction follows: the schedule's ``RESHARD`` steps free ``replicate``'s
    bf16 copy of a chunk, and its ``UNSHARD`` steps gather nothing (its shard group is
    one rank), so a chunk's copy exists from its next compute on (two of the rank's
    four chunks at its peak); a chunk's gradients exist from its first backward on; and
    the optimizer state is balanced over the data-parallel ranks across all of the
    rank's stages. Measured over predicted was 0.961 and 0.927 before."""
    config = {"pp": 2, "micro_batch_size": 1, "num_microbatches": 4, "zero_stage": 1, "dtype": "bf16"} | config
    config |= {"schedule": "interleaved-1f1b", "virtual_stages": 4, "recompute": "none"}
    cluster = autopar.preset("dgx-h100", nodes=2)
    plan = autopar.estimate(_meta_gpt(), cluster, config, global_batch_size=config["dp"] * 4, seq_len=CFG.seq_len)
    _assert_rank0_priced(plan, rel=0.01)


def test_an_interleaved_zero2_plan_at_scale_is_priced_on_the_ranks_it_fills():
    """The plan the search returns for a GPT-3-style 314B model with Megatron-Core's
    degrees (dp=48 x tp=8 x pp=8 on 3,072 H100, interleaved 1F1B, ZeRO-2, sequence
    parallelism), whose ranks take the room their walk leaves below the stage bound
    (``autopar.search.walk_room``): its first two pipeline ranks, one step each on fake
    tensors at the full world size, hold at most their prediction and within 1% of it
    (measured 73.76 and 69.71 GiB, predicted 74.02 and 70.08). With the room given
    back, a plan sits at the walk's edge, so what the walk misses is an out-of-memory:
    before a block cut its sequence shard outside its checkpoint and the selectively
    recomputed attention kept its output, rank 0 measured 75.29 GiB against 74.02 and
    rank 1 74.99 against 74.21."""
    cfg = GPTConfig(vocab_size=131072, seq_len=4096, dim=16384, n_layers=96, n_heads=128)

    def build() -> GPT:
        with torch.device("meta"):
            return GPT(cfg)

    fixed = {"tp": 8, "pp": 8, "schedule": "interleaved-1f1b", "zero_stage": 2, "sequence_parallel": True}
    fixed |= {"compile": False, "fp8": False}
    cluster = autopar.preset("dgx-h100", nodes=384)
    plan = autopar.plan(build(), cluster, global_batch_size=1536, seq_len=cfg.seq_len, constraints=fixed)
    stride = plan.config.world_size // plan.config.pp
    report = dry_run(build, plan, ranks=[0, stride], measure=True)
    for rank in report.ranks:
        assert rank.measured is not None, report.problems
        measured, predicted = rank.measured.peak_bytes, rank.predicted_allocated_bytes
        assert 0.99 * predicted <= measured <= predicted, (rank.rank, measured, predicted)


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b"])
def test_a_pipeline_without_data_parallelism_casts_its_weights_once(schedule):
    """dp=1, pp=2 in bf16: the runtime runs FSDP2's ``replicate`` on the one-rank group,
    whose mixed precision casts a stage's weights once. Under autocast, as before, each
    micro-batch's forward cast them anew and kept its copy for its backward: rank 0 of
    1F1B (two micro-batches in flight) measured 1.10 of the prediction and interleaved
    1F1B 1.15; now within 1%."""
    config = {"dp": 1, "tp": 1, "pp": 2, "micro_batch_size": 1, "num_microbatches": 4, "zero_stage": 0}
    config |= {"dtype": "bf16", "recompute": "none", "compile": False, "schedule": schedule}
    config |= {"virtual_stages": 2} if schedule == "interleaved-1f1b" else {}
    cluster = autopar.preset("dgx-h100", devices_per_node=2)
    plan = autopar.estimate(_meta_gpt(), cluster, config, global_batch_size=4, seq_len=CFG.seq_len)
    _assert_rank0_priced(plan, rel=0.01)
