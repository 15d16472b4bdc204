"""A step of tens of seconds reads its rate in significant digits (``0.158 samples/s``),
not rounded to ``0.0``; rates of 1 or more keep one decimal and thousands separators."""

import pytest
import torch

import autopar
from autopar.models import Llama, LlamaConfig, build_named_model
from autopar.present.report import summary_html
from autopar.present.units import per_second, significant


def _predicted(plan) -> str:
    return next(line for line in autopar.explain(plan).splitlines() if line.startswith("Predicted"))


@pytest.fixture(scope="module")
def long_plan():
    cfg = LlamaConfig(
        vocab_size=1000, seq_len=1048576, dim=256, n_layers=2, n_heads=4, n_kv_heads=4, ffn_dim=512, rope_theta=1e6
    )
    with torch.device("meta"):
        model = Llama(cfg)
    return autopar.plan(model, "dgx-a100-80gb:1", global_batch_size=8, seq_len=1048576, top=0)


def test_a_long_sequence_plans_rate_keeps_its_significant_digits(long_plan):
    p = long_plan.prediction
    assert 0.01 < p.samples_per_s < 1  # a step of tens of seconds for 8 samples
    line = _predicted(long_plan)
    samples = significant(p.samples_per_s)
    assert samples not in ("0", "0.0") and float(samples) == pytest.approx(p.samples_per_s, rel=5e-3)
    assert f"| {samples} samples/s | {p.tokens_per_s:,.0f} tokens/s | " in line
    assert " 0.0 samples/s" not in line
    assert f"{samples} samples/s" in summary_html(long_plan)  # the HTML report shows the explanation


def test_a_rate_of_one_or_more_reads_as_before(gpt2_plan):
    p = gpt2_plan.prediction
    assert p.samples_per_s >= 1
    assert f"| {p.samples_per_s:,.1f} samples/s | {p.tokens_per_s:,.0f} tokens/s | " in _predicted(gpt2_plan)


def test_an_image_model_has_samples_and_no_tokens():
    plan = autopar.plan(
        build_named_model("resnet-small"),
        "dgx-a100-80gb:1",
        global_batch_size=16,
        sample_input=torch.zeros(1, 3, 224, 224),
        top=0,
    )
    line = _predicted(plan)
    assert f"| {per_second(plan.prediction.samples_per_s, 1)} samples/s | " in line and "tokens/s" not in line


@pytest.mark.parametrize(
    "value, decimals, text",
    [
        (0.023529, 1, "0.0235"),
        (0.15790832, 1, "0.158"),
        (0.5, 1, "0.5"),
        (0.0, 1, "0.0"),
        (1.0, 1, "1.0"),
        (115.4321, 1, "115.4"),
        (24661.2, 0, "24,661"),
        (0.75, 0, "0.75"),
        (472678.9, 0, "472,679"),
    ],
)
def test_per_second(value, decimals, text):
    assert per_second(value, decimals) == text
