"""The stage knapsack (autopar.search.stage_solver) against brute-force enumeration:
one option per unit, fastest under the stage's memory, by its closed form for groups
of identical units, its vectorised table and its integer program."""

import dataclasses
import math
import random

import numpy as np
import pytest

from autopar.search import run_times, stage_solver
from autopar.search.run_times import homogeneous_times
from autopar.search.split_weights import TwoWeights
from autopar.search.stage_solver import Priced, brute_force_stage, solve_stage


def _random_groups(rng):
    groups = []
    for _ in range(rng.choice([1, 2, 3])):
        k = rng.choice([1, 1, 2, 3, 4])
        opts = []
        for lay in range(rng.choice([1, 2])):
            static = rng.uniform(0, 5)
            for mode in range(rng.choice([1, 2, 3, 4])):  # none, selective, op, full
                opts.append(
                    Priced(
                        time_s=rng.uniform(1, 2) * (1 + 0.3 * mode),
                        static_bytes=static,
                        act_bytes=rng.uniform(1, 10) / (1 + 3 * mode),
                        transient_bytes=rng.uniform(0, 4),
                        layout=lay,
                    )
                )
        groups.append((k, tuple(opts)))
    return groups


def _matches_brute_force(groups, budget, inflight):
    got, want = solve_stage(groups, budget, inflight), brute_force_stage(groups, budget, inflight)
    assert (got is None) == (want is None)
    if got is not None:
        assert got.time_s == pytest.approx(want.time_s, rel=1e-12)
        assert got.memory_bytes <= budget * (1 + 1e-12)


@pytest.mark.parametrize("seed", range(60))
def test_stage_knapsack_matches_brute_force(seed):
    rng = random.Random(seed)
    groups = _random_groups(rng)
    budget, inflight = rng.uniform(5, 60), rng.choice([1.0, 2.0, 3.5])
    _matches_brute_force(groups, budget, inflight)


@pytest.mark.parametrize("seed", range(20))
def test_vectorised_repeated_blocks_match_the_knapsack(seed):
    rng = random.Random(100 + seed)
    ((_, opts),) = [g for g in _random_groups(rng)][:1]
    budget, inflight = rng.uniform(5, 80), rng.choice([1.0, 2.0, 3.5])
    table = homogeneous_times(opts, 12, budget, inflight)
    for n in range(1, 13):
        found = solve_stage([(n, opts)], budget, inflight)
        assert table[n] == (pytest.approx(found.time_s, rel=1e-12) if found else math.inf)


@pytest.mark.parametrize("seed", range(20))
def test_four_recompute_modes_per_layout_match_brute_force(seed, monkeypatch):
    """Every layout with four options, each slower and smaller than the last (none,
    selective, op, full): the closed form scans two slow counts, the vectorised table
    the fourth's; both equal enumerating every assignment."""
    rng = random.Random(500 + seed)
    opts = []
    for lay in range(rng.choice([1, 2])):
        static, time_s, act = rng.uniform(0, 3), rng.uniform(1, 2), rng.uniform(6, 10)
        for _ in range(4):
            opts.append(Priced(time_s=time_s, static_bytes=static, act_bytes=act, transient_bytes=0.0, layout=lay))
            time_s, act = time_s * rng.uniform(1.05, 1.5), act * rng.uniform(0.3, 0.9)
    opts = tuple(opts)
    inflight = rng.choice([1.0, 2.0])
    k = rng.choice([3, 4, 5, 6])
    budget = k * rng.uniform(3, 12)
    got, want = solve_stage([(k, opts)], budget, inflight), brute_force_stage([(k, opts)], budget, inflight)
    assert (got is None) == (want is None)
    if got is not None:
        assert got.time_s == pytest.approx(want.time_s, rel=1e-12)
    table = homogeneous_times(opts, k, budget, inflight)
    assert table[k] == (pytest.approx(want.time_s, rel=1e-12) if want else math.inf)
    monkeypatch.setattr(run_times, "KERNEL_ELEMENTS", 1)  # one count per slice: the same table
    assert np.array_equal(homogeneous_times(opts, k, budget, inflight), table)


def test_mixes_of_both_slow_options_are_priced_where_they_can_win(monkeypatch):
    """Deep stages (up to 60 blocks, several budgets at once, loose to tight): leaving out
    the mixes of the two slowest options that cannot beat a mix of one of them gives the
    same table as pricing every mix, on draws where such mixes are the fastest somewhere."""
    full, per_pass = run_times._mixed_rows, run_times.MIXED_ROWS_PER_PASS
    mixes_won = 0
    for seed in range(12):
        rng = random.Random(900 + seed)
        opts, time_s, act = [], rng.uniform(1, 2), rng.uniform(6, 10)
        static = rng.uniform(0, 3)
        for _ in range(4):
            opts.append(Priced(time_s=time_s, static_bytes=static, act_bytes=act, transient_bytes=0.0, layout=0))
            time_s, act = time_s * rng.uniform(1.01, 1.5), act * rng.uniform(0.3, 0.95)
        opts, n_max = tuple(opts), 60
        budgets = np.array([n_max * rng.uniform(1, 12) for _ in range(6)])
        inflight = np.array([rng.choice([1.0, 2.0, 3.0]) for _ in range(6)])
        pruned = homogeneous_times(opts, n_max, budgets, inflight)
        monkeypatch.setattr(run_times, "MIXED_ROWS_PER_PASS", 7)  # more passes: the same table
        assert np.array_equal(homogeneous_times(opts, n_max, budgets, inflight), pruned), seed
        monkeypatch.setattr(
            run_times,
            "_mixed_rows",
            lambda n, rooms, w, t, slow, found: run_times._mix_rows(n, rooms, w, t, slow),
        )
        assert np.array_equal(homogeneous_times(opts, n_max, budgets, inflight), pruned), seed
        monkeypatch.setattr(run_times, "_mixed_rows", lambda n, rooms, w, t, slow, found: np.full(found.shape, np.inf))
        mixes_won += bool((pruned < homogeneous_times(opts, n_max, budgets, inflight)).any())
        monkeypatch.setattr(run_times, "_mixed_rows", full)
        monkeypatch.setattr(run_times, "MIXED_ROWS_PER_PASS", per_pass)
    assert mixes_won


@pytest.mark.parametrize("seed", range(40))
def test_two_weights_match_every_per_unit_assignment(seed):
    """A kind of unit in both stages of a V's rank: some units weigh their activations
    more. The closed form (smallest activations on the heavier units, the fastest two
    split over the heavier and lighter slots left) equals enumerating every option of
    every unit, each unit weighed by its own stage, within one layout."""
    rng = random.Random(1300 + seed)
    opts = []
    for lay in range(rng.choice([1, 2])):
        static, time_s, act = rng.uniform(0, 3), rng.uniform(1, 2), rng.uniform(6, 10)
        for _ in range(rng.choice([1, 2, 3, 4])):
            opts.append(Priced(time_s=time_s, static_bytes=static, act_bytes=act, transient_bytes=0.0, layout=lay))
            time_s, act = time_s * rng.uniform(1.05, 1.5), act * rng.uniform(0.3, 0.9)
    opts = tuple(opts)
    k = rng.choice([2, 3, 4, 5])
    weights = TwoWeights(heavy_units=rng.randint(1, k - 1), heavy=rng.uniform(1.5, 4.0), light=rng.uniform(0.2, 1.4))
    inflight = rng.choice([1.0, 2.0])
    budget = k * rng.uniform(3, 14)
    got = solve_stage([(k, opts)], budget, inflight, weights=[weights])
    want = math.inf
    for lay in {o.layout for o in opts}:
        mine = [o for o in opts if o.layout == lay]
        per_unit = [
            (1, tuple(dataclasses.replace(o, act_bytes=o.act_bytes * f) for o in mine))
            for f in [weights.heavy] * weights.heavy_units + [weights.light] * (k - weights.heavy_units)
        ]
        found = brute_force_stage(per_unit, budget, inflight)
        want = min(want, found.time_s if found else math.inf)
    assert (got is None) == math.isinf(want)
    if got is not None:
        assert got.time_s == pytest.approx(want, rel=1e-12)
        assert got.memory_bytes <= budget * (1 + 1e-12)


def _random_layouts(rng, n_layouts):
    opts = []
    for lay in range(n_layouts):
        static, time_s, act = rng.uniform(0, 3), rng.uniform(1, 2), rng.uniform(6, 10)
        for _ in range(rng.choice([1, 2, 3])):
            opts.append(Priced(time_s=time_s, static_bytes=static, act_bytes=act, transient_bytes=0.0, layout=lay))
            time_s, act = time_s * rng.uniform(1.05, 1.5), act * rng.uniform(0.3, 0.9)
    return tuple(opts)


@pytest.mark.parametrize("seed", range(25))
def test_two_weights_beside_another_group_match_every_per_unit_assignment(seed):
    """Two repeated kinds (the integer program), one of them in both stages of a V: its
    heavier and lighter units solved as two groups that share a layout, equal to
    enumerating every option of every unit."""
    rng = random.Random(1700 + seed)
    opts, other = _random_layouts(rng, rng.choice([1, 2])), _random_layouts(rng, rng.choice([1, 2]))
    k = rng.choice([2, 3, 4])
    weights = TwoWeights(heavy_units=rng.randint(1, k - 1), heavy=rng.uniform(1.5, 4.0), light=rng.uniform(0.2, 1.4))
    inflight, budget = rng.choice([1.0, 2.0]), (k + 2) * rng.uniform(3, 14)
    got = solve_stage([(k, opts), (2, other)], budget, inflight, weights=[weights, None])
    want = math.inf
    factors = [weights.heavy] * weights.heavy_units + [weights.light] * (k - weights.heavy_units)
    for lay in {o.layout for o in opts}:
        mine = [o for o in opts if o.layout == lay]
        per_unit = [(1, tuple(dataclasses.replace(o, act_bytes=o.act_bytes * f) for o in mine)) for f in factors]
        found = brute_force_stage([*per_unit, (2, other)], budget, inflight)
        want = min(want, found.time_s if found else math.inf)
    assert (got is None) == math.isinf(want)
    if got is not None:
        assert got.time_s == pytest.approx(want, rel=1e-12)
        assert got.memory_bytes <= budget * (1 + 1e-12)


@pytest.mark.parametrize("seed", range(40))
def test_two_kinds_of_two_weights_match_every_per_unit_assignment_without_the_integer_program(seed, monkeypatch):
    """Gemma 3's two kinds on an interleaved rank: either kind or both in chunks that
    hold unequal micro-batches, beside up to two single units. The frontier of the
    smaller kind (its smallest activations on its heavier units) with the larger
    kind's closed form equals enumerating every option of every unit, each weighed by
    its own chunk, and the integer program is never asked."""

    def refuse(*args, **kwargs):
        raise AssertionError("the integer program was asked")

    monkeypatch.setattr(stage_solver, "_solve_ilp_weighted", refuse)
    rng = random.Random(2600 + seed)
    kinds, weights = [], []
    for _ in range(2):
        k = rng.choice([2, 3])
        kinds.append((k, _random_layouts(rng, rng.choice([1, 2]))))
        heavy = TwoWeights(heavy_units=rng.randint(1, k - 1), heavy=rng.uniform(1.5, 4.0), light=rng.uniform(0.2, 1.4))
        weights.append(heavy if rng.random() < 0.7 else None)
    singles = [(1, _random_layouts(rng, 1)) for _ in range(rng.choice([0, 1, 2]))]
    inflight = rng.choice([1.0, 2.0])
    budget = (kinds[0][0] + kinds[1][0] + len(singles)) * rng.uniform(3, 14) * inflight
    got = solve_stage([*kinds, *singles], budget, inflight, weights=[*weights, *[None] * len(singles)])

    def per_unit(k, opts, w):
        factors = [1.0] * k if w is None else [w.heavy] * w.heavy_units + [w.light] * (k - w.heavy_units)
        return [(1, tuple(dataclasses.replace(o, act_bytes=o.act_bytes * f) for o in opts)) for f in factors]

    want = math.inf
    (k0, opts0), (k1, opts1) = kinds
    for lay0 in {o.layout for o in opts0}:
        for lay1 in {o.layout for o in opts1}:
            units = per_unit(k0, tuple(o for o in opts0 if o.layout == lay0), weights[0])
            units += per_unit(k1, tuple(o for o in opts1 if o.layout == lay1), weights[1])
            found = brute_force_stage([*units, *singles], budget, inflight)
            want = min(want, found.time_s if found else math.inf)
    assert (got is None) == math.isinf(want)
    if got is not None:
        assert got.time_s == pytest.approx(want, rel=1e-12)
        assert got.memory_bytes <= budget * (1 + 1e-12)


@pytest.mark.parametrize("seed", range(60))
def test_two_kinds_of_repeated_units_match_brute_force_without_the_integer_program(seed, monkeypatch):
    """Two groups of identical units (Gemma 3's sliding-window and global layers) beside
    up to two single units: the frontier of the smaller group's counts with the larger
    group's closed form finds what enumerating every per-unit assignment finds, and the
    integer program is never asked."""

    def refuse(*args, **kwargs):
        raise AssertionError("the integer program was asked")

    monkeypatch.setattr(stage_solver, "_solve_ilp_weighted", refuse)
    rng = random.Random(2000 + seed)
    groups = []
    for k in (rng.choice([2, 3, 4, 5]), rng.choice([2, 3, 4]), *([1] * rng.choice([0, 1, 2]))):
        (_, opts), *_ = _random_groups(random.Random(rng.random()))
        groups.append((k, opts))
    rng.shuffle(groups)
    budget, inflight = rng.uniform(10, 120), rng.choice([1.0, 2.0, 3.5])
    _matches_brute_force(groups, budget, inflight)


def test_ranges_of_the_same_content_in_another_order_give_each_unit_its_own_kinds_options():
    """Two ranges holding as many blocks of each kind, between blocks of the same kinds,
    in another order (Gemma 3's global layers at other places): the second, solved from
    the first's memo, gives each unit an option of its own kind, as a fresh solver does.
    Handing the first range's options over by position had put global layers' options on
    sliding-window ones, and a plan predicted at 81.9 GiB on a 79.6 GiB H100 passed as
    fitting."""
    import torch

    from autopar.cost.model import CostModel
    from autopar.cost.peak import budget_bytes
    from autopar.graph import extract
    from autopar.models import MLPConfig, MLPStack
    from autopar.plan import ParallelConfig
    from autopar.search.scan import ALL_MODES
    from autopar.search.solve import ConfigSolver
    from autopar.vocab import Optimizer

    from .exact_reference import tiny_cluster

    small, large = 256, 1024
    widths = (small, small, large, small, small, large, small, small)  # blocks are units 1..8
    graph = extract(
        MLPStack(MLPConfig(in_dim=64, dim=128, out_dim=32, widths=widths)),
        sample_input=torch.zeros(1, 256, 64),
        dtype="bf16",
    )
    cluster = tiny_cluster(0.02)
    model = CostModel(graph=graph, cluster=cluster, optimizer=Optimizer.ADAM, global_batch_size=8)
    cfg = ParallelConfig(dp=1, tp=1, pp=2, micro_batch_size=1, num_microbatches=8, schedule="1f1b")
    first, second = tuple(range(1, 5)), tuple(range(5, 9))  # small small large small | small large small small
    solver = ConfigSolver(model=model, budget_bytes=budget_bytes(cluster.device.memory))
    assert solver.range_signature[1, 5] == solver.range_signature[5, 9]
    solver.solve_units(first, cfg, ALL_MODES, 2.0, 1)
    stage, _ = solver.solve_units(second, cfg, ALL_MODES, 2.0, 1)
    fresh, _ = ConfigSolver(model=model, budget_bytes=solver.budget_bytes).solve_units(second, cfg, ALL_MODES, 2.0, 1)
    for u, got, want in zip(second, stage.options, fresh.options):
        assert got.layout.param_numel == solver.options(u, cfg, ALL_MODES)[0].layout.param_numel
        assert got.recompute is want.recompute
