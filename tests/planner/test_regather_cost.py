"""Keeping the shards of sequence-parallel gathers (``regather``) in the cost model: a
real block's terms against a hand count, the recompute modes that take them, the
configuration's refusals, and a plan that picks it where memory is short."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import autopar
from autopar.cost.comm import all_gather_s
from autopar.cost.leaf import leaf_fwd_s
from autopar.cost.recompute import make_option
from autopar.cost.tensor_parallel import evaluate_layout
from autopar.errors import ConfigError
from autopar.graph import extract
from autopar.hardware import preset
from autopar.models import GPT, GPTConfig, Llama, LlamaConfig, build_named_model
from autopar.plan import ParallelConfig
from autopar.runtime.api import analyse
from autopar.search.constraints import check_constraints
from autopar.search.intra_op import LayoutSolver
from autopar.search.space import enumerate_space
from autopar.vocab import Layout, Recompute, TPStyle

from .exact_reference import layout_ctx, search_and_brute_force, tiny_cluster

MBS, SEQ, DIM = 2, 2048, 4096
SEQ_64K = 65536


def _block(tp: int):
    graph = extract(build_named_model("llama2-7b"), seq_len=SEQ)
    block = graph.profile_of(1)
    ctx = layout_ctx(preset("dgx-h100", nodes=1), tp=tp, sp=True, mbs=MBS)
    styles = LayoutSolver().fastest(block, ctx).styles
    return block, ctx, styles


@pytest.mark.parametrize("tp", [2, 8])
def test_a_block_keeps_one_shard_of_each_of_its_two_gathers(tp):
    """By hand, on Llama 2 7B's block with sequence parallelism: the attention's input
    (read by wq, wk and wv) and the MLP's (read by w1 and w3) are the two gathers; each
    is ``mbs x seq x dim`` bf16 values, of which a rank keeps ``1 / tp`` instead of all,
    gathers it again once in the backward, behind the smallest reader's input-gradient
    matmul (the size of its forward one), and holds one whole at a time."""
    block, ctx, styles = _block(tp)
    by = {leaf.name: leaf for leaf in block.leaves}
    held = evaluate_layout(block, styles, Layout.Q, ctx)
    kept = evaluate_layout(block, styles, Layout.Q, dataclasses.replace(ctx, regather=True))
    whole = MBS * SEQ * DIM * 2.0
    assert held.regather.saved_bytes == 0
    assert kept.regather.saved_bytes == pytest.approx(2 * whole * (1 - 1 / tp), rel=1e-12)
    assert kept.regather.held_bytes == whole
    gather = all_gather_s(whole, ctx.span, ctx.cluster)
    hiding = [
        min(leaf_fwd_s(by[name], TPStyle.COLUMN, ctx) for name in group)
        for group in (("attention.wq", "attention.wk", "attention.wv"), ("feed_forward.w1", "feed_forward.w3"))
    ]
    assert 0 < min(hiding)
    assert kept.regather.backward_s == pytest.approx(sum(max(0.0, gather - h) for h in hiding), rel=1e-12)
    assert kept.regather.syncs == 2
    assert kept.time_s == held.time_s and kept.saved_bytes == held.saved_bytes


def test_only_the_modes_that_keep_activations_take_the_shards():
    """``none`` and ``selective`` keep the shards (less activation memory, one whole
    gathered again while the unit's backward runs, the all-gathers in its backward);
    ``op`` and ``full`` keep a checkpoint, priced as without."""
    block, ctx, styles = _block(8)
    held = evaluate_layout(block, styles, Layout.Q, ctx)
    kept = evaluate_layout(block, styles, Layout.Q, dataclasses.replace(ctx, regather=True))
    r = kept.regather
    for mode in Recompute:
        a, b = make_option(held, mode, 1.0, 1.0, 1.0), make_option(kept, mode, 1.0, 1.0, 1.0)
        if mode.checkpoints_unit:
            assert (b.act_bytes, b.transient_bytes, b.bwd_s, b.syncs) == (
                a.act_bytes,
                a.transient_bytes,
                a.bwd_s,
                a.syncs,
            )
        else:
            assert b.act_bytes == pytest.approx(a.act_bytes - r.saved_bytes, rel=1e-12)
            assert b.transient_bytes == pytest.approx(a.transient_bytes + r.held_bytes, rel=1e-12)
            assert b.bwd_s == pytest.approx(a.bwd_s + r.backward_s, rel=1e-12)
            assert b.syncs == a.syncs + r.syncs


def test_regather_needs_sequence_parallelism_and_eager_blocks_where_autopar_runs_it():
    """One line naming the values and what to set, from the configuration and from the
    planner's constraints. Compiled blocks are refused for autopar's runtime only: priced
    for Megatron-LM's kernels (sequence-first), which keep the shards in fused kernels,
    the pair is allowed, and the runtime refuses such a plan before any collective."""
    base = dict(dp=1, tp=2, pp=1, micro_batch_size=1, num_microbatches=1, regather=True)
    with pytest.raises(ConfigError, match="regather=True needs sequence_parallel=True"):
        ParallelConfig(**base)
    assert ParallelConfig(**base, sequence_parallel=True).regather
    with pytest.raises(ConfigError, match="constraint regather=True with compile=True is not allowed.*sequence-first"):
        check_constraints({"regather": True, "compile": True})
    assert check_constraints({"regather": True, "compile": True}, megatron_kernels=True) == {
        "regather": True,
        "compile": True,
        "sequence_parallel": True,
    }
    for megatron in (False, True):
        with pytest.raises(ConfigError, match="constraint regather=True with sequence_parallel=False is not allowed"):
            check_constraints({"regather": True, "sequence_parallel": False}, megatron_kernels=megatron)
    with pytest.raises(ConfigError, match="constraint regather='yes' is not allowed: use True or False"):
        check_constraints({"regather": "yes"})


def _recomputed(plan: autopar.Plan) -> int:
    """Units that recompute anything."""
    units = plan.model.units
    return sum(plan.layer_strategies.recompute_of(u, plan.config.recompute) is not Recompute.NONE for u in units)


def test_a_plan_short_of_memory_keeps_the_shards_rather_than_recompute():
    """A Llama 3 8B shape on 8 H100 with tp=8, eager, one sample of 64K tokens: holding
    the gathers, 20 of its 35 units recompute; keeping their shards, 6 do, and the step is
    faster; the other way is priced and said."""
    cfg = LlamaConfig(vocab_size=32000, seq_len=SEQ_64K, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336)
    with torch.device("meta"):
        model = Llama(cfg)
    fixed = {"tp": 8, "pp": 1, "compile": False, "sequence_parallel": True, "fp8": False}
    cluster = preset("dgx-h100", nodes=1)
    plan = autopar.plan(model, cluster, global_batch_size=1, seq_len=SEQ_64K, constraints=fixed)
    held = autopar.plan(model, cluster, global_batch_size=1, seq_len=SEQ_64K, constraints={**fixed, "regather": False})
    assert plan.config.regather and not held.config.regather
    assert plan.prediction.fits and held.prediction.fits
    assert (_recomputed(plan), _recomputed(held)) == (6, 20)
    assert plan.prediction.step_time_s < held.prediction.step_time_s
    contrast = [a for a in plan.alternatives if a.status == "regather"]
    assert contrast and not contrast[0].config.regather
    assert contrast[0].step_time_s == pytest.approx(held.prediction.step_time_s, rel=1e-9)
    line = next(x for x in autopar.explain(plan).splitlines() if x.startswith("SP gathers"))
    assert "shards kept" in line and "this configuration holding them" in line


@pytest.mark.parametrize("memory_gib", [0.021, 0.04])
def test_whole_search_with_kept_shards_matches_brute_force(memory_gib):
    """Eager blocks with sequence parallelism searched both ways: the search (which skips
    a kept-shard candidate whose twin holding the gathers recomputes nothing) equals brute
    force over every configuration, split and per-unit option, where units must recompute
    (0.021 GiB) and where the best keeps every activation (0.04)."""
    graph = extract(GPT(GPTConfig(vocab_size=512, seq_len=1024, dim=256, n_layers=2, n_heads=8)), seq_len=1024)
    cluster = tiny_cluster(memory_gib)
    constraints = {"micro_batch_size": 2, "compile": False}
    configs, _ = enumerate_space(graph, cluster, 8, check_constraints(constraints))
    assert {(c.regather, c.sequence_parallel) for c in configs} == {(False, False), (False, True), (True, True)}
    result, want = search_and_brute_force(graph, cluster, constraints, global_batch_size=8, micro_batch_size=2)
    assert math.isfinite(want) and result.best.fits
    assert result.best.step_time_s == pytest.approx(want, rel=1e-9)


def test_megatron_priced_compiled_blocks_keep_shards_and_the_runtime_refuses_them():
    """Priced for Megatron-LM (sequence-first), a compiled, sequence-parallel estimate
    keeps shards (``regather``, Megatron's only way) and holds less than the same blocks
    priced for autopar's runtime, which hold the gathers, by exactly the kept-shard saving
    of every unit in flight; the search offers the pair there and nowhere else, and
    ``autopar.analyse`` refuses the plan in one line: autopar's hooks run on eager
    blocks."""
    cfg = LlamaConfig(vocab_size=32000, seq_len=4096, dim=1024, n_layers=2, n_heads=8, n_kv_heads=8, ffn_dim=2816)
    with torch.device("meta"):
        model = Llama(cfg)
    cluster = preset("dgx-h100", nodes=1)
    fixed = {"tp": 8, "compile": True, "sequence_parallel": True, "recompute": "none", "fp8": False}
    kw = dict(global_batch_size=1, seq_len=4096, activations="sequence-first")
    held = autopar.estimate(model, cluster, fixed, global_batch_size=1, seq_len=4096)
    kept = autopar.estimate(model, cluster, fixed, **kw)
    assert not held.config.regather
    assert kept.config.regather and kept.config.compile
    # two gathers per block (attention and MLP inputs) and the output layer's input, each
    # 4096 x 1024 bf16 per sample, one micro-batch in flight
    whole = 4096 * 1024 * 2.0
    saved = (cfg.n_layers * 2 + 1) * whole * (1 - 1 / 8)
    got = held.prediction.stages[0].memory.activations_bytes - kept.prediction.stages[0].memory.activations_bytes
    assert got == pytest.approx(saved, rel=1e-9)
    with pytest.raises(ConfigError, match="regather=True with compile=True"):
        autopar.estimate(model, cluster, {**fixed, "regather": True}, global_batch_size=1, seq_len=4096)
    graph = extract(model, seq_len=4096)
    pairs = {
        megatron: {
            (c.compile, c.regather)
            for c in enumerate_space(
                graph,
                cluster,
                8,
                check_constraints({"tp": 8, "sequence_parallel": True, "fp8": False}, megatron_kernels=megatron),
                megatron_kernels=megatron,
            )[0]
        }
        for megatron in (False, True)
    }
    assert (True, True) in pairs[True] and (True, True) not in pairs[False]
    with torch.device("meta"), pytest.raises(ConfigError, match="priced for Megatron-LM's kernels"):
        analyse(Llama(cfg), kept)


def test_the_backwards_gathers_of_kept_shards_are_tp_communication_not_bubble():
    """Without a pipeline there is no bubble: a plan that keeps the shards differs from
    one holding the gathers only by the backward's all-gathers (same compute, one TP
    rank group, no data parallelism), and the step's whole difference is TP
    communication."""
    cfg = LlamaConfig(vocab_size=32000, seq_len=8192, dim=1024, n_layers=2, n_heads=8, n_kv_heads=8, ffn_dim=2816)
    with torch.device("meta"):
        model = Llama(cfg)
    fixed = {"tp": 8, "compile": False, "sequence_parallel": True, "recompute": "none", "fp8": False}
    plans = {
        regather: autopar.estimate(
            model, preset("dgx-h100", nodes=1), {**fixed, "regather": regather}, global_batch_size=2, seq_len=8192
        ).prediction
        for regather in (False, True)
    }
    held, kept = plans[False], plans[True]
    assert kept.step_time_s > held.step_time_s
    assert held.breakdown.bubble_s == pytest.approx(0.0, abs=1e-12)
    assert kept.breakdown.bubble_s == pytest.approx(0.0, abs=1e-12)
    assert kept.breakdown.tp_comm_s - held.breakdown.tp_comm_s == pytest.approx(
        kept.step_time_s - held.step_time_s, rel=1e-9
    )
