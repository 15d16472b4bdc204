"""autopar's plans against the configurations a user would otherwise pick.

For a zoo of models on several clusters: autopar's plan, and the baselines
- **DP**: pure data parallelism (ZeRO-0), or ZeRO-3 where plain DP does not fit;
- **Megatron rule**: TP = GPUs per node (the largest the heads allow), the smallest PP
  that fits, DP the rest (micro-batch and recomputation still searched);
- **ZeRO-3**: data parallelism only, fully sharded;
- **exhaustive**: every configuration of autopar's space costed, no pruning (only where
  the space is small enough to cost in reasonable time): it must match autopar.

Besides the zoo, named **scenarios** of what people train today (``--scenarios-only``
runs just them): long context (Llama-3.1-8B at 128K tokens on 64 H100) with the
baseline **no CP** (the best plan without context parallelism), and mixtures of
experts (Mixtral-8x7B on 64 H100, Mixtral-8x22B on 512 H100) with the baseline **no EP**
(the best plan without expert parallelism). DP and ZeRO-3 replicate the experts (ep=1);
the Megatron rule fixes tp, pp and cp=1 and leaves ep to the search, as Megatron-LM's
MoE recipes set an expert-parallel size beside the rule.
Each baseline is a constrained search in autopar's own cost model, so the ratios show
what the search finds inside its model, not measured speed-ups (benchmarks/measured.py
runs plans for real on local processes).
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from _report import markdown_table, write_csv, write_png, write_result
from matplotlib.figure import Figure

import autopar
from autopar.cost.model import CostModel
from autopar.cost.peak import budget_bytes
from autopar.errors import ConfigError, InfeasiblePlanError
from autopar.graph import extract
from autopar.models import get_named_model
from autopar.models.registry import build_named_model, named_models
from autopar.search.constraints import check_constraints
from autopar.search.scan import ALL_MODES
from autopar.search.solve import ConfigSolver
from autopar.search.space import enumerate_space, tp_degrees
from autopar.vocab import Optimizer

ZOO = [
    "gpt2-small",
    "gpt2-xl",
    "gpt3-1.3b",
    "gpt3-13b",
    "gpt3-175b",
    "gpt-530b",
    "gpt-1t",
    "llama2-7b",
    "llama3-70b",
    "llama3-405b",
    "bert-large",
    "mlp-wide",
    "resnet-small",
]
CLUSTERS = [("dgx-a100-80gb", 1), ("dgx-a100-80gb", 8), ("dgx-h100", 64), ("p3.16xlarge", 4), ("local-cpu", 1)]
EXHAUSTIVE_LIMIT = 1000
SCENARIOS = [
    # (model, preset, nodes, global batch in sequences, tokens per sequence)
    ("llama3.1-8b", "dgx-h100", 8, 32, 131072),  # 4M tokens per step, as Llama 3's long-context stage
    ("mixtral-8x7b", "dgx-h100", 8, 512, 4096),
    ("mixtral-8x22b", "dgx-h100", 64, 1024, 4096),
]


def _batch(world: int, kind: str) -> int:
    return max(8 * world, 64) if kind != "tokens" else max(4 * world, 32)


def _try(fn):
    try:
        return fn()
    except (InfeasiblePlanError, ConfigError):
        return None


BASELINES = ("DP", "Megatron rule", "ZeRO-3", "no CP", "no EP")
ABLATIONS = {"no CP": "cp", "no EP": "ep"}
"""Baselines that turn one of autopar's axes off: shown only where autopar's plan uses it."""


def _applicable(config) -> list[str]:
    """The baselines that apply to a plan of ``config``."""
    return [b for b in BASELINES if b not in ABLATIONS or getattr(config, ABLATIONS[b]) > 1]


def _cases(models: list[str], scenarios_only: bool):
    """(model, preset, nodes, batch or None, seq_len or None) to plan: the zoo on every
    cluster (batch and length by default), then the scenarios."""
    if not scenarios_only:
        for name in models:
            for preset, nodes in CLUSTERS:
                if preset == "local-cpu" and name not in ("gpt2-small", "mlp-wide", "resnet-small", "bert-large"):
                    continue
                yield name, preset, nodes, None, None
    yield from SCENARIOS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="*", default=ZOO)
    parser.add_argument("--scenarios-only", action="store_true", help="plan only the named scenarios")
    args = parser.parse_args()
    if not args.models:
        parser.error("--models: give one or more model names (see 'autopar models'), or leave --models out for all")
    unknown = [m for m in args.models if m not in named_models()]
    if unknown:
        parser.error(f"--models {' '.join(unknown)}: unknown; see 'autopar models' for the names")
    rows: list[dict[str, str]] = []
    ratios: list[tuple[str, dict[str, float | None]]] = []
    for name, preset, nodes, fixed_batch, seq_len in _cases(args.models, args.scenarios_only):
        entry = get_named_model(name)
        cluster = autopar.preset(preset, nodes=nodes)
        model = build_named_model(name)
        kind = entry.input_kind
        tokens = seq_len or entry.seq_len
        inputs = {"seq_len": tokens} if kind == "tokens" else {"sample_input": entry.sample_input(1)}
        dtype = cluster.device.preferred_dtype
        graph = extract(model, dtype=dtype, **inputs)
        batch = fixed_batch or _batch(cluster.world_size, kind)
        start = time.perf_counter()
        best = _try(lambda: autopar.plan(graph, cluster, global_batch_size=batch))
        search_s = time.perf_counter() - start
        row = {
            "model": name if seq_len is None else f"{name} at {tokens // 1024}K tokens, batch {batch}",
            "cluster": f"{preset} x {nodes}",
            "autopar plan": "does not fit",
            "tokens or samples/s": "",
            "memory": "",
            **{f"vs {b}": "" for b in BASELINES},
            "exhaustive": "",
            "search s": f"{search_s:.2f}",
        }
        if best is not None:
            t = best.prediction.step_time_s
            dp = _try(
                lambda: autopar.plan(
                    graph,
                    cluster,
                    global_batch_size=batch,
                    constraints={"tp": 1, "pp": 1, "cp": 1, "ep": 1, "zero_stage": 0},
                )
            )
            if dp is None:  # the user's DP baseline where plain DP does not fit
                dp = _try(
                    lambda: autopar.plan(
                        graph,
                        cluster,
                        global_batch_size=batch,
                        constraints={"tp": 1, "pp": 1, "cp": 1, "ep": 1, "zero_stage": 3},
                    )
                )
            z3 = _try(
                lambda: autopar.plan(
                    graph,
                    cluster,
                    global_batch_size=batch,
                    constraints={"tp": 1, "pp": 1, "cp": 1, "ep": 1, "zero_stage": 3},
                )
            )
            applicable = _applicable(best.config)
            found = {"DP": dp, "Megatron rule": _megatron(graph, cluster, batch), "ZeRO-3": z3}
            for b, axis in ABLATIONS.items():
                if b in applicable:
                    found[b] = _try(
                        lambda: autopar.plan(graph, cluster, global_batch_size=batch, constraints={axis: 1})
                    )
            rate = best.prediction.tokens_per_s if kind == "tokens" else best.prediction.samples_per_s
            row.update(
                {
                    "autopar plan": best.config.short(),
                    "tokens or samples/s": f"{rate:,.0f}",
                    "memory": f"{best.prediction.memory_bytes_per_device / 2**30:.1f} GiB",
                    **{
                        f"vs {b}": _ratio(
                            t,
                            found[b],
                            "ZeRO-3" if b == "DP" and found[b] is not None and found[b].config.zero_stage == 3 else "",
                        )
                        for b in applicable
                    },
                    "exhaustive": _exhaustive(graph, cluster, batch)(t) if seq_len is None else "",
                }
            )
            ratios.append(
                (
                    f"{name} @ {preset} x{nodes}",
                    {b: None if found[b] is None else found[b].prediction.step_time_s / t for b in applicable},
                )
            )
        rows.append(row)
        print(" | ".join(row.values()), flush=True)
    name = "compare_scenarios" if args.scenarios_only else "compare"
    png = write_png(name, _figure(ratios))
    csv_path = write_csv(name, rows)
    body = markdown_table(rows) + (
        "\n\nRatios are autopar's throughput over the baseline's (x1.00 = as fast); 'does not fit' means the "
        "baseline has no configuration that fits ('no CP' and 'no EP' are filled where autopar's plan splits "
        "sequences or experts); a "
        "DP ratio marked ZeRO-3 is DP with ZeRO-3 because plain DP "
        f"does not fit. Rows also in `{csv_path.name}`.\n\n![autopar over the baselines]({png.name})"
    )
    print(write_result(name, "autopar against the usual choices (predicted)", body))


def _ratio(t: float, other, marker: str) -> str:
    if other is None:
        return "does not fit"
    return f"x{other.prediction.step_time_s / t:.2f}" + (f" ({marker})" if marker else "")


def _figure(ratios: list[tuple[str, dict[str, float | None]]]) -> Figure:
    """autopar's predicted speed-up over each baseline per case, on a log axis; a
    baseline that does not fit is drawn as a cross at the axis' right edge; one that does
    not apply to a case (no CP or no EP where autopar's plan does not use the axis) is left out."""
    fig = Figure(figsize=(8, 0.28 * len(ratios) * len(BASELINES) / 2 + 1.5))
    ax = fig.add_subplot()
    height = 0.8 / len(BASELINES)
    cap = max([r for _, rs in ratios for r in rs.values() if r is not None], default=2.0) * 1.5
    for k, base in enumerate(BASELINES):
        offset = (k - (len(BASELINES) - 1) / 2) * height
        pairs = [(i + offset, rs[base]) for i, (_, rs) in enumerate(ratios) if base in rs]
        ys, values = [y for y, _ in pairs], [v for _, v in pairs]
        ax.barh(
            [y for y, v in zip(ys, values) if v is not None],
            [v for v in values if v is not None],
            height=height,
            left=0,
            label=f"over {base}",
        )
        missing = [y for y, v in zip(ys, values) if v is None]
        if missing:
            ax.plot([cap] * len(missing), missing, "kx")
    ax.set_yticks(range(len(ratios)), [label for label, _ in ratios], fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.axvline(1.0, color="gray", linewidth=0.8)
    ax.set_xlabel("autopar throughput / baseline throughput (predicted; x: the baseline does not fit)")
    ax.legend(fontsize=7, loc="lower right")
    return fig


def _megatron(graph, cluster, batch):
    allowed = [t for t in tp_degrees(graph, cluster.world_size) if t <= cluster.devices_per_node]
    tp = max(allowed)
    rest = cluster.world_size // tp
    for pp in [p for p in range(1, rest + 1) if rest % p == 0]:
        fixed = {"tp": tp, "pp": pp, "cp": 1}
        found = _try(lambda: autopar.plan(graph, cluster, global_batch_size=batch, constraints=fixed))
        if found is not None:
            return found
    return None


def _exhaustive(graph, cluster, batch):
    configs, _ = enumerate_space(graph, cluster, batch, check_constraints({}))
    if len(configs) > EXHAUSTIVE_LIMIT:
        return lambda t: f"skipped ({len(configs)} configs)"
    ev = ConfigSolver(
        model=CostModel(graph=graph, cluster=cluster, optimizer=Optimizer.ADAM, global_batch_size=batch),
        budget_bytes=budget_bytes(cluster.device.memory),
        micro_batches=tuple(sorted({c.micro_batch_size for c in configs})),
    )
    start = time.perf_counter()
    best = min((ev.evaluate(c, ALL_MODES).step_time_s for c in configs), default=math.inf)
    secs = time.perf_counter() - start

    def verdict(t: float) -> str:
        same = math.isclose(best, t, rel_tol=1e-9)
        return f"{'same' if same else 'DIFFERENT'} ({len(configs)} configs, {secs:.1f} s)"

    return verdict


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
