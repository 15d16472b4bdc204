"""The "no plan fits" refusal offers only remedies that apply: no smaller micro-batch
when the least memory found already runs one sample per micro-batch, and, for a long
sequence the model's attention keeps from context parallelism, why that split is out."""

import dataclasses

import pytest
import torch

import autopar
from autopar.errors import InfeasiblePlanError
from autopar.graph import extract


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
        "mask (a sliding window narrower than the sequence, or bidirectional attention), which the causal ring of "
        "context parallelism cannot compute."
    )
