"""The planner's peak memory against a measured dry run for pipelined ZeRO-2 under the
schedules whose FSDP2 behaviour differs from a plain backward (autopar.cost.memory):
zero-bubble schedules defer each stage's weight gradients past FSDP2's post-backward,
multi-stage schedules keep at most three stages of a rank gathered, and the pipelined
gradient is accumulated unsharded (a vocabulary-parallel embedding's whole)."""

import pytest
import torch

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


@pytest.mark.parametrize(
    "config",
    [
        {"dp": 8, "tp": 1, "schedule": "interleaved-zb", "virtual_stages": 2},
        {"dp": 8, "tp": 1, "schedule": "interleaved-zb", "virtual_stages": 4},
        {"dp": 8, "tp": 1, "schedule": "interleaved-1f1b", "virtual_stages": 4},
        {"dp": 4, "tp": 2, "schedule": "1f1b"},
    ],
    ids=["zero-bubble-v2", "zero-bubble-v4", "interleaved-v4", "1f1b-vocab-parallel"],
)
def test_pipelined_zero2_peak_is_priced(config):
    """Rank 0 of a pp=2 ZeRO-2 plan in bf16, one step on fake tensors at the full world
    size: the planner's allocation is within 3% of the measured peak. Before the
    deferred weight gradients, the three-stage gather limit, the whole fp32 gradient of
    a vocabulary-parallel table and the unsharded-only pipelined gradient were priced,
    measured over predicted was 1.07, 1.07, 0.91 and 0.95. Only rank 0 runs, so the
    inputs of its later stages are assumed, not checked (a reported problem)."""
    config = {"pp": 2, "micro_batch_size": 1, "num_microbatches": 4, "zero_stage": 2, "dtype": "bf16"} | config
    config["recompute"] = "none"
    devices = config["dp"] * config["pp"] * config["tp"]
    cluster = autopar.preset("dgx-h100", nodes=devices // 8)
    plan = autopar.estimate(_meta_gpt(), cluster, config, global_batch_size=config["dp"] * 4, seq_len=CFG.seq_len)
    report = dry_run(_meta_gpt, plan, ranks=[0], measure=True)
    rank = report.ranks[0]
    assert rank.measured is not None, report.problems
    assert rank.measured.peak_bytes == pytest.approx(rank.predicted_allocated_bytes, rel=0.03), (
        rank.measured.peak_bytes,
        rank.predicted_allocated_bytes,
    )
