"""How unevenly ranks finish the same work, measured on 2 gloo ranks with known noise."""

import math
import random
import time

import pytest
import torch
import torch.distributed as dist

from autopar.runtime.spmd import SPMDSettings, run_spmd
from profiler.sync_skew import noise_s_per_sqrt_s, speed_spread, spread_from_times, sync_noise_s_per_sqrt_s

pytestmark = pytest.mark.multiprocess
SETTINGS = SPMDSettings(timeout_s=120, pg_timeout_s=60)
INJECTED = 0.02
"""Seconds per sqrt(second): 1.3 ms of noise after 4 ms of work, 3.8 ms after 36 ms."""
WORK_S = (0.004, 0.016, 0.036)
"""Long enough that the injected noise almost never asks for a negative sleep."""


def _noisy_and_even(rank, world, measure, noisy_seconds, seed):
    """``measure(work)`` with work slept for ``noisy_seconds(rng, seconds)`` (each rank
    its own seeded draws), then with the same sleep on every rank."""
    rng = random.Random(seed + rank)

    def noisy(seconds):
        time.sleep(noisy_seconds(rng, seconds))

    def even(seconds):
        time.sleep(seconds)

    return {name: measure(work) for name, work in (("noisy", noisy), ("even", even))}


def _random_walk(rng, seconds):
    return max(seconds + rng.gauss(0.0, INJECTED * seconds**0.5), 0.0)


def _sync_noise(work):
    return sync_noise_s_per_sqrt_s(dist.group.WORLD, torch.device("cpu"), work=work, work_s=WORK_S, meetings=100)


def test_the_noise_injected_into_each_ranks_work_is_measured_back():
    """Each rank sleeps its work with Gaussian noise of a known standard deviation,
    ``INJECTED * sqrt(T)``, drawn independently per rank. Sleeps also wake up unevenly,
    more so on a busy machine (0.02-0.05 of ``INJECTED`` on an idle box, 0.26 once under a
    full test suite), and that jitter is independent of the injected noise, so the two add
    in variance: the same run measures the jitter alone by sleeping the same time on both
    ranks, and the injected noise, recovered as ``sqrt(noisy^2 - even^2)``, is within 15%
    of ``INJECTED`` (the seeded draws, 100 per length, give 0.0186; what is left is their
    own sampling error), with the jitter well below it. Both ranks report one figure."""
    results = run_spmd(_noisy_and_even, 2, _sync_noise, _random_walk, 0, settings=SETTINGS)
    assert results[0] == results[1]
    got = results[0]
    assert got["even"] < 0.5 * got["noisy"]
    assert math.sqrt(got["noisy"] ** 2 - got["even"] ** 2) == pytest.approx(INJECTED, rel=0.15)


def test_the_estimate_from_work_times_by_hand():
    """Two ranks finish T seconds of work k sqrt(T) apart around T: each meeting waits
    k sqrt(T) for the slowest beyond the mean, so e_2 sigma = k and sigma = k sqrt(pi).
    Three ranks spread by -a, 0, +a wait a beyond the mean: sigma = a / e_3 with
    e_3 = 3 / (2 sqrt(pi)) when a = k sqrt(T)."""
    k = 0.01
    two = [[[t - k * math.sqrt(t)] * 4, [t + k * math.sqrt(t)] * 4] for t in (0.002, 0.008, 0.032)]
    assert noise_s_per_sqrt_s(two) == pytest.approx(k * math.sqrt(math.pi), rel=1e-9)
    three = [[[t - k * math.sqrt(t)], [t], [t + k * math.sqrt(t)]] for t in (0.002, 0.032)]
    assert noise_s_per_sqrt_s(three) == pytest.approx(k * 2 * math.sqrt(math.pi) / 3, rel=1e-9)
    assert noise_s_per_sqrt_s([[[0.01, 0.01], [0.01, 0.01]], [[0.02], [0.02]]]) == 0.0


def _one_rank(rank, world):
    group = dist.new_group([0])
    errors = []
    if rank == 0:
        for measure in (
            lambda: sync_noise_s_per_sqrt_s(group, torch.device("cpu")),
            lambda: speed_spread(group, torch.device("cpu"), 0.0),
        ):
            try:
                measure()
            except ValueError as exc:
                errors.append(str(exc))
    return errors


def test_one_rank_and_one_work_length_are_refused():
    with pytest.raises(ValueError, match="two different work lengths"):
        sync_noise_s_per_sqrt_s(None, torch.device("cpu"), work_s=(0.01, 0.01))
    noise, spread = run_spmd(_one_rank, 2, settings=SETTINGS)[0]
    assert "sync-noise measurement needs a group of 2 ranks or more, got 1" in noise
    assert "speed-spread measurement needs a group of 2 ranks or more, got 1" in spread


SPREAD = 0.1
"""Each rank runs each stretch of work at a speed drawn 10% apart (one standard deviation)."""


def _wandering_speed(rng, seconds):
    return seconds * max(1.0 + rng.gauss(0.0, SPREAD), 0.0)


def _speed_spread(work):
    return speed_spread(dist.group.WORLD, torch.device("cpu"), 0.0, work=work, work_s=0.05, meetings=40)


def test_a_spread_in_the_ranks_speed_is_measured_back():
    """Each rank sleeps each 50 ms stretch at a speed drawn independently with a known
    spread, 10%: the measurement recovers it within 30% (40 draws per rank; the waits
    are half the ranks' difference, a noisy statistic). Sleeps also wake up unevenly,
    by how busy the machine is (a spread of 0.031 once, under a full test suite),
    independently of the drawn speeds: as in the sync-noise test, the same run measures
    that jitter alone by sleeping the same time on both ranks, well below the drawn
    spread, and the drawn spread is what is left in variance. A fixed bound on the jitter
    failed a CI run on a busy machine. Both ranks report one figure."""
    results = run_spmd(_noisy_and_even, 2, _speed_spread, _wandering_speed, 100, settings=SETTINGS)
    assert results[0] == results[1]
    got = results[0]
    assert got["even"] < 0.5 * got["noisy"]
    assert math.sqrt(got["noisy"] ** 2 - got["even"] ** 2) == pytest.approx(SPREAD, rel=0.3)


def test_the_spread_from_work_times_by_hand():
    """Two ranks finishing T seconds of work a T apart around T wait a T beyond the mean:
    delta T e_2 = a T, so delta = a sqrt(pi) with no random walk; a random walk of sigma
    explains sigma^2 T of the variance, and delta takes the rest; a random walk that
    explains all of it leaves 0."""
    a, t = 0.05, 0.2
    times = [[t * (1 - a)] * 3, [t * (1 + a)] * 3]
    assert spread_from_times(times, 0.0) == pytest.approx(a * math.sqrt(math.pi), rel=1e-9)
    sigma = 0.01
    expected = math.sqrt((a * t * math.sqrt(math.pi)) ** 2 - sigma**2 * t) / t
    assert spread_from_times(times, sigma) == pytest.approx(expected, rel=1e-9)
    assert spread_from_times(times, 1.0) == 0.0
