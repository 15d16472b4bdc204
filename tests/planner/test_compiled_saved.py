"""What a compiled block saves for its backward (:mod:`autopar.graph.compiled_saved`),
against what ``torch.compile``'s own partitioner saves on this machine's CPU, against
hand counts, and in the plan's activation memory.

The reference is autograd's saved-tensor hook around a block that inductor compiled:
it sees each tensor the compiled forward hands its backward. Parameters are left out,
as the trace leaves them out; every storage is counted once.
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch
import torch.nn.functional as F
import transformers

import autopar
from autopar.graph import extract
from autopar.graph.compiled_saved import compiled_saved_deltas
from autopar.graph.fusion import Fusion
from autopar.models.gpt import GPT, GPTConfig
from autopar.models.llama import Llama, LlamaConfig
from autopar.runtime.compile import compile_blocks

SEQ, BATCH = 64, 2
CHILD_TIMEOUT_S = 240
"""A cold inductor compile of a few small blocks on two busy cores."""


@pytest.fixture(scope="module")
def child():
    """A fresh process for inductor. Compiling in the test process would start inductor's
    worker pool there, and the runtime's tests fork their ranks from this process later:
    a fork inherits the pool mid-state and its compiles hang."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield pool


def _saved_bytes(model: torch.nn.Module, run) -> int:
    """Bytes of the distinct storages autograd saves while ``run()`` runs, parameters
    and buffers left out."""
    constants = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in constants:
            seen[storage._cdata] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(seen.values())


def _predicted(graph, *, compiled: bool, blocks_only: bool = False) -> float:
    """Saved bytes per sample of the graph's units (blocks compiled when ``compiled``)."""
    total = 0.0
    for unit in graph.units:
        if blocks_only and not unit.is_block:
            continue
        profile = graph.profiles[unit.profile]
        c = compiled and unit.is_block
        total += sum(leaf.saved(c) for leaf in profile.leaves)
        total += sum(f.saved(c) + f.attn_saved_bytes for f in profile.flows)
    return total


def _llama() -> Llama:
    return Llama(LlamaConfig(vocab_size=256, seq_len=SEQ, dim=128, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=352))


def _gpt() -> GPT:
    return GPT(GPTConfig(vocab_size=256, seq_len=SEQ, dim=128, n_layers=1, n_heads=4))


def _block_case(name: str) -> tuple[float, float, int]:
    """In the child: the trace's eager and compiled saved bytes of one of autopar's
    blocks (bf16, alone) and what the block compiled by inductor saves."""
    torch._dynamo.reset()  # each case compiles from scratch, whatever ran before it
    torch.manual_seed(0)
    model = {"llama": _llama, "gpt": _gpt}[name]().to(torch.bfloat16)
    graph = extract(model, seq_len=SEQ)
    block = model.layers["0"]
    x = torch.randn(BATCH, SEQ, 128, dtype=torch.bfloat16, requires_grad=True)
    compiled = torch.compile(block)
    measured = _saved_bytes(block, lambda: compiled(x))
    eager, predicted = (_predicted(graph, compiled=c, blocks_only=True) * BATCH for c in (False, True))
    return eager, predicted, measured


@pytest.mark.parametrize("name", ["llama", "gpt"])
def test_a_compiled_block_saves_what_torch_compile_saves(name, child):
    """autopar's blocks in bf16, one alone: the trace's compiled saved bytes are what
    inductor's partitioner hands the backward, but for a few scalars of the CUDA
    attention kernel the trace models (its random-number seed and offset, 16 bytes).
    Llama's RMSNorm fp32 copies and SwiGLU's SiLU output are recomputed (a third less
    than eager); a GPT block's LayerNorm and GELU save what eager does."""
    eager, predicted, measured = child.submit(_block_case, name).result(timeout=CHILD_TIMEOUT_S)
    assert predicted == pytest.approx(measured, rel=1e-3)
    if name == "llama":
        assert measured < 0.7 * eager
    else:
        assert measured == pytest.approx(eager, rel=1e-3)


def _hf_llama():
    cfg = transformers.LlamaConfig(
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=256,
    )
    return transformers.LlamaForCausalLM(cfg)


def _hf_gpt2():
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=128, n_head=4, n_positions=256, vocab_size=256, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0
    )
    return transformers.GPT2LMHeadModel(cfg)


def _transformers_config(name: str):
    """A 2-layer transformers config of ``name`` at width 128."""
    common = {"num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 256}
    attention = {"hidden_size": 128, "intermediate_size": 352, "num_attention_heads": 4}
    if name == "gemma":
        return transformers.GemmaConfig(**attention, num_key_value_heads=2, head_dim=32, **common)
    if name == "phi3":
        return transformers.Phi3Config(**attention, num_key_value_heads=4, pad_token_id=0, **common)
    return transformers.MixtralConfig(
        **{**attention, "intermediate_size": 256}, num_key_value_heads=2, num_local_experts=4, **common
    )


def _whole_model_case(name: str) -> tuple[float, int]:
    """In the child: what compiling the blocks of a transformers model removes from its
    saved bytes, as the trace predicts it and as measured with the blocks compiled as
    the runtime compiles them."""
    torch._dynamo.reset()  # each case compiles from scratch, whatever ran before it
    torch.manual_seed(0)
    makers = {"llama": _hf_llama, "gpt2": _hf_gpt2}
    make = makers.get(name) or (lambda: transformers.AutoModelForCausalLM.from_config(_transformers_config(name)))
    model = make().to(torch.bfloat16)
    graph = extract(model, seq_len=SEQ)
    ids = torch.randint(0, 256, (BATCH, SEQ))

    def step():
        logits = model(ids).logits
        F.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())

    eager = _saved_bytes(model, step)
    compile_blocks(model, [u.fqn for u in graph.units if u.is_block])
    compiled = _saved_bytes(model, step)
    return (_predicted(graph, compiled=False) - _predicted(graph, compiled=True)) * BATCH, eager - compiled


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_compiling_a_transformers_model_saves_what_the_trace_says_less(name, child):
    """transformers' Llama and GPT-2 (its seven-op tanh GELU), whole models in bf16 with
    their blocks compiled as the runtime compiles them: what compiling removes from the
    saved bytes equals the trace's prediction, byte for byte."""
    predicted, measured = child.submit(_whole_model_case, name).result(timeout=CHILD_TIMEOUT_S)
    assert predicted > 0
    assert measured == predicted


@pytest.mark.parametrize("name", ["gemma", "phi3", "mixtral"])
def test_other_architectures_save_about_what_the_trace_says(name, child):
    """Gemma (GELU-tanh gate, norms scaled by 1 + weight), Phi-3 (q, k, v and gate, up
    each in one matrix) and Mixtral (routed experts): what compiling removes is within a
    few percent above what inductor removes, or below it. Measured at writing: Gemma
    removes 0.4% more than inductor, Mixtral 2.1% more; Phi-3 13% less (inductor's cut
    over its fused projections saves one more hidden-wide tensor per block less than the
    trace's nearest-tensors rule, which errs toward more memory)."""
    predicted, measured = child.submit(_whole_model_case, name).result(timeout=CHILD_TIMEOUT_S)
    assert 0.85 * measured <= predicted <= 1.03 * measured


def test_a_recomputation_needing_more_than_it_frees_is_not_taken():
    """A 100-byte result of a 400-byte input that lived in registers: recomputing it
    would save the input instead, so it stays, unless the input is saved anyway. A
    reduction's result, and anything a matmul reads, stay whatever they cost."""
    fusion = Fusion()
    fusion.fused_op([(1, 400.0)], [(2, 100.0)], lambda *_: None)
    assert compiled_saved_deltas([(2, 100.0, False)], fusion) == [0.0]
    assert compiled_saved_deltas([(1, 400.0, False), (2, 100.0, False)], fusion) == [0.0, -100.0]
    fusion.fused_op([(1, 400.0)], [(3, 4.0)], lambda *_: None, never_recomputed=frozenset({3}))
    fusion.fused_op([(1, 400.0)], [(4, 400.0)], lambda *_: None)
    fusion.library_kernel([(4, 400.0)], [(5, 400.0)], lambda *_: None)
    saved = [(1, 400.0, False), (3, 4.0, False), (4, 400.0, False)]
    assert compiled_saved_deltas(saved, fusion) == [0.0, 0.0, 0.0]


def test_a_compiled_plan_holds_the_smaller_activations():
    """Llama, no recomputation, data parallel on 8 H100: the compiled plan's activations are the eager
    plan's less each block's saved bytes that compiling recomputes, times blocks and
    micro-batch."""
    cfg = LlamaConfig(vocab_size=1024, seq_len=512, dim=512, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=1408)
    with torch.device("meta"):
        model = Llama(cfg)
    cluster = autopar.preset("dgx-h100", nodes=1)
    fixed = {"tp": 1, "pp": 1, "micro_batch_size": 2, "recompute": "none", "zero_stage": 0}
    plans = [
        autopar.estimate(model, cluster, {**fixed, "compile": c}, global_batch_size=16, seq_len=512)
        for c in (False, True)
    ]
    graph = extract(model, seq_len=512)
    freed = (_predicted(graph, compiled=False) - _predicted(graph, compiled=True)) * 2
    memory = [p.prediction.stages[0].memory.activations_bytes for p in plans]
    assert freed > 0
    assert memory[0] - memory[1] == pytest.approx(freed)
