"""What context parallelism refuses, before any collective and in one line: a sequence
that does not split into 2 x cp chunks, and attention the causal ring cannot compute (a
materialized softmax, an explicit mask)."""

import math
import types

import pytest
import torch
import torch.nn.functional as F
from parity import SEQ, build, make_plan, run, token_loss, with_cp

from autopar.models.gpt import Attention
from autopar.runtime.api import analyse, parallelize
from autopar.runtime.errors import ContextParallelError


def _with_attention(forward):
    model = build("gpt")
    for module in model.modules():
        if isinstance(module, Attention):
            module.forward = types.MethodType(forward, module)
    return model


def _heads(module, x):
    b, s, _ = x.shape
    return [w(x).view(b, s, -1, module.head_dim).transpose(1, 2) for w in (module.wq, module.wk, module.wv)]


def _materialized(module, x):
    q, k, v = _heads(module, x)
    scores = q @ k.transpose(-2, -1) / math.sqrt(module.head_dim)
    causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
    o = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
    return module.wo(o.transpose(1, 2).reshape(x.shape))


def _masked(module, x):
    q, k, v = _heads(module, x)
    causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=causal)
    return module.wo(o.transpose(1, 2).reshape(x.shape))


def test_a_sequence_that_does_not_split_into_two_chunks_per_rank_is_refused():
    """s=16 with cp=3: head-tail needs 6 equal chunks."""
    with pytest.raises(ContextParallelError, match=r"seq_len=16 does not split into 2 x cp = 6 equal chunks"):
        analyse(build("gpt"), with_cp(make_plan("gpt"), 3))  # the planner refuses it too


@pytest.mark.parametrize(
    "forward,message",
    [
        (_materialized, r"computes no F.scaled_dot_product_attention"),
        (_masked, r"attn_mask=a tensor, is_causal=False; the ring runs causal attention without a mask only"),
    ],
)
def test_attention_the_ring_cannot_compute_is_refused(forward, message):
    """The same parameters (the plan's fingerprint matches), another attention."""
    with pytest.raises(ContextParallelError, match=message):
        analyse(_with_attention(forward), make_plan("gpt", cp=2))


def test_the_same_models_pass_without_context_parallelism():
    """The checks are context parallelism's: with cp=1 these models are accepted."""
    for forward in (_materialized, _masked):
        analyse(_with_attention(forward), make_plan("gpt"))


def _step_with_short_sequences(rank, world, plan):
    job = parallelize(build("gpt"), plan, loss_fn=token_loss, measure_memory=False)
    tokens = torch.zeros(4, SEQ // 2, dtype=torch.long)
    try:
        job.step((tokens, tokens))
    except ContextParallelError as exc:
        return str(exc)
    return None


@pytest.mark.multiprocess
def test_a_step_on_sequences_of_another_length_is_refused():
    """The positions bound to the stages are those of the plan's sequence: a batch of
    8-token sequences under a plan for 16 is refused on every rank, before any collective."""
    for message in run(_step_with_short_sequences, 2, make_plan("gpt", cp=2)):
        assert message is not None and "needs whole sequences of the plan's seq_len=16 tokens" in message
        assert "got inputs of shape (4, 8)" in message


def test_sliding_window_attention_narrower_than_the_sequence_is_refused():
    """A transformers Mistral with an 8-token window over 16-token sequences: its masks
    are not causal ones, which the ring computes."""
    from hf_decoders import build_decoder
    from test_models import make

    model = build_decoder("mistral")
    with pytest.raises(ContextParallelError, match=r"sliding-window attention \(sliding_window=8 < seq_len=16\)"):
        analyse(model, with_cp(make(model), 2))


def test_a_transformers_decoder_on_the_meta_device_passes_the_check():
    """The dry run builds a transformers model on the meta device; the check's trial
    forward reaches transformers' test for packed sequences, which reads the position
    ids' values (``.item()`` on meta raised). A causal Llama passes, as on real weights;
    a narrow sliding window is still refused."""
    from hf_decoders import build_decoder
    from test_models import make

    model = build_decoder("llama")
    with torch.device("meta"):
        meta = type(model)(model.config)
    analyse(meta, with_cp(make(model), 2))
    windowed = build_decoder("mistral")
    with torch.device("meta"), pytest.raises(ContextParallelError, match="sliding-window attention"):
        analyse(type(windowed)(windowed.config), with_cp(make(windowed), 2))
