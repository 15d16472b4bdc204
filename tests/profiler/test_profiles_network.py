"""Network profiles applied to the cost model: each collective at its own measured fit
or curve, the framework overheads, sync noise and shared memory bandwidth measured
across processes, and the transfers the profiler subtracts priced as the planner
prices them."""

import dataclasses
import json

import pytest
from profile_factories import device, exact, network

from autopar.cost.comm import GroupSpan
from autopar.hardware import cluster_from_dict, cluster_to_dict
from autopar.hardware import preset as build_preset
from autopar.hardware.device import alone
from autopar.profiles import (
    cluster_from_profiles,
)
from autopar.profiles.report import ProfileReport
from autopar.vocab import DType


def test_each_collective_is_priced_at_its_own_measured_fit():
    """gloo gathers and scatters slower than it all-reduces; the planner must use each
    op's fit where the profile has one, and the joint fit for the rest."""
    from autopar.cost.comm import all_gather_s, all_reduce_s, p2p_s, reduce_scatter_s

    c = cluster_from_profiles([network(per_op={"reduce_scatter": (7e-4, 4e8), "broadcast": (1e-4, 3e9)})])
    assert [f.op for f in c.intra_node.per_op] == ["reduce_scatter"]  # broadcast is not priced by the planner
    assert "own fits for reduce_scatter" in c.intra_node.source
    span, size = GroupSpan(size=2, per_node=2, nodes=1), 8e6
    assert reduce_scatter_s(size, span, c) == pytest.approx(0.5 * size / 4e8 + 7e-4)
    assert all_gather_s(size, span, c) == pytest.approx(0.5 * size / 1e9 + 1e-5)  # the joint fit
    assert all_reduce_s(size, span, c) == pytest.approx(2 * (0.5 * size / 1e9 + 1e-5))
    across = GroupSpan(size=2, per_node=1, nodes=2)
    assert reduce_scatter_s(size, across, c) == pytest.approx(0.5 * size / 4e8 + 7e-4)  # inter level's own fit
    assert p2p_s(size, cross_node=False, cluster=c) == pytest.approx(size / 1e9 + 1e-5)
    assert cluster_from_dict(cluster_to_dict(c)) == c


def test_the_network_profiles_framework_overheads_replace_the_one_rank_figures():
    """The device profile measures DTensor's overhead on a one-rank mesh (no transfer
    runs); a network profile measures it, and FSDP2's with the rate of its copies, on
    the real groups, with the processes time-sharing the cores as they will, and the
    cluster takes those figures as they are."""
    nodes = ("a",) * 4
    measured = device(rate_flop_per_s=2e11, bandwidth=3e10)
    dev = ProfileReport(device=dataclasses.replace(measured.device, tp_overhead_s=2e-4))
    one_rank = cluster_from_profiles([dev, network(node_of_rank=nodes, inter=None)]).device
    assert one_rank.host.time_share == 0.5 and one_rank.host.tp_overhead_s == pytest.approx(
        4e-4
    )  # 4 processes, 2 cores
    assert one_rank.host.fsdp_overhead_s == 0.0 and one_rank.host.fsdp_tensor_overhead_s == 0.0
    grouped = cluster_from_profiles(
        [
            dev,
            network(
                node_of_rank=nodes,
                inter=None,
                tp_overhead_s=7e-4,
                fsdp_overhead_s=2e-3,
                fsdp_tensor_overhead_s=4e-5,
                fsdp_copy_bytes_per_s=6e9,
            ),
        ]
    ).device
    assert (
        grouped.host.tp_overhead_s,
        grouped.host.fsdp_overhead_s,
        grouped.host.fsdp_tensor_overhead_s,
        grouped.host.fsdp_copy_bytes_per_s,
    ) == (7e-4, 2e-3, 4e-5, 6e9)
    assert "FSDP copies at 6.00 GB/s" in grouped.source
    assert (
        "700 us per tensor-parallel layer forward, 2000 us per FSDP collective, 40 us per parameter tensor in "
        "an FSDP collective"
    ) in grouped.source


def test_the_sync_noise_a_network_profile_measured_applies_at_its_process_count():
    """How unevenly the ranks of a node finish the same work is a property of how many
    share it: the cluster takes the figure from a network profile with its processes
    per node, and not from one with another count."""
    dev = device(rate_flop_per_s=2e11, bandwidth=3e10)
    four = network(node_of_rank=("a",) * 4, inter=None, sync_noise_s_per_sqrt_s=0.03, sync_speed_spread=0.07)
    assert dev.device is not None and cluster_from_profiles([dev]).device.host.sync_noise_s_per_sqrt_s == 0.0
    noisy = cluster_from_profiles([dev, four]).device
    assert (noisy.host.sync_noise_s_per_sqrt_s, noisy.host.sync_speed_spread) == (0.03, 0.07)
    assert "30.0 ms per sqrt(s) of it and 7.0% of it apart" in noisy.source
    other = cluster_from_profiles([dev, four], base=build_preset("local-cpu", devices_per_node=2)).device
    assert other.host.sync_noise_s_per_sqrt_s == 0.0 and other.host.sync_speed_spread == 0.0


def test_the_bandwidth_processes_keep_while_streaming_together_lowers_the_devices():
    """4 processes on the factory's 2 cores: each gets half a core (time share 0.5), and a
    network profile that measured 0.35 of one process's bandwidth with all 4 streaming
    leaves 0.7 beyond the time share; ``alone`` gives back the single process's
    figures, which the layer calibration compares against. A profile taken with another
    number of processes per node does not apply."""
    nodes = ("a",) * 4
    dev = device(rate_flop_per_s=2e11, bandwidth=3e10)
    shared = cluster_from_profiles([dev, network(node_of_rank=nodes, inter=None, memory_share=0.35)]).device
    assert (shared.host.time_share, shared.host.bandwidth_share) == (0.5, pytest.approx(0.7))
    assert shared.roofline.memory_bandwidth_bytes_per_s == pytest.approx(3e10 * 0.5 * 0.7)
    assert alone(shared).roofline.memory_bandwidth_bytes_per_s == pytest.approx(3e10)
    assert alone(shared).roofline.matmul_curves[DType.FP32][-1][1] == pytest.approx(2e11)
    assert "keep 0.35 of one process's memory bandwidth" in shared.source
    other = build_preset("local-cpu", devices_per_node=2)
    elsewhere = cluster_from_profiles(
        [dev, network(node_of_rank=nodes, inter=None, memory_share=0.35, tp_overhead_s=7e-4)], base=other
    ).device
    assert elsewhere.host.bandwidth_share == 1.0 and elsewhere.host.tp_overhead_s != 7e-4


def _bumpy_all_reduce(report: ProfileReport, tailed: bool = False) -> ProfileReport:
    """``report`` with its intra all-reduce series replaced by four sizes whose times
    dip at 4 KiB (3 ms at 2 KiB, 2 ms at 4 KiB), as gloo's noisy sweeps do. ``tailed``:
    each size's repeats are ``t, t, 4 t`` (median ``t``, mean ``2 t``), as gloo's are."""

    from autopar.profiles.network_section import CommPoint, CommSeries
    from autopar.profiles.sections import Timing

    times = {1024: 1e-3, 2048: 3e-3, 4096: 2e-3, 8192: 4e-3}
    pts = tuple(
        CommPoint(
            nbytes=float(s),
            time=Timing.of([t, t, 4 * t]) if tailed else exact(t),
            algbw_bytes_per_s=s / t,
            busbw_bytes_per_s=s / t,
        )
        for s, t in times.items()
    )
    bumpy = CommSeries(
        op="all_reduce", level="intra", label="intra group", ranks=(0, 1), per_node=2, nodes=1, points=pts
    )
    return ProfileReport(network=dataclasses.replace(report.network, series=(bumpy,)))


def test_a_collective_is_priced_by_its_measured_curve_on_groups_of_its_size():
    """A network profile's medians per size become the monotone curve of the op (the
    dip pooled: 2.5 ms at 2 and 4 KiB), which prices the op on groups of the measured
    size; past the largest size the op's fitted bandwidth continues it."""
    from autopar.cost.comm import all_reduce_s

    report = _bumpy_all_reduce(network(node_of_rank=("a", "a"), inter=None, per_op={"all_reduce": (1e-5, 1e9)}))
    c = cluster_from_profiles([report])
    assert "all_reduce by its measured curve on 2 ranks" in c.intra_node.source
    span = GroupSpan(size=2, per_node=2, nodes=1)
    assert all_reduce_s(3072, span, c) == pytest.approx(2.5e-3)
    assert all_reduce_s(6144, span, c) == pytest.approx(2.5e-3 + 0.5 * 1.5e-3)
    assert all_reduce_s(8192 + 1e6, span, c) == pytest.approx(4e-3 + 2 * 0.5 * 1e6 / 1e9)
    assert cluster_from_dict(json.loads(json.dumps(cluster_to_dict(c)))) == c


def test_a_collective_is_priced_by_the_mean_of_its_repeats():
    """A step pays every call: with repeats of ``t, t, 4 t`` per size the curve runs at
    twice the medians (``2 x 2.5`` ms at 3 KiB); the same report without means (written
    before they were recorded) is priced by its medians."""
    from autopar.cost.comm import all_reduce_s

    report = _bumpy_all_reduce(
        network(node_of_rank=("a", "a"), inter=None, per_op={"all_reduce": (1e-5, 1e9)}), tailed=True
    )
    span = GroupSpan(size=2, per_node=2, nodes=1)
    assert all_reduce_s(3072, span, cluster_from_profiles([report])) == pytest.approx(5e-3)
    old = report.to_dict()
    for point in old["network"]["series"][0]["points"]:
        del point["time"]["mean_s"]
    assert all_reduce_s(3072, span, cluster_from_profiles([old])) == pytest.approx(2.5e-3)


@pytest.mark.parametrize("tailed", [False, True])
def test_the_profiler_subtracts_transfers_priced_as_the_planner_prices_them(tailed):
    """The framework overheads are what a step costs beyond its transfers; the profiler
    must price those transfers exactly as the cost model will from the same report,
    or the difference is counted twice or never."""
    from autopar.cost.comm import all_reduce_s
    from profiler.network import _Group, _transfer_cost

    report = _bumpy_all_reduce(
        network(node_of_rank=("a", "a"), inter=None, per_op={"all_reduce": (1e-5, 1e9)}), tailed=tailed
    )
    c = cluster_from_profiles([report])
    fit = next(f for f in report.network.fits if f.ops == ("all_reduce",))
    group = _Group(level="intra", label="intra group", ranks=(0, 1), handle=None, per_node=2, nodes=1)
    cost = _transfer_cost(fit, "all_reduce", group, report.network.series)
    span = GroupSpan(size=2, per_node=2, nodes=1)
    for nbytes in (512, 1024, 3000, 6144, 1e5):
        assert cost(nbytes) == pytest.approx(all_reduce_s(nbytes, span, c))
