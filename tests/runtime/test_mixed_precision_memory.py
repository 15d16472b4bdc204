"""A bf16 plan casts its weights the way the planner prices: FSDP2's ``replicate``
(``autopar.runtime.data_parallel``), so the whole block computes in bf16. Under
``torch.autocast``, which ran without data parallelism and beside DDP before, only the
matmuls did: the embedding's fp32 output kept the residual stream, the norms and their
saved inputs in fp32, and rank 0's dry-run peak measured 1.088 of the plan on one
device and 1.289 at tp=8 on one node."""

import functools

import pytest
import torch
from dry_memory import assert_rank0_allocation_measured
from parity import run

import autopar
from autopar.runtime.api import parallelize
from autopar.runtime.dry_step import measure_step
from autopar.runtime.local import cross_entropy

transformers = pytest.importorskip("transformers")


def _llama(hidden: int = 512, device: str = "meta") -> torch.nn.Module:
    cfg = transformers.LlamaConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=4096,
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.LlamaForCausalLM(cfg)


@pytest.mark.parametrize("devices, tp", [(1, 1), (8, 8)], ids=["one-device", "tp8-dp1"])
def test_a_bf16_plan_without_data_parallelism_measures_its_predicted_peak(devices, tp):
    fixed = {"tp": tp, "pp": 1, "micro_batch_size": 2, "zero_stage": 0, "compile": False, "fp8": False}
    cluster = autopar.preset("dgx-h100", devices_per_node=devices)
    plan = autopar.estimate(_llama(), cluster, fixed, global_batch_size=2, seq_len=4096)
    assert (plan.config.dp, plan.config.dtype.value) == (1, "bf16")
    assert_rank0_allocation_measured(_llama, plan, rel=0.02)


def _real_peak(rank: int, world: int, plan: autopar.Plan) -> int:
    job = parallelize(_llama(256, "cpu"), plan, loss_fn=cross_entropy, measure_memory=False)
    return measure_step(job, plan, None).peak_bytes


@pytest.mark.multiprocess
@pytest.mark.parametrize("micro_batch_size", [2, 1], ids=["one-micro-batch", "two-micro-batches"])
def test_a_bf16_data_parallel_step_on_real_tensors_measures_its_predicted_peak(micro_batch_size):
    """Two gloo ranks (dp=2, ZeRO-0) in bf16, counted on their real tensors: each unit's
    gradients all-reduced as its backward ends (``replicate`` per unit). DDP with
    autocast, which ran here before, measured 1.052 and 1.042 of the plan."""
    fixed = {"tp": 1, "pp": 1, "micro_batch_size": micro_batch_size, "zero_stage": 0, "compile": False, "fp8": False}
    cluster = autopar.preset("dgx-h100", devices_per_node=2)
    plan = autopar.estimate(_llama(256), cluster, fixed, global_batch_size=4, seq_len=2048)
    assert (plan.config.dp, plan.config.dtype.value) == (2, "bf16")
    assert plan.config.num_microbatches == 2 // micro_batch_size
    memory = plan.prediction.stages[0].memory
    predicted = memory.total_bytes - memory.reserve_bytes
    for peak in run(_real_peak, 2, plan, timeout_s=300):
        assert peak == pytest.approx(predicted, rel=0.02)


@pytest.mark.parametrize(
    "devices, tp, zero_stage, micro_batch_size, batch",
    [(1, 1, 0, 2, 2), (8, 2, 1, 2, 8), (1, 1, 0, 1, 4), (4, 1, 1, 1, 8)],
    ids=["one-device", "tp2-dp4-zero1", "one-device-4-micro-batches", "dp4-zero1-2-micro-batches"],
)
def test_a_step_whose_parameters_outweigh_its_activations_measures_its_predicted_peak(
    devices, tp, zero_stage, micro_batch_size, batch
):
    """Hidden 2,048 at 256 tokens, where each unit's gradients and copies outweigh the
    activations. One micro-batch: the step peaks late in the backward, where
    ``replicate`` has let go of the bf16 copies of the units whose backward is over (it
    reshards each unit as its backward in the last micro-batch ends), and they are gone
    for the optimizer step; counted to the step's end the measured peaks were 0.935 and
    0.929 of the plan. Several: a unit's reduction in the last micro-batch holds the fp32
    reduce input beside the accumulated gradients (its bf16 ones were added into them
    first), and before it only its bf16 gradients; priced as a single micro-batch's
    reduction (bf16 gradients beside the fp32 buffer) in every micro-batch, 0.937 and
    0.911."""
    fixed = {
        "tp": tp,
        "pp": 1,
        "micro_batch_size": micro_batch_size,
        "zero_stage": zero_stage,
        "compile": False,
        "fp8": False,
    }
    cluster = autopar.preset("dgx-h100", devices_per_node=devices)
    plan = autopar.estimate(_llama(2048), cluster, fixed, global_batch_size=batch, seq_len=256)
    assert (plan.config.num_microbatches, plan.config.dtype.value) == (
        batch * tp // devices // micro_batch_size,
        "bf16",
    )
    assert_rank0_allocation_measured(functools.partial(_llama, 2048), plan, rel=0.03)
