"""How long ``autopar.plan`` takes on the large cases, extraction included.

Targets (issue: the planner): GPT-3 175B on 1024 A100 under 2 s; a 1T GPT (128 layers,
hidden 25600) on 3072 A100 and a 530B GPT on 5120 A100 under 5 s each. Building the meta
model is the user's side and is not timed. Reports the median of repeats of wall and CPU
time (the CPU time is what the search costs; wall time includes other load on the box).
"""

from __future__ import annotations

import argparse
import statistics
import time

from _report import markdown_table, write_csv, write_result

import autopar
from autopar.models import build_named_model

CASES = [
    ("gpt3-175b", "dgx-a100-80gb", 128, 1536, 2048, 2.0),
    ("gpt-1t", "dgx-a100-80gb", 384, 3072, 2048, 5.0),
    ("gpt-530b", "dgx-a100-80gb", 640, 2560, 2048, 5.0),
    ("llama3-405b", "dgx-h100", 256, 1024, 8192, None),
    ("llama3-70b", "dgx-h100", 64, 512, 8192, None),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows: list[dict[str, object]] = []
    for name, preset, nodes, batch, seq, target in CASES:
        cluster = autopar.Cluster.preset(preset, nodes=nodes)
        walls, cpus = [], []
        result = None
        for _ in range(args.repeats):
            model = build_named_model(name)
            w0, c0 = time.perf_counter(), time.process_time()
            result = autopar.plan(model, cluster, global_batch_size=batch, seq_len=seq)
            walls.append(time.perf_counter() - w0)
            cpus.append(time.process_time() - c0)
        wall, cpu = statistics.median(walls), statistics.median(cpus)
        verdict = "" if target is None else (f"< {target:g} s: {'met' if cpu < target else 'MISSED'}")
        rows.append(
            {
                "model": name,
                "cluster": f"{preset} x {nodes}",
                "devices": cluster.world_size,
                "batch": f"{batch} x {seq}",
                "wall s (median)": f"{wall:.2f}",
                "CPU s (median)": f"{cpu:.2f}",
                "target": verdict,
                "configurations costed": result.candidates_evaluated,
                "plan": result.config.short(),
            }
        )
        print(rows[-1], flush=True)
    csv_path = write_csv("planner_speed", rows)
    body = markdown_table(rows) + (
        f"\n\nRows also in `{csv_path.name}`. Times include extracting the model "
        "(fake-tensor trace) and the whole search. The box is shared; CPU time is the "
        "cost of the search itself."
    )
    print(write_result("planner_speed", "Planner speed", body))


if __name__ == "__main__":
    main()
