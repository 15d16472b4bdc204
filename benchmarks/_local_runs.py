"""Profiling this machine and running plans on its local processes: what
``predicted_vs_measured.py`` and ``measured.py`` share.

Profiles are taken in rounds (the device sweep once; per round the layers by one process
and the network by each process count) and combined, the layers by their median and
each network point over every round's repeats, so a burst of load from other jobs does
not decide them; plans run in interleaved rounds for the same reason. Nothing here
writes results: each benchmark reports in its own way.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import _foreign_cpu
import torch
import torch.distributed as dist

import autopar
from autopar.profiles.report import ProfileReport
from autopar.profiles.sections import Timing
from autopar.runtime.local import BatchFn, LocalRun, cross_entropy, run_locally
from autopar.runtime.mesh import MeshDims
from autopar.runtime.spmd import SPMDSettings, run_spmd
from autopar.vocab import TPStyle
from profiler.device import profile_device
from profiler.fit import bus_factor
from profiler.layers import profile_model
from profiler.network import NetworkSweep, fit_levels, profile_network

SETTINGS = SPMDSettings(timeout_s=600, pg_timeout_s=120)


# ---- profiling ----


@dataclass(frozen=True, kw_only=True)
class ProfileTarget:
    """A model to profile: how to build it and one sample batch at the profiled shape."""

    build: Callable[[], torch.nn.Module]
    sample: Callable[[], Any]


def _profile_rank(
    rank: int, world: int, targets: Mapping[str, ProfileTarget], max_bytes: int, command: str
) -> dict[str, Any]:
    out: dict[str, Any] = {"layers": {}, "network": None}
    for name, target in targets.items() if world == 1 else ():
        torch.manual_seed(0)
        model = target.build().train()
        sample = target.sample()
        dist.barrier()
        out["layers"][name] = profile_model(model, sample, name=name, command=command).to_dict()
        del model
    if world > 1:
        dist.barrier()
        sweep = NetworkSweep(max_bytes=max_bytes, repeats=3)
        report = profile_network(sweep=sweep, command=command).to_dict()
        out["network"] = report if rank == 0 else None
    return out


def profile_world(
    world: int, targets: Mapping[str, ProfileTarget], *, max_bytes: int = 16 * 2**20, command: str
) -> dict[str, Any]:
    """One sweep: by one process, its layer reports (``{name: report}``); by ``world > 1``
    processes at once, their network report."""
    ranks = run_spmd(_profile_rank, world, targets, max_bytes, command, settings=SETTINGS)
    return {"layers": ranks[0]["layers"], "network": ranks[0]["network"]}


def layers_s(report: Mapping[str, Any]) -> float:
    """A layer report's forward + backward time of the whole model (every instance)."""
    return sum((u["fwd"]["median_s"] + u["bwd"]["median_s"]) * len(u["instances"]) for u in report["layers"]["units"])


def _network_s(report: Mapping[str, Any]) -> float:
    """The joint intra-node fit's time for a 1 MiB message: one number to rank sweeps by."""
    fit = next(f for f in report["network"]["fits"] if f["level"] == "intra" and len(f["ops"]) > 1)
    return fit["alpha_s"] + 2**20 / fit["bandwidth_bytes_per_s"]


def _median_by(items: Sequence[Any], key: Callable[[Any], float]) -> Any:
    return sorted(items, key=key)[(len(items) - 1) // 2]


GROUP_FIELDS = (
    "tp_overhead_s",
    "fsdp_overhead_s",
    "fsdp_tensor_overhead_s",
    "fsdp_copy_bytes_per_s",
    "memory_share",
    "sync_noise_s_per_sqrt_s",
    "sync_speed_spread",
)
"""A network report's measurements on its real groups: each a few milliseconds left once
the transfers are taken out, or a spread of times, and noisy apart from the curves."""


def combine(device: Mapping[str, Any], sweeps: Mapping[int, Sequence[Mapping[str, Any]]]) -> dict[str, Any]:
    """The profile to plan with: the median one-process layer report over the sweeps (by
    :func:`layers_s`) and, per world size, the median network report (by its 1 MiB
    time) with its sweeps pooled over all of them (:func:`pool_sweeps`) and each of its
    group measurements (``GROUP_FIELDS``) the median over the sweeps, so a burst of
    load from other jobs does not decide them.

    Returns ``{"device": report, "layers": {name: report}, "layers_s_rounds": {name: [s
    per sweep]}, "worlds": {w: {"network": report, "network_s_rounds": [s per sweep],
    "group_rounds": {field: [value per sweep]}}}}``.
    """
    taken = sweeps[1]
    names = list(taken[0]["layers"])
    worlds = {w: _combine_networks([s["network"] for s in runs]) for w, runs in sweeps.items() if w > 1}
    return {
        "device": device,
        "layers": {n: _median_by([s["layers"][n] for s in taken], layers_s) for n in names},
        "layers_s_rounds": {n: [layers_s(s["layers"][n]) for s in taken] for n in names},
        "worlds": worlds,
    }


def _combine_networks(reports: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    chosen = pool_sweeps(_median_by(reports, _network_s), reports)
    rounds = {f: [float(r["network"].get(f, 0.0)) for r in reports] for f in GROUP_FIELDS}
    chosen["network"].update({f: statistics.median(values) for f, values in rounds.items()})
    return {"network": chosen, "network_s_rounds": [_network_s(r) for r in reports], "group_rounds": rounds}


def pool_sweeps(chosen: Mapping[str, Any], reports: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``chosen`` (a network report) with each point of its sweeps pooled over the same
    point of every report in ``reports`` (sweeps of the same groups and sizes): its
    time per call the mean over all their repeats, its median the median of their
    medians, its range theirs; the fits are refitted through the pooled points. One
    sweep's point rests on 3 repeats: the 512 KiB all-reduce that prices tensor
    parallelism on 2 ranks here was priced at 1.1 ms from one run's kept sweep and at
    2.4 from the next run's, enough to flip the layout the planner picks for tp=2."""
    base = ProfileReport.from_dict(chosen)
    nets = [ProfileReport.from_dict(r).network for r in reports]
    series = []
    for i, s in enumerate(base.network.series):
        points = []
        for j, p in enumerate(s.points):
            times = [n.series[i].points[j].time for n in nets]
            if any(n.series[i].op != s.op or n.series[i].points[j].nbytes != p.nbytes for n in nets):
                raise ValueError(f"sweeps of different shapes cannot be pooled (series {i}, point {j})")
            repeats = sum(t.repeats for t in times)
            low, high = min(t.min_s for t in times), max(t.max_s for t in times)
            mean = min(max(statistics.fmean([t.per_call_s for t in times], [t.repeats for t in times]), low), high)
            time_ = Timing(
                median_s=statistics.median(t.median_s for t in times),
                min_s=low,
                max_s=high,
                repeats=repeats,
                mean_s=mean,
            )
            algbw = p.nbytes / mean
            points.append(
                dataclasses.replace(
                    p, time=time_, algbw_bytes_per_s=algbw, busbw_bytes_per_s=algbw * bus_factor(s.op, len(s.ranks))
                )
            )
        series.append(dataclasses.replace(s, points=tuple(points)))
    fits, unfitted = fit_levels(tuple(series))
    network = dataclasses.replace(base.network, series=tuple(series), fits=fits, unfitted=unfitted)
    return dataclasses.replace(base, network=network).to_dict()


def profile_round(
    sweeps: dict[int, list[dict[str, Any]]],
    targets: Mapping[str, ProfileTarget],
    *,
    label: str,
    command: str,
    log: Callable[[str], None] = print,
) -> None:
    """One sweep for every world size of ``sweeps`` (:func:`profile_world`), appended to it."""
    for w in sweeps:
        start = time.perf_counter()
        sweeps[w].append(profile_world(w, targets, command=command))
        log(f"profile {label}, {w} process(es): {time.perf_counter() - start:.0f} s")


def profile_machine(
    worlds: Sequence[int],
    targets: Mapping[str, ProfileTarget],
    *,
    rounds: int = 3,
    command: str,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Profiles of this machine: the device sweep once, in this process (its matmul
    curves carry the shape dependence), then ``rounds`` interleaved sweeps of the layers
    by one process and of the network by each ``w > 1`` of ``worlds``
    (:func:`profile_round`), :func:`combine`-d."""
    device = profile_device(command=command).to_dict()
    sweeps: dict[int, list[dict[str, Any]]] = {w: [] for w in sorted({1, *worlds})}
    for rnd in range(rounds):
        profile_round(sweeps, targets, label=f"round {rnd + 1}", command=command, log=log)
    return combine(device, sweeps)


def plan_key(plan: autopar.Plan) -> str:
    """What the runtime does with a plan: equal keys, equal runs."""
    return json.dumps(
        [
            plan.config.short(),
            sorted((k, v.value) for k, v in plan.layer_strategies.tp.items()),
            sorted((k, v.value) for k, v in plan.layer_strategies.recompute.items()),
            [list(s) for s in plan.stages],
        ]
    )


def reports(profile: Mapping[str, Any], world: int, model: str) -> list[Mapping[str, Any]]:
    """The reports ``autopar.estimate`` / ``autopar.plan`` take for ``model`` on ``world``
    processes: the device, the model's layers, the network of ``world`` processes."""
    network = profile["worlds"][world]["network"] if world > 1 else None
    return [r for r in (profile["device"], profile["layers"][model], network) if r is not None]


# ---- measuring ----


@dataclass(frozen=True, kw_only=True)
class Run:
    """A plan to run and what it is trained on."""

    label: str
    build: Callable[[], torch.nn.Module]
    plan: autopar.Plan
    batch_fn: BatchFn
    loss_fn: Callable = cross_entropy
    sample_input: Any = None
    """One micro-batch of inputs for ``parallelize`` (models without token ids)."""


@dataclass(kw_only=True)
class Measured:
    """What the rounds measured for one run: each round's median step, the per-rank
    peaks of the metered run, or the error that stopped it."""

    round_medians_s: list[float] = field(default_factory=list)
    peak_bytes: tuple[int, ...] = ()
    error: str = ""

    @property
    def median_s(self) -> float:
        return statistics.median(self.round_medians_s) if self.round_medians_s else float("nan")


@dataclass(frozen=True, kw_only=True)
class Interleaved:
    """Every run's rounds, and what other processes took of the CPU in each round."""

    by_label: dict[str, Measured]
    foreign: list[_foreign_cpu.ForeignCpu | None]


def measure_interleaved(
    runs: Sequence[Run],
    *,
    rounds: int,
    steps: int,
    warmup: int = 2,
    memory: bool = True,
    before_round: Callable[[int], None] | None = None,
    log: Callable[[str], None] = print,
) -> Interleaved:
    """Run every plan once per round, in forward order on even rounds and reversed on odd
    ones; peak memory (``memory``) in the first round; ``before_round(r)`` first in
    each round (inside the window whose foreign CPU is recorded). A run that fails is
    recorded, not retried."""
    out = {r.label: Measured() for r in runs}
    foreign: list[_foreign_cpu.ForeignCpu | None] = []
    for rnd in range(rounds):
        window = _foreign_cpu.sample()
        if before_round is not None:
            before_round(rnd)
        order = runs if rnd % 2 == 0 else list(reversed(runs))
        for run in order:
            m = out[run.label]
            if m.error:
                continue
            start = time.perf_counter()
            try:
                res: LocalRun = run_locally(
                    run.build,
                    run.plan,
                    run.batch_fn,
                    loss_fn=run.loss_fn,
                    steps=steps,
                    warmup=warmup,
                    measure_memory=memory and rnd == 0,
                    settings=SETTINGS,
                    sample_input=run.sample_input,
                )
            except Exception as exc:  # one broken plan must not hide the others' numbers
                m.error = _first_cause(exc)
                log(f"round {rnd + 1} {run.label}: FAILED {m.error}")
                continue
            m.round_medians_s.append(res.median_step_s)
            if res.peak_memory_bytes:
                m.peak_bytes = res.peak_memory_bytes
            log(f"round {rnd + 1} {run.label}: {res.median_step_s:.3f} s [{time.perf_counter() - start:.0f} s wall]")
        foreign.append(_foreign_cpu.between(window, _foreign_cpu.sample()))
        log(f"round {rnd + 1}: other processes took {_foreign_cpu.describe(foreign[-1:])}")
    return Interleaved(by_label=out, foreign=foreign)


def _first_cause(exc: Exception) -> str:
    """The first rank's error line of an SPMD failure (else the exception's first line)."""
    lines = str(exc).splitlines()
    cause = next((line for line in lines[1:] if line.startswith("rank ")), lines[0] if lines else "")
    return f"{type(exc).__name__}: {cause[:300]}"


def predicted_peaks(plan: autopar.Plan) -> tuple[float, ...]:
    """The predicted peak bytes of each global rank: its pipeline rank's stages."""
    dims = MeshDims.of(plan)
    by_pp: dict[int, float] = {}
    for s in plan.prediction.stages:
        by_pp[s.pipeline_rank] = max(by_pp.get(s.pipeline_rank, 0.0), s.memory.total_bytes)
    return tuple(by_pp[dims.coordinate(r)[0]] for r in range(plan.config.world_size))


def describe(plan: autopar.Plan) -> str:
    """The configuration, with the per-unit recompute where it differs from the config's
    and the stage split when pipelined."""
    text = plan.config.short()
    modes = sorted({m.value for m in plan.layer_strategies.recompute.values()})
    if modes:
        text += f"; {len(plan.layer_strategies.recompute)} units recompute={'/'.join(modes)}"
    if plan.config.pp > 1:
        text += "; stages of " + "+".join(str(len(s)) for s in plan.stages) + " modules"
    if plan.config.tp > 1:
        text += "; sharded " + ", ".join(_sharded_leaves(plan))
    return text


def _sharded_leaves(plan: autopar.Plan) -> list[str]:
    """``leaf=style (blocks)`` for each sharded leaf of the blocks, then the others: the
    layout the per-layer search chose, which noisy profiles can change between runs."""
    blocks: dict[str, list[str]] = {}
    for fqn, style in plan.layer_strategies.tp.items():
        if style is TPStyle.REPLICATE:
            continue
        parts = fqn.split(".")
        key, block = (".".join(parts[2:]), parts[1]) if len(parts) > 2 and parts[1].isdigit() else (fqn, "")
        blocks.setdefault(f"{key}={style.value}", []).append(block)
    return [f"{leaf} ({' '.join(ids)})" if any(ids) else leaf for leaf, ids in sorted(blocks.items())]


def fmt_rounds(values: Sequence[float]) -> str:
    return " / ".join(f"{v:.3f}" for v in values)


def profile_lines(profile: Mapping[str, Any]) -> list[str]:
    """Markdown bullets: the layer totals of every profile round (their spread is the
    machine's noise while profiling), then per world size the kept network fit."""
    lines = [
        "- layers, one process: "
        + "; ".join(
            f"{name} fwd+bwd per round {' / '.join(f'{s * 1e3:.0f}' for s in rounds)} ms"
            for name, rounds in profile["layers_s_rounds"].items()
        )
    ]
    for w, per in sorted(profile["worlds"].items(), key=lambda kv: int(kv[0])):
        net = per["network"]["network"]
        fit = next(f for f in net["fits"] if f["level"] == "intra" and len(f["ops"]) > 1)
        lines.append(
            f"- network, {w} processes: alpha {fit['alpha_s'] * 1e6:.0f} us, busbw "
            f"{fit['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s (1 MiB all-reduce-fit time per round: "
            f"{' / '.join(f'{s * 1e3:.1f}' for s in per['network_s_rounds'])} ms); framework time "
            f"{net.get('tp_overhead_s', 0.0) * 1e6:.0f} us per tensor-parallel layer forward, "
            f"{net.get('fsdp_overhead_s', 0.0) * 1e6:.0f} us per FSDP collective and "
            f"{net.get('fsdp_tensor_overhead_s', 0.0) * 1e6:.0f} us per parameter tensor in it; memory "
            f"bandwidth kept with all {w} streaming {net.get('memory_share', 1.0):.2f}; ranks apart by "
            f"{net.get('sync_noise_s_per_sqrt_s', 0.0) * 1e3:.1f} ms per sqrt(s) of work and "
            f"{net.get('sync_speed_spread', 0.0):.1%} of it"
        )
    return lines
