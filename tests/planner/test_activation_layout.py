"""Pricing a plan for Megatron-LM's sequence-first activations (``activations=``): what
changes, what the plan says, how a bad value is refused, and the command-line flag."""

from __future__ import annotations

import pytest

import autopar
from autopar.cli import main
from autopar.cost.compute import rates
from autopar.errors import ConfigError
from autopar.vocab import ActivationLayout, DType

LLAMA = "llama3-8b"
CONFIG = {
    "tp": 8,
    "sequence_parallel": True,
    "regather": True,  # what Megatron-LM's sequence parallelism does, and autopar's runtime on eager blocks
    "compile": False,
    "micro_batch_size": 2,
    "recompute": "none",
    "zero_stage": 3,
}


def _estimate(activations: str) -> autopar.Plan:
    model = autopar.models.build_named_model(LLAMA)
    return autopar.estimate(model, "dgx-h100:1", CONFIG, global_batch_size=8, seq_len=2048, activations=activations)


def test_sequence_first_pricing_drops_the_copies_and_says_so():
    """Llama 3 8B at tp=8 with sequence parallelism, two sequences per micro-batch: the
    batch-first plan (autopar's runtime) pays, per block and micro-batch, a copy of the
    whole ``2 x 2048 x 4096`` bf16 tensor around each of its four forward collectives
    and three of its four backward ones (the backward all-gathers of the row-parallel
    outputs' gradients, and the reduce-scatters of the column inputs' gradients), so at
    least the blocks' 32 x 7 copies (read and written); the sequence-first plan pays none, says so, and
    records the layout."""
    batch_first, sequence_first = _estimate("batch-first"), _estimate("sequence-first")
    assert sequence_first.settings.activations is ActivationLayout.SEQUENCE_FIRST
    assert batch_first.settings.activations is ActivationLayout.BATCH_FIRST
    assert sequence_first.settings.megatron_kernels and not batch_first.settings.megatron_kernels
    assert any("sequence-first" in note for note in sequence_first.notes)
    assert not any("sequence-first" in note for note in batch_first.notes)
    per_copy = 2 * (2 * 2048 * 4096 * 2.0) / rates(autopar.preset("dgx-h100").device, DType.BF16).bytes_per_s
    microbatches = batch_first.config.num_microbatches
    extra = batch_first.prediction.step_time_s - sequence_first.prediction.step_time_s
    assert extra >= 32 * 7 * microbatches * per_copy * (1 - 1e-9)
    assert sequence_first.config == batch_first.config


def test_a_plan_priced_sequence_first_round_trips(tmp_path):
    plan = _estimate("sequence-first")
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = autopar.Plan.load(path)
    assert loaded.settings.activations is ActivationLayout.SEQUENCE_FIRST and loaded.settings.megatron_kernels


def test_a_bad_layout_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"activations='seq-first' is not allowed; use one of 'batch-first'") as err:
        autopar.estimate(
            autopar.models.build_named_model("gpt2-small"),
            "dgx-h100:1",
            {"tp": 2},
            global_batch_size=8,
            seq_len=128,
            activations="seq-first",
        )
    assert "\n" not in str(err.value)


def test_the_command_line_takes_the_layout(capsys):
    args = ["estimate", "--model", LLAMA, "--cluster", "dgx-h100:1", "--global-batch-size", "8", "--seq-len", "2048"]
    args += [item for key, value in CONFIG.items() for item in ("--set", f"{key}={value}")]
    assert main([*args, "--activations", "sequence-first"]) == 0
    assert "sequence-first" in capsys.readouterr().out
