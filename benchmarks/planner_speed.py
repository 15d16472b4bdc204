"""How long planning takes a new user on the large cases, extraction included.

Each run is a fresh Python process, as a user's first ``autopar.plan`` call would be: the
model is built on the meta device (the user's side, not timed), then ``autopar.plan`` is
timed whole (the trace that extracts the layer graph, the search, the Plan). The CLI
case times ``autopar.cli.main`` inside the process the same way, building its model
included. PyTorch imports its compiler stack on the first operation on meta or fake
tensors in a process (in 2.13, about 1.5 s on 2 cores), whoever runs it: building a model
on meta usually does. The worker imports it before anything is timed and reports its
cost apart, so every row times autopar alone. The whole process (interpreter, ``import
torch``, that import, the model) is reported beside it. The
median of ``--repeats`` runs is compared with the target (the planner-core issue's
table). The machine's load average is recorded with every row: the box is shared, and a
busy one makes every figure longer.

Usage: ``python benchmarks/planner_speed.py [--repeats 3] [--only NAME]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from _report import markdown_table, write_csv, write_result


@dataclass(frozen=True)
class Case:
    name: str
    model: str
    """``hf-gpt2:<hidden>:<layers>:<heads>``, ``hf-llama:405b`` or a registered model name."""
    cluster: str
    global_batch_size: int
    seq_len: int
    target_s: float
    before_s: str
    """What the issue measured before the restructure (same case, same kind of machine)."""
    cli: bool = False


CASES = (
    Case(
        "GPT-3 175B, transformers GPT2LMHeadModel", "hf-gpt2:12288:96:96", "dgx-a100-80gb:128", 1536, 2048, 1.0, "3.2"
    ),
    Case("GPT-3 175B, autopar GPT", "gpt3-175b", "dgx-a100-80gb:128", 1536, 2048, 1.0, "-"),
    Case(
        "1T GPT, transformers GPT2LMHeadModel",
        "hf-gpt2:25600:128:160",
        "dgx-a100-80gb:384",
        3072,
        2048,
        2.0,
        "11.9-15.4",
    ),
    Case("1T GPT, autopar GPT", "gpt-1t", "dgx-a100-80gb:384", 3072, 2048, 2.0, "19.6"),
    Case("autopar plan --model llama3-70b (CLI)", "llama3-70b", "dgx-h100:16", 512, 8192, 1.0, "5.4", cli=True),
    Case("Llama-3-405B, transformers LlamaForCausalLM", "hf-llama:405b", "dgx-h100:2048", 2048, 8192, 2.0, "3.8"),
    Case("Llama-3-405B, autopar Llama", "llama3-405b", "dgx-h100:2048", 2048, 8192, 2.0, "-"),
    # the larger space of the modern-parallelism issue: expert and context parallelism searched
    Case("Mixtral-8x22B, autopar MoELlama (ep searched)", "mixtral-8x22b", "dgx-h100:64", 1024, 4096, 2.0, "-"),
    Case("Llama-3.1-8B at 128K tokens (cp searched)", "llama3.1-8b", "dgx-h100:8", 32, 131072, 2.0, "-"),
    # two kinds of blocks: Gemma 3's five sliding-window layers to one global, at 32K tokens
    Case(
        "Gemma-3-27B at 32K tokens, transformers Gemma3ForCausalLM",
        "hf-gemma3:27b",
        "dgx-h100:16",
        1024,
        32768,
        2.0,
        "335",
    ),
)

WORKER = r"""
import json, sys, time
case = json.loads(sys.argv[1])
import torch
start = time.perf_counter()
import torch._dynamo  # noqa: F401 - the first op on meta or fake tensors imports it: paid apart
compiler_s = time.perf_counter() - start
import autopar

def build(spec):
    if spec.startswith("hf-gpt2:"):
        from transformers import GPT2Config, GPT2LMHeadModel
        hidden, layers, heads = (int(x) for x in spec.split(":")[1:])
        config = GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, n_positions=2048, vocab_size=51200)
        with torch.device("meta"):
            return GPT2LMHeadModel(config)
    if spec == "hf-llama:405b":
        from transformers import LlamaConfig, LlamaForCausalLM
        config = LlamaConfig(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
            num_attention_heads=128, num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192)
        with torch.device("meta"):
            return LlamaForCausalLM(config)
    if spec == "hf-gemma3:27b":
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig
        config = Gemma3TextConfig(hidden_size=5376, intermediate_size=21504, num_hidden_layers=62,
            num_attention_heads=32, num_key_value_heads=16, head_dim=128, vocab_size=262208,
            max_position_embeddings=131072, query_pre_attn_scalar=168, sliding_window=1024,
            rope_scaling={"factor": 8.0, "rope_type": "linear"}, sliding_window_pattern=6)
        with torch.device("meta"):
            return Gemma3ForCausalLM(config)
    from autopar.models import build_named_model
    return build_named_model(spec)

if case["cli"]:
    import contextlib, io
    from autopar.cli import main
    argv = ["plan", "--model", case["model"], "--cluster", case["cluster"],
            "--global-batch-size", str(case["global_batch_size"])]
    out = io.StringIO()
    w0, c0 = time.perf_counter(), time.process_time()
    with contextlib.redirect_stdout(out):
        rc = main(argv)
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    assert rc == 0, out.getvalue()
    plan_line = next((l.strip() for l in out.getvalue().splitlines() if "dp=" in l), "")
    evaluated = None
else:
    model = build(case["model"])
    cluster = autopar.parse_cluster(case["cluster"])
    w0, c0 = time.perf_counter(), time.process_time()
    plan = autopar.plan(model, cluster, global_batch_size=case["global_batch_size"], seq_len=case["seq_len"])
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    plan_line, evaluated = plan.config.short(), plan.candidates_evaluated
print(json.dumps({"wall_s": wall, "cpu_s": cpu, "plan": plan_line, "evaluated": evaluated, "compiler_s": compiler_s}))
"""


def run_once(case: Case) -> dict:
    """One fresh process: the timed call's wall and CPU seconds, the process's whole wall."""
    payload = json.dumps(case.__dict__)
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", WORKER, payload],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=Path(__file__).resolve().parent.parent,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    process_s = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{case.name}: worker failed:\n{done.stderr[-2000:]}")
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "process_s": process_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", default=None, help="run only the cases whose name contains this")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: give at least 1")
    if args.only and not any(args.only in case.name for case in CASES):
        parser.error(f"--only {args.only!r} matches no case; the cases are: {', '.join(c.name for c in CASES)}")
    rows = []
    for case in CASES:
        if args.only and args.only not in case.name:
            continue
        load = os.getloadavg()[0]
        runs = [run_once(case) for _ in range(args.repeats)]
        wall = statistics.median(r["wall_s"] for r in runs)
        rows.append(
            {
                "case": case.name,
                "cluster": case.cluster,
                "batch": f"{case.global_batch_size} x {case.seq_len}",
                "before s": case.before_s,
                "now s (median)": f"{wall:.2f}",
                "runs s": " / ".join(f"{r['wall_s']:.2f}" for r in runs),
                "CPU s (median)": f"{statistics.median(r['cpu_s'] for r in runs):.2f}",
                "whole process s": f"{statistics.median(r['process_s'] for r in runs):.1f}",
                "torch compiler import s": f"{statistics.median(r['compiler_s'] for r in runs):.1f}",
                "target s": f"{case.target_s:g}",
                "met": "yes" if wall <= case.target_s else "NO",
                "load avg": f"{load:.2f}",
                "configurations solved": runs[0]["evaluated"] if runs[0]["evaluated"] is not None else "-",
                "plan": runs[0]["plan"],
            }
        )
        print(rows[-1], flush=True)
    csv_path = write_csv("planner_speed", rows)
    body = markdown_table(rows) + (
        f"\n\nRows also in `{csv_path.name}`. Each run is a fresh process; the timed call is "
        "`autopar.plan` (or the CLI's `main`) with the model already built on the meta device, "
        "so extraction, search and the Plan are all in it. *Whole process* adds the interpreter, "
        "`import torch`, PyTorch's one-off import of its compiler stack (its own column; the first "
        "operation on meta or fake tensors in a process pays it) and building the model. *Before* is the planner-core issue's measurement "
        "of the same case before the restructure (Gemma 3: the CLI's wall time before its two kinds of blocks were "
        "priced by count, 2026-12-05). *Load avg* is the one-minute load when the "
        "case started (2 cores)."
    )
    print(write_result("planner_speed", "Planner speed", body))


if __name__ == "__main__":
    main()
