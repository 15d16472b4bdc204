"""How unevenly ranks finish the same work, measured on 2 gloo ranks with known noise."""

import math
import random
import time

import pytest
import torch
import torch.distributed as dist

from autopar.runtime.spmd import SPMDSettings, run_spmd
from profiler.sync_skew import noise_s_per_sqrt_s, sync_noise_s_per_sqrt_s

pytestmark = pytest.mark.multiprocess
SETTINGS = SPMDSettings(timeout_s=120, pg_timeout_s=60)
INJECTED = 0.02
"""Seconds per sqrt(second): 1.3 ms of noise after 4 ms of work, 3.8 ms after 36 ms."""
WORK_S = (0.004, 0.016, 0.036)
"""Long enough that the injected noise almost never asks for a negative sleep."""


def _measure(rank, world):
    rng = random.Random(rank)

    def noisy(seconds):
        time.sleep(max(seconds + rng.gauss(0.0, INJECTED * seconds ** 0.5), 0.0))

    def even(seconds):
        time.sleep(seconds)

    cpu = torch.device("cpu")
    return {name: sync_noise_s_per_sqrt_s(dist.group.WORLD, cpu, work=work, work_s=WORK_S, meetings=100)
            for name, work in (("noisy", noisy), ("even", even))}


def test_the_noise_injected_into_each_ranks_work_is_measured_back():
    """Each rank sleeps its work with Gaussian noise of a known standard deviation,
    ``INJECTED * sqrt(T)``, drawn independently per rank: the measurement recovers
    ``INJECTED`` within 15% (the seeded draws, 100 per length, give 0.0186 on this box;
    what is left is their own sampling error). Sleeping the same time on both ranks
    measures a small part of it (sleeps wake up unevenly too: 0.02-0.05 of it over nine
    runs). Both ranks report one figure."""
    results = run_spmd(_measure, 2, settings=SETTINGS)
    assert results[0] == results[1]
    got = results[0]
    assert got["noisy"] == pytest.approx(INJECTED, rel=0.15)
    assert got["even"] < 0.25 * INJECTED


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
    if rank == 0:
        try:
            sync_noise_s_per_sqrt_s(group, torch.device("cpu"))
        except ValueError as exc:
            return str(exc)
    return ""


def test_one_rank_and_one_work_length_are_refused():
    with pytest.raises(ValueError, match="two different work lengths"):
        sync_noise_s_per_sqrt_s(None, torch.device("cpu"), work_s=(0.01, 0.01))
    assert "group of 2 ranks or more, got 1" in run_spmd(_one_rank, 2, settings=SETTINGS)[0]
