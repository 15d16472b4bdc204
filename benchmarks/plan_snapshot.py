"""The plan file of every configuration the benchmarks plan, and their diff.

Refactoring the planner must not change a plan unless a named bug is fixed. This script
plans every configuration of ``compare.py`` (autopar and the three baselines),
``planner_faithful.py`` (the published runs, as estimates), ``measured.py`` (with the
profiles committed in ``results/``) and five large searches, and writes their plan data
(less the search's own time and candidate count, and less the cluster, whose file layout
is not a prediction) to a gzipped JSON file. ``--compare BEFORE AFTER`` reports every
configuration whose plan differs, field by field, with numbers compared to a relative
tolerance (a sum taken in another order may differ in its last bits).

    python benchmarks/plan_snapshot.py --write results/plan_snapshot_after.json.gz
    python benchmarks/plan_snapshot.py --compare results/plan_snapshot_before.json.gz \
        results/plan_snapshot_after.json.gz --out results/plan_diff_<date>.md
    python benchmarks/plan_snapshot.py --configs BEFORE AFTER   # which chosen configurations changed
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import _published_runs as published
import compare
import measured
import torch

import autopar
from autopar.errors import ConfigError, InfeasiblePlanError
from autopar.graph import extract
from autopar.models import get_named_model
from autopar.models.registry import build_named_model
from autopar.search.space import tp_degrees

RESULTS = Path(__file__).parent / "results"
REL_TOL = 1e-9
DROPPED = ("search_time_s", "candidates_evaluated", "cluster", "schema_version")
SPEED_CASES = (
    ("gpt3-175b", "dgx-a100-80gb", 128, 1536, 2048),
    ("gpt-1t", "dgx-a100-80gb", 384, 3072, 2048),
    ("gpt-530b", "dgx-a100-80gb", 640, 2560, 2048),
    ("llama3-405b", "dgx-h100", 256, 1024, 8192),
    ("llama3-70b", "dgx-h100", 64, 512, 8192),
)
"""Large searches (the planner-speed cases as first benchmarked), with autopar's models."""


def _canonical(plan: autopar.Plan | None) -> Any:
    if plan is None:
        return None
    data = plan.to_dict()
    for key in DROPPED:
        data.pop(key)
    return data


def _cases() -> Iterator[tuple[str, Callable[[], autopar.Plan | None]]]:
    for name in compare.ZOO:
        entry = get_named_model(name)
        for preset, nodes in compare.CLUSTERS:
            if preset == "local-cpu" and name not in ("gpt2-small", "mlp-wide", "resnet-small", "bert-large"):
                continue
            cluster = autopar.preset(preset, nodes=nodes)
            inputs = (
                {"seq_len": entry.seq_len} if entry.input_kind == "tokens" else {"sample_input": entry.sample_input(1)}
            )
            graph = extract(build_named_model(name), dtype=cluster.device.preferred_dtype, **inputs)
            batch = compare._batch(cluster.world_size, entry.input_kind)
            base = f"compare/{name}@{preset}x{nodes}"

            def planned(constraints=None, graph=graph, cluster=cluster, batch=batch):
                return lambda: autopar.plan(graph, cluster, global_batch_size=batch, constraints=constraints)

            yield f"{base}/autopar", planned()
            yield f"{base}/dp0", planned({"tp": 1, "pp": 1, "zero_stage": 0})
            yield f"{base}/zero3", planned({"tp": 1, "pp": 1, "zero_stage": 3})
            tp = max(t for t in tp_degrees(graph, cluster.world_size) if t <= cluster.devices_per_node)
            rest = cluster.world_size // tp
            for pp in [p for p in range(1, rest + 1) if rest % p == 0][:3]:
                yield f"{base}/megatron-tp{tp}-pp{pp}", planned({"tp": tp, "pp": pp})
    for label, hidden, heads, layers, gpus, batch, tp, pp, _ in published.NARAYANAN_2021:
        config = {"tp": tp, "pp": pp, "micro_batch_size": 1, "recompute": "full", "zero_stage": 0, "dtype": "fp16"}
        yield (
            f"faithful/{label}",
            lambda h=hidden, a=heads, n=layers, g=gpus, b=batch, c=config: autopar.estimate(
                published.gpt(h, a, n),
                autopar.preset("dgx-a100-80gb", nodes=g // 8),
                c,
                global_batch_size=b,
                seq_len=2048,
                attention="materialized",
            ),
        )
    for recompute, sp in (("full", False), ("selective", True)):
        config = {
            "tp": 8,
            "pp": 35,
            "micro_batch_size": 1,
            "recompute": recompute,
            "sequence_parallel": sp,
            "zero_stage": 0,
        }
        yield (
            f"faithful/530b-{recompute}",
            lambda c=config: autopar.estimate(
                published.gpt(20480, 128, 105),
                autopar.preset("dgx-a100-80gb", nodes=280),
                c,
                global_batch_size=2240,
                seq_len=2048,
                attention="materialized",
            ),
        )
    profile = json.loads((RESULTS / "measured_2026-11-30_profiles.json").read_text())
    profile["worlds"] = {int(k): v for k, v in profile["worlds"].items()}
    local = autopar.preset("local-cpu", devices_per_node=4)
    for name, case in measured.CASES.items():
        reports = measured.case_reports(profile, 4, name)
        yield f"measured/{name}/autopar", lambda c=case, r=reports: measured._plan(c, local, r)
        yield (
            f"measured/{name}/dp0",
            lambda c=case, r=reports: measured._plan(c, local, r, {"tp": 1, "pp": 1, "zero_stage": 0}),
        )
        yield (
            f"measured/{name}/zero3",
            lambda c=case, r=reports: measured._plan(c, local, r, {"tp": 1, "pp": 1, "zero_stage": 3}),
        )
        yield f"measured/{name}/megatron", lambda c=case, r=reports: measured._megatron(c, local, r)
    for name, preset, nodes, batch, seq in SPEED_CASES:
        yield (
            f"speed/{name}",
            lambda n=name, p=preset, k=nodes, b=batch, s=seq: autopar.plan(
                build_named_model(n), autopar.preset(p, nodes=k), global_batch_size=b, seq_len=s
            ),
        )


def write(path: Path) -> None:
    out: dict[str, Any] = {}
    for key, make in _cases():
        started = time.perf_counter()
        try:
            out[key] = _canonical(make())
        except (InfeasiblePlanError, ConfigError) as exc:
            out[key] = {"error": f"{type(exc).__name__}: {exc}"}
        print(f"{key}: {time.perf_counter() - started:.1f} s", flush=True)
    with gzip.open(path, "wt") as f:
        json.dump(out, f, sort_keys=True)
    print(f"{len(out)} plans written to {path}")


def differences(a: Any, b: Any, path: str = "") -> Iterator[str]:
    """Where ``a`` and ``b`` differ: numbers beyond the tolerance, anything else."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if key not in a or key not in b:
                yield f"{path}.{key}: only in {'after' if key in b else 'before'}"
            else:
                yield from differences(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            yield f"{path}: {len(a)} items before, {len(b)} after"
        for i, (x, y) in enumerate(zip(a, b)):
            yield from differences(x, y, f"{path}[{i}]")
    elif isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        if not math.isclose(a, b, rel_tol=REL_TOL, abs_tol=1e-12):
            yield f"{path}: {a!r} -> {b!r}"
    elif a != b:
        yield f"{path}: {a!r} -> {b!r}"


def _load(path: Path) -> dict[str, Any]:
    with gzip.open(path, "rt") as f:
        return json.load(f)


def compare_files(before: Path, after: Path, out: Path | None) -> int:
    old, new = _load(before), _load(after)
    lines = []
    changed = 0
    for key in sorted(set(old) | set(new)):
        found = list(differences(old.get(key), new.get(key), key))
        if found:
            changed += 1
            lines += [f"- `{key}`: {len(found)} difference(s)", *[f"  - `{d}`" for d in found[:8]]]
    summary = (
        f"{len(set(old) | set(new))} configurations, {changed} with a different plan "
        f"(numbers compared to a relative tolerance of {REL_TOL:g})."
    )
    print(summary)
    print("\n".join(lines))
    if out is not None:
        out.write_text(
            f"# Plan files before and after\n\nCommand: `python benchmarks/plan_snapshot.py --compare "
            f"{before.name} {after.name}`\n\n{summary}\n\n" + "\n".join(lines) + "\n"
        )
    return 1 if changed else 0


def _config(plan: dict) -> str:
    c = plan["config"]
    schedule = f"{c['schedule']}(v={c['virtual_stages']})" if c["virtual_stages"] > 1 else c["schedule"]
    return (
        f"dp{c['dp']} tp{c['tp']} pp{c['pp']} mbs{c['micro_batch_size']} m{c['num_microbatches']} {schedule} "
        f"zero{c['zero_stage']} recompute {c['recompute']}"
    )


def config_changes(before: Path, after: Path) -> str:
    """A Markdown table of the configurations whose chosen parallel configuration
    changed (with predicted step time and memory), and the pipelined plans that kept
    theirs with other memory."""
    old, new = _load(before), _load(after)
    rows, memory = [], []
    for key, a in old.items():
        b = new.get(key)
        planned_a, planned_b = isinstance(a, dict) and "config" in a, isinstance(b, dict) and "config" in b
        if not (planned_a and planned_b):
            if planned_a != planned_b:
                rows.append(f"| {key} | {_config(a) if planned_a else a} | {_config(b) if planned_b else b} | |")
            continue
        ta, tb = a["prediction"]["step_time_s"], b["prediction"]["step_time_s"]
        ma, mb = (p["prediction"]["memory_bytes_per_device"] / 2**30 for p in (a, b))
        if _config(a) != _config(b):
            rows.append(
                f"| {key} | {_config(a)}: {ta:.4g} s, {ma:.1f} GiB | {_config(b)}: {tb:.4g} s, {mb:.1f} GiB | "
                f"{100 * (tb / ta - 1):+.1f}% |"
            )
        elif a["config"]["pp"] > 1 and abs(mb - ma) > 0.05:
            memory.append((mb - ma, key, ma, mb))
    lines = ["| configuration | before | after | step time |", "|---|---|---|---|", *rows, ""]
    lines.append(
        f"{len(rows)} of {len(old)} plans take another configuration; {len(memory)} pipelined plans keep theirs "
        f"with other memory, the largest changes:"
    )
    lines += [f"- {key}: {ma:.1f} -> {mb:.1f} GiB" for _, key, ma, mb in sorted(memory)[:8]]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", type=Path)
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    parser.add_argument("--configs", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not (args.write or args.configs or args.compare):
        parser.error("give --write FILE, --compare BEFORE AFTER or --configs BEFORE AFTER")
    missing = [str(p) for p in (*(args.compare or ()), *(args.configs or ())) if not p.is_file()]
    if missing:
        parser.error(f"{', '.join(missing)}: no such file; give snapshots written with --write")
    torch.set_num_threads(1)
    if args.write:
        write(args.write)
    if args.configs:
        print(config_changes(*args.configs))
    if args.compare:
        sys.exit(compare_files(*args.compare, args.out))


if __name__ == "__main__":
    main()
