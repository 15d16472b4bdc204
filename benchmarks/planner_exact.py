"""The search against brute-force enumeration of its own cost model, at scale.

Four differential checks on seeded random instances (the test suite runs a few of each;
this runs many): the intra-op layout ILP, the per-stage knapsack, the pipeline-split DP,
and the whole search on small real models at several memory capacities (a configuration
space small enough to enumerate every configuration, split and per-unit option), one of
them on two nodes, where HSDP shard groups are candidates, one at 16K tokens, where
context parallelism (cp=2 and 4, 8K and 4K tokens per rank) is, a mixture of experts, where expert
parallelism (ep 1, 2 and 4) is, a two-stage-per-rank pipeline of untied weights, where
every multi-stage schedule (DualPipeV included) is, and compiled blocks on a device that
runs asynchronous tensor parallelism, where it is (the layout ILP's random units take it
too).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import random
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "planner"))

from _report import markdown_table, write_csv, write_result
from exact_reference import brute_force_search, layout_ctx, random_profile, tiny_cluster
from test_stage_knapsack import _random_groups

from autopar.cost.model import CostModel
from autopar.cost.peak import budget_bytes
from autopar.graph import extract
from autopar.hardware import preset
from autopar.models import GPT, CNNConfig, GPTConfig, Llama, LlamaConfig, MoEConfig, MoELlama, ResNet
from autopar.search.constraints import check_constraints
from autopar.search.intra_op import LayoutSolver, brute_force_layout
from autopar.search.scan import search
from autopar.search.solve import ConfigSolver
from autopar.search.split import band_of, best_split, brute_force_split
from autopar.search.stage_solver import brute_force_stage, solve_stage
from autopar.vocab import Optimizer


def layouts(n: int) -> tuple[int, int, float]:
    cluster = preset("dgx-a100-80gb", nodes=2)
    ok, start = 0, time.perf_counter()
    for seed in range(n):
        rng = random.Random(seed)
        prof = random_profile(rng)
        sp = rng.random() < 0.5
        ctx = layout_ctx(
            cluster, tp=rng.choice([2, 4, 8, 16]), sp=sp, mbs=rng.choice([1, 2, 8]), last=rng.random() < 0.3
        )
        ctx = dataclasses.replace(ctx, async_tp=sp and rng.random() < 0.5)  # fused collectives need SP
        ok += math.isclose(
            LayoutSolver().fastest(prof, ctx).time_s, brute_force_layout(prof, ctx).time_s, rel_tol=1e-9, abs_tol=1e-15
        )
    return ok, n, time.perf_counter() - start


def stages(n: int) -> tuple[int, int, float]:
    ok, start = 0, time.perf_counter()
    for seed in range(n):
        rng = random.Random(10_000 + seed)
        groups = _random_groups(rng)
        budget, inflight = rng.uniform(5, 60), rng.choice([1.0, 2.0, 3.5])
        a, b = solve_stage(groups, budget, inflight), brute_force_stage(groups, budget, inflight)
        ok += (a is None and b is None) or (
            a is not None and b is not None and math.isclose(a.time_s, b.time_s, rel_tol=1e-12)
        )
    return ok, n, time.perf_counter() - start


def splits(n: int) -> tuple[int, int, float]:
    ok, start = 0, time.perf_counter()
    for seed in range(n):
        rng = np.random.default_rng(20_000 + seed)
        units, m = int(rng.integers(2, 11)), int(rng.integers(1, 17))
        count = int(rng.integers(1, min(units, 5) + 1))
        table = np.full((count, units + 1, units + 1), np.inf)
        for k in range(count):
            for i in range(units + 1):
                for j in range(i + 1, units + 1):
                    if (k == 0) == (i == 0) and (k == count - 1) == (j == units) and rng.random() > 0.15:
                        table[k, i, j] = float(rng.integers(1, 50)) + (j - i)
        a, b = best_split(band_of(table), m), brute_force_split(table, m)
        ok += (a is None and b is None) or (a is not None and b is not None and math.isclose(a[0], b[0]))
    return ok, n, time.perf_counter() - start


def whole() -> list[dict[str, str]]:
    import torch

    rows = []
    cases = [
        (
            "GPT 2 blocks",
            (0.01, 0.012, 0.02, 0.05),
            extract(
                GPT(GPTConfig(vocab_size=512, seq_len=256, dim=256, n_layers=2, n_heads=8)), seq_len=256, dtype="bf16"
            ),
        ),
        (
            "ResNet 2x1 blocks",
            (0.004, 0.006, 0.01, 0.05),
            extract(
                ResNet(CNNConfig(image_size=64, width=32, stages=2, blocks_per_stage=1)),
                sample_input=torch.zeros(1, 3, 64, 64),
                dtype="bf16",
            ),
        ),
    ]
    # a fixed micro-batch, and every micro-batch size (the scan's scaled bounds across sizes)
    batches = (((2,), {"micro_batch_size": 2}), ((1, 2, 4, 8), {}))
    runs = [
        (name, levels, graph, 1, sizes, constraints)
        for (name, levels, graph), (sizes, constraints) in itertools.product(cases, batches)
    ]
    # two nodes of 4: data-parallel groups of 8 with node-sized HSDP shard groups among the candidates
    gpt = cases[0][2]
    runs.append(
        ("GPT 2 blocks, 2 nodes, ZeRO-3, tp=1 (HSDP)", (0.012, 0.03), gpt, 2, (1, 2), {"tp": 1, "zero_stage": 3})
    )
    # 16K tokens: cp=2 and cp=4 keep 8K and 4K tokens per rank (autopar.search.context_degrees.CP_MIN_TOKENS): candidates
    long_gpt = extract(
        GPT(GPTConfig(vocab_size=512, seq_len=16384, dim=128, n_layers=2, n_heads=4)), seq_len=16384, dtype="bf16"
    )
    runs.append(("GPT 2 blocks at 16K tokens (cp)", (0.05, 0.1, 0.2, 0.4), long_gpt, 1, (1, 2, 4, 8), {}))
    # 4 experts of a top-2 MoE: ep = 1, 2 or 4 inside the data-parallel ranks
    moe = MoEConfig(vocab_size=256, seq_len=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=512, n_experts=4)
    moe_graph = extract(MoELlama(moe), seq_len=128, dtype="bf16")
    runs.append(("MoE Llama 2 blocks, 4 experts (ep)", (0.006, 0.008, 0.01, 1.0), moe_graph, 1, (1, 2, 4, 8), {}))
    # pipeline schedules at pp=2 with two stages per rank on untied weights: interleaved 1F1B,
    # interleaved ZB, ZB-V and DualPipeV (m >= 4) compete on the same splits, with data
    # parallelism free: a rank off the critical path is where a slower option could hide more
    # of its gradient reduction (docs/cost-model.md, "Each rank's idle time")
    llama = LlamaConfig(vocab_size=512, seq_len=256, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=384)
    llama_graph = extract(Llama(llama), seq_len=256, dtype="bf16")
    runs.append(
        (
            "Llama 4 blocks, pp=2 x 2 stages (schedules)",
            (0.006, 0.01, 0.02, 1.0),
            llama_graph,
            1,
            (1, 2, 4, 8),
            {"pp": 2, "virtual_stages": 2},
        )
    )
    # compiled blocks on a device that runs asynchronous TP: every tp > 1 candidate with SP tried both ways
    runs.append(("GPT 2 blocks, compiled (async TP)", (0.012, 0.02, 0.05), gpt, 1, (1, 2, 4, 8), {"compile": True}))
    for name, levels, graph, nodes, sizes, constraints in runs:
        for memory_gib in levels:
            cluster = dataclasses.replace(tiny_cluster(memory_gib), nodes=nodes)
            if constraints.get("compile"):
                cluster = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, async_tp=True))
            model = CostModel(graph=graph, cluster=cluster, optimizer=Optimizer.ADAM, global_batch_size=8)
            budget = budget_bytes(cluster.device.memory)
            start = time.perf_counter()
            want = brute_force_search(ConfigSolver(model=model, budget_bytes=budget, micro_batches=sizes), constraints)
            brute_s = time.perf_counter() - start
            start = time.perf_counter()
            got = search(  # exact for the memory bound brute force checks; the walk room comes after
                ConfigSolver(model=model, budget_bytes=budget, micro_batches=sizes),
                check_constraints(constraints),
                top=0,
                walk_room=False,
            )
            search_s = time.perf_counter() - start
            found = got.best.step_time_s if got.best.fits else math.inf
            winner = got.best.config.short() if got.best.fits else "none fits"
            same = (math.isinf(want) and math.isinf(found)) or math.isclose(want, found, rel_tol=1e-9)
            rows.append(
                {
                    "model": name,
                    "micro-batch": "/".join(map(str, sizes)),
                    "device memory": f"{memory_gib} GiB",
                    "brute force optimum": f"{want * 1e3:.4f} ms",
                    "search optimum": f"{found * 1e3:.4f} ms",
                    "verdict": "same" if same else "DIFFERENT",
                    "search's winner": winner,
                    "brute force": f"{brute_s:.1f} s",
                    "search": f"{search_s:.2f} s",
                }
            )
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--instances", type=int, default=300)
    args = parser.parse_args()
    n = args.instances
    checks: list[dict[str, str]] = []
    for label, fn, count in (
        ("layout ILP (random units, tp 2-16, SP, async TP, micro-batch)", layouts, n),
        ("stage knapsack (random option groups)", stages, 3 * n),
        ("pipeline split DP (random cost tables)", splits, 3 * n),
    ):
        ok, total, secs = fn(count)
        checks.append({"check": label, "agree with brute force": f"{ok} / {total}", "time": f"{secs:.1f} s"})
        print(checks[-1], flush=True)
    searches = whole()
    paths = [write_csv("planner_exact_parts", checks), write_csv("planner_exact_whole", searches)]
    print(
        write_result(
            "planner_exact",
            "Search against brute force",
            "\n\n".join(
                [
                    markdown_table(checks),
                    "Whole search vs enumeration of every configuration x split x per-unit option (4 devices):",
                    markdown_table(searches),
                    "Rows also in " + " and ".join(f"`{p.name}`" for p in paths) + ".",
                ]
            ),
        )
    )


if __name__ == "__main__":
    main()
