"""``autopar demo``: the whole loop on this machine in about a minute.

1. profile this machine: its matmul curves and memory bandwidth, a small GPT's layers
   (at another shape than the one trained below, so the prediction is not circular),
   and the network between local processes;
2. plan that GPT for the local processes with the measurements;
3. run the plan for a few steps on those processes and print predicted against measured;
4. plan GPT-3 175B on 128 DGX A100 nodes and print the plan with its explanation.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from autopar.errors import ConfigError
from autopar.hardware import Cluster, preset
from autopar.hardware.device import alone
from autopar.models import GPT, GPTConfig, build_named_model
from autopar.plan import Plan
from autopar.present.explain import explain
from autopar.profiles.to_cluster import cluster_from_profiles
from autopar.runtime.local import LocalRun, run_locally, token_batches
from autopar.runtime.mesh import MeshDims
from autopar.runtime.spmd import SPMDSettings, run_spmd
from autopar.search.planner import plan as make_plan

DEMO_GPT = GPTConfig(vocab_size=2048, seq_len=128, dim=256, n_layers=4, n_heads=8)
PROFILE_SHAPE = (2, 256)  # (batch, sequence) the layers are profiled at
GLOBAL_BATCH = 16
WARMUP_STEPS = 2  # untimed: the first steps allocate optimizer state and communication buckets


@dataclass(frozen=True, kw_only=True)
class DemoResult:
    """What the demo found."""

    local_plan: Plan
    measured: LocalRun
    large_plan: Plan

    @property
    def step_ratio(self) -> float:
        """Predicted over measured step time of the local plan."""
        return self.local_plan.prediction.step_time_s / self.measured.median_step_s


def build_demo_gpt() -> GPT:
    """The small GPT the demo plans and trains."""
    return GPT(DEMO_GPT)


def _network_rank(rank: int, world: int) -> dict[str, Any]:
    import profiler
    from profiler.network import NetworkSweep

    return profiler.profile_network(
        sweep=NetworkSweep(max_bytes=16 * 2**20, repeats=3), command="autopar demo"
    ).to_dict()


def profile_machine(nproc: int, say: Callable[[str], None]) -> list[Any]:
    """Device, layer and network reports of this machine."""
    import profiler

    say("  device: matmul FLOP/s across sizes, memory bandwidth ...")
    device = profiler.profile_device(command="autopar demo")
    say(f"  layers: {DEMO_GPT.n_layers}-layer GPT at batch {PROFILE_SHAPE[0]} x {PROFILE_SHAPE[1]} tokens ...")
    model = GPT(
        GPTConfig(
            vocab_size=DEMO_GPT.vocab_size,
            seq_len=PROFILE_SHAPE[1],
            dim=DEMO_GPT.dim,
            n_layers=DEMO_GPT.n_layers,
            n_heads=DEMO_GPT.n_heads,
        )
    )
    layers = profiler.profile_model(model, torch.randint(0, DEMO_GPT.vocab_size, PROFILE_SHAPE), command="autopar demo")
    say(f"  network: collectives between {nproc} local processes ...")
    network = run_spmd(_network_rank, nproc, settings=SPMDSettings(timeout_s=300))[0]
    return [device, layers, network]


def run_demo(*, nproc: int = 2, steps: int = 6, say: Callable[[str], None] = print) -> DemoResult:
    """Run the four steps (see the module docstring), printing as it goes. The arguments
    are checked first, before a minute of profiling."""
    started = time.perf_counter()
    base = _checked_local_cluster(nproc, steps)
    say(f"1/4 Profiling this machine ({nproc} processes)")
    reports = profile_machine(nproc, say)
    cluster = cluster_from_profiles(reports, base=base)
    d, link = cluster.device, cluster.intra_node
    say(
        f"  measured: memory {d.roofline.memory_bandwidth_bytes_per_s / 1e9:.1f} GB/s per process with {nproc} "
        f"streaming, {alone(d).roofline.memory_bandwidth_bytes_per_s / 1e9:.1f} alone (preset "
        f"{base.device.roofline.memory_bandwidth_bytes_per_s / 1e9:.0f}); link busbw {link.bandwidth_bytes_per_s / 1e9:.2f} GB/s, "
        f"latency {link.latency_s * 1e6:.0f} us (preset {base.intra_node.bandwidth_bytes_per_s / 1e9:.2f} GB/s, "
        f"{base.intra_node.latency_s * 1e6:.0f} us)"
    )

    say(
        f"\n2/4 Planning a {DEMO_GPT.n_layers}-layer GPT (dim {DEMO_GPT.dim}, {DEMO_GPT.seq_len} tokens) for "
        f"{nproc} local processes, global batch {GLOBAL_BATCH}"
    )
    local = make_plan(build_demo_gpt(), base, global_batch_size=GLOBAL_BATCH, seq_len=DEMO_GPT.seq_len, profile=reports)
    say("  " + explain(local).replace("\n", "\n  ").split("\n  Stages")[0])

    say(f"\n3/4 Running the plan for {steps} steps on {nproc} processes")
    measured = run_locally(
        build_demo_gpt,
        local,
        token_batches(DEMO_GPT.vocab_size, DEMO_GPT.seq_len),
        steps=steps,
        warmup=WARMUP_STEPS,
        measure_memory=True,
    )
    p = local.prediction
    worst_rank = max(range(len(measured.peak_memory_bytes)), key=lambda r: measured.peak_memory_bytes[r])
    pipeline_rank = MeshDims.of(local).coordinate(worst_rank)[0]  # the mesh puts pp outermost
    predicted_mem = max(s.memory.total_bytes for s in p.stages if s.pipeline_rank == pipeline_rank)
    say(f"  {'':<22}{'predicted':>12}{'measured':>12}{'pred/meas':>11}")
    say(
        f"  {'step time (s)':<22}{p.step_time_s:>12.3f}{measured.median_step_s:>12.3f}"
        f"{p.step_time_s / measured.median_step_s:>11.2f}"
    )
    peak = measured.peak_memory_bytes[worst_rank]
    say(f"  {'peak memory (MiB)':<22}{predicted_mem / 2**20:>12.1f}{peak / 2**20:>12.1f}{predicted_mem / peak:>11.2f}")
    say(f"  loss: {measured.losses[0]:.3f} -> {measured.losses[-1]:.3f} over {len(measured.losses)} steps")

    say("\n4/4 Planning GPT-3 175B on 128 DGX A100 nodes (1024 GPUs), global batch 1536 x 2048 tokens")
    large = make_plan(
        build_named_model("gpt3-175b"), preset("dgx-a100-80gb", nodes=128), global_batch_size=1536, seq_len=2048
    )
    say(explain(large))
    say(f"\ndemo finished in {time.perf_counter() - started:.0f} s")
    return DemoResult(local_plan=local, measured=measured, large_plan=large)


def _checked_local_cluster(nproc: int, steps: int) -> Cluster:
    """The local-cpu cluster of ``nproc`` processes, once ``nproc`` and ``steps`` are known
    to work: two processes at least (the network is measured between them; the preset
    refuses more than this machine's memory holds), and steps beyond the warm-up ones."""
    if nproc < 2:
        raise ConfigError(
            f"--nproc {nproc} is not allowed: the demo measures the network between at least 2 processes."
        )
    if steps <= WARMUP_STEPS:
        raise ConfigError(
            f"--steps {steps} is not allowed: the first {WARMUP_STEPS} steps warm up and are not timed; give at least "
            f"{WARMUP_STEPS + 1}."
        )
    return preset("local-cpu", devices_per_node=nproc)


def add_demo_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``autopar demo``."""
    p = subparsers.add_parser("demo", help="profile this machine, plan, run locally, compare; then plan GPT-3 175B")
    p.add_argument("--nproc", type=int, default=2, help="local processes to plan and run on (default 2)")
    p.add_argument("--steps", type=int, default=6, help="training steps to measure (default 6)")
    p.set_defaults(func=lambda args: (run_demo(nproc=args.nproc, steps=args.steps), 0)[1])
    return p
