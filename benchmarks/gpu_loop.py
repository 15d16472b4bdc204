"""The closed loop on one GPU: profile it, run single-GPU plans of a transformers model,
and write predicted against measured step time and peak memory.

One prepared script for the sessions that are lent a GPU (the device machine runs it
with ``--out $OUT``; nothing here needs the network):

1. ``profiler.profile_device`` measures the device's matmul curves, fused attention and bandwidth; the
   report is saved as ``gpu_profile.json``, and the cluster made from it with the
   matching datasheet preset as base (``--base``, guessed from the device's name) is
   saved as ``gpu_cluster.json``: a usable cluster file (``autopar plan --cluster``).
2. A transformers Llama built from a config with random weights (about 1B parameters;
   ``--tiny`` for a few thousand) is planned for one device under each variant: eager
   bf16, compiled blocks, and compiled blocks with FP8 matmuls where the device has FP8
   tensor cores (``autopar.estimate`` with the variant fixed, the rest searched).
3. Each plan runs in this process through ``autopar.parallelize`` (a process group of
   one): ``--steps`` timed steps after ``--warmup``, step time from CUDA events'
   synchronised wall clock, peak memory from ``torch.cuda.max_memory_allocated`` over
   the timed steps.

Output: ``gpu_loop.md`` and ``gpu_loop.csv`` in ``--out`` (the dated copies under
``benchmarks/results`` when ``--out`` is not given). On a machine without CUDA,
``--device cpu --tiny`` runs the same path eager on a tiny model, without memory
(what ``tests/benchmarks/test_gpu_loop.py`` checks), so the script is known to work
before a GPU is lent.

    python benchmarks/gpu_loop.py --out DIR [--steps 10] [--warmup 3] [--base hgx-h200]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from _report import command, environment, markdown_table, write_csv, write_result

import autopar
from autopar.hardware.cluster import save_cluster
from autopar.runtime.local import cross_entropy, token_batches

SIZES = {
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4},
    "1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 16},
}
"""Llama shapes: ``1b`` is Llama-3.2-1B's width and depth with a 32K vocabulary."""


def _model(size: str, seq_len: int, device: torch.device | str) -> torch.nn.Module:
    cfg = transformers.LlamaConfig(
        **SIZES[size],
        num_key_value_heads=SIZES[size]["num_attention_heads"] // 4,
        vocab_size=32000 if size != "tiny" else 256,
        max_position_embeddings=seq_len,
    )
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.LlamaForCausalLM(cfg)


def _base(name: str) -> str:
    """The datasheet preset for a CUDA device's name."""
    for key, preset in (("H200", "hgx-h200"), ("H100", "dgx-h100"), ("A100", "dgx-a100-80gb")):
        if key in name:
            return preset
    raise SystemExit(f"no preset for the device {name!r}: pass --base (one of autopar's preset names)")


def _cluster(device: torch.device, out: Path, base: str | None, tiny: bool) -> autopar.Cluster:
    """Profile the device (a few points only for ``tiny``) and make the one-device
    cluster to plan with."""
    from profiler.device import DeviceSweep, profile_device

    sweep = DeviceSweep(matmul_sizes=(64, 256), dtypes=("fp32",), array_bytes=(1 << 20,)) if tiny else None
    report = profile_device(device=device, sweep=sweep, command="benchmarks/gpu_loop.py")
    report.save(out / "gpu_profile.json")
    if device.type != "cuda":
        return autopar.cluster_from_profiles([report], base=autopar.preset("local-cpu", nodes=1, devices_per_node=1))
    name = base or _base(torch.cuda.get_device_name(device))
    cluster = autopar.cluster_from_profiles([report], base=autopar.preset(name, nodes=1, devices_per_node=1))
    save_cluster(cluster, out / "gpu_cluster.json")
    return cluster


def _variants(cluster: autopar.Cluster, device: torch.device) -> list[tuple[str, dict]]:
    """Eager, compiled, and compiled FP8 where the device runs FP8 (CPU: eager only;
    compiling on CPU runs under the memory meter's dispatch mode uncompiled)."""
    if device.type != "cuda":
        return [("eager", {"compile": False})]
    found = [("eager", {"dtype": "bf16", "compile": False}), ("compiled", {"dtype": "bf16", "compile": True})]
    if cluster.device.roofline.fp8_flops:
        found.append(("compiled fp8", {"dtype": "bf16", "compile": True, "fp8": True}))
    return found


def _measure(
    plan: autopar.Plan, size: str, device: torch.device, steps: int, warmup: int
) -> tuple[list[float], float | None]:
    """Step times (s) of ``steps`` steps after ``warmup``, and the peak bytes over them."""
    job = autopar.parallelize(_model(size, plan.model.seq_len, "meta"), plan, loss_fn=cross_entropy, device=device)
    opt = job.optimizer(torch.optim.AdamW, lr=1e-4)
    batches = token_batches(256 if size == "tiny" else 32000, plan.model.seq_len)
    times = []
    for i in range(warmup + steps):
        if i == warmup and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        job.step(batches(plan.config.global_batch_size, i))
        opt.step()
        opt.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    peak = float(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None
    return times, peak


def run(args: argparse.Namespace) -> list[dict]:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    out = Path(args.out) if args.out else None
    work = out or Path("benchmarks/results")
    work.mkdir(parents=True, exist_ok=True)
    cluster = _cluster(device, work, args.base, args.tiny)
    size = "tiny" if args.tiny else "1b"
    seq, batch = (32, 2) if args.tiny else (args.seq_len, args.batch)
    # a group of one needs no rendezvous: an in-memory store, and no environment touched
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    rows = []
    try:
        for label, fixed in _variants(cluster, device):
            plan = autopar.estimate(
                _model(size, seq, "meta"), cluster, {"tp": 1, "pp": 1, **fixed}, global_batch_size=batch, seq_len=seq
            )
            times, peak = _measure(plan, size, device, args.steps, args.warmup)
            measured = statistics.median(times)
            predicted = plan.prediction.step_time_s
            rows.append(
                {
                    "variant": label,
                    "plan": plan.config.short(),
                    "predicted step (ms)": f"{1e3 * predicted:.1f}",
                    "measured step (ms)": f"{1e3 * measured:.1f}",
                    "error": f"{predicted / measured - 1:+.1%}",
                    "predicted memory (GiB)": f"{plan.prediction.memory_bytes_per_device / 2**30:.2f}",
                    "measured memory (GiB)": f"{peak / 2**30:.2f}" if peak is not None else "-",
                    "steps (ms)": " ".join(f"{1e3 * t:.1f}" for t in times),
                }
            )
            print(rows[-1], flush=True)
    finally:
        dist.destroy_process_group()
    _write(rows, out, device, cluster)
    return rows


def _write(rows: list[dict], out: Path | None, device: torch.device, cluster: autopar.Cluster) -> None:
    body = (
        f"Device: {cluster.device.name} ({device}); {cluster.device.source}\n\n"
        + markdown_table(rows)
        + "\n\nPredicted with the device's own profile (`gpu_profile.json`, as `gpu_cluster.json`); the "
        "memory predicted is the planner's peak including its stated reserve, the measured one the "
        "allocator's peak over the timed steps.\n"
    )
    if out is None:
        write_csv("gpu_loop", rows)
        write_result("gpu_loop", "Predicted against measured on one GPU", body)
        return
    header = f"# Predicted against measured on one GPU ({datetime.date.today()})\n\nCommand: `{command()}`  \n"
    (out / "gpu_loop.md").write_text(header + f"Environment: {environment()}\n\n" + body)
    (out / "gpu_loop.csv").write_text(
        ",".join(rows[0]) + "\n" + "\n".join(",".join(f'"{v}"' for v in r.values()) for r in rows) + "\n"
    )


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for the results (default: benchmarks/results, dated)")
    parser.add_argument("--device", default=None, help="cuda (default where there is one) or cpu")
    parser.add_argument("--base", default=None, help="the datasheet preset (default: from the device's name)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model (checks the script, measures nothing)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
