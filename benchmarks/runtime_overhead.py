"""Runtime overhead: autopar's DP-only, TP-only and PP-only runs against the same
configuration written by hand in plain PyTorch, and predicted vs measured peak memory.

Each configuration trains a GPT (dim 256, 4 layers, 8 heads, seq 128, vocab 2048) with
SGD (momentum 0.9: the planner's ``sgd``, one buffer per parameter, so the predicted
memory counts the state that runs) on local gloo processes forked by autopar's harness.
The hand-written baselines use PyTorch directly: ``DistributedDataParallel`` with
``no_sync`` over the micro-batches; ``parallelize_module`` with Megatron-LM's plan and ``loss_parallel``; a
``PipelineStage`` per rank with the same ``Schedule1F1B``. Runs are interleaved
(autopar, hand-written, autopar, ...) and the step time of a run is the median of its
timed steps after warm-up; the table gives the median over repeats. Memory: the
peak tensor bytes autopar's meter records (:mod:`autopar.runtime.metrics`) on the most
loaded rank, against the plan's ``memory_bytes_per_device`` with and without its fixed
reserve for context and fragmentation.

    python benchmarks/runtime_overhead.py [--repeats 3] [--steps 6]

Numbers on a shared 2-core machine vary by tens of percent run to run; read the ratio,
not the absolute times.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel

import autopar
from autopar.models import GPT, GPTConfig
from autopar.runtime.api import parallelize
from autopar.runtime.spmd import SPMDSettings, run_spmd

CFG = GPTConfig(vocab_size=2048, seq_len=128, dim=256, n_layers=4, n_heads=8)
MBS = 4
LR = 0.01
MOMENTUM = 0.9
CONFIGS = {
    "DP (dp=2, DDP)": dict(dp=2, tp=1, pp=1, num_microbatches=2),
    "TP (tp=2, Megatron)": dict(dp=1, tp=2, pp=1, num_microbatches=2),
    "PP (pp=2, 1F1B)": dict(dp=1, tp=1, pp=2, num_microbatches=4),
}


def build() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.flatten(0, 1).float(), target.flatten())


def megatron_styles() -> dict[str, autopar.TPStyle]:
    styles = {"tok_embeddings": "vocab", "output": "column"}
    for i in range(CFG.n_layers):
        styles.update({f"layers.{i}.attention.{p}": "column" for p in ("wq", "wk", "wv")})
        styles.update(
            {
                f"layers.{i}.attention.wo": "row",
                f"layers.{i}.feed_forward.w1": "column",
                f"layers.{i}.feed_forward.w2": "row",
            }
        )
    return {k: autopar.TPStyle(v) for k, v in styles.items()}


def make_plan(config: dict) -> autopar.Plan:
    import dataclasses

    world = config["dp"] * config["tp"] * config["pp"]
    full = {"micro_batch_size": MBS, "dtype": "fp32", **config}
    plan = autopar.estimate(
        build(),
        autopar.preset("local-cpu", devices_per_node=world),
        full,
        global_batch_size=config["dp"] * MBS * config["num_microbatches"],
        seq_len=CFG.seq_len,
        optimizer="sgd",
    )
    if config["tp"] > 1:
        plan = dataclasses.replace(
            plan, layer_strategies=dataclasses.replace(plan.layer_strategies, tp=megatron_styles())
        )
    return plan


def batches(n: int, size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randint(0, CFG.vocab_size, (size, CFG.seq_len), generator=g),
            torch.randint(0, CFG.vocab_size, (size, CFG.seq_len), generator=g),
        )
        for _ in range(n)
    ]


def _timed(step, data, warmup: int) -> float:
    times = []
    for i, batch in enumerate(data):
        dist.barrier()
        start = time.perf_counter()
        step(batch)
        dist.barrier()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def autopar_run(rank: int, world: int, plan: autopar.Plan, steps: int, memory: bool) -> tuple[float, int]:
    job = parallelize(build(), plan, loss_fn=loss_fn, measure_memory=memory)
    opt = job.optimizer(torch.optim.SGD, lr=LR, momentum=MOMENTUM)

    def step(batch):
        job.step(batch)
        opt.step()
        opt.zero_grad()

    data = list(job.shard(batches(steps, plan.config.global_batch_size)))
    median = _timed(step, data, warmup=2)
    return median, max(m.peak_memory_bytes for m in job.metrics)


def manual_run(rank: int, world: int, plan: autopar.Plan, steps: int, memory: bool) -> tuple[float, int]:
    cfg = plan.config
    model = build()
    data = batches(steps, cfg.global_batch_size)
    if cfg.dp > 1:
        ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)
        opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=MOMENTUM)

        def step(batch):
            x, y = (t.chunk(cfg.dp)[rank] for t in batch)
            chunks = list(zip(x.chunk(cfg.num_microbatches), y.chunk(cfg.num_microbatches)))
            for i, (xs, ys) in enumerate(chunks):
                if i < len(chunks) - 1:
                    with ddp.no_sync():
                        (loss_fn(ddp(xs), ys) / len(chunks)).backward()
                else:
                    (loss_fn(ddp(xs), ys) / len(chunks)).backward()
            opt.step()
            opt.zero_grad()
    elif cfg.tp > 1:
        mesh = init_device_mesh("cpu", (cfg.tp,))
        block = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(),
        }
        for layer in model.layers.values():
            parallelize_module(layer, mesh, block)
        model.output.weight = torch.nn.Parameter(model.output.weight.detach().clone())  # untie: sharded alike below
        parallelize_module(
            model,
            mesh,
            {
                "tok_embeddings": RowwiseParallel(input_layouts=torch.distributed.tensor.Replicate()),
                "output": ColwiseParallel(use_local_output=False),
            },
        )
        model.tok_embeddings.weight = model.output.weight  # retie: both Shard(0) over the vocabulary
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)

        def step(batch):
            x, y = batch
            with loss_parallel():
                for xs, ys in zip(x.chunk(cfg.num_microbatches), y.chunk(cfg.num_microbatches)):
                    (loss_fn(model(xs), ys) / cfg.num_microbatches).backward()
            opt.step()
            opt.zero_grad()
    else:
        stage_units = plan.stages[rank]
        stage = copy.deepcopy(model)
        for name in list(stage.layers):
            if f"layers.{name}" not in stage_units:
                del stage.layers[name]
        for part in ("tok_embeddings", "pos_embeddings", "norm", "output"):
            if part not in stage_units:
                setattr(stage, part, None)
        pipe = Schedule1F1B(
            PipelineStage(stage, rank, cfg.pp, torch.device("cpu")), cfg.num_microbatches, loss_fn=loss_fn
        )
        opt = torch.optim.SGD(stage.parameters(), lr=LR, momentum=MOMENTUM)

        def step(batch):
            x, y = batch
            if rank == 0:
                pipe.step(x)
            else:
                pipe.step(target=y, losses=[])
            opt.step()
            opt.zero_grad()

    return _timed(step, data, warmup=2), -1


def environment() -> str:
    cores = len(__import__("os").sched_getaffinity(0))
    return (
        f"Python {platform.python_version()}, torch {torch.__version__}, {platform.machine()}, {cores} cores, "
        f"gloo on local processes"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    settings = SPMDSettings(timeout_s=600, pg_timeout_s=120)
    rows = [
        "| configuration | autopar step (s) | hand-written step (s) | autopar / hand | measured peak (MiB) | "
        "predicted peak (MiB) | predicted without reserve (MiB) |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, config in CONFIGS.items():
        plan = make_plan(config)
        world = plan.config.world_size
        ours, theirs = [], []
        for _ in range(args.repeats):
            ours.append(max(t for t, _ in run_spmd(autopar_run, world, plan, args.steps, False, settings=settings)))
            theirs.append(max(t for t, _ in run_spmd(manual_run, world, plan, args.steps, False, settings=settings)))
        peak = max(m for _, m in run_spmd(autopar_run, world, plan, 4, True, settings=settings))
        pred = plan.prediction
        reserve = max(s.memory.reserve_bytes for s in pred.stages)
        a, b = statistics.median(ours), statistics.median(theirs)
        rows.append(
            f"| {label} | {a:.3f} | {b:.3f} | {a / b:.2f} | {peak / 2**20:.1f} | "
            f"{pred.memory_bytes_per_device / 2**20:.1f} | {(pred.memory_bytes_per_device - reserve) / 2**20:.1f} |"
        )
        print(rows[-1], flush=True)
    today = datetime.date.today().isoformat()
    out = Path(__file__).parent / "results" / f"runtime_overhead_{today}.md"
    out.parent.mkdir(exist_ok=True)
    command = "python benchmarks/runtime_overhead.py " + " ".join(sys.argv[1:])
    body = "\n".join(rows)
    out.write_text(
        f"# Runtime overhead: autopar vs hand-written PyTorch\n\nDate: {today}  \nCommand: `{command.strip()}`  \n"
        f"Environment: {environment()}  \nModel: GPT dim {CFG.dim}, {CFG.n_layers} layers, {CFG.n_heads} heads, "
        f"seq {CFG.seq_len}, vocab {CFG.vocab_size}; micro-batch {MBS}; SGD with momentum {MOMENTUM}; fp32; {args.repeats} interleaved "
        f"repeats of {args.steps} steps (2 warm-up)\n\n{body}\n\n{NOTES}\n"
    )
    print(f"wrote {out}")


NOTES = """Step time: the slowest rank's median over timed steps (barrier to barrier, optimizer step
included), median over repeats. autopar runs every plan through `torch.distributed.pipelining`
(one stage when pp=1), uses DDP with `static_graph=True`, and records wall time per step;
memory metering is off in the timed runs and on in a separate run. Measured peak: the most
loaded rank's peak tensor bytes during a step (parameters, gradients, optimizer state,
activations and communication buffers that PyTorch allocates; not gloo's internal buffers).
The planner's prediction adds a fixed reserve for context and fragmentation; both columns are
shown."""


if __name__ == "__main__":
    main()
