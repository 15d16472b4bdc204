"""The benchmarks' combining of profile rounds: network sweeps pooled, group measurements by their medians."""

import dataclasses
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "profiler"))

import _local_runs
from profile_factories import network

from autopar.profiles.network_section import CommPoint, CommSeries
from autopar.profiles.report import ProfileReport
from autopar.profiles.sections import Timing
from profiler.fit import coefficients

SIZES = tuple(2**k for k in range(10, 22, 2))


def _sweep(alpha_s: float, bandwidth: float, repeats: int, slow: float = 1.0, **group: float) -> dict:
    """A 2-rank intra all-reduce sweep on the exact line ``alpha, bandwidth`` (the cost
    model's coefficients), each size's repeats ``t, ..., t, slow x t``; ``group``: its
    measurements on the real groups (``tp_overhead_s=...``)."""
    c_bw, c_lat = coefficients("all_reduce", "intra", 2)
    points = []
    for nbytes in SIZES:
        t = c_lat * alpha_s + c_bw * nbytes / bandwidth
        time = Timing.of([t] * (repeats - 1) + [slow * t])
        points.append(
            CommPoint(
                nbytes=float(nbytes), time=time, algbw_bytes_per_s=nbytes / t, busbw_bytes_per_s=c_bw * nbytes / t
            )
        )
    series = CommSeries(
        op="all_reduce", level="intra", label="intra group", ranks=(0, 1), per_node=2, nodes=1, points=tuple(points)
    )
    base = network(node_of_rank=("a", "a"), inter=None, **group)
    return ProfileReport(network=dataclasses.replace(base.network, series=(series,))).to_dict()


def test_pooled_points_are_the_mean_over_every_repeat_and_the_fit_goes_through_them():
    """Two rounds on the lines alpha 1e-4 and 3e-4 s at 1 GB/s, with 3 and 1 repeats:
    each pooled point costs the repeat-weighted mean, ``(3 t1 + t2) / 4``, so the pool is
    the line alpha ``1.5e-4`` s at 1 GB/s, and the refit finds it."""
    one, two = _sweep(1e-4, 1e9, 3), _sweep(3e-4, 1e9, 1)
    pooled = ProfileReport.from_dict(_local_runs.pool_sweeps(one, [one, two])).network
    c_bw, c_lat = coefficients("all_reduce", "intra", 2)
    for nbytes, point in zip(SIZES, pooled.series[0].points):
        t1, t2 = c_lat * 1e-4 + c_bw * nbytes / 1e9, c_lat * 3e-4 + c_bw * nbytes / 1e9
        assert point.time.per_call_s == pytest.approx((3 * t1 + t2) / 4)
        assert (point.time.repeats, point.time.min_s, point.time.max_s) == (4, pytest.approx(t1), pytest.approx(t2))
        assert point.busbw_bytes_per_s == pytest.approx(c_bw * nbytes / point.time.per_call_s)
    fit = next(f for f in pooled.fits if f.ops == ("all_reduce",))
    assert (fit.alpha_s, fit.bandwidth_bytes_per_s) == (pytest.approx(1.5e-4), pytest.approx(1e9))


def test_a_slow_repeat_counts_in_the_pool():
    """Repeats ``t, t, 4 t`` in each round: the pooled time per call is ``2 t``, where the
    median of the medians would say ``t``."""
    one = _sweep(1e-4, 1e9, 3, slow=4.0)
    pooled = ProfileReport.from_dict(_local_runs.pool_sweeps(one, [one, one])).network
    for point in pooled.series[0].points:
        assert point.time.per_call_s == pytest.approx(2 * point.time.median_s)


def test_sweeps_of_other_sizes_are_refused():
    one = _sweep(1e-4, 1e9, 3)
    other = _sweep(1e-4, 1e9, 3)
    other["network"]["series"][0]["points"][2]["nbytes"] *= 2
    with pytest.raises(ValueError, match="different shapes cannot be pooled"):
        _local_runs.pool_sweeps(one, [one, other])


def test_combined_rounds_keep_the_median_network_and_the_median_of_each_group_measurement():
    """The report kept is the one with the median 1 MiB time, its sweeps pooled over the
    rounds (equal repeats on the lines alpha 3, 1 and 2 x 1e-4 s: the pooled fit finds
    their mean, 2e-4); each measurement on the real groups is the median over the rounds
    on its own, so one round's outlier (a tensor-parallel overhead read as 12 us where
    the others read 300-400) does not ride in with the report chosen for its curves."""
    rounds = [
        _sweep(3e-4, 1e9, 3, tp_overhead_s=12e-6, sync_speed_spread=0.09),
        _sweep(1e-4, 1e9, 3, tp_overhead_s=4e-4, sync_speed_spread=0.0),
        _sweep(2e-4, 1e9, 3, tp_overhead_s=3e-4, sync_speed_spread=0.07),
    ]
    layers = {"layers": {"m": {"layers": {"units": []}}}, "network": None}
    sweeps = [{"layers": {}, "network": report} for report in rounds]
    got = _local_runs.combine({"device": {}}, {1: [layers] * 3, 2: sweeps})["worlds"][2]
    kept = ProfileReport.from_dict(got["network"]).network
    assert kept.fits[0].alpha_s == pytest.approx(2e-4)
    assert (kept.tp_overhead_s, kept.sync_speed_spread) == (3e-4, 0.07)
    assert got["group_rounds"]["tp_overhead_s"] == [12e-6, 4e-4, 3e-4]
    assert rounds[0]["network"]["tp_overhead_s"] == 12e-6  # the rounds themselves untouched
