"""A plan file whose prediction contradicts itself (MFU above HFU, a breakdown that does
not add up to the step, negative terms, rates that are not the batch over the step) is
refused at load in one line naming the field; every plan the planner writes still loads."""

import json
import re

import pytest
import torch

import autopar
from autopar import Plan, PlanFormatError
from autopar.models import Llama, LlamaConfig, build_named_model

REMEDY = (
    ". The file was edited or damaged: make the plan again (autopar plan, or autopar.estimate for a fixed "
    "configuration)."
)


@pytest.fixture(scope="module")
def gpt2_data():
    plan = autopar.plan(
        build_named_model("gpt2-small"),
        autopar.preset("dgx-a100-80gb", nodes=1),
        global_batch_size=64,
        seq_len=1024,
    )
    return json.loads(plan.to_json())


def _refusal(data) -> str:
    with pytest.raises(PlanFormatError) as info:
        Plan.from_dict(data)
    message = str(info.value)
    assert "\n" not in message and message.endswith(REMEDY)
    return message


def test_the_unedited_plan_loads(gpt2_data):
    plan = Plan.from_dict(gpt2_data)
    p = plan.prediction
    assert p.breakdown.total_s == pytest.approx(p.step_time_s, rel=1e-9)
    assert p.tokens_per_s == pytest.approx(p.samples_per_s * 1024, rel=1e-9)
    assert 0 <= p.mfu <= p.hfu


def test_mfu_above_hfu_is_refused(gpt2_data):
    data = json.loads(json.dumps(gpt2_data))
    hfu = data["prediction"]["hfu"]
    data["prediction"]["mfu"] = 5.0
    assert _refusal(data) == (
        f"plan.prediction: mfu=5.0 must be <= hfu={hfu!r} (hardware FLOPs are the model's and its "
        f"recomputation){REMEDY}"
    )


def test_a_step_time_that_is_not_its_breakdowns_sum_is_refused(gpt2_data):
    data = json.loads(json.dumps(gpt2_data))
    total = Plan.from_dict(gpt2_data).prediction.breakdown.total_s
    data["prediction"]["step_time_s"] = 100
    assert _refusal(data) == (
        f"plan.prediction: step_time_s=100.0 must be the sum of its breakdown's terms, {total:.6g}{REMEDY}"
    )


def test_a_negative_breakdown_term_is_refused(gpt2_data):
    data = json.loads(json.dumps(gpt2_data))
    data["prediction"]["breakdown"]["compute_s"] = -5
    assert _refusal(data) == f"plan.prediction: breakdown.compute_s=-5.0 must be >= 0{REMEDY}"


def test_tokens_per_s_that_is_not_samples_times_seq_len_is_refused(gpt2_data):
    data = json.loads(json.dumps(gpt2_data))
    samples = data["prediction"]["samples_per_s"]
    data["prediction"]["tokens_per_s"] = 1
    assert _refusal(data) == (
        f"plan.prediction: tokens_per_s=1.0 must be samples_per_s x model.seq_len = {samples:.6g} x 1024 = "
        f"{samples * 1024:.0f}{REMEDY}"
    )


def test_samples_per_s_that_is_not_the_batch_over_the_step_is_refused(gpt2_data):
    data = json.loads(json.dumps(gpt2_data))
    step = data["prediction"]["step_time_s"]
    data["prediction"]["samples_per_s"] = 1.5
    assert _refusal(data) == (
        f"plan.prediction: samples_per_s=1.5 must be model.global_batch_size / step_time_s = 64 / {step!r} = "
        f"{64 / step:.6g}{REMEDY}"
    )


def test_an_existing_check_still_comes_first(gpt2_data):
    """A negative MFU reads as negative, not as the MFU/HFU contradiction."""
    data = json.loads(json.dumps(gpt2_data))
    data["prediction"]["mfu"] = -0.5
    assert _refusal(data) == f"plan.prediction: mfu=-0.5 must be >= 0{REMEDY}"


def _long_llama():
    cfg = LlamaConfig(
        vocab_size=1000, seq_len=1048576, dim=256, n_layers=2, n_heads=4, n_kv_heads=4, ffn_dim=512, rope_theta=1e6
    )
    with torch.device("meta"):
        return Llama(cfg)


def _fp8_llama():
    cfg = LlamaConfig(dim=4096, n_layers=2, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=32000)
    with torch.device("meta"):
        return Llama(cfg)


PLANS = {
    "estimate": lambda: autopar.estimate(
        build_named_model("gpt2-small"), "dgx-a100-80gb:1", {"tp": 2, "pp": 2}, global_batch_size=16, seq_len=512
    ),
    "fp8": lambda: autopar.estimate(
        _fp8_llama(), "dgx-h100:1", {"fp8": True, "compile": True}, global_batch_size=16, seq_len=2048
    ),
    "moe": lambda: autopar.estimate(
        build_named_model("moe-tiny"), "dgx-a100-80gb:1", {"ep": 4}, global_batch_size=8, seq_len=128
    ),
    "long-context": lambda: autopar.plan(_long_llama(), "dgx-a100-80gb:1", global_batch_size=8, seq_len=1048576, top=0),
    "image": lambda: autopar.plan(
        build_named_model("resnet-small"),
        "dgx-a100-80gb:1",
        global_batch_size=16,
        sample_input=torch.zeros(1, 3, 224, 224),
        top=0,
    ),
    "cpu": lambda: autopar.plan(build_named_model("moe-tiny"), "local-cpu:2", global_batch_size=4, seq_len=64, top=0),
}


@pytest.mark.parametrize("kind", sorted(PLANS))
def test_every_kind_of_plan_the_planner_writes_loads(kind, tmp_path):
    plan = PLANS[kind]()
    again = Plan.load(plan.save(tmp_path / "plan.json"))
    assert again == plan
    p = plan.prediction
    assert p.breakdown.total_s == pytest.approx(p.step_time_s, rel=1e-9)
    if kind == "fp8":  # measured against the bf16 peak: its MFU may pass 100%, never its HFU's
        assert plan.config.fp8 and p.mfu <= p.hfu
    if kind == "image":
        assert plan.model.seq_len == 1 and not plan.model.has_attention
    if kind == "moe":
        assert plan.config.ep == 4


def test_an_fp8_mfu_above_one_loads():
    """MFU is reported against the bf16 peak, so an FP8 plan's may pass 1.0: only MFU above
    HFU is a contradiction."""
    data = json.loads(PLANS["fp8"]().to_json())
    data["prediction"]["mfu"], data["prediction"]["hfu"] = 1.038, 1.1
    assert Plan.from_dict(data).prediction.mfu == 1.038
    assert re.search(
        r"mfu=1\.2 must be <= hfu=1\.1 ", _refusal({**data, "prediction": {**data["prediction"], "mfu": 1.2}})
    )


@pytest.mark.parametrize(
    ("option", "lacks"),
    [
        ("fp8", "fp8=True needs FP8 tensor cores, which A100-SXM4-80GB does not have (no fp8_flops in its roofline)"),
        ("async_tp", "async_tp=True needs GPUs that run torch's asynchronous tensor parallelism"),
    ],
)
def test_a_kernel_option_the_device_cannot_run_is_refused(gpt2_data, option, lacks):
    """The planner refuses FP8 and asynchronous TP on an A100 (no FP8 tensor cores, no
    async TP in its preset); a file edited to have them is refused at load, in the
    planner's words."""
    data = json.loads(json.dumps(gpt2_data))
    data["config"][option] = True
    if option == "async_tp":  # what async TP needs besides the device, so that only the device is wrong
        data["config"].update(tp=8, dp=1, sequence_parallel=True, compile=True)
        data["config"]["num_microbatches"] = 64 // data["config"]["micro_batch_size"]
    message = _refusal(data)
    assert message.startswith(f"plan.config: {lacks}") and "A100" in message
