"""The questions users ask after the first plan: how few devices, how long, what if.

Each answer is the same search run again with one input changed, so it inherits the
planner's exactness and its assumptions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from torch import nn

from autopar.errors import (
    AutoparError,
    ConfigError,
    DeviceCountError,
    InfeasiblePlanError,
    check_positive_float,
    check_positive_int,
)
from autopar.graph.layer_graph import LayerGraph
from autopar.hardware.cluster import MAX_DEVICES, Cluster
from autopar.plan import Plan
from autopar.plan_checks import overflow
from autopar.search.constraints import DEGREES, check_constraints
from autopar.search.plan_inputs import as_cluster
from autopar.search.planner import model_graph
from autopar.search.planner import plan as make_plan
from autopar.vocab import ActivationLayout


@dataclass(frozen=True, kw_only=True)
class TrainingTime:
    """How long a token budget takes under a plan.

    Attributes:
        steps: optimizer steps (rounded up).
        seconds: wall time at the predicted step time.
        device_hours: seconds x devices / 3600.
    """

    steps: int
    seconds: float
    device_hours: float

    @property
    def days(self) -> float:
        """Wall time in days."""
        return self.seconds / 86400


def time_to_train(plan: Plan, tokens: float) -> TrainingTime:
    """Steps, wall time and device-hours to train on ``tokens`` tokens with ``plan``, a
    plan that fits (one that does not would run out of memory at its first step)."""
    if not isinstance(plan, Plan):
        raise ConfigError(
            f"time_to_train() takes a Plan (autopar.plan(...) or Plan.load(path)), got {type(plan).__name__}."
        )
    problem = overflow(plan.prediction, plan.cluster.device.name)
    if problem:
        raise ConfigError(f"{problem}; time a plan that fits (autopar.plan searches them).")
    check_positive_float("tokens", tokens)
    per_step = plan.model.global_batch_size * plan.model.seq_len
    steps = int(-(-tokens // per_step))
    seconds = steps * plan.prediction.step_time_s
    return TrainingTime(steps=steps, seconds=seconds, device_hours=seconds * plan.config.world_size / 3600)


def _next_count(nodes: int, failure: AutoparError, step: int, most: int) -> int:
    """The count to try after ``nodes`` failed with ``failure``: the count its refusal
    found a configuration fitting on (:attr:`~autopar.errors.InfeasiblePlanError.nodes_that_fit`),
    as a multiple of ``step``, where that is within ``most``; else twice ``nodes``."""
    fits = failure.nodes_that_fit if isinstance(failure, InfeasiblePlanError) else None
    rounded = -(-fits // step) * step if fits is not None else 0
    return rounded if nodes < rounded <= most else 2 * nodes


def fewest_nodes(
    model: nn.Module | LayerGraph,
    cluster: Cluster | str,
    *,
    global_batch_size: int,
    seq_len: int | None = None,
    sample_input: Any = None,
    max_nodes: int = 4096,
    **plan_kwargs: Any,
) -> Plan:
    """The plan on the fewest nodes of ``cluster``'s type that fit the model (a Cluster,
    or a spec string as :func:`autopar.plan` takes; its node count is not used).

    Doubles the node count until a plan fits (or moves to the count a refusal found a
    configuration fitting on), then bisects between the last two counts
    (a count that fits may still be passed over if the batch does not divide it). The
    counts are multiples of the fewest nodes whose devices the fixed degrees in
    ``constraints`` divide: ``tp=3`` on nodes of 8 tries 3, 6, 12, ... nodes. A count
    moves on where nothing fits in memory or no configuration of its devices exists
    (:class:`~autopar.errors.DeviceCountError`); any other error is the input's at every
    count, and is raised at once. ``max_nodes`` stops at the nodes of the largest cluster
    autopar plans (:data:`~autopar.hardware.cluster.MAX_DEVICES` devices).

    Raises:
        ConfigError: a bad constraint, option or size, or one the device lacks.
        DeviceCountError: no count up to ``max_nodes`` has a configuration (none ran
            out of memory); the message gives why at the first count tried.
        InfeasiblePlanError: no count up to ``max_nodes`` fits.
    """
    check_positive_int("max_nodes", max_nodes)
    cluster = as_cluster(cluster)
    largest = MAX_DEVICES // cluster.devices_per_node  # the largest cluster autopar plans
    capped = max_nodes < largest  # the caller's bound, not autopar's, stopped the search
    max_nodes = min(max_nodes, largest)
    megatron = str(plan_kwargs.get("activations", "")) == ActivationLayout.SEQUENCE_FIRST
    # read for the precision, and refused before any plan
    fixed = check_constraints(plan_kwargs.get("constraints"), megatron_kernels=megatron)
    graph = model_graph(  # as plan() would: its checks and its default length
        model,
        cluster,
        fixed,
        seq_len=seq_len,
        sample_input=sample_input,
        attention=plan_kwargs.get("attention", "flash"),
    )
    failures: list[AutoparError] = []

    def attempt(nodes: int) -> Plan | None:
        try:
            return make_plan(graph, cluster.with_nodes(nodes), global_batch_size=global_batch_size, **plan_kwargs)
        except (InfeasiblePlanError, DeviceCountError) as err:
            failures.append(err)
            return None

    step = node_step(fixed, cluster.devices_per_node)
    if step > max_nodes:
        raise DeviceCountError(
            f"the fixed degrees need a multiple of {step} nodes of {cluster.devices_per_node} devices, more than "
            f"max_nodes={max_nodes}; raise max_nodes to {step} or more, or fix other degrees."
        )
    lo, hi, found = 0, step, None
    while hi <= max_nodes:
        found = attempt(hi)
        if found is not None:
            break
        lo, hi = hi, _next_count(hi, failures[-1], step, max_nodes)
    if found is None and all(isinstance(err, DeviceCountError) for err in failures):
        first = "1 node" if step == 1 else f"{step} nodes"
        raise DeviceCountError(
            f"no configuration runs on {step} to {max_nodes} nodes of {cluster.kind} (node counts doubled from "
            f"{step}); on {first}: {failures[0]}"
        )
    if found is None:
        raise InfeasiblePlanError(
            f"no plan fits on up to {max_nodes} nodes of {cluster.kind}; "
            + (
                f"raise max_nodes above {max_nodes}, or give a smaller batch or sequence."
                if capped
                else "the model needs another device type or a smaller batch or sequence."
            ),
            min_memory_bytes=float("inf"),
            capacity_bytes=cluster.device.memory.capacity_bytes,
        )
    while hi - lo > step:
        mid = (lo + hi) // (2 * step) * step
        candidate = attempt(mid)
        if candidate is not None:
            hi, found = mid, candidate
        else:
            lo = mid
    return found


def node_step(fixed: dict[str, Any], devices_per_node: int) -> int:
    """The fewest nodes of ``devices_per_node`` devices whose device count the product of
    the fixed degrees in ``fixed`` divides; every count that can run them is a multiple."""
    product = math.prod(fixed[name] for name in DEGREES if name in fixed)
    return product // math.gcd(product, devices_per_node)
