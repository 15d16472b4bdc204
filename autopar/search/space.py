"""The search space and cheap bounds on it.

A candidate is a :class:`ParallelConfig` without per-layer decisions: a factorisation
``dp x cp x tp x pp`` of the device count (context parallelism where sequences are long:
:func:`autopar.search.context_degrees.cp_degrees`), a micro-batch size (the number of micro-batches
follows from the global batch), a schedule and its virtual stages, a ZeRO stage and,
for ZeRO-2/3, the HSDP shard group (:func:`shard_sizes`), sequence parallelism and the
precision. ``constraints`` fix any subset of these fields.
Per-layer choices (TP styles, recompute per unit) are made inside each candidate.

The memory floor (:func:`memory_floor`, never above the exact peak) rules out
candidates before they are solved.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from autopar.cost.bounds import memory_floor_bytes, states_floor_bytes, unit_floor
from autopar.cost.leaf import allowed_styles
from autopar.cost.model import CostModel
from autopar.cost.pipeline import schedule_problem
from autopar.errors import ConfigError, DeviceCountError
from autopar.graph.layer_graph import LayerGraph, Leaf, LeafKind
from autopar.hardware.cluster import Cluster
from autopar.plan import ParallelConfig
from autopar.search.constraints import DEGREES, check_degrees
from autopar.search.context_degrees import CP_MIN_TOKENS, check_context_parallel, cp_degrees, cp_left, ring_blocker
from autopar.search.experts import check_expert_parallel, ep_degrees
from autopar.search.integers import divisors
from autopar.search.kernel_options import (
    async_tp_options,
    check_async_tp,
    check_fp8,
    compile_options,
    fp8_options,
    regather_options,
)
from autopar.search.rejections import Rejection, expert_rejection, shard_rejection
from autopar.search.schedules import check_schedule_constraints, offered_schedules, split_problem
from autopar.vocab import ZERO_STAGES, DType, Recompute, Schedule, TPStyle

CUT_NOTE = (
    "autopar's runtime cannot cut this model into pipeline stages: its blocks sit in an nn.ModuleList or "
    "nn.Sequential, which renumber their children when one is removed (hold them in an nn.ModuleDict, as "
    "autopar.models do); pp > 1 is searched only when asked for with constraints"
)
MAX_MICRO_BATCH = 64


def shard_sizes(dp: int, tp: int, devices_per_node: int) -> list[int]:
    """The HSDP shard groups the search tries for ``dp`` data-parallel ranks, ``tp`` apart:
    every divisor ``d`` of ``dp`` (``2 <= d < dp``) whose group covers a power-of-two
    number of whole nodes (``tp * d`` is ``devices_per_node * 2**k``). A group smaller
    than a node adds intra-node all-reduces and saves no inter-node traffic, and one of a
    node count between two powers of two is rarely a divisor; plain FSDP (one group of
    ``dp``) is always a candidate besides these."""
    out = []
    for d in divisors(dp)[1:-1]:
        nodes, rest = divmod(tp * d, devices_per_node)
        if not rest and nodes & (nodes - 1) == 0:
            out.append(d)
    return out


def tp_degrees(graph: LayerGraph, world: int) -> list[int]:
    """TP degrees that divide the device count and the layer shapes: every linear leaf
    of the repeated blocks (or of every unit, for a model without repeats) must be
    splittable (heads, KV heads and FFN sizes divisible), as in Megatron-LM."""
    linears = _tp_linears(graph)
    out = [1]
    if not linears:
        return out
    for t in divisors(world)[1:]:
        if all(_splittable(leaf, t) for leaf in linears):
            out.append(t)
    return out


def _tp_linears(graph: LayerGraph) -> list[Leaf]:
    """The linear leaves a TP degree must split: the repeated blocks' (or every unit's,
    for a model without repeats)."""
    block_profiles = {u.profile for u in graph.units if u.prefix} or {u.profile for u in graph.units}
    return [leaf for p in block_profiles for leaf in graph.profiles[p].leaves if leaf.kind is LeafKind.LINEAR]


def layer_misfit(graph: LayerGraph, t: int) -> str | None:
    """Why the model's layers do not split ``t`` ways, in words (the first layer it cannot
    split and that layer's size), or None where they do: then only a device count ``t``
    does not divide keeps it out of :func:`tp_degrees`."""
    linears = _tp_linears(graph)
    if not linears and t > 1:
        return "the model has no linear layer for tensor parallelism to split"
    for leaf in linears:
        if _splittable(leaf, t):
            continue
        if leaf.out_heads or leaf.in_heads:
            heads = leaf.out_heads if leaf.out_heads % t else leaf.in_heads
            return f"{leaf.name} splits by whole attention heads and has {heads}"
        return f"{leaf.name} ({leaf.in_features} -> {leaf.out_features} features) divides by it on neither side"
    return None


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
    graph: LayerGraph,
    cluster: Cluster,
    global_batch_size: int,
    constraints: Mapping[str, Any],
    *,
    fold_shard_groups: bool = False,
    megatron_kernels: bool = False,
) -> tuple[list[ParallelConfig], list[Rejection]]:
    """Every candidate configuration that satisfies ``constraints``, and the regions
    rejected outright (batch not divisible, too many stages, schedule limits). With
    ``fold_shard_groups``, a plain ZeRO-2/3 candidate stands for its HSDP siblings too
    (:func:`shard_siblings` lists them), which the caller expands when it needs them.
    ``megatron_kernels``: priced for Megatron-LM (sequence-first activations), whose
    compiled-like fused blocks keep gather shards too (:func:`regather_options`), and
    which runs no zero-bubble schedule nor ZeRO-3 under a pipeline: those are left out
    (:func:`autopar.search.constraints.check_megatron_runs`)."""
    world = cluster.world_size
    c = constraints
    check_fp8(c, cluster)
    check_async_tp(c, cluster)
    rejected: list[Rejection] = []
    dtype = c.get("dtype", cluster.device.preferred_dtype)
    cluster.device.peak(dtype)  # raises a clear error if the device lacks it
    reduce_dtype = c.get("reduce_dtype", DType.FP32)
    if reduce_dtype is not DType.FP32 and dtype is not reduce_dtype:
        raise ConfigError(
            f"constraint reduce_dtype={reduce_dtype.value!r} needs dtype={reduce_dtype.value!r}, and this "
            f"{cluster.device.name} trains in {dtype.value!r} by default; set dtype={reduce_dtype.value!r} too."
        )
    kernels = {  # by whether the schedule splits the backward
        split: list(
            itertools.product(compile_options(c, cluster, split_backward=split), fp8_options(c, cluster, dtype))
        )
        for split in (False, True)
    }
    n_units = len(graph.units)
    allowed_tp = tp_degrees(graph, world)
    if "tp" in c and c["tp"] not in allowed_tp:  # the model's fault at any device count, or this count's
        why = layer_misfit(graph, c["tp"])
        raise (ConfigError if why else DeviceCountError)(
            f"tp={c['tp']} does not fit: {why or f'it does not divide the {world} devices'}; allowed on {world} "
            f"devices: {allowed_tp}."
        )
    check_schedule_constraints(c, graph)
    check_context_parallel(graph, c, world)
    check_expert_parallel(graph, c)
    check_degrees(c, world)  # after the checks that hold at any device count
    tps = [c["tp"]] if "tp" in c else allowed_tp
    configs: list[ParallelConfig] = []
    dp_reached = False  # whether any split tried leaves a fixed dp
    for tp in tps:
        if world % tp:
            rejected.append(Rejection(what=f"tp={tp}", reason=f"does not divide the {world} devices", searched=("tp",)))
            continue
        for cp, pp in _cp_pp(graph, world // tp, c):
            if (world // tp) % (cp * pp):
                if "dp" in c:  # no such split leaves the fixed dp either: no reason about it
                    continue
                rejected.append(
                    Rejection(
                        what=f"tp={tp} cp={cp} pp={pp}",
                        reason=f"tp x cp x pp does not divide {world} devices",
                        searched=DEGREES[1:],
                    )
                )
                continue
            dp = world // (tp * cp * pp)
            dp_reached = dp_reached or dp == c.get("dp")
            if "dp" in c and c["dp"] != dp:
                left = world // (c["dp"] * tp * pp)  # only cp was left to the search: does it try the one needed?
                if {"tp", "pp"} <= c.keys() and left not in cp_degrees(graph, world // tp, c):
                    rejected.append(cp_left(c, world, graph.seq_len))
                continue
            if pp > n_units:
                rejected.append(
                    Rejection(what=f"pp={pp}", reason=f"more stages than the model's {n_units} units", searched=("pp",))
                )
                continue
            if pp > 1 and not graph.sequential:
                rejected.append(
                    Rejection(
                        what=f"pp={pp}", reason="the model's blocks do not run once each, in order", searched=("pp",)
                    )
                )
                continue
            if pp > 1 and not graph.cuttable and "pp" not in c:
                rejected.append(Rejection(what=f"pp={pp}", reason=CUT_NOTE, searched=("pp",)))
                continue
            if reduce_dtype is not DType.FP32 and dp * cp == 1:
                rejected.append(
                    Rejection(
                        what=f"dp={dp} cp={cp}",
                        reason=f"reduce_dtype={reduce_dtype.value!r} needs dp x cp > 1 (the gradients' reduction "
                        f"over data-parallel ranks runs in it)",
                        searched=("dp",),
                    )
                )
                continue
            why_not = expert_rejection(c, dp, cp) or shard_rejection(c, dp, cp)
            if why_not:
                rejected.append(why_not)
                continue
            if global_batch_size % dp:
                rejected.append(
                    Rejection(
                        what=f"dp={dp} (tp={tp} pp={pp})",
                        reason=f"global batch {global_batch_size} is not divisible by dp={dp}",
                        searched=("dp",),
                    )
                )
                continue
            per_rank = global_batch_size // dp
            batch_rejection = _batch_rejection(c, dp, per_rank)
            if batch_rejection:
                rejected.append(batch_rejection)
                continue
            mbs_list = (
                [c["micro_batch_size"]] if "micro_batch_size" in c else divisors(per_rank, at_most=MAX_MICRO_BATCH)
            )
            # whether the model splits over a schedule's stages does not depend on the batch split
            schedules = [
                (s, v, split_problem(graph, s, pp, v))
                for s, v in offered_schedules(pp, graph, c)
                if not (megatron_kernels and s.zero_bubble)  # Megatron-LM has none (check_megatron_runs)
            ]
            for mbs in mbs_list:
                if per_rank % mbs:
                    continue
                m = per_rank // mbs
                if "num_microbatches" in c and c["num_microbatches"] != m:
                    continue
                for schedule, v, unsplit in schedules:
                    what, problem = f"pp={pp} micro_batch_size={mbs} (dp={dp})", schedule_problem(schedule, pp, v, m)
                    if not problem:
                        what, problem = f"pp={pp} virtual_stages={v}", unsplit
                    if problem:
                        if "schedule" in c or "virtual_stages" in c:  # pinned: say why it never runs here
                            rejected.append(Rejection(what=what, reason=problem))
                        continue
                    if schedule is Schedule.GPIPE and "schedule" not in c and m >= pp:
                        continue  # dominated: 1F1B takes the same time and holds fewer micro-batches
                    # model states shard over dp x cp: context-parallel ranks hold the same weights
                    zeros = [c["zero_stage"]] if "zero_stage" in c else ([0] if dp * cp == 1 else list(ZERO_STAGES))
                    if reduce_dtype is not DType.FP32:  # FSDP2 reduces in it: ZeRO-2/3 only
                        zeros = [z for z in zeros if z >= 2]
                    sps = (
                        [c["sequence_parallel"]] if "sequence_parallel" in c else ([False, True] if tp > 1 else [False])
                    )
                    for zero, shard in _shardings(zeros, dp, tp * cp, cluster.devices_per_node, c, fold_shard_groups):
                        if schedule.zero_bubble and zero == 3:
                            continue  # the runtime refuses it (autopar.runtime.pipeline.check_schedule)
                        if megatron_kernels and zero == 3 and pp > 1:
                            continue  # Megatron-FSDP does not pipeline (check_megatron_runs)
                        for sp, ep, (compiled, fp8) in itertools.product(
                            sps, ep_degrees(graph, dp * cp, (shard or dp) * cp, c), kernels[schedule.zero_bubble]
                        ):
                            if sp and tp == 1:
                                continue
                            configs += [
                                ParallelConfig(
                                    dp=dp,
                                    tp=tp,
                                    pp=pp,
                                    cp=cp,
                                    ep=ep,
                                    micro_batch_size=mbs,
                                    num_microbatches=m,
                                    schedule=schedule,
                                    virtual_stages=v,
                                    zero_stage=zero,
                                    dp_shard=shard,
                                    recompute=c.get("recompute", Recompute.NONE),
                                    sequence_parallel=sp,
                                    dtype=dtype,
                                    compile=compiled,
                                    fp8=fp8,
                                    async_tp=overlapped,
                                    regather=regather,
                                    reduce_dtype=reduce_dtype,
                                )
                                for overlapped in async_tp_options(c, cluster, tp, sp, compiled)
                                for regather in regather_options(c, sp, compiled, megatron_kernels)
                            ]
    if "dp" in c and not dp_reached and not {"tp", "pp"} <= c.keys():  # both fixed: cp_left said why
        rejected.append(_dp_unreached(graph, world, c, tps))
    return configs, rejected


def _shardings(
    zeros: list[int], dp: int, tp: int, devices_per_node: int, c: Mapping[str, Any], fold: bool
) -> Iterator[tuple[int, int | None]]:
    """(ZeRO stage, shard group) pairs: plain sharding for every stage, and under ZeRO-2/3
    the HSDP groups of :func:`shard_sizes` (left to the plain one when ``fold``); a fixed
    ``dp_shard`` keeps only the stages that take it (None: plain sharding at any stage; a
    group size: ZeRO-2/3 with groups of that size, plain FSDP where it is ``dp``, nothing
    where it does not divide ``dp``)."""
    for zero in zeros:
        if "dp_shard" in c:
            shard = c["dp_shard"]
            if shard is None:
                yield zero, None
            elif zero >= 2 and dp % shard == 0:
                yield zero, shard
            continue
        yield zero, None
        if zero >= 2 and not fold:
            for shard in shard_sizes(dp, tp, devices_per_node):
                yield zero, shard


def shard_siblings(config: ParallelConfig, devices_per_node: int, constraints: Mapping[str, Any]) -> tuple[int, ...]:
    """The HSDP shard groups a plain candidate of a folded space (:func:`enumerate_space`
    with ``fold_shard_groups``) stands for: :func:`shard_sizes` under ZeRO-2/3, none when
    ``dp_shard`` is fixed or the candidate is itself HSDP."""
    if "dp_shard" in constraints or config.dp_shard is not None or config.zero_stage < 2:
        return ()
    return config_shard_sizes(config, devices_per_node)


def config_shard_sizes(config: ParallelConfig, devices_per_node: int) -> tuple[int, ...]:
    """The HSDP shard groups of :func:`shard_sizes` that ``config``'s degrees allow: those
    whose group (``dp_shard x cp`` ranks) holds whole expert groups of ``ep`` ranks."""
    sizes = shard_sizes(config.dp, config.tp * config.cp, devices_per_node)
    return tuple(s for s in sizes if s * config.cp % config.ep == 0)


def _cp_pp(graph: LayerGraph, devices: int, c: Mapping[str, Any]) -> Iterator[tuple[int, int]]:
    """(cp, pp) pairs for the ``devices`` devices left after tensor parallelism."""
    for cp in cp_degrees(graph, devices, c):
        for pp in [c["pp"]] if "pp" in c else divisors(devices // cp):
            yield cp, pp


def _dp_unreached(graph: LayerGraph, world: int, c: Mapping[str, Any], tps: list[int]) -> Rejection:
    """Why a fixed ``dp`` found no candidate: no tensor-, context- and pipeline-parallel
    degrees the search tries (``tps``, :func:`cp_degrees`, divisors) make the devices it
    leaves."""
    fixed = " ".join(f"{k}={c[k]}" for k in DEGREES if k in c)
    cps = sorted({cp for tp in tps if world % tp == 0 for cp in cp_degrees(graph, world // tp, c)})
    blocker = ring_blocker(graph)
    if "cp" in c:
        why_cp = ""
    elif blocker:
        why_cp = f" ({blocker})"
    else:
        why_cp = (
            f" (cp > 1 only where each rank keeps >= {CP_MIN_TOKENS} tokens of a sequence, here {graph.seq_len}; "
            f"fix cp to try another)"
        )
    return Rejection(
        what=fixed,
        reason=f"they leave {world // c['dp']} devices to tp x cp x pp, which no degrees the search tries make: tp "
        f"in {tps}{'' if 'tp' in c else ' (dividing the devices and the layer shapes)'}, cp in {cps}{why_cp}"
        + (f", pp={c['pp']}" if "pp" in c else ""),
    )


def _batch_rejection(c: Mapping[str, Any], dp: int, per_rank: int) -> Rejection | None:
    """Why a fixed micro-batch size or count cannot split the ``per_rank`` samples of each
    of ``dp`` data-parallel ranks, if it cannot (the search would find no candidate, and
    the message would not say why)."""
    mbs, m = c.get("micro_batch_size"), c.get("num_microbatches")
    samples = f"the {per_rank} samples per data-parallel rank"
    for name, value in (("micro_batch_size", mbs), ("num_microbatches", m)):
        if value is not None and per_rank % value:
            return Rejection(what=f"{name}={value} (dp={dp})", reason=f"does not divide {samples}")
    if mbs is not None and m is not None and mbs * m != per_rank:
        return Rejection(
            what=f"micro_batch_size x num_microbatches = {mbs} x {m} (dp={dp})", reason=f"is not {samples}"
        )
    if m is not None and mbs is None and per_rank // m > MAX_MICRO_BATCH:
        return Rejection(
            what=f"num_microbatches={m} (dp={dp})",
            reason=f"splits {samples} into micro-batches of {per_rank // m}, above the {MAX_MICRO_BATCH} the "
            f"search tries; fix micro_batch_size too",
        )
    return None


def micro_batch_range(
    graph: LayerGraph, cluster: Cluster, global_batch_size: int, constraints: Mapping[str, Any]
) -> tuple[int, ...]:
    """The micro-batch sizes the search may meet (all divisors up to the cap)."""
    if "micro_batch_size" in constraints:
        return (constraints["micro_batch_size"],)
    return tuple(divisors(global_batch_size, at_most=MAX_MICRO_BATCH))


def memory_floor(model: CostModel, config: ParallelConfig, cache: dict) -> float:
    """The peak memory per device ``config`` needs at least
    (:func:`autopar.cost.bounds.memory_floor_bytes` over the units' floors; ``cache``
    keeps the units' floors per unit structure and the model states per sharding)."""
    units = (
        *config.unit_family,
        config.micro_batch_size,
    )
    floors = cache.get(units)
    if floors is None:
        kinds = cache.get("kinds")
        if kinds is None:
            n = model.num_units
            counts: dict[tuple, list[int]] = {}
            for u in range(n):
                counts.setdefault(cache_key(model, u), []).append(u)
            kinds = cache["kinds"] = [(us[0], len(us)) for us in counts.values()]
        found = [(count, unit_floor(model, u, config)) for u, count in kinds]
        floors = cache[units] = (
            sum(count * f.param_numel for count, f in found),
            sum(count * f.input_bytes for count, f in found),
        )
    params, inputs = floors
    sharding = (
        "states",
        *config.unit_family,
        config.zero_stage,
        config.dp,
        config.dp_shard,
        config.pp > 1,
    )
    states = cache.get(sharding)
    if states is None:
        states = cache[sharding] = states_floor_bytes(model, config, params)
    return memory_floor_bytes(model, config, states, inputs)


def cache_key(model: CostModel, unit: int) -> tuple:
    """A unit's profile and place: what makes two units cost the same."""
    return (model.graph.units[unit].profile, unit == 0, unit == model.num_units - 1)
