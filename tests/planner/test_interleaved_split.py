"""Interleaved stages split by a fixed rule: blocks evenly (Megatron-LM's default), or,
where only the units divide, units evenly with the embedding and the loss counting as a
layer each, so the first and the last stage hold one block fewer, down to the
embedding alone and the loss alone (Llama 3 405B's 126 layers on 128 stages)."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.models import Llama, LlamaConfig
from autopar.search.split import even_bounds


@pytest.mark.parametrize(
    "n, first, last, chunks, exact, want",
    [
        (10, 1, 1, 4, False, (0, 3, 5, 7, 10)),  # 8 blocks: 2 each, prologue on the first, epilogue on the last
        (10, 1, 1, 4, True, (0, 3, 5, 7, 10)),  # the same, exactly: 8 blocks divide
        (8, 1, 1, 4, False, (0, 3, 5, 6, 8)),  # 6 blocks: 2, 2, 1, 1 as evenly as possible
        (8, 1, 1, 4, True, (0, 2, 4, 6, 8)),  # 6 blocks do not divide; 8 units do: E+1 | 2 | 2 | 1+L
        (128, 1, 1, 32, True, tuple(range(0, 129, 4))),  # Llama 3 405B: 126 layers, 16 x 2 stages
        (7, 1, 1, 4, True, None),  # neither 5 blocks nor 7 units divide
        (6, 0, 0, 4, True, None),  # no prologue or epilogue to lighten the ends with
        (6, 1, 1, 3, True, (0, 2, 4, 6)),  # 4 blocks do not divide by 3: E+1 | 2 | 1+L
        (5, 1, 1, 4, True, None),  # fewer blocks than stages
        (6, 1, 1, 6, True, tuple(range(7))),  # one unit each: E | 1 | 1 | 1 | 1 | L
        (6, 1, 1, 6, False, None),  # fewer blocks than stages where the ends need not be layers
        (6, 0, 0, 6, True, tuple(range(7))),  # six blocks on six stages
        (5, 1, 0, 5, True, None),  # a prologue without an epilogue does not count as a layer
        (128, 1, 1, 128, True, tuple(range(129))),  # Llama 3 405B: 126 layers, 16 x 8 stages
    ],
)
def test_even_bounds_by_hand(n, first, last, chunks, exact, want):
    assert even_bounds(n, first, last, chunks, exact=exact) == want


def test_a_llama_of_126_layers_interleaves_over_32_stages_with_lighter_ends():
    """126 layers on pp=16 x v=2: 126 blocks do not divide by 32, its 128 units do; the
    estimate runs the interleaved schedule, the first stage holding the embedding and 3
    layers, the last 3 layers and the head, every other stage 4 layers."""
    fixed = {"tp": 1, "pp": 16, "micro_batch_size": 1, "schedule": "interleaved-1f1b", "virtual_stages": 2}
    plan = _estimate_llama_126(fixed)
    stages = plan.stages
    assert len(stages) == 32
    assert stages[0] == ("tok_embeddings", "layers.0", "layers.1", "layers.2")
    assert stages[-1] == ("layers.123", "layers.124", "layers.125", "norm", "output")
    assert all(len(s) == 4 and all(m.startswith("layers.") for m in s) for s in stages[1:-1])


def test_a_llama_of_126_layers_interleaves_one_layer_per_stage():
    """126 layers on pp=16 x v=8, as Llama 3 405B trained: 128 stages for 128 units, the
    first holding the embedding alone, the last the final norm and the head, every other
    stage one layer."""
    fixed = {"tp": 1, "pp": 16, "micro_batch_size": 1, "schedule": "interleaved-1f1b", "virtual_stages": 8}
    plan = _estimate_llama_126(fixed)
    stages = plan.stages
    assert len(stages) == 128
    assert stages[0] == ("tok_embeddings",)
    assert stages[-1] == ("norm", "output")
    assert list(stages[1:-1]) == [(f"layers.{i}",) for i in range(126)]


EVEN = r"\(virtual_stages=\[2, 4, 8\] split at pp=16\)"
"""By hand: 16 v stages split 126 blocks for no v (126 = 2 x 63), and 128 units for v = 1, 2, 4, 8."""


@pytest.mark.parametrize(
    ("schedule", "v", "why"),
    [
        ("interleaved-zb", 7, rf"112 stages needs its 126 blocks, or its 128 units .* to split evenly {EVEN}\."),
        ("interleaved-1f1b", 7, rf"112 stages needs its 126 blocks, or its 128 units .* to split evenly {EVEN}\."),
        # beyond the counts the search tries unasked: the same reason, not another candidate's
        ("interleaved-1f1b", 9, rf"144 stages needs its 126 blocks, or its 128 units .* to split evenly {EVEN}\."),
    ],
)
def test_a_split_that_does_not_divide_is_refused_in_one_line(schedule, v, why):
    """A pinned schedule over stages the model cannot fill evenly is refused naming the
    stages, the blocks and the units."""
    fixed = {"tp": 1, "pp": 16, "micro_batch_size": 1, "schedule": schedule, "virtual_stages": v}
    with pytest.raises(autopar.ConfigError, match=why) as err:
        _estimate_llama_126(fixed)
    assert "\n" not in str(err.value)
    assert str(err.value).count("needs its") == 1  # said once, not once per batch split


def _estimate_llama_126(fixed: dict) -> autopar.Plan:
    """An estimate for a 126-layer Llama (Llama 3 405B's depth, small widths) on 16 H100."""
    cfg = LlamaConfig(dim=512, n_layers=126, n_heads=8, n_kv_heads=8, ffn_dim=1024, vocab_size=1024, seq_len=256)
    with torch.device("meta"):
        model = Llama(cfg)
    return autopar.estimate(model, autopar.preset("dgx-h100", nodes=2), fixed, global_batch_size=32, seq_len=256)


def test_a_count_of_stages_given_beyond_the_searched_ones_is_planned():
    """The search tries up to eight stages per rank by itself; a count given is tried as
    given: 4 ranks of 32 stages each hold one unit per stage, the embedding and the loss
    alone at the ends."""
    fixed = {"tp": 1, "pp": 4, "micro_batch_size": 1, "schedule": "interleaved-1f1b", "virtual_stages": 32}
    plan = _estimate_llama_126(fixed)
    assert plan.config.virtual_stages == 32 and len(plan.stages) == 128
    assert plan.stages[0] == ("tok_embeddings",) and plan.stages[-1] == ("norm", "output")
