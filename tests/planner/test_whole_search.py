"""The whole search (bounds, pruning and all) against brute-force enumeration of the same
cost model (:mod:`tests.planner.exact_reference`): plain, with the kernel options a
device may search, and on two stages per rank."""

import dataclasses
import math

import pytest

from autopar.cost.model import CostModel
from autopar.cost.peak import budget_bytes
from autopar.graph import extract
from autopar.models import GPT, GPTConfig, Llama, LlamaConfig
from autopar.search.bounds import TimeBound
from autopar.search.constraints import check_constraints
from autopar.search.scan import ALL_MODES, search
from autopar.search.solve import ConfigSolver
from autopar.search.space import enumerate_space
from autopar.search.walk_room import with_walk_room
from autopar.vocab import Optimizer, Schedule, TPStyle

from .exact_reference import brute_force_search, search_and_brute_force, tiny_cluster


@pytest.mark.parametrize("memory_gib", [0.012, 0.02, 0.03, 0.1])
def test_whole_search_matches_brute_force(memory_gib):
    model = GPT(GPTConfig(vocab_size=512, seq_len=256, dim=256, n_layers=2, n_heads=8))
    graph = extract(model, seq_len=256, dtype="bf16")
    cluster = tiny_cluster(memory_gib)
    constraints = {"micro_batch_size": 2}
    result, want = search_and_brute_force(graph, cluster, constraints, global_batch_size=8, micro_batch_size=2)
    if math.isinf(want):
        assert not result.best.fits
    else:
        assert result.best.fits
        assert result.best.step_time_s == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize(("fp8_efficiency", "bandwidth", "fp8_wins"), [(0.5, 1e12, False), (0.9, 10e12, True)])
@pytest.mark.parametrize("memory_gib", [0.02, 0.1])
def test_whole_search_with_kernel_options_matches_brute_force(memory_gib, fp8_efficiency, bandwidth, fp8_wins):
    """On a device that compiles unasked, has FP8 matmuls and runs asynchronous TP, the
    search tries compiled blocks only (eager under a zero-bubble schedule), asynchronous
    TP only where it applies and FP8 both ways; brute force over every way of all three
    (and every configuration, split and per-unit option) finds nothing faster. FP8 loses where its casts cost more than its
    matmuls save (a slow FP8 rate, little bandwidth) and wins on fast FP8 and memory."""
    model = GPT(GPTConfig(vocab_size=512, seq_len=256, dim=256, n_layers=2, n_heads=8))
    graph = extract(model, seq_len=256, dtype="bf16")
    tiny = tiny_cluster(memory_gib)
    roof = dataclasses.replace(
        tiny.device.roofline,
        fp8_flops=200e12,
        fp8_matmul_efficiency=fp8_efficiency,
        memory_bandwidth_bytes_per_s=bandwidth,
    )
    device = dataclasses.replace(tiny.device, roofline=roof, compiles=True, async_tp=True)
    cluster = dataclasses.replace(tiny, device=device)
    constraints = {"micro_batch_size": 2}
    model = CostModel(graph=graph, cluster=cluster, optimizer=Optimizer.ADAM, global_batch_size=8)

    def solver() -> ConfigSolver:
        return ConfigSolver(model=model, budget_bytes=budget_bytes(cluster.device.memory), micro_batches=(2,))

    configs, _ = enumerate_space(graph, cluster, 8, check_constraints(constraints))
    split = [c.pp > 1 and c.schedule.zero_bubble for c in configs]
    assert all(c.compile != s and c.async_tp == (c.sequence_parallel and not s) for c, s in zip(configs, split))
    assert {c.fp8 for c in configs} == {False, True}
    want = brute_force_search(solver(), constraints)
    result = search(solver(), check_constraints(constraints), top=3)
    assert math.isfinite(want) and result.best.fits
    assert result.best.step_time_s == pytest.approx(want, rel=1e-9)
    assert result.best.config.fp8 is fp8_wins


@pytest.mark.parametrize("schedule", [None, "interleaved-zb"])
@pytest.mark.parametrize("memory_gib", [0.01, 0.02, 1.0])
def test_whole_search_matches_brute_force_on_two_stages_per_rank(memory_gib, schedule):
    """Interleaved 1F1B, interleaved ZB and ZB-V (its V placement: rank 0 holds the
    first and the last stage) on an untied 4-block Llama, and interleaved ZB alone: the
    search equals brute force. ZeRO-2 is fixed: under DDP and ZeRO-1 a longer backward
    hides more of the data-parallel tail, so recomputation can pay off through the tail,
    which the per-rank choice does not see (for interleaved 1F1B as well)."""
    model = Llama(LlamaConfig(vocab_size=512, seq_len=128, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=256))
    graph = extract(model, seq_len=128, dtype="bf16")
    cluster = tiny_cluster(memory_gib)
    constraints = {"micro_batch_size": 2, "pp": 2, "tp": 1, "virtual_stages": 2, "zero_stage": 2}
    constraints.update({"schedule": schedule} if schedule else {})
    model = CostModel(graph=graph, cluster=cluster, optimizer=Optimizer.ADAM, global_batch_size=8)

    def solver() -> ConfigSolver:
        return ConfigSolver(model=model, budget_bytes=budget_bytes(cluster.device.memory), micro_batches=(2,))

    configs, _ = enumerate_space(graph, cluster, 8, check_constraints(constraints))
    offered = {Schedule(schedule)} if schedule else {Schedule.INTERLEAVED_1F1B, Schedule.INTERLEAVED_ZB, Schedule.ZBV}
    assert {c.schedule for c in configs} == offered
    want = brute_force_search(solver(), constraints)
    result = search(solver(), check_constraints(constraints), top=3, walk_room=False)
    # at 0.01 GiB only full or per-operator recomputation fits, which a split backward cannot run
    assert result.best.fits == math.isfinite(want) == (memory_gib > 0.01 or schedule is None)
    if result.best.fits:
        assert result.best.step_time_s == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize(("memory_gib", "gains"), [(0.009, True), (0.01, True), (0.011, True), (0.012, False)])
def test_the_walk_room_is_between_the_bound_and_the_walked_optimum(memory_gib, gains):
    """Interleaved 1F1B ranks re-solved in the room their walk leaves below the bound
    (:mod:`autopar.search.walk_room`): never slower than the search under the bound, never
    faster than brute force under the walk itself (every configuration, split and option
    whose ranks' predicted peaks fit), and what it returns fits by its prediction. Where
    memory is tight it is faster (0.009 GiB: 0.336 ms under the bound, 0.317 with the
    room, 0.316 the walked optimum; 0.011 GiB: the walked optimum); with room to spare
    all three agree."""
    model = Llama(LlamaConfig(vocab_size=512, seq_len=128, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=256))
    graph = extract(model, seq_len=128, dtype="bf16")
    cluster = tiny_cluster(memory_gib)
    constraints = {"micro_batch_size": 2, "pp": 2, "tp": 1, "virtual_stages": 2, "zero_stage": 2}
    constraints["schedule"] = "interleaved-1f1b"
    model = CostModel(graph=graph, cluster=cluster, optimizer=Optimizer.ADAM, global_batch_size=8)

    def solver() -> ConfigSolver:
        return ConfigSolver(model=model, budget_bytes=budget_bytes(cluster.device.memory), micro_batches=(2,))

    bound = search(solver(), check_constraints(constraints), top=0, walk_room=False).best
    roomy = search(solver(), check_constraints(constraints), top=0).best
    walked = brute_force_search(solver(), constraints, walked=True)
    assert bound.fits and roomy.fits
    assert walked * (1 - 1e-9) <= roomy.step_time_s <= bound.step_time_s
    assert (roomy.step_time_s < bound.step_time_s) is gains
    assert max(s.memory.total_bytes for s in roomy.prediction.stages) <= cluster.device.memory.capacity_bytes


def test_the_walk_room_is_skipped_only_where_it_cannot_beat_the_fastest_so_far():
    """The room is priced for a configuration only while its first round (every rank
    given the most room any round gives it) beats the fastest step the search holds: at
    the configuration's own lower bound (every unit at its fastest option) nothing can,
    and the outcome comes back as it was; at its own step time the room is taken, as
    with no incumbent at all."""
    model = Llama(LlamaConfig(vocab_size=512, seq_len=128, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=256))
    graph = extract(model, seq_len=128, dtype="bf16")
    cluster = tiny_cluster(0.009)
    constraints = {"micro_batch_size": 2, "pp": 2, "tp": 1, "virtual_stages": 2, "zero_stage": 2}
    constraints["schedule"] = "interleaved-1f1b"
    model = CostModel(graph=graph, cluster=cluster, optimizer=Optimizer.ADAM, global_batch_size=8)
    solver = ConfigSolver(model=model, budget_bytes=budget_bytes(cluster.device.memory), micro_batches=(2,))
    outcome = search(solver, check_constraints(constraints), top=0, walk_room=False).best
    modes = ALL_MODES
    roomy = with_walk_room(solver, outcome, modes)
    assert roomy.step_time_s < outcome.step_time_s  # the room pays here (the test above, 0.009 GiB)
    floor_s = TimeBound(solver, modes)(outcome.config)
    assert with_walk_room(solver, outcome, modes, beat_s=floor_s) is outcome
    assert with_walk_room(solver, outcome, modes, beat_s=outcome.step_time_s) == roomy


def test_a_tied_weight_is_counted_once_only_where_its_owners_split_it_alike():
    """A tied GPT at 1K tokens on devices where every byte counts (the least memory any
    plan fits in, to 0.0001 GiB): the fastest choice that fits holds the tied table once
    (the embedding split by vocabulary and the head column-parallel: both split it along
    its rows) and fits only by recomputing both blocks and the head per operator. The
    search once solved the stage with the saving for every choice and, when its pick kept
    the table twice, again without it, missing such a pick; it now solves each pair of the
    owners' layouts that holds it once with its saving, and equals brute force."""
    graph = extract(GPT(GPTConfig(vocab_size=512, seq_len=1024, dim=256, n_layers=2, n_heads=8)), seq_len=1024)
    assert graph.shared
    constraints = {"micro_batch_size": 2, "compile": False, "regather": False}
    for memory_gib in (0.0197, 0.0198):
        result, want = search_and_brute_force(
            graph, tiny_cluster(memory_gib), constraints, global_batch_size=8, micro_batch_size=2
        )
        assert result.best.fits == math.isfinite(want) == (memory_gib == 0.0198)
    assert result.best.step_time_s == pytest.approx(want, rel=1e-9)
    options = [o for stage in result.best.stages for o in stage.options]
    assert [o.recompute.value for o in options] == ["none", "full", "full", "op"]
    assert options[0].layout.styles[0] is TPStyle.VOCAB and options[-1].layout.styles[-1] is TPStyle.COLUMN
