"""What a plan was priced for that an exported file does not carry: the optimizer whose
state the plan's memory counts, and CPU processes where every target trains on GPUs."""

from __future__ import annotations

import shlex

import pytest

import autopar
from autopar.export import export
from autopar.models import GPT, GPTConfig

MODEL = GPT(GPTConfig(vocab_size=512, seq_len=256, dim=128, n_layers=4, n_heads=4))
PLAIN = {"tp": 1, "pp": 1, "micro_batch_size": 1, "zero_stage": 1, "compile": False}
SPLIT = {"tp": 2, "pp": 1, "micro_batch_size": 1, "zero_stage": 1, "compile": False}


def _estimate(cluster: str, config: dict, optimizer: str = "adam") -> autopar.Plan:
    return autopar.estimate(MODEL, cluster, config, global_batch_size=8, seq_len=256, optimizer=optimizer)


@pytest.fixture(scope="module")
def sgd() -> autopar.Plan:
    return _estimate("dgx-h100:1", PLAIN, "sgd")


def _notes(plan: autopar.Plan, to: str) -> list[str]:
    return list(export(plan, to=to).notes)


def test_a_framework_without_the_plans_optimizer_says_what_it_runs_instead(sgd):
    """torchtitan builds Adam or AdamW only: Adam's two moments hold 8 bytes per parameter,
    SGD's momentum 4, so its state is 4 bytes per parameter more than the plan priced."""
    (note,) = [n for n in _notes(sgd, "torchtitan") if "SGD" in n]
    assert note.startswith("torchtitan has no SGD: it trains with Adam, whose two moments take 4 more bytes")
    assert "--optimizer adam" in note
    adafactor = _estimate("dgx-h100:1", PLAIN, "adafactor")
    (note,) = [n for n in _notes(adafactor, "megatron") if "Adafactor" in n]
    assert note.startswith("Megatron-LM has no Adafactor: it trains with Adam, whose two moments take 8 more bytes")


def test_where_the_script_builds_the_optimizer_the_note_names_the_one_to_build(sgd):
    for target in ("deepspeed", "accelerate"):
        (note,) = [n for n in _notes(sgd, target) if "SGD" in n]
        assert "build torch.optim.SGD with momentum; Adam would hold 4 more bytes per parameter" in note, target


def test_megatron_flags_carry_sgd_and_say_nothing_more(sgd):
    """Megatron-LM and Megatron-DeepSpeed take ``--optimizer sgd`` (SGD with momentum)."""
    megatron = export(sgd, to="megatron")
    assert shlex.split(megatron.launch)[-2:] == ["--optimizer", "sgd"]
    split = _estimate("dgx-h100:1", SPLIT, "sgd")
    deepspeed = export(split, to="deepspeed")
    words = shlex.split(deepspeed.launch)
    assert words[words.index("--optimizer") + 1] == "sgd"
    assert not any("SGD" in n for n in (*megatron.notes, *deepspeed.notes))


def test_an_adam_plan_on_gpus_gets_neither_note():
    plan = _estimate("dgx-h100:1", PLAIN)
    for target in ("megatron", "deepspeed", "torchtitan", "accelerate"):
        notes = _notes(plan, target)
        assert not any(w in n for n in notes for w in ("trains with Adam", "builds the", "CPU processes")), target


def test_a_plan_for_cpu_processes_says_its_predictions_do_not_hold_on_gpus():
    plan = _estimate("local-cpu:2", PLAIN)
    for target, name in (
        ("megatron", "Megatron-LM"),
        ("deepspeed", "DeepSpeed"),
        ("torchtitan", "torchtitan"),
        ("accelerate", "Accelerate"),
    ):
        (note,) = [n for n in _notes(plan, target) if "CPU processes" in n]
        assert f"and {name} trains on CUDA GPUs, where its predictions do not hold: plan on the GPU cluster" in note
