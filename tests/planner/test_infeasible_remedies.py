"""The "no plan fits" refusal offers only remedies that apply: no smaller micro-batch
when the least memory found already runs one sample per micro-batch, and, for a long
sequence the model's attention keeps from context parallelism, why that split is out."""

import dataclasses
import re

import pytest
import torch

import autopar
from autopar.errors import InfeasiblePlanError
from autopar.graph import extract
from autopar.models import GPT, GPTConfig

from .exact_reference import tiny_cluster


def _small_h100s():
    """One DGX H100 node whose devices hold 3 GiB, so a small model at 64K tokens overflows them."""
    cluster = autopar.preset("dgx-h100", nodes=1)
    memory = dataclasses.replace(cluster.device.memory, capacity_bytes=3 * 2**30, reserved_bytes=0.5 * 2**30)
    return dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, memory=memory))


def test_a_sliding_window_at_a_long_sequence_says_context_parallelism_is_out():
    transformers = pytest.importorskip("transformers")
    config = transformers.MistralConfig(
        vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=65536, sliding_window=4096, use_cache=False,
    )  # fmt: skip
    with torch.device("meta"):
        graph = extract(transformers.MistralForCausalLM(config), seq_len=65536)
    with pytest.raises(InfeasiblePlanError) as err:
        autopar.plan(graph, _small_h100s(), global_batch_size=8)
    message = str(err.value)
    assert " mbs=1 " in message and "micro-batch" not in message and "Try a shorter sequence." in message
    assert message.endswith(
        "Context parallelism, which would split the sequence, cannot run it: its attention is not causal without a "
        "mask (a sliding window, for which transformers passes a mask unless the window is wider than the sequence, "
        "or bidirectional attention), which the causal ring of context parallelism cannot compute."
    )


def test_suggested_node_counts_hold_a_configuration_for_the_batch():
    """Llama 3 70B on one node of 8 H100, batch 64, pinned to pp=1 without recomputation:
    the refusal's node counts are ones where the batch divides over the data-parallel
    ranks for some tensor-parallel degree (8 n / tp divides 64, counted by hand; 5 nodes,
    the memory estimate's count, has none: 40, 20, 10, 5), and planning at the largest
    count suggested fits."""
    from autopar.models import build_named_model

    model = build_named_model("llama3-70b")
    pins = {"recompute": "none", "pp": 1}
    with pytest.raises(InfeasiblePlanError) as err:
        autopar.plan(model, "dgx-h100:1", global_batch_size=64, seq_len=4096, constraints=pins)
    message = str(err.value)
    hint = re.search(r"Try .*?(\d+) nodes \(.* fits there, .*; below (\d+) nodes none can", message)
    assert hint, message
    counts = [int(n) for n in hint.groups()]
    for n in counts:
        assert any(64 % (8 * n // tp) == 0 for tp in (1, 2, 4, 8)), n
    plan = autopar.plan(model, f"dgx-h100:{max(counts)}", global_batch_size=64, seq_len=4096, constraints=pins)
    assert plan.prediction.fits


def test_pins_no_node_count_can_hold_are_named_instead_of_a_lower_bound():
    """tp=1, pp=1 and no recomputation pinned: each device holds a whole sequence's
    activations, which no count of nodes divides, so the refusal says no count it tried
    fits with those pins and to fix fewer (it offered "at least N nodes", and planning
    there was refused again), and that full recomputation, which it still offers, is not
    enough alone (checked on this node, as each remedy is). A shorter sequence is not
    offered: on this node the model states alone (13.4M parameters, 16 bytes each at
    least, over at most 4 ranks: 51 MiB) outgrow a device. Planning on 16 nodes (dp=64,
    one sample per rank) is refused too; with recomputation alone, here, also."""
    model = GPT(GPTConfig(vocab_size=1000, seq_len=512, dim=512, n_layers=4, n_heads=8))
    pins = {"tp": 1, "pp": 1, "recompute": "none"}
    cluster = tiny_cluster(20 / 1024)
    with pytest.raises(InfeasiblePlanError) as err:
        autopar.plan(model, cluster, global_batch_size=64, seq_len=512, constraints=pins)
    assert str(err.value).endswith(
        "Try recompute='full' (not enough alone). No node count from 4 to 64 fits with pp=1, "
        "recompute='none', "
        "tp=1 fixed: fix fewer."
    )
    assert err.value.nodes_that_fit is None
    with pytest.raises(InfeasiblePlanError):
        autopar.plan(model, cluster.with_nodes(16), global_batch_size=64, seq_len=512, constraints=pins)
    with pytest.raises(InfeasiblePlanError):
        autopar.plan(model, cluster, global_batch_size=64, seq_len=512, constraints={**pins, "recompute": "full"})


@pytest.mark.parametrize("memory_mib, alone", [(80, True), (60, False)])
def test_recomputation_is_offered_alone_only_where_it_fits_alone(memory_mib, alone):
    """Recomputation pinned off: the refusal offers recompute='full' as it is where that
    alone fits this cluster, and marks it not enough alone where it does not, each
    checked by planning with it on the same cluster."""
    model = GPT(GPTConfig(vocab_size=1000, seq_len=512, dim=512, n_layers=4, n_heads=8))
    cluster = tiny_cluster(memory_mib / 1024)
    with pytest.raises(InfeasiblePlanError) as err:
        autopar.plan(model, cluster, global_batch_size=64, seq_len=512, constraints={"recompute": "none"})
    offered = "Try recompute='full', " if alone else "Try recompute='full' (not enough alone), "
    assert offered in str(err.value), str(err.value)
    try:
        autopar.plan(model, cluster, global_batch_size=64, seq_len=512, constraints={"recompute": "full"})
        fits = True
    except InfeasiblePlanError:
        fits = False
    assert fits is alone


def test_no_shorter_sequence_is_offered_where_the_model_states_alone_overflow():
    """tp=1, pp=1 and ZeRO-0 pinned on 4 devices of 40 MiB: each holds the whole model's
    weights, gradients and Adam states, 16 bytes per parameter at least (fp32 master,
    gradient, two moments) by hand, about 48 MiB for these 3.2M parameters. The refusal
    offered a shorter sequence; it now names the states' share instead, and planning at
    an eighth of the sequence is refused too, so the remedy it left out would not have
    helped."""
    model = GPT(GPTConfig(vocab_size=1000, seq_len=512, dim=256, n_layers=4, n_heads=4))
    pins = {"tp": 1, "pp": 1, "zero_stage": 0}
    cluster = tiny_cluster(40 / 1024)
    with pytest.raises(InfeasiblePlanError) as err:
        autopar.plan(model, cluster, global_batch_size=64, seq_len=512, constraints=pins)
    message = str(err.value)
    assert "shorter sequence" not in message and "micro-batch" not in message, message
    held = re.search(r"; its weights, gradients and optimizer states alone take ([\d.]+) MiB there\)", message)
    assert held, message
    params = sum(p.numel() for p in model.parameters())
    assert float(held.group(1)) >= 16 * params / 2**20 > 40
    with pytest.raises(InfeasiblePlanError):
        autopar.plan(model, cluster, global_batch_size=64, seq_len=64, constraints=pins)
