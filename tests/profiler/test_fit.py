"""The alpha-beta fit against autopar's own cost model: data made by ``autopar.cost.comm``
from a known link must fit back to that link, so a fitted LinkSpec means what the
planner thinks it means."""

import random

import pytest

from autopar.cost.comm import all_gather_s, all_reduce_s, group_span, p2p_s, reduce_scatter_s
from autopar.hardware import Cluster, DeviceMemory, DeviceSpec, LinkSpec, Roofline
from profiler.errors import MeasurementError
from profiler.fit import Sample, bus_factor, coefficients, fit_alpha_beta

SIZES = [2.0**k for k in range(10, 27, 2)]


def _cluster(nodes, per_node, link):
    dev = DeviceSpec(
        name="d",
        roofline=Roofline(peak_flops={"fp32": 1e12}, memory_bandwidth_bytes_per_s=1e11),
        memory=DeviceMemory(capacity_bytes=1e9),
        preferred_dtype="fp32",
    )
    return Cluster(name="c", nodes=nodes, devices_per_node=per_node, device=dev, intra_node=link, inter_node=link)


@pytest.mark.parametrize("level,nodes,per_node", [("intra", 1, 4), ("intra", 1, 8), ("inter", 4, 1), ("inter", 8, 1)])
def test_fit_recovers_the_cost_models_link(level, nodes, per_node):
    link = LinkSpec(bandwidth_bytes_per_s=3.7e9, latency_s=6e-6)
    cluster = _cluster(nodes, per_node, link)
    n = nodes * per_node
    span = group_span(n, 1, per_node)
    samples = []
    for op, fn in (("all_reduce", all_reduce_s), ("all_gather", all_gather_s), ("reduce_scatter", reduce_scatter_s)):
        c_bw, c_lat = coefficients(op, level, n)
        samples += [Sample(nbytes=s, time_s=fn(s, span, cluster), c_bw=c_bw, c_lat=c_lat) for s in SIZES]
    c_bw, c_lat = coefficients("send_recv", level, n)
    samples += [
        Sample(nbytes=s, time_s=p2p_s(s, cross_node=level == "inter", cluster=cluster), c_bw=c_bw, c_lat=c_lat)
        for s in SIZES
    ]
    fit = fit_alpha_beta(samples)
    assert fit.bandwidth_bytes_per_s == pytest.approx(3.7e9, rel=1e-9)
    assert fit.alpha_s == pytest.approx(6e-6, rel=1e-9)
    assert fit.rms_rel_error < 1e-9
    assert fit.points == len(samples)


def test_noisy_data_fits_within_the_noise():
    rng = random.Random(7)
    c_bw, c_lat = coefficients("all_reduce", "intra", 4)
    samples = [
        Sample(nbytes=s, time_s=(c_bw * s / 5e8 + c_lat * 1e-4) * rng.uniform(0.9, 1.1), c_bw=c_bw, c_lat=c_lat)
        for s in SIZES
    ]
    fit = fit_alpha_beta(samples)
    assert fit.bandwidth_bytes_per_s == pytest.approx(5e8, rel=0.15)
    assert fit.alpha_s == pytest.approx(1e-4, rel=0.15)
    assert 0 < fit.rms_rel_error < 0.1


def test_negative_latency_is_clamped_to_zero():
    samples = [Sample(nbytes=s, time_s=s / 1e9 - 2e-6, c_bw=1.0, c_lat=1.0) for s in SIZES[1:]]
    unclamped_alpha = -2e-6  # the exact least-squares solution of this data
    assert all(s.time_s > 0 for s in samples) and unclamped_alpha < 0
    fit = fit_alpha_beta(samples)
    assert fit.alpha_s == 0.0
    # with alpha pinned at 0, the best beta in relative error is sum(b) / sum(b^2), b = S / t
    b = [s.nbytes / s.time_s for s in samples]
    assert fit.bandwidth_bytes_per_s == pytest.approx(sum(x * x for x in b) / sum(b), rel=1e-12)


def test_fit_needs_growth_and_two_sizes():
    with pytest.raises(MeasurementError, match="two message sizes"):
        fit_alpha_beta([Sample(nbytes=1024, time_s=1e-3, c_bw=1, c_lat=1)] * 3)
    flat = [Sample(nbytes=s, time_s=1e-3, c_bw=1.0, c_lat=1.0) for s in SIZES]
    with pytest.raises(MeasurementError, match="do not grow"):
        fit_alpha_beta(flat)


def test_bus_factors_follow_nccl_tests():
    assert bus_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    assert bus_factor("all_gather", 8) == pytest.approx(7 / 8)
    assert bus_factor("reduce_scatter", 4) == pytest.approx(3 / 4)
    assert bus_factor("broadcast", 8) == 1.0
    assert bus_factor("send_recv", 2) == 1.0
    assert coefficients("all_reduce", "inter", 8) == (pytest.approx(7 / 4), 6.0)
    with pytest.raises(MeasurementError):
        coefficients("all_to_all", "intra", 4)
    with pytest.raises(MeasurementError):
        coefficients("all_reduce", "intra", 1)
