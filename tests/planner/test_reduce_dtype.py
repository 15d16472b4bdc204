"""Gradients reduced in bf16 (``ParallelConfig.reduce_dtype``): the model states and the
reduction it prices against hand counts, the constraints that need it, the search that
never picks it by itself, and the exports that carry it."""

import dataclasses
import json

import pytest

import autopar
from autopar.cost.memory import state_bytes
from autopar.errors import ConfigError, DeviceCountError, InfeasiblePlanError
from autopar.export import ExportError, export
from autopar.models import build_named_model
from autopar.plan import ParallelConfig
from autopar.present.units import size
from autopar.vocab import DType, Optimizer

from .test_export import variant

GIB = 2**30


def test_pipelined_zero2_states_by_hand():
    """1e9 parameters per device under pipelined ZeRO-2 over 8 ranks in bf16, Adam: the
    fp32 master shard (0.5 GB) and the gathered bf16 copy (2 GB) as before; the unsharded
    gradients accumulated in bf16 take 2 bytes per parameter instead of 4; Adam's shard
    1 GB; the transient is one new gradient of the largest tensor (5e7 x 2 bytes), not
    the largest unit's gradients waiting for their cast."""
    common = dict(param_numel=1e9, factored_numel=0.0, largest_unit_numel=1e8, largest_grad_numel=5e7)
    common |= dict(dtype=DType.BF16, optimizer=Optimizer.ADAM, zero_stage=2, dp=8, pipelined=True)
    bf16 = state_bytes(**common, reduce_dtype=DType.BF16)
    fp32 = state_bytes(**common)
    assert (bf16.params_bytes, bf16.grads_bytes, bf16.optimizer_bytes) == (2.5e9, 2e9, 1e9)
    assert bf16.transient_bytes == 1e8
    assert (fp32.params_bytes, fp32.grads_bytes, fp32.optimizer_bytes, fp32.transient_bytes) == (2.5e9, 4e9, 1e9, 2e8)


def test_unpipelined_zero2_reduces_from_a_bf16_buffer_by_hand():
    """Without pipelining the sharded gradients stay fp32 (1e9 x 4 / 8 bytes); only the
    reduce-scatter input of the largest unit shrinks, from 4 to 2 bytes per element
    beside its 2-byte unsharded gradients: 1e8 x (2 + 2) against 1e8 x (4 + 2)."""
    common = dict(param_numel=1e9, factored_numel=0.0, largest_unit_numel=1e8)
    common |= dict(dtype=DType.BF16, optimizer=Optimizer.ADAM, zero_stage=2, dp=8, pipelined=False)
    bf16, fp32 = state_bytes(**common, reduce_dtype=DType.BF16), state_bytes(**common)
    assert bf16.grads_bytes == fp32.grads_bytes == 5e8
    assert (bf16.transient_bytes, fp32.transient_bytes) == (4e8, 6e8)


def _estimate(reduce_dtype: str, pp: int):
    return autopar.estimate(
        build_named_model("gpt3-13b"),
        autopar.preset("dgx-h100", nodes=2),
        {"tp": 4, "pp": pp, "micro_batch_size": 1, "zero_stage": 2, "compile": False, "reduce_dtype": reduce_dtype},
        global_batch_size=32,
        seq_len=2048,
    )


def test_a_pipelined_plan_holds_half_the_gradient_bytes_and_reduces_faster():
    """GPT-3 13B at tp=4 pp=2 dp=2 under ZeRO-2: each stage's gradient bytes halve and
    nothing else it holds between steps changes; its exposed reduction takes less time."""
    bf16, fp32 = _estimate("bf16", 2), _estimate("fp32", 2)
    assert bf16.config.reduce_dtype is DType.BF16 and "reduce-bf16" in bf16.config.short()
    for low, full in zip(bf16.prediction.stages, fp32.prediction.stages, strict=True):
        assert low.memory.grads_bytes == pytest.approx(full.memory.grads_bytes / 2, rel=1e-12)
        assert (low.memory.params_bytes, low.memory.optimizer_bytes) == (
            full.memory.params_bytes,
            full.memory.optimizer_bytes,
        )
        assert low.memory.activations_bytes == full.memory.activations_bytes
        assert 0 < low.dp_comm_s < full.dp_comm_s
    assert bf16.prediction.memory_bytes_per_device < fp32.prediction.memory_bytes_per_device


def test_the_search_reduces_in_fp32_unless_told():
    """The search never trades the sum's precision by itself; given reduce_dtype='bf16' it
    keeps to ZeRO-2/3, whose FSDP2 reduces in it."""
    model, cluster = build_named_model("gpt3-1.3b"), autopar.preset("dgx-h100", nodes=1)
    default = autopar.plan(model, cluster, global_batch_size=64, seq_len=2048)
    assert default.config.reduce_dtype is DType.FP32
    told = autopar.plan(model, cluster, global_batch_size=64, seq_len=2048, constraints={"reduce_dtype": "bf16"})
    assert told.config.reduce_dtype is DType.BF16 and told.config.zero_stage >= 2


@pytest.mark.parametrize(
    "constraints, message",
    [
        ({"reduce_dtype": "bf16", "zero_stage": 1}, "constraint reduce_dtype='bf16' with zero_stage=1 is not allowed"),
        ({"reduce_dtype": "bf16", "dtype": "fp16"}, "reduce_dtype='bf16' is not allowed with dtype='fp16'"),
        ({"reduce_dtype": "bf17"}, "constraint reduce_dtype='bf17' is not allowed; use one of 'fp32', 'bf16', 'fp16'"),
        ({"reduce_dtype": "fp16"}, "constraint reduce_dtype='fp16' is not allowed: gradients reduce in 'fp32'"),
    ],
)
def test_a_reduction_the_runtime_cannot_run_is_refused_before_the_search(constraints, message):
    with pytest.raises(ConfigError, match=message.replace("(", "\\(")):
        autopar.plan(
            build_named_model("gpt2-small"),
            autopar.preset("dgx-h100", nodes=1),
            global_batch_size=64,
            seq_len=1024,
            constraints=constraints,
        )


def test_megatron_and_deepspeed_are_told_the_reduction_precision(pipelined_plan):
    """Megatron-LM reduces in fp32 under --bf16 unless given --grad-reduce-in-bf16;
    DeepSpeed reduces in the training precision unless given communication_data_type."""
    fp32 = variant(pipelined_plan, zero_stage=2)
    bf16 = variant(pipelined_plan, zero_stage=2, reduce_dtype="bf16")
    assert "--grad-reduce-in-bf16" in export(bf16, to="megatron").text
    assert "--grad-reduce-in-bf16" not in export(fp32, to="megatron").text
    for plan, value in ((bf16, "bf16"), (fp32, "fp32")):
        assert json.loads(export(plan, to="deepspeed").text)["communication_data_type"] == value


def test_torchtitan_refuses_a_bf16_reduction(pipelined_plan):
    """torchtitan offers float32 reductions only: the export says so rather than write a
    job that holds twice the plan's pipelined gradients."""
    with pytest.raises(ExportError, match="torchtitan reduces gradients in float32 only"):
        export(variant(pipelined_plan, zero_stage=2, reduce_dtype="bf16"), to="torchtitan")


def test_accelerate_is_told_to_keep_an_fp32_reduction(pipelined_plan):
    """Accelerate's FSDP reduces in its mixed precision by default: an fp32-reducing plan
    says how to keep fp32, a bf16-reducing one needs no note."""
    fp32 = variant(pipelined_plan, pp=1, dp=4, zero_stage=2)
    notes = [n for n in export(fp32, to="accelerate").notes if "reduce_dtype" in n]
    assert (
        len(notes) == 1 and "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)" in notes[0]
    )
    bf16 = variant(fp32, reduce_dtype="bf16")
    assert not [n for n in export(bf16, to="accelerate").notes if "reduce_dtype" in n]


def test_a_pipelined_plan_that_does_not_fit_is_told_of_bf16_reduction_and_fits_with_it():
    """GPT-3 13B pinned to tp=2 pp=4 ZeRO-2 with full recomputation on 16 H100 cut to
    22 GiB: nothing fits reducing in fp32, and the refusal names reduce_dtype='bf16' with
    what it saves, the difference of the two configurations' estimates; with it the search
    finds a plan that fits."""
    cluster = autopar.preset("dgx-h100", nodes=2)
    memory = dataclasses.replace(cluster.device.memory, capacity_bytes=22 * GIB)
    small = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, memory=memory))
    fixed = {"tp": 2, "pp": 4, "zero_stage": 2, "recompute": "full", "micro_batch_size": 1, "compile": False}
    model = build_named_model("gpt3-13b")
    peaks = [
        autopar.estimate(model, small, fixed | {"fp8": True, "reduce_dtype": r}, global_batch_size=32, seq_len=2048)
        for r in ("fp32", "bf16")
    ]
    saved = size(peaks[0].prediction.memory_bytes_per_device - peaks[1].prediction.memory_bytes_per_device)
    with pytest.raises(InfeasiblePlanError) as err:
        autopar.plan(model, small, global_batch_size=32, seq_len=2048, constraints=fixed)
    assert (
        f"reduce_dtype='bf16' (pipeline stages then hold their gradients in 2 bytes per parameter, not 4: {saved} less)"
        in str(err.value)
    )
    fits = autopar.plan(model, small, global_batch_size=32, seq_len=2048, constraints=fixed | {"reduce_dtype": "bf16"})
    assert fits.prediction.fits and fits.config.reduce_dtype is DType.BF16


def test_the_hint_is_left_out_where_bf16_reduction_would_not_fit():
    """Mixtral 8x7B pinned to pp=2 ep=4 ZeRO-2 on 8 H100 needs 111 GiB: bf16 reduction saves
    far less than the 32 GiB over (a rank holds a quarter of each expert stack), so the
    refusal does not offer it."""
    with pytest.raises(InfeasiblePlanError) as err:
        autopar.plan(
            build_named_model("mixtral-8x7b"),
            autopar.preset("dgx-h100", nodes=1),
            global_batch_size=64,
            seq_len=4096,
            constraints={"schedule": "1f1b", "zero_stage": 2, "ep": 4, "pp": 2},
        )
    assert "no plan fits" in str(err.value) and "reduce_dtype" not in str(err.value)


def test_one_replica_reduces_nothing():
    """With dp x cp = 1 no gradient is reduced, and autopar's runtime wraps nothing in FSDP2:
    refused as a configuration, and as a search with dp pinned to 1."""
    with pytest.raises(ConfigError, match="reduce_dtype='bf16' needs data parallelism \\(dp x cp > 1, got 1\\)"):
        ParallelConfig(dp=1, tp=1, pp=2, micro_batch_size=1, num_microbatches=2, zero_stage=2, reduce_dtype="bf16")
    with pytest.raises(DeviceCountError, match="dp=1 cp=1: reduce_dtype='bf16' needs dp x cp > 1"):
        autopar.plan(
            build_named_model("gpt3-1.3b"),
            autopar.preset("dgx-h100", nodes=1),
            global_batch_size=64,
            seq_len=2048,
            constraints={"reduce_dtype": "bf16", "dp": 1},
        )


def test_estimate_names_what_a_bf16_reduction_lacks_first():
    """On 8 devices at tp=8, dp x cp is 1: no ZeRO stage would make the reduction run, so
    that is what the refusal names, not the zero_stage it would ask for next."""
    with pytest.raises(ConfigError, match="reduce_dtype='bf16' needs data parallelism \\(dp x cp > 1, got 1\\)"):
        autopar.estimate(
            build_named_model("gpt2-small"),
            autopar.preset("dgx-h100", nodes=1),
            {"reduce_dtype": "bf16", "tp": 4, "pp": 2},
            global_batch_size=64,
            seq_len=1024,
        )


def test_estimate_names_its_default_zero_stage():
    with pytest.raises(ConfigError, match="estimate prices zero_stage=0 unless given; set zero_stage=2 or 3 too"):
        autopar.estimate(
            build_named_model("gpt2-small"),
            autopar.preset("dgx-h100", nodes=1),
            {"reduce_dtype": "bf16"},
            global_batch_size=64,
            seq_len=1024,
        )
