"""Measured: autopar's plan against the configurations a user would otherwise pick, all
trained for real on local gloo processes.

For a few small models on ``--nproc`` local processes (default 4): the plan
``autopar.plan`` finds on a profiled ``local-cpu`` cluster, and the baselines of
``benchmarks/compare.py``, each a constrained ``autopar.plan`` with the same profile
(micro-batch and recomputation still searched):

- **DP**: pure data parallelism (DDP, ZeRO-0);
- **Megatron rule**: TP = processes per node (the largest the model's shapes allow), the
  smallest PP that fits, DP the rest;
- **ZeRO-3**: data parallelism only, fully sharded (FSDP2).

The profile (``_local_runs.profile_machine``): layers by one process, the
network by ``--nproc`` processes at once, at other shapes than the ones trained (GPT seq 256 x 3 against seq 128 x 4;
the MLP and the CNN at 24 and 12 samples against micro-batches of 4 to 64). Plans that
came out the same are run once. Runs are interleaved over rounds, and a run's step time
is its median step (barrier to barrier, the slowest rank); the table gives the median
over rounds. The ratios are autopar's throughput over the baseline's (x1.00 = as fast),
predicted and measured side by side.

    python benchmarks/measured.py [--nproc 4] [--rounds 3] [--steps 8] [--models gpt mlp resnet]

Writes ``benchmarks/results/measured_<date>.md``, ``.csv`` and ``.png``. Numbers vary by tens of
percent between runs on a shared 2-core machine (process start-up and collective latency
under oversubscription).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import _foreign_cpu
import torch
from _local_runs import (
    Measured,
    ProfileTarget,
    Run,
    describe,
    fmt_rounds,
    measure_interleaved,
    plan_key,
    profile_lines,
    profile_machine,
    reports,
)
from _report import result_path, write_csv, write_png, write_result
from matplotlib.figure import Figure
from predicted_vs_measured import CFG as GPT_CFG
from predicted_vs_measured import PROFILE_BATCH as GPT_PROFILE_BATCH
from predicted_vs_measured import PROFILE_CFG as GPT_PROFILE_CFG

import autopar
from autopar.errors import ConfigError, InfeasiblePlanError
from autopar.graph import extract
from autopar.models import GPT, CNNConfig, MLPConfig, MLPStack, ResNet
from autopar.runtime.local import BatchFn, token_batches
from autopar.search.space import tp_degrees

NAME = "measured"
MLP_CFG = MLPConfig(in_dim=256, dim=512, ffn_dim=2048, n_layers=4, out_dim=16)
CNN_CFG = CNNConfig(image_size=32, width=32, stages=3, blocks_per_stage=1, num_classes=10)


@dataclass(frozen=True, kw_only=True)
class Case:
    """A model to plan and train: its builder, what the planner reads, its data."""

    build: Callable[[], torch.nn.Module]
    inputs: Mapping[str, Any]
    """``seq_len`` or ``sample_input`` for ``autopar.plan``."""
    global_batch: int
    batch_fn: BatchFn
    profile: ProfileTarget
    describe: str
    profile_name: str = ""
    """Whose layer profile to use (default: the case's own)."""
    memory_cap_bytes: float = 0.0
    """Memory per process the planner may use (0: what the device profile measured)."""


def _classes(in_shape: tuple[int, ...], classes: int) -> BatchFn:
    """Random inputs of ``in_shape`` per sample and random class targets."""

    def make(batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return torch.randn((batch, *in_shape), generator=g), torch.randint(0, classes, (batch,), generator=g)

    return make


def _sample(shape: tuple[int, ...]) -> Callable[[], torch.Tensor]:
    return lambda: torch.randn(shape, generator=torch.Generator().manual_seed(0))


CASES = {
    "gpt": Case(
        build=lambda: GPT(GPT_CFG),
        inputs={"seq_len": GPT_CFG.seq_len},
        global_batch=16,
        batch_fn=token_batches(GPT_CFG.vocab_size, GPT_CFG.seq_len),
        profile=ProfileTarget(
            build=lambda: GPT(GPT_PROFILE_CFG),
            sample=lambda: torch.randint(
                0,
                GPT_CFG.vocab_size,
                (GPT_PROFILE_BATCH, GPT_PROFILE_CFG.seq_len),
                generator=torch.Generator().manual_seed(0),
            ),
        ),
        describe=f"GPT dim {GPT_CFG.dim}, {GPT_CFG.n_layers} layers, {GPT_CFG.n_heads} heads, seq {GPT_CFG.seq_len}, "
        f"vocab {GPT_CFG.vocab_size}; global batch 16 sequences",
    ),
    "mlp": Case(
        build=lambda: MLPStack(MLP_CFG),
        inputs={"sample_input": torch.zeros(1, MLP_CFG.in_dim)},
        global_batch=256,
        batch_fn=_classes((MLP_CFG.in_dim,), MLP_CFG.out_dim),
        profile=ProfileTarget(build=lambda: MLPStack(MLP_CFG), sample=_sample((24, MLP_CFG.in_dim))),
        describe=f"MLPStack in {MLP_CFG.in_dim}, dim {MLP_CFG.dim}, ffn {MLP_CFG.ffn_dim}, {MLP_CFG.n_layers} blocks, "
        f"{MLP_CFG.out_dim} classes; global batch 256",
    ),
    "resnet": Case(
        build=lambda: ResNet(CNN_CFG),
        inputs={"sample_input": torch.zeros(1, CNN_CFG.in_channels, CNN_CFG.image_size, CNN_CFG.image_size)},
        global_batch=64,
        batch_fn=_classes((CNN_CFG.in_channels, CNN_CFG.image_size, CNN_CFG.image_size), CNN_CFG.num_classes),
        profile=ProfileTarget(
            build=lambda: ResNet(CNN_CFG),
            sample=_sample((12, CNN_CFG.in_channels, CNN_CFG.image_size, CNN_CFG.image_size)),
        ),
        describe=f"ResNet {CNN_CFG.image_size}x{CNN_CFG.image_size}, width {CNN_CFG.width}, {CNN_CFG.stages} stages "
        f"of {CNN_CFG.blocks_per_stage} block, {CNN_CFG.num_classes} classes; global batch 64",
    ),
}
CASES["gpt-56mib"] = dataclasses.replace(
    CASES["gpt"],
    profile_name="gpt",
    memory_cap_bytes=56 * 2**20,
    describe="the same GPT with the planner told each process has 56 MiB, so plain DP (~68 MiB at best) does not "
    "fit and the search has to trade memory for time",
)
BASELINES = ("DP", "Megatron rule", "ZeRO-3")


def case_reports(profile: Mapping[str, Any], nproc: int, name: str) -> list[Mapping[str, Any]]:
    """The case's profile reports; with a memory cap, the device report's memory set to it
    (the planner reads memory per device from a device profile, not from the cluster)."""
    case = CASES[name]
    out = reports(profile, nproc, case.profile_name or name)
    if case.memory_cap_bytes:
        device = copy.deepcopy(out[0])
        shared = device["device"]["memory_shared"]
        device["device"]["memory_bytes"] = case.memory_cap_bytes * (nproc if shared else 1)
        out = [device, *out[1:]]
    return out


def _plan(
    case: Case, cluster: autopar.Cluster, profile: list, constraints: Mapping[str, Any] | None = None
) -> autopar.Plan | None:
    torch.manual_seed(0)
    try:
        return autopar.plan(
            case.build(),
            cluster,
            global_batch_size=case.global_batch,
            constraints=constraints,
            profile=profile,
            **case.inputs,
        )
    except (InfeasiblePlanError, ConfigError):
        return None


def _megatron(case: Case, cluster: autopar.Cluster, profile: list) -> autopar.Plan | None:
    """TP = processes per node as far as the shapes allow, the smallest PP that fits, DP the rest."""
    graph = extract(case.build(), dtype=cluster.device.preferred_dtype, **case.inputs)
    tp = max(t for t in tp_degrees(graph, cluster.world_size) if t <= cluster.devices_per_node)
    rest = cluster.world_size // tp
    for pp in (p for p in range(1, rest + 1) if rest % p == 0):
        found = _plan(case, cluster, profile, {"tp": tp, "pp": pp})
        if found is not None:
            return found
    return None


def plans_for(case: Case, cluster: autopar.Cluster, profile: list) -> dict[str, autopar.Plan | None]:
    """autopar's plan and each baseline's (None where none fits); DP falls back on ZeRO-3
    where plain DP does not fit, as in benchmarks/compare.py."""
    return {
        "autopar": _plan(case, cluster, profile),
        "DP": (
            _plan(case, cluster, profile, {"tp": 1, "pp": 1, "zero_stage": 0})
            or _plan(case, cluster, profile, {"tp": 1, "pp": 1, "zero_stage": 3})
        ),
        "Megatron rule": _megatron(case, cluster, profile),
        "ZeRO-3": _plan(case, cluster, profile, {"tp": 1, "pp": 1, "zero_stage": 3}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="steps per run, the first 2 untimed")
    parser.add_argument("--models", nargs="*", default=list(CASES), choices=list(CASES))
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()
    say = lambda s: print(s, flush=True)  # noqa: E731
    targets = {CASES[m].profile_name or m: CASES[m].profile for m in args.models}
    profile = profile_machine([args.nproc], targets, rounds=args.rounds, command=NAME, log=say)
    saved = result_path(NAME, "_profiles.json")
    saved.write_text(json.dumps(profile))
    profile_s = time.perf_counter() - started
    cluster = autopar.preset("local-cpu", devices_per_node=args.nproc)

    plans: dict[str, dict[str, autopar.Plan | None]] = {}
    runs: dict[str, Run] = {}
    for name in args.models:
        case = CASES[name]
        plans[name] = plans_for(case, cluster, case_reports(profile, args.nproc, name))
        for label, plan in plans[name].items():
            if plan is not None and _run_key(name, plan) not in runs:
                runs[_run_key(name, plan)] = Run(
                    label=f"{name} {label}",
                    build=case.build,
                    plan=plan,
                    batch_fn=case.batch_fn,
                    sample_input=_sample_input(case, plan),
                )
        say(f"{name}: " + "; ".join(f"{k}: {describe(v) if v else 'none fits'}" for k, v in plans[name].items()))
    measured = measure_interleaved(list(runs.values()), rounds=args.rounds, steps=args.steps, log=say)
    by_plan = {key: measured.by_label[run.label] for key, run in runs.items()}
    verdicts, table, rows = _tables(args.models, plans, by_plan)
    csv_path = write_csv(NAME, rows)
    png = write_png(NAME, _figure(rows))
    head = (
        f"Cluster: `local-cpu` with {args.nproc} processes per node; layers profiled by one process, the "
        f"network by {args.nproc} at once, at other shapes ({args.rounds} interleaved rounds: median layers, network points pooled; saved "
        f"as `{saved.name}`; "
        f"{profile_s:.0f} s). Models: "
        + "; ".join(f"**{n}**: {CASES[n].describe}" for n in args.models)
        + f". fp32, AdamW. {args.rounds} interleaved rounds of {args.steps} steps (2 untimed) per distinct plan, "
        f"peak memory in a metered run in the first; CPU that other processes took during each round: "
        f"{_foreign_cpu.describe(measured.foreign)}, of {os.cpu_count()}; everything took {(time.perf_counter() - started) / 60:.1f} "
        f"min. Every round is in `{csv_path.name}`."
    )
    text = "\n\n".join(
        [
            head,
            verdicts,
            table,
            f"![autopar's speed-up, predicted and measured]({png.name})",
            NOTES,
            "Profiles kept:\n\n" + "\n".join(profile_lines(profile)),
        ]
    )
    md = write_result(NAME, f"autopar against the usual choices, measured on {args.nproc} local processes", text)
    print(text)
    print(f"wrote {md} and {csv_path}")


def _sample_input(case: Case, plan: autopar.Plan) -> Any:
    """One micro-batch of the case's own inputs for a model that takes no token ids
    (``parallelize`` traces it to place tensor-parallel layouts); None for token models,
    which are traced with the plan's sequence length."""
    if "sample_input" not in case.inputs:
        return None
    return case.batch_fn(plan.config.micro_batch_size, 0)[0]


def _run_key(name: str, plan: autopar.Plan) -> str:
    """Cases that train the same model share the runs of equal plans."""
    return f"{CASES[name].profile_name or name}:{plan_key(plan)}"


def _tables(
    models: list[str], plans: Mapping[str, Mapping[str, autopar.Plan | None]], by_plan: Mapping[str, Measured]
) -> tuple[str, str, list[dict[str, Any]]]:
    rows, lines, verdicts = [], [], []
    for name in models:
        got = {label: (plan, by_plan[_run_key(name, plan)]) for label, plan in plans[name].items() if plan}
        ours, ours_m = got["autopar"]
        for label in ("autopar", *BASELINES):
            if label not in got:
                lines.append(f"| {name} | {label} | none fits | | | | | | | | |")
                rows.append({"model": name, "plan": label, "config": "none fits"})
                continue
            plan, m = got[label]
            same = label != "autopar" and plan_key(plan) == plan_key(ours)
            pred, meas = plan.prediction.step_time_s, m.median_s
            pred_x = pred / ours.prediction.step_time_s
            meas_x = meas / ours_m.median_s if m.round_medians_s and ours_m.round_medians_s else float("nan")
            shown = label + (" (ZeRO-3: plain DP does not fit)" if label == "DP" and plan.config.zero_stage else "")
            peak = max(m.peak_bytes) / 2**20 if m.peak_bytes else float("nan")
            status = f"FAILED: {m.error}" if m.error else f"{meas:.3f}"
            lines.append(
                f"| {name} | {shown} | {describe(plan)} | {pred:.3f} | {status} | {fmt_rounds(m.round_medians_s)} | "
                f"{pred / meas:.2f} | {'' if label == 'autopar' else f'x{pred_x:.2f}'} | "
                f"{'' if label == 'autopar' else f'x{meas_x:.2f}' + (' (same plan)' if same else '')} | "
                f"{plan.prediction.memory_bytes_per_device / 2**20:.0f} | {peak:.0f} |"
            )
            rows.append(
                {
                    "model": name,
                    "plan": shown,
                    "config": describe(plan),
                    "predicted_s": f"{pred:.4f}",
                    "measured_median_s": f"{meas:.4f}",
                    "measured_rounds_s": fmt_rounds(m.round_medians_s),
                    "predicted_over_measured": f"{pred / meas:.3f}",
                    "predicted_autopar_speedup": "" if label == "autopar" else f"{pred_x:.3f}",
                    "measured_autopar_speedup": "" if label == "autopar" else f"{meas_x:.3f}",
                    "same_plan_as_autopar": same,
                    "predicted_peak_mib": f"{plan.prediction.memory_bytes_per_device / 2**20:.1f}",
                    "measured_peak_mib_per_rank": " / ".join(f"{b / 2**20:.1f}" for b in m.peak_bytes),
                    "error": m.error,
                }
            )
        timed = {label: m.median_s for label, (_, m) in got.items() if m.round_medians_s}
        fastest = min(timed, key=timed.get) if timed else "none"
        slower = (
            f" (autopar's step is {timed['autopar'] / timed[fastest]:.2f}x the fastest's)"
            if "autopar" in timed and fastest != "autopar" and plan_key(got[fastest][0]) != plan_key(ours)
            else ""
        )
        cap = CASES[name].memory_cap_bytes
        over = sorted({label for label, (_, m) in got.items() if cap and m.peak_bytes and max(m.peak_bytes) > cap})
        over_note = (
            f"; measured peaks over the {cap / 2**20:.0f} MiB the planner was given: {', '.join(over)}" if over else ""
        )
        verdicts.append(f"- {name}: measured fastest is **{fastest}**{slower}{over_note}")
    head = [
        "| model | plan | configuration | predicted s | measured s (median) | rounds (s) | predicted / measured | "
        "autopar's speed-up, predicted | autopar's speed-up, measured | predicted peak MiB | measured peak MiB "
        "(most loaded rank) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    return "\n".join(verdicts), "\n".join(head + lines), rows


def _figure(rows: list[dict[str, Any]]) -> Figure:
    """autopar's speed-up over each baseline that ran, predicted next to measured, per
    model (a bar at x1 where the baseline's plan is autopar's own)."""
    pairs = [
        (
            f"{r['model']}: {r['plan'].split(' (')[0]}",
            float(r["predicted_autopar_speedup"]),
            float(r["measured_autopar_speedup"]),
        )
        for r in rows
        if r.get("predicted_autopar_speedup") and r.get("measured_autopar_speedup") and not r.get("error")
    ]
    fig = Figure(figsize=(7, 0.35 * len(pairs) + 1.5))
    ax = fig.add_subplot()
    ys = range(len(pairs))
    ax.barh([y - 0.2 for y in ys], [p[1] for p in pairs], height=0.4, label="predicted")
    ax.barh([y + 0.2 for y in ys], [p[2] for p in pairs], height=0.4, label="measured")
    ax.set_yticks(list(ys), [p[0] for p in pairs], fontsize=7)
    ax.invert_yaxis()
    ax.axvline(1.0, color="gray", linewidth=0.8)
    ax.set_xlabel("baseline step time / autopar step time (above 1: autopar faster)")
    ax.legend(fontsize=7)
    return fig


NOTES = """Speed-up: the baseline's step time over autopar's, predicted (cost model) and measured
(x1.00 = as fast, below 1 the baseline is faster). 'same plan' means the constrained
search returned autopar's own plan, run once and shared. Step time: median over rounds of
each run's median step (barrier to barrier, the slowest rank, optimizer step included)."""


if __name__ == "__main__":
    sys.exit(main())
