"""The search space and cheap bounds on it.

A candidate is a :class:`ParallelConfig` without per-layer decisions: a factorisation
``dp x tp x pp`` of the device count, a micro-batch size (the number of micro-batches
follows from the global batch), a schedule and its virtual stages, a ZeRO stage,
sequence parallelism and the precision. ``constraints`` fix any subset of these fields.
Per-layer choices (TP styles, recompute per unit) are made inside each candidate.

Bounds (never above the exact cost, so pruning by them loses nothing):

- time: each leaf and glue op at its cheapest style with no communication, the
  pipeline perfectly balanced: ``(m - 1 + pp) / pp * sum_units t_min``;
- memory: every leaf at its fewest parameters, activations fully recomputed, spread
  evenly over the stages, on the least loaded pipeline rank.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Any

from autopar.cluster import Cluster
from autopar.cost.comm import group_span
from autopar.cost.compute import rates
from autopar.cost.memory import state_bytes
from autopar.cost.pipeline import inflight_microbatches, schedule_problem
from autopar.cost.tensor_parallel import (
    BACKWARD_FACTOR,
    Layout,
    TPContext,
    allowed_styles,
    glue_fwd_s,
    leaf_accumulate_s,
    leaf_fwd_s,
    leaf_param_numel,
)
from autopar.errors import ConfigError
from autopar.graph.layer_graph import LayerGraph, Leaf, LeafKind
from autopar.plan import ParallelConfig
from autopar.vocab import ZERO_STAGES, DType, Optimizer, Recompute, Schedule, TPStyle

CONFIG_FIELDS = tuple(f.name for f in fields(ParallelConfig))
CUT_NOTE = (
    "autopar's runtime cannot cut this model into pipeline stages: its blocks sit in an nn.ModuleList or "
    "nn.Sequential, which renumber their children when one is removed (hold them in an nn.ModuleDict, as "
    "autopar.models do); pp > 1 is searched only when asked for with constraints"
)
MAX_MICRO_BATCH = 64
MAX_VIRTUAL_STAGES = 8


def divisors(n: int) -> list[int]:
    """Positive divisors of ``n`` in increasing order."""
    return [d for d in range(1, n + 1) if n % d == 0]


def check_constraints(constraints: Mapping[str, Any] | None) -> dict[str, Any]:
    """Validate the names and types of fixed fields (values are checked by ParallelConfig)."""
    out = dict(constraints or {})
    unknown = sorted(set(out) - set(CONFIG_FIELDS))
    if unknown:
        raise ConfigError(f"unknown constraint(s) {unknown}; allowed: {', '.join(CONFIG_FIELDS)}.")
    for name in ("dp", "tp", "pp", "micro_batch_size", "num_microbatches", "virtual_stages"):
        if name in out:
            v = out[name]
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"constraint {name}={v!r} is not allowed: it must be a positive integer.")
    conv = {"schedule": Schedule, "recompute": Recompute, "dtype": DType}
    for name, cls in conv.items():
        if name in out:
            try:
                out[name] = cls(out[name])
            except ValueError:
                allowed = ", ".join(repr(m.value) for m in cls)
                raise ConfigError(f"constraint {name}={out[name]!r} is not allowed; use one of {allowed}.") from None
    if "zero_stage" in out and (isinstance(out["zero_stage"], bool) or out["zero_stage"] not in ZERO_STAGES):
        raise ConfigError(f"constraint zero_stage={out['zero_stage']!r} is not allowed; use 0, 1, 2 or 3.")
    if "sequence_parallel" in out and not isinstance(out["sequence_parallel"], bool):
        raise ConfigError(f"constraint sequence_parallel={out['sequence_parallel']!r} must be True or False.")
    return out


@dataclass(frozen=True, kw_only=True)
class Rejection:
    """A region of the space ruled out before costing, and why."""

    what: str
    reason: str


def tp_degrees(graph: LayerGraph, world: int) -> list[int]:
    """TP degrees that divide the device count and the layer shapes: every linear leaf
    of the repeated blocks (or of every unit, for a model without repeats) must be
    splittable (heads, KV heads and FFN sizes divisible), as in Megatron-LM."""
    block_profiles = {u.profile for u in graph.units if u.prefix} or {u.profile for u in graph.units}
    linears = [leaf for p in block_profiles for leaf in graph.profiles[p].leaves if leaf.kind is LeafKind.LINEAR]
    out = [1]
    if not linears:
        return out
    for t in divisors(world)[1:]:
        if all(_splittable(leaf, t) for leaf in linears):
            out.append(t)
    return out


def _splittable(leaf: Leaf, t: int) -> bool:
    """Attention projections need whole heads (and KV heads) per rank; other linears a
    divisible input or output dimension."""
    if leaf.out_heads or leaf.in_heads:
        return all(h % t == 0 for h in (leaf.out_heads, leaf.in_heads) if h)
    return any(s is not TPStyle.REPLICATE for s in allowed_styles(leaf, _ShapeOnly(t)))


@dataclass(frozen=True)
class _ShapeOnly:
    """The part of a TPContext that divisibility checks read."""

    tp: int
    sequence_parallel: bool = False


def enumerate_space(
    graph: LayerGraph, cluster: Cluster, global_batch_size: int, constraints: Mapping[str, Any]
) -> tuple[list[ParallelConfig], list[Rejection]]:
    """Every candidate configuration that satisfies ``constraints``, and the regions
    rejected outright (batch not divisible, too many stages, schedule limits)."""
    world = cluster.world_size
    c = constraints
    rejected: list[Rejection] = []
    dtype = c.get("dtype", cluster.device.preferred_dtype)
    cluster.device.peak(dtype)  # raises a clear error if the device lacks it
    n_units = len(graph.units)
    allowed_tp = tp_degrees(graph, world)
    if "tp" in c and c["tp"] not in allowed_tp:
        raise ConfigError(
            f"tp={c['tp']} does not fit the model's layer shapes on {world} devices (attention heads, "
            f"KV heads and FFN sizes must divide by it); allowed: {allowed_tp}."
        )
    tps = [c["tp"]] if "tp" in c else allowed_tp
    configs: list[ParallelConfig] = []
    for tp in tps:
        if world % tp:
            rejected.append(Rejection(what=f"tp={tp}", reason=f"does not divide the {world} devices"))
            continue
        for pp in [c["pp"]] if "pp" in c else divisors(world // tp):
            if (world // tp) % pp:
                rejected.append(Rejection(what=f"tp={tp} pp={pp}", reason=f"tp x pp does not divide {world} devices"))
                continue
            if pp > n_units:
                rejected.append(Rejection(what=f"pp={pp}", reason=f"more stages than the model's {n_units} units"))
                continue
            if pp > 1 and not graph.sequential:
                rejected.append(Rejection(what=f"pp={pp}", reason="the model's blocks do not run once each, in order"))
                continue
            if pp > 1 and not graph.cuttable and "pp" not in c:
                rejected.append(Rejection(what=f"pp={pp}", reason=CUT_NOTE))
                continue
            dp = world // (tp * pp)
            if "dp" in c and c["dp"] != dp:
                continue
            if global_batch_size % dp:
                rejected.append(
                    Rejection(
                        what=f"dp={dp} (tp={tp} pp={pp})",
                        reason=f"global batch {global_batch_size} is not divisible by dp={dp}",
                    )
                )
                continue
            per_rank = global_batch_size // dp
            mbs_list = (
                [c["micro_batch_size"]]
                if "micro_batch_size" in c
                else [d for d in divisors(per_rank) if d <= MAX_MICRO_BATCH]
            )
            for mbs in mbs_list:
                if per_rank % mbs:
                    continue
                m = per_rank // mbs
                if "num_microbatches" in c and c["num_microbatches"] != m:
                    continue
                for schedule, v in _schedules(pp, graph, c):
                    problem = schedule_problem(schedule, pp, v, m)
                    if problem:
                        continue
                    if schedule is Schedule.GPIPE and "schedule" not in c and m >= pp:
                        continue  # dominated: 1F1B takes the same time and holds fewer micro-batches
                    zeros = [c["zero_stage"]] if "zero_stage" in c else ([0] if dp == 1 else list(ZERO_STAGES))
                    sps = (
                        [c["sequence_parallel"]] if "sequence_parallel" in c else ([False, True] if tp > 1 else [False])
                    )
                    for zero in zeros:
                        for sp in sps:
                            if sp and tp == 1:
                                continue
                            configs.append(
                                ParallelConfig(
                                    dp=dp,
                                    tp=tp,
                                    pp=pp,
                                    micro_batch_size=mbs,
                                    num_microbatches=m,
                                    schedule=schedule,
                                    virtual_stages=v,
                                    zero_stage=zero,
                                    recompute=c.get("recompute", Recompute.NONE),
                                    sequence_parallel=sp,
                                    dtype=dtype,
                                )
                            )
    return configs, rejected


def _schedules(pp: int, graph: LayerGraph, c: Mapping[str, Any]) -> Iterator[tuple[Schedule, int]]:
    if pp == 1:
        yield Schedule.ONE_F_ONE_B, 1
        return
    wanted = c.get("schedule")
    for schedule in (Schedule.ONE_F_ONE_B, Schedule.GPIPE):
        if wanted in (None, schedule) and c.get("virtual_stages", 1) == 1:
            yield schedule, 1
    if wanted in (None, Schedule.INTERLEAVED_1F1B):
        blocks = sum(1 for u in graph.units if u.prefix)
        for v in [c["virtual_stages"]] if "virtual_stages" in c else range(2, MAX_VIRTUAL_STAGES + 1):
            if v >= 2 and blocks % (pp * v) == 0 and blocks >= pp * v:
                yield Schedule.INTERLEAVED_1F1B, v


def micro_batch_range(
    graph: LayerGraph, cluster: Cluster, global_batch_size: int, constraints: Mapping[str, Any]
) -> tuple[int, ...]:
    """The micro-batch sizes the search may meet (all divisors up to the cap)."""
    if "micro_batch_size" in constraints:
        return (constraints["micro_batch_size"],)
    return tuple(d for d in divisors(global_batch_size) if d <= MAX_MICRO_BATCH)


@dataclass(frozen=True, kw_only=True)
class Bounds:
    """Lower bounds of a candidate's step time and peak memory per device."""

    time_s: float
    memory_bytes: float


def lower_bounds(
    graph: LayerGraph, cluster: Cluster, config: ParallelConfig, optimizer: Optimizer, cache: dict
) -> Bounds:
    """Cheap bounds (see the module docstring); ``cache`` memoises per-unit terms."""
    n = len(graph.units)
    kinds = cache.get("kinds")
    if kinds is None:
        counts: dict[tuple, list[int]] = {}
        for u in range(n):
            counts.setdefault((graph.units[u].profile, u == 0, u == n - 1), []).append(u)
        kinds = cache["kinds"] = [(us[0], len(us)) for us in counts.values()]
    time_sum = 0.0
    params_sum = 0.0
    act = 0.0
    for u, count in kinds:
        key = (
            graph.units[u].profile,
            u == 0,
            u == n - 1,
            config.tp,
            config.sequence_parallel,
            config.micro_batch_size,
            config.dtype,
        )
        if key not in cache:
            cache[key] = _unit_bounds(graph, cluster, u, config)
        t, params, inp = cache[key]
        time_sum += count * t
        params_sum += count * params
        act += count * inp
    st = state_bytes(
        param_numel=params_sum,
        factored_numel=0.0,
        largest_unit_numel=0.0,
        dtype=config.dtype,
        optimizer=optimizer,
        zero_stage=config.zero_stage,
        dp=config.dp,
        pipelined=config.pp > 1,
        tp=config.tp,
    )
    static = st.params_bytes + st.grads_bytes + (st.optimizer_bytes if optimizer is not Optimizer.ADAFACTOR else 0)
    pp, m = config.pp, config.num_microbatches
    inflight = inflight_microbatches(config.schedule, pp, config.virtual_stages, m, pp - 1)  # the least loaded rank
    time = (
        (m - 1 + pp) / pp * time_sum
        if config.virtual_stages == 1
        else (m + (pp - 1) / config.virtual_stages) * time_sum / pp
    )
    memory = (static + inflight * act) / pp + cluster.device.reserved_bytes
    return Bounds(time_s=time, memory_bytes=memory)


def _unit_bounds(graph: LayerGraph, cluster: Cluster, u: int, config: ParallelConfig) -> tuple[float, float, float]:
    n = len(graph.units)
    prof = graph.profile_of(u)
    ctx = TPContext(
        tp=config.tp,
        span=group_span(config.tp, 1, cluster.devices_per_node),
        cluster=cluster,
        rates=rates(cluster.device, config.dtype),
        micro_batch=config.micro_batch_size,
        tokens=graph.seq_len,
        boundary=Layout.Q if config.sequence_parallel else Layout.R,
        first=u == 0,
        last=u == n - 1,
        loss_parallel=graph.vocab_size > 0,
        sequence_parallel=config.sequence_parallel,
        exposed_weight_traffic=cluster.device.exposed_weight_traffic,
    )
    t = 0.0
    params = 0.0
    accumulate = 0.0
    for leaf in prof.leaves:
        styles = allowed_styles(leaf, ctx)
        t += min(leaf_fwd_s(leaf, s, ctx) for s in styles)
        params += min(leaf_param_numel(leaf, s, config.tp) for s in styles)
        accumulate += min(leaf_accumulate_s(leaf, s, ctx) for s in styles)
    sharded = Layout.F if config.tp > 1 else Layout.R
    t += sum(glue_fwd_s(f, sharded, ctx) for f in prof.flows)
    inp = prof.input_bytes * config.micro_batch_size / (config.tp if config.sequence_parallel and u > 0 else 1)
    return (1 + BACKWARD_FACTOR) * t + accumulate, params, inp
