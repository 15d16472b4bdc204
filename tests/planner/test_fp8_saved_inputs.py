"""FP8 layers' saved inputs priced for Megatron-LM's kernels (sequence-first
activations): Transformer Engine keeps each FP8 layer's input in FP8, once per input
(q, k and v, and the gated MLP's two input projections, are one layer each there), beside
what other ops keep in bf16. autopar's runtime keeps them in bf16, so it refuses such a
plan; a batch-first FP8 plan is priced as its bf16 twin."""

import pytest
import torch

import autopar
from autopar import explain
from autopar.errors import ConfigError
from autopar.export import export
from autopar.models.llama import Llama, LlamaConfig
from autopar.runtime.api import check_plan
from autopar.vocab import ActivationLayout

CFG = LlamaConfig(vocab_size=1024, seq_len=4096, dim=512, n_layers=2, n_heads=8, n_kv_heads=2, ffn_dim=1536)
"""Every block linear's sizes are multiples of 16, so all of them run in FP8."""


def _llama() -> Llama:
    with torch.device("meta"):
        return Llama(CFG)


def _activations(fixed: dict, fp8: bool, layout: ActivationLayout) -> float:
    plan = autopar.estimate(
        _llama(),
        autopar.preset("dgx-h100", nodes=1),
        fixed | {"fp8": fp8, "recompute": "none", "micro_batch_size": 1},
        global_batch_size=8 // fixed["tp"],
        seq_len=CFG.seq_len,
        activations=layout,
    )
    return plan.prediction.stages[0].memory.activations_bytes


@pytest.mark.parametrize(
    "fixed",
    [
        {"dp": 8, "tp": 1, "compile": False},
        {"dp": 4, "tp": 2, "compile": True, "sequence_parallel": True, "regather": True},
    ],
    ids=["tp1", "tp2-sp-kept-shards"],
)
def test_megatron_fp8_keeps_each_block_n_times_h_plus_f_bytes_less(fixed):
    """Per block and sample, by hand (N tokens, h = 512, f = 1536, bytes per rank):

    - bf16: the q/k/v input 2Nh, the w1/w3 input 2Nh, w2's input 2Nf; wo's input is the
      attention's output, which the attention kernel keeps;
    - FP8: the q/k/v input Nh, wo's input Nh (beside the attention's bf16 output), the
      w1/w3 input Nh, w2's input Nf;

    so FP8 keeps N (h + f) bytes less per block, over tp where tensor parallelism shards
    each (sequence shards kept for the column-parallel inputs, features for the
    row-parallel ones): one micro-batch of two blocks in flight."""
    tp = fixed["tp"]
    expected = CFG.n_layers * CFG.seq_len * (CFG.dim + CFG.ffn_dim) / tp
    megatron = ActivationLayout.SEQUENCE_FIRST
    saved = _activations(fixed, False, megatron) - _activations(fixed, True, megatron)
    assert saved == pytest.approx(expected, rel=1e-9)


def test_a_batch_first_fp8_plan_keeps_what_its_bf16_twin_keeps():
    """torchao's float8 layers, which autopar's runtime runs, save their inputs in bf16."""
    fixed = {"dp": 8, "tp": 1, "compile": False}
    first = ActivationLayout.BATCH_FIRST
    assert _activations(fixed, True, first) == _activations(fixed, False, first)


def test_the_runtime_refuses_an_fp8_plan_priced_for_megatron():
    plan = autopar.estimate(
        _llama(),
        autopar.preset("dgx-h100", nodes=1),
        {"dp": 8, "tp": 1, "fp8": True, "compile": False, "micro_batch_size": 1},
        global_batch_size=8,
        seq_len=CFG.seq_len,
        activations="sequence-first",
    )
    with pytest.raises(ConfigError, match="keeps the FP8 layers' inputs in FP8, as Transformer Engine does"):
        check_plan(plan)


def _plan(layout: str) -> autopar.Plan:
    return autopar.estimate(
        _llama(),
        autopar.preset("dgx-h100", nodes=1),
        {"dp": 4, "tp": 2, "pp": 1, "fp8": True, "compile": False, "micro_batch_size": 1},
        global_batch_size=8,
        seq_len=CFG.seq_len,
        activations=layout,
    )


@pytest.mark.parametrize(
    "target, name", [("torchtitan", "torchtitan"), ("deepspeed", "DeepSpeed"), ("accelerate", "Accelerate")]
)
def test_other_frameworks_are_told_they_keep_more_than_a_megatron_fp8_plan_predicts(target, name):
    """torchtitan's float8 and the frameworks that write no FP8 keep the inputs in bf16."""
    (note,) = [n for n in export(_plan("sequence-first"), to=target).notes if "keep their inputs in FP8" in n]
    assert f"{name} keeps them in bf16, so expect more activation memory than predicted" in note
    assert not [n for n in export(_plan("batch-first"), to=target).notes if "keep their inputs in FP8" in n]


def test_megatron_is_told_its_fp8_keeps_less_only_against_a_batch_first_plan():
    megatron = [n for n in export(_plan("sequence-first"), to="megatron").notes if "--fp8-format hybrid" in n]
    runtime = [n for n in export(_plan("batch-first"), to="megatron").notes if "--fp8-format hybrid" in n]
    assert len(megatron) == len(runtime) == 1
    assert "expect less activation memory" in runtime[0] and "expect less" not in megatron[0]


def test_explain_names_the_fp8_layers_the_plan_was_priced_for():
    assert "FP8 matmuls    blocks' linear layers in FP8 (Transformer Engine's, inputs kept in FP8)" in explain(
        _plan("sequence-first")
    )
    assert "(torchao float8, tensorwise scales)" in explain(_plan("batch-first"))
