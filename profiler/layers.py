"""Per-unit forward and backward time, FLOPs and memory of a real model.

The units are ``autopar.graph``'s (what a pipeline stage holds whole): what runs before
the first block, each block, what runs after the last block with the loss. Identical
blocks are measured once (:mod:`profiler.unit_runners`), so a 96-block model costs three
measurements, not 98. For each distinct unit the profiler records:

- forward and backward time (median and range over repeats after warm-up), and for a
  block the backward under full recomputation, timed in turn with the plain run (the
  rerun forward costs less than the recorded one where autograd's bookkeeping is a
  large part of the forward, as on a CPU: ``autopar.profiles.recompute_calibration``
  turns the difference into each unit's recompute fraction);
- forward and backward FLOPs, counted while running it (:mod:`profiler.census`);
- parameter bytes, activation bytes saved for backward, and peak memory;
- the unit's kernels as the analytic cost model sees them (from ``autopar.graph``), so
  that ``autopar.profiles.layer_calibration`` can compare the measured time with the
  roofline prediction at the same shape.

The profile also records the model's fingerprint and parameter shapes, so that the
planner applies it to this model only (:mod:`autopar.profiles.identity`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from autopar.graph import UNIT_INPUT, LayerGraph, UnitProfile, extract
from autopar.graph.extract import _default_loss, training_kwargs
from autopar.profiles.identity import parameter_shapes
from autopar.profiles.report import ProfileReport
from autopar.profiles.sections import ModelProfile, Timing, UnitMeasurement, WorkItem
from profiler.census import FlopLap, MemoryLap, math_attention
from profiler.device import device_name, threads_context
from profiler.errors import MeasurementError
from profiler.machine import provenance
from profiler.timing import Repeats, Stopwatch, synchronize, timer_name
from profiler.unit_runners import BlockRunner, EpilogueRunner, Phase, PrologueRunner, WholeRunner, capture, tensors

_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True, kw_only=True)
class LayerSweep:
    """How each distinct unit is measured.

    Attributes:
        repeats: warm-up and timed repeats per unit (``budget_s`` caps a unit's time).
        count_flops: run each unit once with the math attention kernel to count FLOPs.
        measure_memory: run each unit once to record saved and peak memory.

    The FLOP and memory runs come first and count as warm-up runs: a unit runs
    ``max(warmup, probes)`` times untimed, then ``repeats`` times timed.
    """

    repeats: Repeats = field(default_factory=lambda: Repeats(warmup=1, repeats=5, min_repeats=3, budget_s=10.0))
    count_flops: bool = True
    measure_memory: bool = True

    @property
    def untimed_probes(self) -> int:
        """Runs of each unit before timing that measure FLOPs or memory (and warm up)."""
        return int(self.count_flops) + int(self.measure_memory)

    @property
    def warmup_runs(self) -> int:
        """Untimed runs of each unit before its timed repeats."""
        return max(self.repeats.warmup, self.untimed_probes)


class _ClockLap:
    """A lap that times forward and backward."""

    def __init__(self, device: torch.device):
        self.watch = Stopwatch(device)
        self.seconds = {"fwd": 0.0, "bwd": 0.0}

    def begin(self, phase: Phase) -> None:
        self.watch.start()

    def end(self, phase: Phase) -> None:
        self.seconds[phase] = self.watch.stop()


@dataclass(frozen=True, kw_only=True)
class _Distinct:
    """One distinct unit: what runs it and where it sits in the graph."""

    index: int
    instances: tuple[str, ...]
    runner: Any


def profile_model(
    model: nn.Module,
    sample_input: Any,
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    sweep: LayerSweep | None = None,
    threads: int | None = 1,
    progress: Callable[[str], None] | None = None,
    name: str | None = None,
    command: str = "profiler.profile_model()",
) -> ProfileReport:
    """Measure every distinct unit of ``model`` on ``sample_input``.

    Args:
        model: a real module (not on the meta device), in training mode, on the device
            to measure; its parameter dtype is the measured precision. Its parameters'
            ``.grad`` are reset while measuring.
        sample_input: one batch: a tensor (token ids ``(batch, seq)``, features,
            images), a tuple of positional tensors or a dict of keyword tensors, with
            the batch in dimension 0, on the model's device.
        loss_fn: ``output -> scalar`` (default: ``autopar.graph``'s: cross-entropy for
            token models, a sum otherwise), run as part of the last unit.
        sweep: repeats and what else to measure.
        threads: CPU intra-op threads while measuring (default 1: a ``local-cpu`` device is
            one single-threaded process, and spare threads spin-wait on a busy core;
            None leaves torch's setting).
        progress: called with a line when each unit starts and when it is measured
            (a large model's head alone can take minutes on a CPU).
        name: the model's name in the report (default: its class name).
        command: recorded in the report's provenance.
    """
    sweep = sweep or LayerSweep()
    say = progress or (lambda _line: None)
    device, dtype = _device_and_dtype(model)
    inputs = _without_cache(model, _as_call(sample_input))
    with threads_context(threads):
        n_threads = torch.get_num_threads() if device.type == "cpu" else 1
        graph = extract(model, sample_input=sample_input, dtype=dtype, loss_fn=loss_fn)
        loss = loss_fn or _default_loss(graph.vocab_size)
        batch = _batch(inputs)
        distinct = _plan(model, graph, inputs, loss)
        units = []
        started = time.perf_counter()
        for k, unit in enumerate(distinct, 1):
            say(
                f"[{k}/{len(distinct)}] {graph.units[unit.index].fqn} (x{len(unit.instances)}): measuring "
                f"({sweep.warmup_runs} untimed + up to {sweep.repeats.repeats} timed runs)"
            )
            measured = _measure(model, graph, unit, device, batch, sweep)
            units.append(measured)
            say(
                f"[{k}/{len(distinct)}] {measured.fqn} (x{len(measured.instances)}): fwd "
                f"{measured.fwd.median_s * 1e3:.2f} ms, bwd {measured.bwd.median_s * 1e3:.2f} ms, "
                f"{measured.achieved_flop_per_s / 1e9:.1f} GFLOP/s ({time.perf_counter() - started:.1f} s)"
            )
    first = tensors(inputs)[0]
    layers = ModelProfile(
        model=name or type(model).__name__,
        model_fingerprint=graph.fingerprint,
        parameter_shapes=parameter_shapes(model),
        batch=batch,
        seq_len=graph.seq_len,
        sample_shape=tuple(int(s) for s in first.shape),
        dtype=dtype,
        device=device_name(device, n_threads),
        device_kind="cuda" if device.type == "cuda" else "cpu",
        threads=n_threads,
        timer=timer_name(device),
        warmup=sweep.warmup_runs,
        units=tuple(units),
        provenance=provenance(command),
    )
    return ProfileReport(layers=layers)


def _device_and_dtype(model: nn.Module) -> tuple[torch.device, str]:
    params = list(model.parameters())
    if not params:
        raise MeasurementError(f"{type(model).__name__} has no parameters; there is nothing to train or profile.")
    device = params[0].device
    if device.type == "meta":
        raise MeasurementError(
            f"{type(model).__name__} is on the meta device; profile_model runs it, so build it "
            f"on 'cpu' or 'cuda' (to plan without running, use autopar.graph.extract)."
        )
    floats = {p.dtype for p in params if p.is_floating_point()}
    if len(floats) != 1 or next(iter(floats)) not in _DTYPES:
        raise MeasurementError(
            f"{type(model).__name__} has parameters in {sorted(map(str, floats))}; profile_model "
            f"needs one of float32, bfloat16, float16 (call model.to(dtype) first)."
        )
    return device, _DTYPES[next(iter(floats))]


def _as_call(sample: Any) -> tuple[tuple, dict]:
    if isinstance(sample, dict):
        return (), dict(sample)
    if isinstance(sample, (tuple, list)):
        return tuple(sample), {}
    return (sample,), {}


def _without_cache(model: nn.Module, inputs: tuple[tuple, dict]) -> tuple[tuple, dict]:
    """``inputs`` with a training forward's keyword arguments
    (:func:`autopar.graph.extract.training_kwargs`) where they do not set them: a cache
    carried from one measured forward into the next would make the second backward run
    through the first's graph."""
    args, kwargs = inputs
    return args, {**training_kwargs(model), **kwargs}


def _batch(inputs: tuple[tuple, dict]) -> int:
    for t in tensors(inputs):
        if t.dim() >= 1:
            return int(t.shape[0])
    raise MeasurementError(
        "sample_input holds no tensor with a batch dimension; pass e.g. token ids of shape (batch, seq)."
    )


def _plan(
    model: nn.Module, graph: LayerGraph, inputs: tuple[tuple, dict], loss: Callable[[Any], torch.Tensor]
) -> list[_Distinct]:
    """One runner per distinct unit profile, in execution order."""
    modules = dict(model.named_modules())
    blocks = {u.fqn: u.profile for u in graph.units if u.prefix}
    instances: dict[int, list[str]] = {}
    for u in graph.units:
        instances.setdefault(u.profile, []).append(u.fqn)
    if not blocks:
        return [
            _Distinct(
                index=0, instances=tuple(instances[graph.units[0].profile]), runner=WholeRunner(model, inputs, loss)
            )
        ]
    captured = capture(model, inputs, blocks)
    plan = []
    seen: set[int] = set()
    first_block = next(u for u in graph.units if u.prefix)
    for i, u in enumerate(graph.units):
        if u.profile in seen:
            continue
        seen.add(u.profile)
        if u.prefix:
            if u.fqn not in captured.inputs:
                raise MeasurementError(
                    f"block {u.fqn!r} did not run in the capture forward; profile_model needs the "
                    f"blocks to run once each, in order."
                )
            runner: Any = BlockRunner(modules[u.fqn], captured.inputs[u.fqn])
        elif i == 0:
            runner = PrologueRunner(model, inputs, modules[first_block.fqn])
        else:
            runner = EpilogueRunner(model, inputs, loss, blocks, captured)
        plan.append(_Distinct(index=i, instances=tuple(instances[u.profile]), runner=runner))
    return plan


def _measure(
    model: nn.Module, graph: LayerGraph, unit: _Distinct, device: torch.device, batch: int, sweep: LayerSweep
) -> UnitMeasurement:
    g_unit = graph.units[unit.index]
    modules = dict(model.named_modules())
    params = {id(p): p for m in g_unit.modules for p in modules[m].parameters()}
    flops = {"fwd": 0.0, "bwd": 0.0}
    if sweep.count_flops:
        counter = FlopLap()
        with math_attention():
            unit.runner.run(counter)
        flops = counter.flops
    saved = peak = 0.0
    if sweep.measure_memory:
        probe = MemoryLap(device, {p.untyped_storage().data_ptr() for p in model.parameters()})
        unit.runner.run(probe)
        saved, peak = probe.saved_bytes, probe.peak_bytes
    fwd, bwd, recompute_bwd = _time(unit.runner, device, sweep.repeats, done=sweep.untimed_probes)
    return UnitMeasurement(
        fqn=g_unit.fqn,
        signature=graph.profiles[g_unit.profile].signature,
        instances=unit.instances,
        modules=g_unit.modules,
        fwd=fwd,
        bwd=bwd,
        recompute_bwd=recompute_bwd,
        fwd_flops=flops["fwd"],
        bwd_flops=flops["bwd"],
        param_bytes=float(sum(p.numel() * p.element_size() for p in params.values())),
        saved_bytes=saved,
        peak_bytes=peak,
        work=work_items(graph.profiles[g_unit.profile], batch),
    )


def _time(runner: Any, device: torch.device, repeats: Repeats, *, done: int) -> tuple[Timing, Timing, Timing | None]:
    """Forward, backward and (where the runner can) recomputing backward times of
    ``runner`` after ``repeats.warmup`` untimed runs, ``done`` of which already happened
    (the FLOP and memory probes run the unit too, so they double as warm-up). Each
    repeat runs the plain and the recomputing pass back to back, so a load that drifts
    during the sweep moves both alike."""
    lap = _ClockLap(device)
    for _ in range(repeats.warmup - done):
        runner.run(lap)
        if runner.recomputable:
            runner.run(lap, recompute=True)
    synchronize(device)
    fwd: list[float] = []
    bwd: list[float] = []
    redo: list[float] = []
    while len(fwd) < repeats.repeats and (
        len(fwd) < repeats.min_repeats or sum(fwd) + sum(bwd) + sum(redo) < repeats.budget_s
    ):
        runner.run(lap)
        fwd.append(lap.seconds["fwd"])
        bwd.append(lap.seconds["bwd"])
        if runner.recomputable:
            runner.run(lap, recompute=True)
            redo.append(lap.seconds["bwd"])
    return Timing.of(fwd), Timing.of(bwd), Timing.of(redo) if redo else None


def work_items(profile: UnitProfile, batch: int) -> tuple[WorkItem, ...]:
    """The unit's kernels at ``batch`` samples, as ``autopar.cost`` prices a unit on one
    device (``leaf_fwd_s`` per leaf, ``glue_fwd_s`` per flow: the attention core on the
    matmul roof, the rest of the glue on the vector roof); a leaf's parameters are read
    once per call, its activations once per sample."""
    items = []
    for leaf in profile.leaves:
        items.append(
            WorkItem(
                name=leaf.name or "(unit)",
                matmul_flops=leaf.matmul_flops * batch,
                other_flops=(leaf.fwd_flops - leaf.matmul_flops) * batch,
                bytes=leaf.fwd_bytes * batch + leaf.weight_bytes,
                ops=float(leaf.fwd_ops),
                weight_bytes=leaf.weight_bytes,
            )
        )
    names = [leaf.name or "(unit)" for leaf in profile.leaves]

    def end(i: int) -> str:
        return names[i] if i >= 0 else ("input" if i == UNIT_INPUT else "output")

    for f in profile.flows:
        where = f"{end(f.src)} -> {end(f.dst)}"
        if f.attn_flops or f.attn_bytes:
            items.append(
                WorkItem(
                    name=f"attention {where}",
                    matmul_flops=f.attn_flops * batch,
                    other_flops=0.0,
                    bytes=f.attn_bytes * batch,
                    ops=f.attn_ops,
                )
            )
        if f.glue_flops or f.glue_bytes or f.glue_ops:
            items.append(
                WorkItem(
                    name=f"glue {where}",
                    matmul_flops=0.0,
                    other_flops=f.glue_flops * batch,
                    bytes=f.glue_bytes * batch,
                    ops=f.glue_ops,
                )
            )
    return tuple(items)
