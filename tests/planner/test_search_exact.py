"""Every solver against brute-force enumeration of the same cost model.

The search is exact for its own cost model: the intra-op ILP, the stage knapsack, the
pipeline-split DP, and the whole search (bounds, pruning and all) must find the optimum
that exhaustive enumeration finds.
"""

import itertools
import math
import random

import numpy as np
import pytest

from autopar.cluster import Cluster, DeviceSpec, LinkSpec
from autopar.cost.comm import group_span
from autopar.cost.compute import rates
from autopar.cost.pipeline import inflight_microbatches
from autopar.cost.tensor_parallel import Layout, TPContext, model_output_layout
from autopar.graph import extract
from autopar.graph.layer_graph import UNIT_INPUT, UNIT_OUTPUT, Flow, Leaf, LeafKind, UnitProfile
from autopar.models import GPT, GPTConfig, build_named_model
from autopar.search.evaluate import Evaluator, StagePlan
from autopar.search.intra_op import LayoutSolver, brute_force_layout
from autopar.search.planner import ALL_MODES, search
from autopar.search.predict import timing
from autopar.search.space import check_constraints, enumerate_space
from autopar.search.split import best_split, brute_force_split
from autopar.search.stage_solver import (
    Priced,
    StageChoice,
    brute_force_stage,
    homogeneous_times,
    memory_of,
    solve_stage,
)
from autopar.vocab import DType, Optimizer, TPStyle


def _ctx(cluster, *, tp, mbs=1, sp=False, first=False, last=False):
    return TPContext(
        tp=tp,
        span=group_span(tp, 1, cluster.devices_per_node),
        cluster=cluster,
        rates=rates(cluster.device, DType.BF16),
        micro_batch=mbs,
        tokens=64,
        boundary=Layout.Q if sp else Layout.R,
        first=first,
        last=last,
        loss_parallel=True,
        sequence_parallel=sp,
    )


def _random_profile(rng: random.Random) -> UnitProfile:
    """A random chain-with-skips unit: 2-6 leaves of mixed kinds and random sizes."""
    kinds = [
        rng.choice([LeafKind.LINEAR, LeafKind.LINEAR, LeafKind.NORM, LeafKind.EMBEDDING])
        for _ in range(rng.randint(2, 6))
    ]
    leaves = []
    for i, kind in enumerate(kinds):
        fin, fout = rng.choice([64, 96, 128, 256]), rng.choice([64, 128, 192, 256])
        numel = fin * fout if kind is not LeafKind.NORM else fout
        flops = rng.uniform(1e6, 1e9)
        leaves.append(
            Leaf(
                name=f"l{i}",
                kind=kind,
                param_numel=numel + fout,
                weight_numel=numel if kind is not LeafKind.NORM else 0,
                in_features=fin,
                out_features=fout,
                in_heads=rng.choice([0, 0, 4, 8]),
                out_heads=rng.choice([0, 0, 4, 8]),
                vocab=False,
                fwd_flops=flops,
                matmul_flops=flops if kind is LeafKind.LINEAR else 0.0,
                fwd_bytes=rng.uniform(1e4, 1e7),
                saved_bytes=rng.uniform(1e3, 1e6),
            )
        )
    flows = []
    nodes = [UNIT_INPUT, *range(len(leaves))]
    for dst in [*range(len(leaves)), UNIT_OUTPUT]:
        for src in rng.sample([n for n in nodes if n == UNIT_INPUT or (dst == UNIT_OUTPUT or n < dst)], k=1):
            flows.append(
                Flow(
                    src=src,
                    dst=dst,
                    tensor_bytes=rng.uniform(1e4, 1e7),
                    glue_flops=rng.uniform(0, 1e7),
                    glue_bytes=rng.uniform(0, 1e6),
                    saved_bytes=rng.uniform(0, 1e5),
                    attn_flops=rng.choice([0.0, rng.uniform(1e6, 1e8)]),
                    attn_bytes=0.0,
                    attn_saved_bytes=0.0,
                )
            )
    return UnitProfile(
        signature=f"r{rng.random()}", leaves=tuple(leaves), flows=tuple(flows), input_bytes=1e5, output_bytes=1e5
    )


@pytest.mark.parametrize("seed", range(25))
def test_layout_ilp_matches_brute_force_on_random_units(seed):
    rng = random.Random(seed)
    cluster = Cluster.preset("dgx-a100-80gb", nodes=2)
    prof = _random_profile(rng)
    for tp, sp, mbs in [(2, False, 1), (4, True, 3), (8, False, 8), (16, True, 2)]:
        ctx = _ctx(cluster, tp=tp, sp=sp, mbs=mbs, last=rng.random() < 0.3)
        got = LayoutSolver().fastest(prof, ctx)
        want = brute_force_layout(prof, ctx)
        assert got.time_s == pytest.approx(want.time_s, rel=1e-9, abs=1e-15)
        # the loss gets the layout the runtime hands it, never a gathered column output
        assert got.output is model_output_layout(prof, got.styles, ctx)


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("sp", [False, True])
def test_layout_ilp_on_a_real_block_is_megatron(tp, sp):
    cluster = Cluster.preset("dgx-a100-80gb", nodes=1)
    graph = extract(build_named_model("gpt3-6.7b"), seq_len=2048)
    block = graph.profile_of(1)
    cost = LayoutSolver().fastest(block, _ctx(cluster, tp=tp, sp=sp))
    styles = dict(zip((leaf.name for leaf in block.leaves), cost.styles))
    for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1"):
        assert styles[name] is TPStyle.COLUMN
    assert styles["attention.wo"] is TPStyle.ROW and styles["feed_forward.w2"] is TPStyle.ROW
    norm = TPStyle.SEQUENCE if sp else TPStyle.REPLICATE
    assert styles["attention_norm"] is norm and styles["ffn_norm"] is norm
    assert cost.time_s == pytest.approx(brute_force_layout(block, _ctx(cluster, tp=tp, sp=sp)).time_s, rel=1e-12)


def _random_groups(rng):
    groups = []
    for _ in range(rng.choice([1, 2, 3])):
        k = rng.choice([1, 1, 2, 3, 4])
        opts = []
        for lay in range(rng.choice([1, 2])):
            static = rng.uniform(0, 5)
            for mode in range(rng.choice([1, 2, 3])):
                opts.append(
                    Priced(
                        time_s=rng.uniform(1, 2) * (1 + 0.3 * mode),
                        static_bytes=static,
                        act_bytes=rng.uniform(1, 10) / (1 + 3 * mode),
                        transient_bytes=rng.uniform(0, 4),
                        layout=lay,
                    )
                )
        groups.append((k, tuple(opts)))
    return groups


@pytest.mark.parametrize("seed", range(60))
def test_stage_knapsack_matches_brute_force(seed):
    rng = random.Random(seed)
    groups = _random_groups(rng)
    budget, inflight = rng.uniform(5, 60), rng.choice([1.0, 2.0, 3.5])
    got, want = solve_stage(groups, budget, inflight), brute_force_stage(groups, budget, inflight)
    assert (got is None) == (want is None)
    if got is not None:
        assert got.time_s == pytest.approx(want.time_s, rel=1e-12)
        assert got.memory_bytes <= budget * (1 + 1e-12)


@pytest.mark.parametrize("seed", range(20))
def test_vectorised_repeated_blocks_match_the_knapsack(seed):
    rng = random.Random(100 + seed)
    ((_, opts),) = [g for g in _random_groups(rng)][:1]
    budget, inflight = rng.uniform(5, 80), rng.choice([1.0, 2.0, 3.5])
    table = homogeneous_times(opts, 12, budget, inflight)
    for n in range(1, 13):
        found = solve_stage([(n, opts)], budget, inflight)
        assert table[n] == (pytest.approx(found.time_s, rel=1e-12) if found else math.inf)


@pytest.mark.parametrize("seed", range(40))
def test_split_dp_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    units, stages, m = int(rng.integers(2, 9)), 0, int(rng.integers(1, 9))
    stages = int(rng.integers(1, min(units, 4) + 1))
    table = np.full((stages, units + 1, units + 1), np.inf)
    for k in range(stages):
        for i in range(units + 1):
            for j in range(i + 1, units + 1):
                if (k == 0) == (i == 0) and (k == stages - 1) == (j == units) and rng.random() > 0.15:
                    table[k, i, j] = float(rng.integers(1, 20)) + (j - i)
    got, want = best_split(table, m), brute_force_split(table, m)
    assert (got is None) == (want is None)
    if got is not None:
        assert got[0] == pytest.approx(want[0])


def _tiny_cluster(memory_gib: float) -> Cluster:
    device = DeviceSpec(
        name="toy",
        memory_bytes=memory_gib * 2**30,
        peak_flops={DType.BF16: 100e12, DType.FP32: 20e12},
        memory_bandwidth_bytes_per_s=1e12,
        reserved_bytes=2**20,
    )
    link = LinkSpec(bandwidth_bytes_per_s=50e9, latency_s=5e-6)
    return Cluster(
        name="toy x 1",
        nodes=1,
        devices_per_node=4,
        device=device,
        intra_node=link,
        inter_node=LinkSpec(bandwidth_bytes_per_s=5e9, latency_s=2e-5),
    )


def _brute_force_search(evaluator: Evaluator, constraints: dict) -> float:
    """Every configuration x every split x every per-unit option (identical units of a
    stage sharing a layout), priced by the evaluator's cost model."""
    configs, _ = enumerate_space(
        evaluator.graph, evaluator.cluster, evaluator.global_batch_size, check_constraints(constraints)
    )
    n = len(evaluator.graph.units)
    budget = evaluator.budget()
    best = math.inf
    for cfg in configs:
        per_unit = [evaluator.priced_options(u, cfg, ALL_MODES) for u in range(n)]
        if cfg.virtual_stages > 1:
            splits = [evaluator.even_split(cfg.pp * cfg.virtual_stages)]
        else:
            splits = [(0, *cuts, n) for cuts in itertools.combinations(range(1, n), cfg.pp - 1)]
        for bounds in splits:
            if bounds is None:
                continue
            for choice in itertools.product(*(range(len(p[0])) for p in per_unit)):
                stages, ok = [], True
                for r in range(cfg.pp):
                    units = [u for c in range(r, len(bounds) - 1, cfg.pp) for u in range(bounds[c], bounds[c + 1])]
                    kinds = {}
                    for u in units:
                        kinds.setdefault(evaluator.unit_keys[u], set()).add(per_unit[u][1][choice[u]].layout)
                    if any(len(lays) > 1 for lays in kinds.values()):
                        ok = False
                        break
                    inflight = inflight_microbatches(cfg.schedule, cfg.pp, cfg.virtual_stages, cfg.num_microbatches, r)
                    groups = [(1, (per_unit[u][1][choice[u]],)) for u in units]
                    mem = memory_of(groups, tuple((1,) for _ in units), inflight)
                    taken = {u: per_unit[u][0][choice[u]] for u in units}
                    mem -= evaluator.shared_state_bytes(cfg, evaluator.held_once_numel(cfg, taken))
                    mem += evaluator.pipeline_buffer_bytes(tuple(units), cfg, inflight, lambda u: taken[u].layout)
                    if mem > budget * (1 + 1e-12):
                        ok = False
                        break
                if not ok:
                    continue
                for c in range(len(bounds) - 1):
                    units = tuple(range(bounds[c], bounds[c + 1]))
                    opts = tuple(per_unit[u][0][choice[u]] for u in units)
                    r = c % cfg.pp
                    inflight = inflight_microbatches(cfg.schedule, cfg.pp, cfg.virtual_stages, cfg.num_microbatches, r)
                    stages.append(
                        StagePlan(
                            index=c,
                            units=units,
                            options=opts,
                            inflight=inflight,
                            choice=StageChoice(time_s=sum(o.time_s for o in opts), memory_bytes=0.0, counts=()),
                        )
                    )
                best = min(best, timing(evaluator, cfg, stages).step_s)
    return best


@pytest.mark.parametrize("memory_gib", [0.012, 0.02, 0.03, 0.1])
def test_whole_search_matches_brute_force(memory_gib):
    model = GPT(GPTConfig(vocab_size=512, seq_len=256, dim=256, n_layers=2, n_heads=8))
    graph = extract(model, seq_len=256, dtype="bf16")
    cluster = _tiny_cluster(memory_gib)
    constraints = {"micro_batch_size": 2}
    evaluator = Evaluator(
        graph=graph, cluster=cluster, optimizer=Optimizer.ADAM, global_batch_size=8, micro_batches=(2,)
    )
    want = _brute_force_search(evaluator, constraints)
    result = search(
        Evaluator(graph=graph, cluster=cluster, optimizer=Optimizer.ADAM, global_batch_size=8, micro_batches=(2,)),
        check_constraints(constraints),
        top=3,
    )
    if math.isinf(want):
        assert not result.best.fits
    else:
        assert result.best.fits
        assert result.best.step_time_s == pytest.approx(want, rel=1e-9)
