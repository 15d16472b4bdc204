"""What the exactness tests (and ``benchmarks/planner_exact.py``) share: random units and a
toy cluster small enough to enumerate, and the whole search's reference, every
configuration the space offers (and every way of the kernel options the device allows),
every split, every per-unit option, priced by the cost model."""

import dataclasses
import itertools
import math
import random

from autopar.cost.comm import group_span
from autopar.cost.compute import rates
from autopar.cost.leaf import TPContext
from autopar.cost.model import CostModel
from autopar.cost.peak import budget_bytes, held_once_numel, shared_state_bytes
from autopar.cost.pipeline import inflight_microbatches, stage_inflight_microbatches
from autopar.cost.stage import PricedStage, rank_buffer_bytes
from autopar.cost.step import timing
from autopar.graph.layer_graph import UNIT_INPUT, UNIT_OUTPUT, Flow, Leaf, LeafKind, UnitProfile
from autopar.hardware import Cluster, DeviceMemory, DeviceSpec, LinkSpec, Roofline
from autopar.plan import ParallelConfig
from autopar.search.constraints import check_constraints
from autopar.search.scan import ALL_MODES, SearchResult, search
from autopar.search.solve import ConfigSolver
from autopar.search.space import enumerate_space
from autopar.search.stage_solver import memory_of
from autopar.search.walk_room import walked_bytes
from autopar.vocab import DType, Layout, Optimizer, Schedule


def layout_ctx(cluster, *, tp, mbs=1, sp=False, first=False, last=False):
    """A tensor-parallel context on ``cluster`` for 64-token bf16 units."""
    return TPContext(
        tp=tp,
        span=group_span(tp, 1, cluster.devices_per_node),
        cluster=cluster,
        rates=rates(cluster.device, DType.BF16),
        micro_batch=mbs,
        tokens=64,
        boundary=Layout.Q if sp else Layout.R,
        first=first,
        last=last,
        loss_parallel=True,
        sequence_parallel=sp,
    )


def random_profile(rng: random.Random) -> UnitProfile:
    """A random chain-with-skips unit: 2-6 leaves of mixed kinds and random sizes."""
    kinds = [
        rng.choice([LeafKind.LINEAR, LeafKind.LINEAR, LeafKind.NORM, LeafKind.EMBEDDING])
        for _ in range(rng.randint(2, 6))
    ]
    leaves = []
    for i, kind in enumerate(kinds):
        fin, fout = rng.choice([64, 96, 128, 256]), rng.choice([64, 128, 192, 256])
        numel = fin * fout if kind is not LeafKind.NORM else fout
        flops = rng.uniform(1e6, 1e9)
        leaves.append(
            Leaf(
                name=f"l{i}",
                kind=kind,
                param_numel=numel + fout,
                weight_numel=numel if kind is not LeafKind.NORM else 0,
                in_features=fin,
                out_features=fout,
                in_heads=rng.choice([0, 0, 4, 8]),
                out_heads=rng.choice([0, 0, 4, 8]),
                vocab=False,
                fwd_flops=flops,
                matmul_flops=flops if kind is LeafKind.LINEAR else 0.0,
                fwd_bytes=rng.uniform(1e4, 1e7),
                saved_bytes=rng.uniform(1e3, 1e6),
            )
        )
    flows = []
    nodes = [UNIT_INPUT, *range(len(leaves))]
    for dst in [*range(len(leaves)), UNIT_OUTPUT]:
        for src in rng.sample([n for n in nodes if n == UNIT_INPUT or (dst == UNIT_OUTPUT or n < dst)], k=1):
            flows.append(
                Flow(
                    src=src,
                    dst=dst,
                    tensor_bytes=rng.uniform(1e4, 1e7),
                    glue_flops=rng.uniform(0, 1e7),
                    glue_bytes=rng.uniform(0, 1e6),
                    saved_bytes=rng.uniform(0, 1e5),
                    attn_flops=rng.choice([0.0, rng.uniform(1e6, 1e8)]),
                    attn_bytes=0.0,
                    attn_saved_bytes=0.0,
                )
            )
    return UnitProfile(
        signature=f"r{rng.random()}", leaves=tuple(leaves), flows=tuple(flows), input_bytes=1e5, output_bytes=1e5
    )


def tiny_cluster(memory_gib: float) -> Cluster:
    device = DeviceSpec(
        name="toy",
        roofline=Roofline(peak_flops={DType.BF16: 100e12, DType.FP32: 20e12}, memory_bandwidth_bytes_per_s=1e12),
        memory=DeviceMemory(capacity_bytes=memory_gib * 2**30, reserved_bytes=2**20),
    )
    link = LinkSpec(bandwidth_bytes_per_s=50e9, latency_s=5e-6)
    return Cluster(
        name="toy x 1",
        nodes=1,
        devices_per_node=4,
        device=device,
        intra_node=link,
        inter_node=LinkSpec(bandwidth_bytes_per_s=5e9, latency_s=2e-5),
    )


def kernel_variants(cfg: ParallelConfig, cluster: Cluster, fixed: dict) -> list[ParallelConfig]:
    """``cfg`` with every way of compiling (where the device compiles unasked), FP8,
    asynchronous TP and kept gather shards the device and the constraints allow,
    whichever ways the search's space tries: the brute force does not take the space's
    word that the ways it leaves out never win."""
    compiles = [False, True] if cluster.device.compiles else [fixed.get("compile", False)]
    fp8s = [False, True] if cluster.device.roofline.fp8_flops and cfg.dtype is DType.BF16 else [False]
    out = set()
    for compiled, fp8, overlapped, regather in itertools.product(compiles, fp8s, [False, True], [False, True]):
        if overlapped and not (cluster.device.async_tp and compiled and cfg.sequence_parallel):
            continue
        if regather and not (cfg.sequence_parallel and not compiled):
            continue
        if compiled and cfg.schedule.zero_bubble and cfg.pp > 1:  # torch splits eager backwards only
            continue
        v = dataclasses.replace(cfg, compile=compiled, fp8=fp8, async_tp=overlapped, regather=regather)
        if all(getattr(v, k) == fixed[k] for k in ("compile", "fp8", "async_tp", "regather") if k in fixed):
            out.add(v)
    return sorted(out, key=repr)


def brute_force_search(evaluator: ConfigSolver, constraints: dict, *, walked: bool = False) -> float:
    """Every configuration x every split x every per-unit option (identical units of a
    stage sharing a layout), priced by the cost model. A choice fits where every rank's
    memory bound does, or with ``walked``, where an interleaved 1F1B rank's predicted
    peak (its walk, :func:`autopar.cost.peak.rank_memory`) does."""
    model = evaluator.model
    fixed = check_constraints(constraints)
    configs, _ = enumerate_space(model.graph, model.cluster, model.global_batch_size, fixed)
    configs = [v for cfg in configs for v in kernel_variants(cfg, model.cluster, fixed)]
    n = len(model.graph.units)
    budget = evaluator.budget_bytes
    best = math.inf
    for cfg in configs:
        per_unit = [evaluator.priced_options(u, cfg, ALL_MODES) for u in range(n)]
        if cfg.virtual_stages > 1:
            splits = [evaluator.even_split(cfg.pp * cfg.virtual_stages, exact=True)]
        else:
            splits = [(0, *cuts, n) for cuts in itertools.combinations(range(1, n), cfg.pp - 1)]
        for bounds in splits:
            if bounds is None:
                continue
            for choice in itertools.product(*(range(len(p[0])) for p in per_unit)):
                stages, ok = [], True
                for r in range(cfg.pp):
                    units = [u for c in cfg.stages_of_rank(r) for u in range(bounds[c], bounds[c + 1])]
                    kinds = {}
                    for u in units:
                        kinds.setdefault(evaluator.unit_keys[u], set()).add(per_unit[u][1][choice[u]].layout)
                    if any(len(lays) > 1 for lays in kinds.values()):
                        ok = False
                        break
                    inflight = inflight_microbatches(cfg.schedule, cfg.pp, cfg.virtual_stages, cfg.num_microbatches, r)
                    held = {
                        u: stage_inflight_microbatches(
                            cfg.schedule, cfg.pp, cfg.virtual_stages, cfg.num_microbatches, c
                        )
                        for c in cfg.stages_of_rank(r)
                        for u in range(bounds[c], bounds[c + 1])
                    }
                    groups = [
                        (
                            1,
                            (
                                dataclasses.replace(
                                    per_unit[u][1][choice[u]],
                                    act_bytes=per_unit[u][1][choice[u]].act_bytes * held[u] / inflight,
                                ),
                            ),
                        )
                        for u in units
                    ]
                    mem = memory_of(groups, tuple((1,) for _ in units), inflight)
                    taken = {u: per_unit[u][0][choice[u]] for u in units}
                    mem -= shared_state_bytes(model, cfg, held_once_numel(model, cfg, taken))
                    mem += rank_buffer_bytes(model, tuple(units), cfg, inflight, lambda u: taken[u].layout)
                    if mem > budget * (1 + 1e-12) and not (walked and cfg.schedule is Schedule.INTERLEAVED_1F1B):
                        ok = False
                        break
                if not ok:
                    continue
                for c in range(len(bounds) - 1):
                    units = tuple(range(bounds[c], bounds[c + 1]))
                    opts = tuple(per_unit[u][0][choice[u]] for u in units)
                    inflight = stage_inflight_microbatches(
                        cfg.schedule, cfg.pp, cfg.virtual_stages, cfg.num_microbatches, c
                    )
                    stages.append(PricedStage(index=c, units=units, options=opts, inflight=inflight))
                if walked and cfg.schedule is Schedule.INTERLEAVED_1F1B:
                    if any(walked_bytes(evaluator, cfg, stages, r) > budget * (1 + 1e-12) for r in range(cfg.pp)):
                        continue
                best = min(best, timing(model, cfg, stages).step_s)
    return best


def search_and_brute_force(
    graph, cluster: Cluster, constraints: dict, *, global_batch_size: int, micro_batch_size: int
) -> tuple[SearchResult, float]:
    """The whole search (top 3) and :func:`brute_force_search` over one cost model:
    ``graph`` on ``cluster`` with Adam under ``constraints``, each with a fresh solver
    of the device's budget."""
    model = CostModel(graph=graph, cluster=cluster, optimizer=Optimizer.ADAM, global_batch_size=global_batch_size)

    def solver() -> ConfigSolver:
        return ConfigSolver(
            model=model, budget_bytes=budget_bytes(cluster.device.memory), micro_batches=(micro_batch_size,)
        )

    return search(solver(), check_constraints(constraints), top=3), brute_force_search(solver(), constraints)
