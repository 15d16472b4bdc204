"""Asynchronous tensor parallelism in the cost model: a real block's hidden collectives
against a hand calculation, both layout searches against brute force with the hidden
terms, and the configuration's refusals."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

import autopar
from autopar.cost.comm import all_gather_s, reduce_scatter_s
from autopar.cost.leaf import leaf_fwd_s
from autopar.cost.tensor_parallel import evaluate_layout
from autopar.errors import ConfigError
from autopar.graph import extract
from autopar.hardware import preset
from autopar.models import GPT, GPTConfig, Llama, LlamaConfig, build_named_model
from autopar.plan import ParallelConfig
from autopar.search.constraints import check_constraints
from autopar.search.intra_op import LayoutSolver, brute_force_layout
from autopar.search.space import enumerate_space
from autopar.vocab import Layout, TPStyle

from .exact_reference import layout_ctx, random_profile, search_and_brute_force, tiny_cluster


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("table_limit", [0, 10**6], ids=["ilp", "table"])
def test_async_layout_search_matches_brute_force_on_random_units(seed, table_limit):
    """With the hidden terms, the integer program and the array pricing still find the
    optimum that brute force over the reference (:func:`evaluate_layout`) finds."""
    rng = random.Random(1000 + seed)
    cluster = preset("dgx-h100", nodes=2)
    prof = random_profile(rng)
    for tp, mbs in [(2, 1), (4, 3), (8, 8)]:
        ctx = dataclasses.replace(layout_ctx(cluster, tp=tp, sp=True, mbs=mbs, last=rng.random() < 0.3), async_tp=True)
        got = LayoutSolver(table_limit=table_limit).fastest(prof, ctx)
        want = brute_force_layout(prof, ctx)
        assert got.time_s == pytest.approx(want.time_s, rel=1e-9, abs=1e-15)


def _block(tp: int):
    cluster = preset("dgx-h100", nodes=1)
    graph = extract(build_named_model("gpt3-6.7b"), seq_len=2048)
    block = graph.profile_of(1)
    ctx = layout_ctx(cluster, tp=tp, sp=True, mbs=2)
    styles = LayoutSolver().fastest(block, ctx).styles
    return block, ctx, styles


@pytest.mark.parametrize("tp", [2, 8])
def test_a_megatron_block_hides_each_collective_behind_its_matmul(tp):
    """By hand, on GPT-3 6.7B's block (wq, wk, wv, w1 column-parallel; wo, w2 row-parallel;
    norms on sequence shards): each forward all-gather hides behind its column readers
    (the three attention projections; the MLP's w1), each reduce-scatter behind its row
    matmul (forward) and the same matmul's input gradient (its backward all-gather); the
    reduce-scatter of the MLP input's gradient hides behind w1 alone, the attention
    input's not at all (three readers' gradients are summed first). Each hides at most
    ``(tp - 1) / tp`` of the matmul. On a micro-batch of two sequences every collective
    also copies the whole tensor (read and written); a fused reduce-scatter does not, a
    fused all-gather still does (its gathered tensor is read batch-first after it)."""
    block, ctx, styles = _block(tp)
    names = [leaf.name for leaf in block.leaves]
    by = dict(zip(names, block.leaves))
    assert [styles[names.index(n)] for n in ("attention.wq", "attention.wo", "feed_forward.w1")] == [
        TPStyle.COLUMN,
        TPStyle.ROW,
        TPStyle.COLUMN,
    ]
    sync = evaluate_layout(block, styles, Layout.Q, ctx)
    fused = evaluate_layout(block, styles, Layout.Q, dataclasses.replace(ctx, async_tp=True))
    k = (tp - 1) / tp
    nbytes = 2 * 2048 * 4096 * 2.0  # micro-batch 2 x 2048 tokens x 4096 features, bf16
    ag, rs = all_gather_s(nbytes, ctx.span, ctx.cluster), reduce_scatter_s(nbytes, ctx.span, ctx.cluster)
    copy = 2 * nbytes / ctx.rates.bytes_per_s

    def mm(name: str, style: TPStyle) -> float:
        return leaf_fwd_s(by[name], style, ctx)

    attention_in = sum(mm(f"attention.{w}", TPStyle.COLUMN) for w in ("wq", "wk", "wv"))
    fwd = 2 * copy + (
        min(ag, k * attention_in)
        + min(ag, k * mm("feed_forward.w1", TPStyle.COLUMN))
        + min(rs, k * mm("attention.wo", TPStyle.ROW))
        + min(rs, k * mm("feed_forward.w2", TPStyle.ROW))
    )
    bwd = 1 * copy + (
        min(ag, k * mm("attention.wo", TPStyle.ROW))
        + min(ag, k * mm("feed_forward.w2", TPStyle.ROW))
        + min(rs, k * mm("feed_forward.w1", TPStyle.COLUMN))
    )
    assert sync.fwd_comm_s - fused.fwd_comm_s == pytest.approx(fwd, rel=1e-9)
    assert sync.bwd_comm_s - fused.bwd_comm_s == pytest.approx(bwd, rel=1e-9)
    assert fused.fwd_compute_s == sync.fwd_compute_s and fused.bwd_compute_s == sync.bwd_compute_s


@pytest.mark.parametrize(
    ("changes", "missing"),
    [
        ({"tp": 1, "sequence_parallel": False}, "tp=1"),
        ({"sequence_parallel": False}, "sequence_parallel=False"),
        ({"compile": False}, "compile=False"),
    ],
)
def test_async_tp_without_its_prerequisites_is_refused_in_one_line(changes, missing):
    base = {"dp": 1, "tp": 2, "pp": 1, "micro_batch_size": 1, "num_microbatches": 1}
    fixed = {**base, "sequence_parallel": True, "compile": True, "async_tp": True, **changes}
    with pytest.raises(ConfigError, match=rf"async_tp=True needs tp > 1 .*{missing}") as err:
        ParallelConfig(**fixed)
    assert "\n" not in str(err.value)
    assert ParallelConfig(**{**base, "sequence_parallel": True, "compile": True, "async_tp": True}).async_tp


def _async_cluster(memory_gib: float):
    cluster = tiny_cluster(memory_gib)
    return dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, async_tp=True))


@pytest.mark.parametrize("memory_gib", [0.02, 0.1])
def test_whole_search_with_async_tp_candidates_matches_brute_force(memory_gib):
    """Compiled blocks on a device that runs asynchronous TP: every tp > 1 candidate with
    sequence parallelism is tried asynchronous only (synchronous never costs less), and the
    search equals brute force over every configuration both ways, split and per-unit
    option."""
    graph = extract(GPT(GPTConfig(vocab_size=512, seq_len=256, dim=256, n_layers=2, n_heads=8)), seq_len=256)
    cluster = _async_cluster(memory_gib)
    constraints = {"micro_batch_size": 2, "compile": True}
    configs, _ = enumerate_space(graph, cluster, 8, check_constraints(constraints))
    assert {(c.async_tp, c.tp > 1 and c.sequence_parallel) for c in configs} == {(False, False), (True, True)}
    result, want = search_and_brute_force(graph, cluster, constraints, global_batch_size=8, micro_batch_size=2)
    assert math.isfinite(want) and result.best.fits
    assert result.best.step_time_s == pytest.approx(want, rel=1e-9)


def _llama():
    with torch.device("meta"):
        return Llama(LlamaConfig(vocab_size=32000, seq_len=4096, dim=4096, n_layers=4, n_heads=32, n_kv_heads=8))


def test_a_compiled_tensor_parallel_plan_prices_async_tp_and_explains_it():
    """On H100 with compiled blocks at tp=8 the fused collectives win; explain prices the
    synchronous way beside it; on A100 (not known to run it) nothing is offered, and
    asking for it is refused in one line, as is asking with eager blocks."""
    h100 = preset("dgx-h100", nodes=1)
    fixed = {"tp": 8, "compile": True}
    plan = autopar.plan(_llama(), h100, global_batch_size=8, seq_len=4096, constraints=fixed)
    assert plan.config.async_tp and plan.config.sequence_parallel
    sync = next(a for a in plan.alternatives if a.status == "async_tp")
    assert not sync.config.async_tp and sync.slower_by > 0
    line = next(x for x in autopar.explain(plan).splitlines() if x.startswith("Async TP"))
    assert "this configuration synchronous: " in line and f"{100 * sync.slower_by:+.1f}%" in line
    sync_plan = autopar.plan(
        _llama(), h100, global_batch_size=8, seq_len=4096, constraints={**fixed, "async_tp": False}
    )
    assert sync_plan.prediction.step_time_s > plan.prediction.step_time_s
    a100 = preset("dgx-a100-80gb", nodes=1)
    eager_a100 = autopar.plan(_llama(), a100, global_batch_size=8, seq_len=4096, constraints=fixed)
    assert not eager_a100.config.async_tp and not [a for a in eager_a100.alternatives if a.status == "async_tp"]
    with pytest.raises(ConfigError, match=r"async_tp=True needs GPUs .* A100-SXM4-80GB is not known to") as err:
        autopar.plan(_llama(), a100, global_batch_size=8, seq_len=4096, constraints={**fixed, "async_tp": True})
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"async_tp=True with compile=False is not allowed") as err:
        autopar.plan(
            _llama(), h100, global_batch_size=8, seq_len=4096, constraints={"async_tp": True, "compile": False}
        )
    assert "\n" not in str(err.value)


def test_asking_for_async_tp_turns_on_what_it_needs_and_round_trips(tmp_path):
    """``async_tp=True`` alone compiles the blocks and shards the norms (it needs both);
    the plan file keeps it."""
    plan = autopar.plan(
        _llama(), preset("dgx-h100", nodes=1), global_batch_size=8, seq_len=4096, constraints={"async_tp": True}
    )
    assert plan.config.async_tp and plan.config.compile and plan.config.sequence_parallel and plan.config.tp > 1
    path = tmp_path / "plan.json"
    plan.save(path)
    assert autopar.Plan.load(path) == plan
