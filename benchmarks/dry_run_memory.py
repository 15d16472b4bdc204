"""Predicted against measured peak memory per rank at full scale, before launch.

For each case a plan is made (the planner's own, or a configuration forced through
``autopar.estimate``), then ``autopar.runtime.dry_run.dry_run(..., measure=True)`` runs one
training step of the chosen ranks at the plan's full world size on fake tensors with a
fake process group (``autopar.runtime.dry_step``) and counts the tensor bytes the
runtime allocates. Each case runs in its own process (the dry run creates process
groups) with a time limit. The planner's allocation is its peak less the device's
reserve (CUDA context and fragmentation allowance), which tensor bytes do not include.

    python benchmarks/dry_run_memory.py [--cases gpt3,...] [--timeout-s 600] [--out FILE]

It writes ``benchmarks/results/dry_run_memory_<date>.md``, or ``--out``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from _report import write_result

CASES = {
    "gpt3": ("gpt3-175b", "dgx-a100-80gb:128", 1536, None, "GPT-3 175B on 1024 A100, the planner's plan"),
    "llama70b": ("llama3-70b", "dgx-h100:16", 512, None, "Llama-3-70B on 128 H100, the planner's plan"),
    "llama405b": ("llama3-405b", "dgx-h100:256", 2048, None, "Llama-3-405B on 2048 H100, the planner's plan"),
    "cp128k": (
        "llama3.1-8b",
        "dgx-h100:8",
        32,
        None,
        "Llama-3.1-8B at 128K tokens on 64 H100, the planner's plan (context parallel)",
    ),
    "pipe256": (
        "gpt3-175b",
        "dgx-a100-80gb:128",
        1024,
        {"dp": 4, "tp": 8, "pp": 32, "micro_batch_size": 1, "schedule": "1f1b", "zero_stage": 1},
        "GPT-3 175B, pp=32 with 256 micro-batches (1F1B)",
    ),
    "zero3": (
        "llama3-70b",
        "dgx-h100:16",
        256,
        {"dp": 16, "tp": 8, "pp": 1, "micro_batch_size": 1, "zero_stage": 3, "recompute": "full"},
        "Llama-3-70B, ZeRO-3 over dp=16 x tp=8, full recompute",
    ),
    "moe-ep": (
        "mixtral-8x7b",
        "dgx-h100:8",
        512,
        None,
        "Mixtral-8x7B at 4K tokens on 64 H100, the planner's plan (expert parallel)",
        4096,
    ),
    "lone-ends": (
        "llama3-405b",
        "dgx-h100:32",
        64,
        {
            "dp": 2,
            "tp": 8,
            "pp": 16,
            "micro_batch_size": 1,
            "schedule": "interleaved-1f1b",
            "virtual_stages": 8,
            "zero_stage": 1,
            "recompute": "full",
            "sequence_parallel": True,
            "compile": False,
        },
        "Llama-3-405B as Meta split it: 16 x 8 stages, the embedding and the loss alone (32 micro-batches)",
    ),
    "moe-ep-zero3": (
        "mixtral-8x7b",
        "dgx-h100:8",
        512,
        {"dp": 64, "tp": 1, "pp": 1, "ep": 8, "micro_batch_size": 1, "zero_stage": 3, "recompute": "none"},
        "Mixtral-8x7B at 4K tokens, ZeRO-3 over dp=64 with ep=8 (one expert per rank, 8 replicas)",
        4096,
    ),
    "zero2": (
        "llama3-70b",
        "dgx-h100:16",
        16,
        {"dp": 16, "tp": 8, "pp": 1, "micro_batch_size": 1, "zero_stage": 2, "recompute": "full", "compile": False},
        "Llama-3-70B at 8K tokens, ZeRO-2 over dp=16 x tp=8, full recompute (one micro-batch)",
        8192,
    ),
}
"""case -> (model, cluster, global batch, forced config or None for the planner's plan,
label[, tokens per sample when not the model's default])."""
BOTH_ENDS = {"lone-ends"}
"""Cases whose last pipeline rank is measured too (it holds the loss's stage, whose
micro-batches interleaved 1F1B keeps the fewest of)."""


def _one(case: str) -> list[dict]:
    """Plan and dry-run one case in this process: the first pipeline rank is measured,
    and the last too for :data:`BOTH_ENDS`; one row per rank."""
    import torch

    import autopar
    from autopar.hardware import parse_cluster
    from autopar.models import build_named_model
    from autopar.models.registry import get_named_model
    from autopar.runtime.dry_run import dry_run

    name, cluster_spec, gbs, config, _, *tokens = CASES[case]
    cluster = parse_cluster(cluster_spec)
    seq = tokens[0] if tokens else get_named_model(name).seq_len
    with torch.device("meta"):
        model = build_named_model(name)
    started = time.perf_counter()
    if config is None:
        plan = autopar.plan(model, cluster, global_batch_size=gbs, seq_len=seq)
    else:
        plan = autopar.estimate(model, cluster, config, global_batch_size=gbs, seq_len=seq)
    planned_s = time.perf_counter() - started

    def build() -> torch.nn.Module:
        with torch.device("meta"):
            return build_named_model(name)

    c = plan.config
    last = (c.pp - 1) * c.world_size // c.pp  # the first device of the last pipeline rank
    started = time.perf_counter()
    report = dry_run(build, plan, ranks=[0, last] if case in BOTH_ENDS else [0], measure=True)
    seconds = time.perf_counter() - started
    return [
        {
            "plan": c.short(),
            "world": c.world_size,
            "rank": rank.rank,
            "planned_s": planned_s,
            "dry_run_s": seconds,
            "problems": list(report.problems),
            "predicted_peak": plan.prediction.memory_bytes_per_device,
            "predicted_allocated": rank.predicted_allocated_bytes,
            "measured_peak": rank.measured.peak_bytes if rank.measured else -1,
            "measured_held": rank.measured.held_bytes if rank.measured else -1,
            "step_s": rank.measured.seconds if rank.measured else 0.0,
        }
        for rank in report.ranks
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--timeout-s", type=float, default=600)
    parser.add_argument("--out", default=None)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(_one(args.one)))
        return
    unknown = [case for case in args.cases.split(",") if case not in CASES]
    if unknown:
        parser.error(f"--cases {','.join(unknown)}: unknown; the cases are {', '.join(CASES)}")
    gib = 2**30
    lines = [
        "Rank 0 of each plan (the first pipeline rank), and the last pipeline rank's first where the case says "
        "(rank N); one step on fake tensors at the full world size (fewer micro-batches where the others repeat "
        "one that ran: `autopar.runtime.dry_step.measured_microbatches`).",
        "",
        "| case | plan | predicted peak | predicted allocation | measured peak | measured / predicted "
        "| held after step | dry run (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for case in args.cases.split(","):
        started = time.perf_counter()
        try:
            out = subprocess.run(
                [sys.executable, __file__, "--one", case], capture_output=True, text=True, timeout=args.timeout_s
            )
            rows = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else []
            failure = None if rows else (out.stderr.strip().splitlines() or ["no output"])[-1]
        except subprocess.TimeoutExpired:
            rows, failure = [], f"over the {args.timeout_s:g} s limit"
        label = CASES[case][4]
        if not rows:
            lines.append(f"| {label} | | | | not measured: {failure} | | | {time.perf_counter() - started:.0f} |")
        for row in rows:
            ratio = row["measured_peak"] / row["predicted_allocated"] if row["predicted_allocated"] else 0.0
            where = f" (rank {row['rank']})" if row["rank"] else ""
            lines.append(
                f"| {label}{where} | {row['plan']} on {row['world']} | {row['predicted_peak'] / gib:.2f} GiB | "
                f"{row['predicted_allocated'] / gib:.2f} GiB | {row['measured_peak'] / gib:.2f} GiB | {ratio:.3f} | "
                f"{row['measured_held'] / gib:.2f} GiB | {row['dry_run_s']:.0f} |"
            )
        if rows and rows[0]["problems"]:
            lines.append(f"| | problems: {'; '.join(rows[0]['problems'])} | | | | | | |")
        print(lines[-1], flush=True)
    title = "Measured dry run against the plan's memory"
    print(write_result("dry_run_memory", title, "\n".join(lines), Path(args.out) if args.out else None))


if __name__ == "__main__":
    main()
