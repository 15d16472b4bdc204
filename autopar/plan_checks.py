"""Checks of a plan read from a file: what every plan autopar makes satisfies, which a
hand-edited or damaged file may break (:meth:`autopar.plan.Plan.from_dict` refuses it)."""

from __future__ import annotations

import math
from dataclasses import fields
from typing import TYPE_CHECKING

from autopar.errors import ConfigError
from autopar.search.kernel_options import check_async_tp, check_fp8

if TYPE_CHECKING:
    from autopar.hardware.cluster import Cluster
    from autopar.parallel_config import ParallelConfig
    from autopar.plan import ModelSummary, Plan, Prediction


def device_problem(config: ParallelConfig, cluster: Cluster) -> str:
    """A kernel option the plan's device cannot run, as the planner refuses it
    (:func:`~autopar.search.kernel_options.check_fp8`, ``check_async_tp``): FP8 matmuls
    without FP8 tensor cores, asynchronous TP where torch does not run it; empty where none."""
    try:
        check_fp8(config.__dict__, cluster)
        check_async_tp(config.__dict__, cluster)
    except ConfigError as refused:
        return str(refused).rstrip(".")
    return ""


def idle_sequence_parallel(name: str, config: ParallelConfig) -> str:
    """Why a configuration with sequence parallelism whose layout splits no layer does
    not run: nothing gathers the sharded sequence back (a plan search refuses it; an
    estimate notes it)."""
    return (
        f"sequence_parallel=True with tp={config.tp} is not allowed for {name}: the fastest layout splits none of "
        f"its layers (each is replicated over the {config.tp} tensor-parallel ranks), so no layer gathers the "
        f"sharded sequence back and autopar's runtime cannot run it; set sequence_parallel=False, or a smaller tp."
    )


def check_sequence_parallel(plan: Plan) -> None:
    """Refuse a plan with sequence parallelism whose layout splits no layer, as the
    planner does (:func:`idle_sequence_parallel`): an estimate only notes it."""
    if plan.config.sequence_parallel and not plan.layer_strategies.tp:
        raise ConfigError(idle_sequence_parallel(plan.model.name, plan.config))


def overflow(p: Prediction, device: str) -> str:
    """What a plan predicted not to fit holds against ``device``'s memory, for the
    refusals of what would run it (export, run, time to train); empty where it fits."""
    if p.fits:
        return ""
    return (
        f"the plan does not fit: it predicts {p.memory_bytes_per_device / 2**30:.1f} GiB per device, more than the "
        f"{p.memory_capacity_bytes / 2**30:.1f} GiB each {device} holds, so it would run out of memory"
    )


def prediction_problem(p: Prediction, model: ModelSummary) -> str:
    """What a prediction read from a file breaks of what any prediction satisfies (a step
    that takes time, a stage at least, no peak above the device called fitting, rates,
    memory and step terms not negative, terms adding up to the step, rates that are the
    batch over the step, MFU not above HFU); empty where nothing. A hand-edited file may break it."""
    if not p.step_time_s > 0:
        return f"step_time_s={p.step_time_s!r} must be > 0"
    if not p.stages:
        return "stages must list at least one stage"
    if p.fits and p.memory_bytes_per_device > p.memory_capacity_bytes * (1 + 1e-9):
        return (
            f"fits is true with memory_bytes_per_device={p.memory_bytes_per_device!r} above "
            f"memory_capacity_bytes={p.memory_capacity_bytes!r}"
        )
    rates = ("samples_per_s", "tokens_per_s", "tflops_per_device", "mfu", "hfu", "memory_bytes_per_device")
    negative = [name for name in rates if getattr(p, name) < 0]
    if negative:
        return f"{negative[0]}={getattr(p, negative[0])!r} must be >= 0"
    return _consistency_problem(p, model)


def _consistency_problem(p: Prediction, model: ModelSummary) -> str:
    """What a prediction breaks of the identities :func:`autopar.cost.step.predict` writes
    (to a relative 1e-6; float sums round): empty where nothing."""
    b, step, batch = p.breakdown, p.step_time_s, model.global_batch_size
    terms = [(f.name, getattr(b, f.name)) for f in fields(b)]
    negative = [(name, value) for name, value in terms if not value >= -1e-9 * step]  # a residual rounds below 0
    if negative:
        return f"breakdown.{negative[0][0]}={negative[0][1]!r} must be >= 0"
    if not math.isclose(b.total_s, step, rel_tol=1e-6):
        return f"step_time_s={step!r} must be the sum of its breakdown's terms, {_g(b.total_s)}"
    if not math.isclose(p.samples_per_s, batch / step, rel_tol=1e-6):
        return (
            f"samples_per_s={p.samples_per_s!r} must be model.global_batch_size / step_time_s = {batch} / "
            f"{step!r} = {_g(batch / step)}"
        )
    tokens = p.samples_per_s * model.seq_len if isinstance(model.seq_len, int) else p.tokens_per_s
    if not math.isclose(p.tokens_per_s, tokens, rel_tol=1e-6):
        return (
            f"tokens_per_s={p.tokens_per_s!r} must be samples_per_s x model.seq_len = {_g(p.samples_per_s)} x "
            f"{model.seq_len} = {_g(tokens)}"
        )
    if p.mfu > p.hfu * (1 + 1e-6):
        return f"mfu={p.mfu!r} must be <= hfu={p.hfu!r} (hardware FLOPs are the model's and its recomputation)"
    return ""


def _g(value: float) -> str:
    """``value`` in six significant digits, whole where it has more digits (no exponent)."""
    return f"{value:.6g}" if abs(value) < 1e6 else f"{value:.0f}"
