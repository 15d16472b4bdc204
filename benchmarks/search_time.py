"""Planning time against model depth and device count (up to 16k devices), with a plot.

A GPT of hidden size 8192 (64 heads) with 24 to 192 layers, planned on 8 to 16384 H100s
(1 to 2048 DGX nodes) at a global batch of 4 sequences per device, extraction included.
Writes a Markdown table, a CSV and a PNG.
"""

from __future__ import annotations

import argparse
import time

import torch
from _report import markdown_table, write_csv, write_png, write_result
from matplotlib.figure import Figure

import autopar
from autopar.errors import InfeasiblePlanError
from autopar.models import GPT, GPTConfig

DEPTHS = [24, 48, 96, 192]
NODES = [1, 8, 64, 512, 2048]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--depths", type=int, nargs="*", default=DEPTHS)
    parser.add_argument("--nodes", type=int, nargs="*", default=NODES)
    args = parser.parse_args()
    if not args.nodes or not args.depths or any(n < 1 for n in args.nodes) or any(d < 1 for d in args.depths):
        parser.error(f"--nodes {args.nodes} --depths {args.depths}: give one or more whole numbers of at least 1")
    rows: list[dict[str, object]] = []
    series: dict[int, list[tuple[int, float]]] = {}
    for depth in args.depths:
        for nodes in args.nodes:
            with torch.device("meta"):
                model = GPT(GPTConfig(vocab_size=51200, seq_len=2048, dim=8192, n_layers=depth, n_heads=64))
            cluster = autopar.preset("dgx-h100", nodes=nodes)
            c0 = time.process_time()
            try:
                plan = autopar.plan(model, cluster, global_batch_size=4 * cluster.world_size, seq_len=2048)
                summary, costed = plan.config.short(), plan.candidates_evaluated
            except InfeasiblePlanError:
                summary, costed = "does not fit", 0
            secs = time.process_time() - c0
            series.setdefault(depth, []).append((cluster.world_size, secs))
            params = sum(p.numel() for p in model.parameters())
            rows.append(
                {
                    "layers": depth,
                    "parameters": f"{params / 1e9:.0f}B",
                    "devices": cluster.world_size,
                    "CPU s": f"{secs:.2f}",
                    "configurations costed": costed,
                    "plan": summary,
                }
            )
            print(rows[-1], flush=True)
    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot()
    for depth, points in series.items():
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=f"{depth} layers")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("devices (H100)")
    ax.set_ylabel("planning time, CPU seconds")
    ax.set_title("autopar.plan time against device count and depth")
    ax.legend()
    png = write_png("search_time", fig)
    csv_path = write_csv("search_time", rows)
    print(
        write_result(
            "search_time",
            "Planning time against depth and devices",
            markdown_table(rows) + f"\n\nRows also in `{csv_path.name}`.\n\n![planning time]({png.name})",
        )
    )


if __name__ == "__main__":
    main()
