"""The sequence length a plan was made for is explicit: taken from the model's maximum
when none is given, with a warning and a note on the plan; never silently."""

import warnings

import pytest
import torch
from torch import nn

import autopar
from autopar import ModelError, explain
from autopar.models import GPT, GPTConfig

CLUSTER = "dgx-a100-80gb:1"
CFG = GPTConfig(vocab_size=1000, seq_len=96, dim=64, n_layers=2, n_heads=4)
NOTE = (
    "Planned for seq_len 96, the model's maximum (config.seq_len), as no sequence length was given; pass seq_len= "
    "with your training length: memory, FLOPs and the chosen plan depend on it."
)


def _gpt() -> nn.Module:
    with torch.device("meta"):
        return GPT(CFG)


def test_plan_without_seq_len_warns_and_notes_the_models_maximum():
    with pytest.warns(UserWarning) as caught:
        plan = autopar.plan(_gpt(), CLUSTER, global_batch_size=8, top=0)
    assert [str(w.message) for w in caught if w.category is UserWarning] == [NOTE]
    assert caught[0].filename == __file__  # points at the caller's line
    assert plan.model.seq_len == 96
    assert plan.notes.count(NOTE) == 1
    assert autopar.Plan.from_json(plan.to_json()).notes == plan.notes
    assert "8 x 96 tokens" in explain(plan) and NOTE in explain(plan)


def test_estimate_without_seq_len_warns_and_notes_the_models_maximum():
    with pytest.warns(UserWarning, match="Planned for seq_len 96"):
        plan = autopar.estimate(_gpt(), CLUSTER, {"tp": 1}, global_batch_size=8)
    assert plan.model.seq_len == 96 and NOTE in plan.notes


def test_a_given_seq_len_is_planned_for_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = autopar.plan(_gpt(), CLUSTER, global_batch_size=8, seq_len=32, top=0)
    assert plan.model.seq_len == 32
    assert not any("Planned for seq_len" in n for n in plan.notes)


class _Relative(nn.Module):
    """A token model without a maximum length in a config."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 16)
        self.head = nn.Linear(16, 100)

    def forward(self, x):
        return self.head(self.embed(x))


def test_a_model_without_a_maximum_still_needs_seq_len():
    with pytest.raises(ModelError, match="give exactly one of seq_len="):
        autopar.plan(_Relative(), CLUSTER, global_batch_size=8, top=0)
