"""A fixed expert-parallel degree: its groups tile the dp x cp ranks holding the same
weights, so fixed degrees may reach a multiple of ep only through context parallelism,
which the search then tries at any sequence length; where nothing reaches one, the
refusal says so instead of naming splits the fixed degrees never allowed."""

import pytest

import autopar
from autopar.errors import DeviceCountError
from autopar.graph import extract
from autopar.search.context_degrees import CP_MIN_TOKENS

CLUSTER = autopar.preset("dgx-h100", nodes=8)  # 64 devices
SEQ = 1024


@pytest.fixture(scope="module")
def mixtral():
    """A dropless transformers Mixtral of 8 experts, 4 heads and 4 blocks at 1024 tokens."""
    transformers = pytest.importorskip("transformers")
    import torch

    config = transformers.MixtralConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=SEQ,
    )
    with torch.device("meta"):
        return extract(transformers.MixtralForCausalLM(config), seq_len=SEQ)


def test_a_fixed_ep_reaches_its_groups_through_context_parallelism(mixtral):
    """dp=4 x pp=2 leave tp x cp = 8 of the 64 devices, and tp divides 4 heads at most:
    only cp >= 2 makes dp x cp a multiple of 8, at 1024 tokens, below the search's usual
    floor for context parallelism."""
    assert SEQ // 2 < CP_MIN_TOKENS
    plan = autopar.plan(mixtral, CLUSTER, global_batch_size=64, constraints={"ep": 8, "dp": 4, "pp": 2})
    c = plan.config
    assert (c.ep, c.dp, c.pp) == (8, 4, 2) and c.cp >= 2 and (c.dp * c.cp) % 8 == 0
    assert c.tp * c.cp == 8 and plan.prediction.fits
    # the plan says why it splits sequences below the floor its notes otherwise state
    assert (
        f"cp={c.cp} leaves each rank {SEQ // c.cp:,} tokens of a sequence, below the 4,096 the search otherwise "
        f"keeps: the fixed ep=8 needs expert groups inside dp x cp, so every context-parallel degree was searched."
    ) in plan.notes
    unpinned = autopar.plan(mixtral, CLUSTER, global_batch_size=64, constraints={"dp": 8, "pp": 2})
    assert unpinned.config.cp == 1 and not any("every context-parallel degree" in n for n in unpinned.notes)


def test_no_split_reaching_a_multiple_of_ep_is_refused_with_that_reason(mixtral):
    """tp=4 x pp=4 leave 4 of the 64 devices to dp x cp: no expert group of 8 fits there,
    said once with the degrees that do (2 and 4 divide both 4 and the 8 experts), not
    once per split of those 4 ranks."""
    with pytest.raises(DeviceCountError) as err:
        autopar.plan(mixtral, CLUSTER, global_batch_size=64, constraints={"ep": 8, "dp": 2, "tp": 4, "pp": 4})
    assert str(err.value) == (
        "ep=8 cannot split the experts on 64 devices beside tp=4 pp=4: an expert group lies within the data- and "
        "context-parallel ranks, whose count divides 4, which 8 does not; use ep in [2, 4] (dividing both 4 and the "
        "8 experts)."
    )


def test_an_ep_dividing_no_device_count_left_is_refused_once(mixtral):
    """ep=8 on one node of 4 devices: whatever tp, pp and cp the search picks, dp x cp
    divides 4, so the refusal is one reason with the degrees that fit, not one per split;
    the ep it names plans."""
    cluster = autopar.preset("dgx-h100", nodes=1, devices_per_node=4)
    with pytest.raises(DeviceCountError, match=r"^ep=8 cannot split the experts on 4 devices: .* use ep in \[2, 4\]"):
        autopar.plan(mixtral, cluster, global_batch_size=8, constraints={"ep": 8})
    assert autopar.plan(mixtral, cluster, global_batch_size=8, constraints={"ep": 4}).config.ep == 4


def test_without_a_fixed_ep_short_sequences_keep_the_floor(mixtral):
    from autopar.search.context_degrees import cp_degrees

    assert cp_degrees(mixtral, 8, {}) == [1]
    assert cp_degrees(mixtral, 8, {"ep": 8}) == [1, 2, 4, 8]
