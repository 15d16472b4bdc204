"""autopar.profiles: reports -> Cluster, sources, and per-unit calibration factors."""

import dataclasses
import json

import pytest
import torch
from profile_factories import device, exact, full, layers, network

import autopar
from autopar.cost.comm import GroupSpan
from autopar.cost.compute import rates
from autopar.cost.leaf import TPContext, leaf_accumulate_s
from autopar.cost.tensor_parallel import evaluate_layout
from autopar.errors import ClusterError, ProfileFormatError
from autopar.graph import extract
from autopar.hardware import cluster_to_dict, preset
from autopar.hardware import preset as build_preset
from autopar.hardware.device import alone
from autopar.models import GPT, GPTConfig
from autopar.profiles import (
    calibrate_units,
    cluster_from_profiles,
    layer_calibration,
    profile_sources,
    recompute_calibration,
)
from autopar.profiles.report import ProfileReport
from autopar.profiles.sections import Timing
from autopar.vocab import DType, Layout, TPStyle
from profiler.layers import LayerSweep, profile_model
from profiler.timing import Repeats


def test_cpu_profiles_replace_the_local_cpu_nominal_numbers():
    c = cluster_from_profiles([device(rate_flop_per_s=2e11, bandwidth=3e10, dtypes=("fp32", "bf16")), network()])
    assert (c.nodes, c.devices_per_node) == (2, 2)
    dev = c.device
    assert dev.roofline.matmul_curves[DType.FP32] == tuple((2.0 * n**3, pytest.approx(2e11)) for n in (64, 256, 1024))
    assert dev.roofline.peak_flops[DType.FP32] == pytest.approx(2e11)  # above the preset's nominal 60 GFLOP/s
    assert dev.roofline.memory_bandwidth_bytes_per_s == 3e10 and dev.roofline.memory_efficiency == 1.0
    assert dev.memory.capacity_bytes == pytest.approx(24 * 2**30 / 2)  # the node's RAM shared by its 2 processes
    assert dev.memory.reserved_bytes == build_preset("local-cpu", devices_per_node=2).device.memory.reserved_bytes
    assert (c.intra_node.bandwidth_bytes_per_s, c.intra_node.latency_s) == (1e9, 1e-5)
    assert (c.inter_node.bandwidth_bytes_per_s, c.inter_node.latency_s) == (1e8, 5e-5)
    assert "fitted alpha-beta" in c.intra_node.source and "measured" in dev.source


def test_a_gpu_base_keeps_its_datasheet_peaks_and_shape():
    base = preset("dgx-a100-80gb", nodes=16)
    gpu = device(
        rate_flop_per_s=2.5e14, bandwidth=1.8e12, kind="cuda", dtypes=("bf16", "fp32"), memory_bytes=80 * 2**30
    )
    c = cluster_from_profiles([gpu, network(kind="cuda", node_of_rank=("n0",) * 8 + ("n1",) * 8)], base=base)
    assert (c.nodes, c.devices_per_node) == (16, 8)  # plan for the base's size, not the measured 2 nodes
    assert c.device.roofline.peak_flops[DType.BF16] == 312e12  # MFU stays against the datasheet
    assert c.device.roofline.peak_flops[DType.FP32] == pytest.approx(2.5e14)  # above the datasheet's fp32: raised
    assert c.device.memory.capacity_bytes == 80 * 2**30  # GPU memory is not shared
    assert c.device.memory.reserved_bytes == base.device.memory.reserved_bytes
    assert c.device.roofline.matmul_curves[DType.BF16][-1][1] == pytest.approx(2.5e14)
    assert cluster_from_profiles([gpu, network(kind="cuda")], base=base).device.name == "Test device"


def test_what_is_not_measured_comes_from_the_base():
    base = preset("dgx-h100", nodes=4)
    only_net = cluster_from_profiles([network(intra=None, kind="cuda")], base=base)
    assert only_net.device == base.device and only_net.intra_node == base.intra_node
    assert only_net.inter_node.bandwidth_bytes_per_s == 1e8
    assert cluster_from_profiles([layers(kind="cuda")], base=base) == base


def test_missing_measurements_without_a_base_are_explained():
    with pytest.raises(ClusterError, match="no link was measured and no base cluster"):
        cluster_from_profiles([device(kind="cuda")])
    with pytest.raises(ClusterError, match="no device"):
        cluster_from_profiles([network(kind="cuda")])
    with pytest.raises(ClusterError, match="no inter-node measurement but the cluster has 2 nodes"):
        cluster_from_profiles([device(kind="cuda"), network(inter=None, kind="cuda")])
    with pytest.raises(ClusterError, match="no intra-node measurement but the cluster has 2 devices per node"):
        cluster_from_profiles([device(kind="cuda"), network(intra=None, kind="cuda")])
    with pytest.raises(ClusterError, match="measure neither a device nor a network"):
        cluster_from_profiles([layers(kind="cuda")])


def test_single_level_networks_fill_the_unused_level():
    one_node = cluster_from_profiles([device(kind="cuda"), network(inter=None, kind="cuda", node_of_rank=("a",) * 4)])
    assert (one_node.nodes, one_node.devices_per_node) == (1, 4)
    assert one_node.inter_node.bandwidth_bytes_per_s == one_node.intra_node.bandwidth_bytes_per_s == 1e9
    assert "not measured" in one_node.inter_node.source
    one_per_node = cluster_from_profiles(
        [device(kind="cuda"), network(intra=None, kind="cuda", node_of_rank=("a", "b"))]
    )
    assert (one_per_node.nodes, one_per_node.devices_per_node) == (2, 1)
    assert one_per_node.intra_node.bandwidth_bytes_per_s == 1e8


def test_reports_are_read_from_objects_dicts_and_files(tmp_path):
    report = full()
    path = report.save(tmp_path / "full.json")
    expected = _numbers(cluster_from_profiles([report]))
    assert _numbers(cluster_from_profiles([report.to_dict()])) == expected
    assert _numbers(cluster_from_profiles([str(path)])) == expected
    assert _numbers(cluster_from_profiles(path)) == expected
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**report.to_dict(), "schema_version": 9}))
    with pytest.raises(ProfileFormatError, match="schema_version 9"):
        cluster_from_profiles([bad])
    with pytest.raises(ProfileFormatError, match="not an autopar profile"):
        cluster_from_profiles([{"nodes": 1}])
    with pytest.raises(ProfileFormatError, match="does not exist"):
        cluster_from_profiles([tmp_path / "none.json"])
    with pytest.raises(ProfileFormatError, match="give a ProfileReport"):
        cluster_from_profiles([42])


def _numbers(cluster):
    """The cluster without its source strings (which name where each report came from)."""
    data = cluster_to_dict(cluster)
    for part in (data["device"], data["intra_node"], data["inter_node"]):
        part.pop("source")
    return data


def test_profile_sources_one_line_per_report(tmp_path):
    path = full().save(tmp_path / "all.json")
    lines = profile_sources([device(host="gpu-node-7"), str(path)])
    assert len(lines) == 2
    assert lines[0].startswith("report #1: device Test device [host gpu-node-7, 2026-11-29T12:00:00+00:00, torch ")
    assert lines[1].startswith(f"{path}: device Test device") and "layers of Toy (batch 2, seq 16, fp32)" in lines[1]
    assert "network gloo x 4 ranks" in lines[1]


def test_calibration_against_a_hand_computed_roofline():
    # 1e9 matmul FLOPs at a flat 1e11 FLOP/s = 10 ms; 1e6 bytes at 1e10 B/s = 0.1 ms: compute bound.
    # predicted fwd 10 ms, bwd 2 x 10 ms; measured 20 + 40 ms: factor 2.
    reports = [device(rate_flop_per_s=1e11, bandwidth=1e10), layers(fwd_s=0.02, bwd_s=0.04)]
    (cal,) = calibrate_units(reports)
    assert cal.predicted_fwd_s == pytest.approx(0.01) and cal.predicted_bwd_s == pytest.approx(0.02)
    assert cal.factor == pytest.approx(2.0)
    factors = layer_calibration(reports)
    assert factors == {"layers.0": pytest.approx(2.0), "layers.1": pytest.approx(2.0), "sig-block": pytest.approx(2.0)}
    memory_bound = calibrate_units(
        [device(rate_flop_per_s=1e11, bandwidth=1e10), layers(fwd_s=0.1, bwd_s=0.2, matmul_flops=1e6, nbytes=1e9)]
    )[0]
    assert memory_bound.predicted_fwd_s == pytest.approx(0.1) and memory_bound.factor == pytest.approx(1.0)
    with pytest.raises(ProfileFormatError, match="layers section"):
        layer_calibration([device()])


def _measured_gpt(batch):
    """A tiny GPT profiled at ``batch`` on a device of known rates, and its graph."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, seq_len=32, dim=64, n_layers=2, n_heads=4))
    x = torch.randint(0, 256, (batch, 32))
    sweep = LayerSweep(repeats=Repeats(warmup=0, repeats=1, min_repeats=1), count_flops=False, measure_memory=False)
    report = ProfileReport.merge(device(rate_flop_per_s=5e10, bandwidth=2e10), profile_model(model, x, sweep=sweep))
    return report, extract(model, sample_input=x, dtype="fp32")


def _unit_cost(graph, i, cluster, batch, **scale):
    """The cost model's time of unit ``i`` on one device (tp=1)."""
    prof = graph.profile_of(i)
    ctx = TPContext(
        tp=1,
        span=GroupSpan(size=1, per_node=1, nodes=1),
        cluster=cluster,
        rates=rates(cluster.device, DType.FP32),
        micro_batch=batch,
        tokens=32,
        boundary=Layout.R,
        first=i == 0,
        last=i == len(graph.units) - 1,
        loss_parallel=False,
        sequence_parallel=False,
        host=cluster.device.host,
        **scale,
    )
    return evaluate_layout(prof, tuple(TPStyle.REPLICATE for _ in prof.leaves), Layout.R, ctx)


def _accumulation_s(graph, i, cluster, batch):
    """The unit's gradient accumulation per micro-batch, which a profiled backward (its
    ``.grad`` reset before each run) does not contain."""
    prof = graph.profile_of(i)
    ctx = TPContext(
        tp=1,
        span=GroupSpan(size=1, per_node=1, nodes=1),
        cluster=cluster,
        rates=rates(cluster.device, DType.FP32),
        micro_batch=batch,
        tokens=32,
        boundary=Layout.R,
        first=i == 0,
        last=i == len(graph.units) - 1,
        loss_parallel=False,
        sequence_parallel=False,
        host=cluster.device.host,
    )
    return sum(leaf_accumulate_s(leaf, TPStyle.REPLICATE, ctx) for leaf in prof.leaves)


def test_prediction_is_the_cost_models_unit_time():
    """The calibration divides by exactly what autopar's cost model computes for the unit
    on one device (evaluate_layout at tp=1), so multiplying by the factor reproduces the
    measured time."""
    report, graph = _measured_gpt(3)
    cluster = cluster_from_profiles([report])
    assert cluster.device.host.exposed_weight_traffic  # a CPU profile: weights priced as passes of their own
    cals = {c.fqn: c for c in calibrate_units([report])}
    for i, unit in enumerate(graph.units):
        cost = _unit_cost(graph, i, cluster, 3)
        accumulate = _accumulation_s(graph, i, cluster, 3)
        assert accumulate > 0
        cal = cals[next(c for c in cals if unit.fqn in cals[c].instances)]
        assert cal.predicted_fwd_s == pytest.approx(cost.fwd_compute_s, rel=1e-12)
        assert cal.predicted_bwd_s == pytest.approx(cost.bwd_compute_s - accumulate, rel=1e-12)
        assert cal.factor * (cost.fwd_compute_s + cost.bwd_compute_s - accumulate) == pytest.approx(
            cal.measured_fwd_s + cal.measured_bwd_s, rel=1e-12
        )


def test_the_planner_takes_reports():
    model = GPT(GPTConfig(vocab_size=256, seq_len=32, dim=64, n_layers=2, n_heads=4))
    base = preset("local-cpu", devices_per_node=2)
    reports = [device(rate_flop_per_s=2e11, bandwidth=3e10), network(node_of_rank=("a", "a"), inter=None)]
    plan = autopar.plan(model, base, global_batch_size=8, seq_len=32, profile=reports)
    assert plan.settings.profile_sources == profile_sources(reports)
    slow = [device(rate_flop_per_s=2e9, bandwidth=3e8), network(node_of_rank=("a", "a"), inter=None)]
    slower = autopar.estimate(model, base, plan.config, global_batch_size=8, seq_len=32, profile=slow)
    assert slower.prediction.step_time_s > 10 * plan.prediction.step_time_s  # 100x slower device


def test_calibrated_cost_model_reproduces_the_measurement():
    """With each unit's factor as its compute scale, the cost model's unit time at the
    measured shape equals the measured time plus the gradient accumulation the
    profiled run did not do; at another batch it follows the device curves (a unit
    twice the batch is predicted at most twice as slow)."""
    report, graph = _measured_gpt(2)
    cluster = cluster_from_profiles([report])
    factors = layer_calibration([report])
    measured = {u.signature: u.time_s for u in report.layers.units}
    for i, unit in enumerate(graph.units):
        sig = graph.profile_of(i).signature

        def unit_time(batch):
            cost = _unit_cost(graph, i, cluster, batch, compute_scale=factors[sig])
            return cost.fwd_compute_s + cost.bwd_compute_s

        accumulate = _accumulation_s(graph, i, cluster, 2)
        assert unit_time(2) == pytest.approx(measured[sig] + accumulate, rel=1e-9), unit.fqn
        assert unit_time(2) < unit_time(4) <= 2 * unit_time(2) * (1 + 1e-9)


def test_processes_beyond_the_cores_time_share_the_measured_device():
    """The factory's machine has 2 cores and the device was measured by one 1-thread
    process: 4 processes on a node get half a core each, 2 get a whole one."""
    two = cluster_from_profiles(
        [device(rate_flop_per_s=2e11, bandwidth=3e10), network(node_of_rank=("a",) * 2, inter=None)]
    )
    four = cluster_from_profiles(
        [device(rate_flop_per_s=2e11, bandwidth=3e10), network(node_of_rank=("a",) * 4, inter=None)]
    )
    assert two.device.host.time_share == 1.0 and four.device.host.time_share == 0.5
    assert four.device.roofline.matmul_curves[DType.FP32][-1][1] == pytest.approx(1e11)
    assert four.device.roofline.memory_bandwidth_bytes_per_s == pytest.approx(1.5e10)
    assert four.device.roofline.peak_flops[DType.FP32] == pytest.approx(1e11)
    own = alone(four.device)
    assert (
        own.roofline.matmul_curves == two.device.roofline.matmul_curves
        and own.host.op_overhead_s == two.device.host.op_overhead_s
    )
    assert own.roofline.memory_bandwidth_bytes_per_s == pytest.approx(two.device.roofline.memory_bandwidth_bytes_per_s)
    # the layer factors compare the one-process measurement with the device alone, so
    # they do not change with the number of processes that will share it
    for net in (("a",) * 2, ("a",) * 4):
        reports = [device(rate_flop_per_s=2e11, bandwidth=3e10), layers(), network(node_of_rank=net, inter=None)]
        assert layer_calibration(reports)["sig-block"] == pytest.approx(
            (0.02 + 0.04) / (3 * max(1e9 / 2e11, 1e6 / 3e10))
        )


def test_local_cpu_processes_beyond_the_cores_get_a_share():
    import os

    cores = len(os.sched_getaffinity(0))
    whole = preset("local-cpu", devices_per_node=cores).device
    shared = preset("local-cpu", devices_per_node=2 * cores).device
    assert whole.host.time_share == 1.0 and shared.host.time_share == 0.5
    assert shared.roofline.peak_flops[DType.FP32] == pytest.approx(whole.roofline.peak_flops[DType.FP32] / 2)
    assert shared.host.op_overhead_s == pytest.approx(2 * whole.host.op_overhead_s)
    assert shared.host.optimizer_bytes_per_s == pytest.approx(whole.host.optimizer_bytes_per_s / 2)
    assert alone(shared).roofline.peak_flops == whole.roofline.peak_flops and "time share" not in alone(shared).source


def test_recompute_fractions_per_block_and_for_the_units_in_between():
    """Each block's fraction is (recomputing backward - backward) / forward; a unit the
    profiler cannot wrap takes the measured units' together, counted per instance; a
    report without the measurement gives none (the planner keeps 1)."""
    base = layers(fwd_s=0.02, bwd_s=0.04).layers
    a = dataclasses.replace(base.units[0], recompute_bwd=exact(0.055))  # 2 instances: (0.055 - 0.04) / 0.02
    b = dataclasses.replace(
        a,
        fqn="layers.2",
        signature="sig-other",
        instances=("layers.2",),
        fwd=exact(0.01),
        bwd=exact(0.02),
        recompute_bwd=exact(0.03),
    )  # 1 instance: 1.0
    head = dataclasses.replace(
        a, fqn="norm+output", signature="sig-head", instances=("norm+output",), recompute_bwd=None
    )
    rep = ProfileReport(layers=dataclasses.replace(base, units=(a, b, head)))
    fractions = recompute_calibration([rep])
    assert fractions["layers.0"] == fractions["layers.1"] == fractions["sig-block"] == pytest.approx(0.75)
    assert fractions["layers.2"] == pytest.approx(1.0)
    assert fractions["norm+output"] == pytest.approx((2 * 0.015 + 0.01) / (2 * 0.02 + 0.01))
    assert "a recomputed forward 0.80 of the forward" in profile_sources([rep])[0]
    assert recompute_calibration([layers()]) == {}
    # a rerun timed no slower than the plain backward, or within their spread, is noise:
    # not measured, so the planner prices a rerun as the forward (a free rerun made full
    # recomputation look free, and the search picked it on a noisy machine)
    noisy = dataclasses.replace(base, units=(dataclasses.replace(a, recompute_bwd=exact(0.03)),))
    assert recompute_calibration([ProfileReport(layers=noisy)]) == {}
    spread = Timing(median_s=a.bwd.median_s + 0.001, min_s=a.bwd.median_s - 0.002, max_s=1.0, repeats=5)
    within = dataclasses.replace(base, units=(dataclasses.replace(a, recompute_bwd=spread), b))
    assert recompute_calibration([ProfileReport(layers=within)])["layers.0"] == pytest.approx(1.0)


def test_the_planner_prices_full_recomputation_at_the_measured_fraction():
    """One block kind, so every unit takes the blocks' fraction f: at tp=1 the
    recomputation the plan predicts is f times what it predicts from the same profile
    without the measurement."""
    report, _graph = _measured_gpt(2)
    lay = report.layers
    f = recompute_calibration([report])["layers.0"]
    assert 0 < f
    bare = ProfileReport.merge(
        ProfileReport(device=report.device),
        ProfileReport(
            layers=dataclasses.replace(lay, units=tuple(dataclasses.replace(u, recompute_bwd=None) for u in lay.units))
        ),
    )
    model = GPT(GPTConfig(vocab_size=256, seq_len=32, dim=64, n_layers=2, n_heads=4))
    cluster = preset("local-cpu", devices_per_node=1)
    config = {"dp": 1, "tp": 1, "pp": 1, "micro_batch_size": 2, "recompute": "full"}
    with_f, without = (
        autopar.estimate(model, cluster, config, global_batch_size=4, seq_len=32, profile=[r]) for r in (report, bare)
    )
    redo = [sum(s.recompute_s for s in p.prediction.stages) for p in (with_f, without)]
    assert redo[1] > 0 and redo[0] == pytest.approx(f * redo[1], rel=1e-9)


def test_a_gpu_base_keeps_its_fp8_peak_and_a_measured_device_alone_has_none():
    """A profile measures bf16/fp32 matmuls, not FP8: an H100 base's datasheet FP8 peak
    stays (so fp8 plans remain possible), and a device measured without a base has none."""
    gpu = device(rate_flop_per_s=7e14, bandwidth=3e12, kind="cuda", dtypes=("bf16", "fp32"), memory_bytes=80 * 2**30)
    h100 = cluster_from_profiles([gpu, network(kind="cuda")], base=preset("dgx-h100", nodes=2))
    assert h100.device.roofline.fp8_flops == 1979e12
    alone = cluster_from_profiles([gpu, network(kind="cuda", node_of_rank=("n0",) * 8)])
    assert alone.device.roofline.fp8_flops == 0.0


def test_a_gpu_profile_compiles_unasked_and_a_cpu_profile_does_not():
    """Plans for a profiled GPU compile their blocks as the presets' do, with or without a
    base; CPU processes compile only when asked."""
    gpu = device(rate_flop_per_s=7e14, bandwidth=3e12, kind="cuda", dtypes=("bf16", "fp32"), memory_bytes=80 * 2**30)
    assert cluster_from_profiles([gpu, network(kind="cuda")], base=preset("dgx-h100", nodes=2)).device.compiles
    assert cluster_from_profiles([gpu, network(kind="cuda", node_of_rank=("n0",) * 8)]).device.compiles
    assert preset("dgx-a100-80gb").device.compiles and not preset("local-cpu").device.compiles
    assert not cluster_from_profiles([device(), network()]).device.compiles


def test_a_gpu_base_keeps_its_attention_and_fp8_efficiencies():
    """A profile measures GEMMs, not FP8 GEMMs, and this one no fused attention kernel:
    the base's stated efficiencies for both stay; a device measured without a base
    states none."""
    gpu = device(rate_flop_per_s=7e14, bandwidth=3e12, kind="cuda", dtypes=("bf16", "fp32"), memory_bytes=80 * 2**30)
    base = preset("dgx-h100", nodes=2).device.roofline
    roof = cluster_from_profiles([gpu, network(kind="cuda")], base=preset("dgx-h100", nodes=2)).device.roofline
    assert (roof.attention_efficiency, roof.fp8_matmul_efficiency) == (0.19, 0.709)
    assert (base.attention_efficiency, base.fp8_matmul_efficiency) == (0.19, 0.709)
    alone = cluster_from_profiles([gpu, network(kind="cuda", node_of_rank=("n0",) * 8)]).device.roofline
    assert (alone.attention_efficiency, alone.fp8_matmul_efficiency) == (None, None)


def test_a_measured_attention_rate_replaces_the_stated_one():
    """A GPU profile that timed the fused attention kernel gives its mean rate as the
    fraction of the peak: over the base's datasheet peak (989 TFLOP/s bf16 on H100), or
    without a base over the fastest measured matmul. The cluster's rates price
    attention at exactly the measured mean."""
    gpu = device(
        rate_flop_per_s=7e14,
        bandwidth=3e12,
        kind="cuda",
        dtypes=("bf16", "fp32"),
        memory_bytes=80 * 2**30,
        attention_flop_per_s=(2.5e14, 3.5e14),
    )
    h100 = cluster_from_profiles([gpu, network(kind="cuda")], base=preset("dgx-h100", nodes=2))
    assert h100.device.roofline.attention_efficiency == pytest.approx(3e14 / 989e12, rel=1e-12)
    assert rates(h100.device, DType.BF16).attention_flops_per_s == pytest.approx(3e14, rel=1e-12)
    assert "fused attention (causal SDPA forward and backward) bf16 300 TFLOP/s" in h100.device.source
    alone = cluster_from_profiles([gpu, network(kind="cuda", node_of_rank=("n0",) * 8)]).device.roofline
    assert alone.attention_efficiency == pytest.approx(3e14 / 7e14, rel=1e-12)


def test_a_network_measured_at_another_count_per_node_says_what_it_left_out():
    """A network profile of 4 processes on one node applied to a cluster of 2 per node:
    its links are used, but its per-process figures (measured with 4 sharing the node)
    are not, which the plan's measurements line now says instead of keeping silent."""
    model = GPT(GPTConfig(vocab_size=256, seq_len=32, dim=64, n_layers=2, n_heads=4))
    base = preset("local-cpu", devices_per_node=2)
    four = network(node_of_rank=("a",) * 4, inter=None, tp_overhead_s=3e-4, memory_share=0.5)
    plan = autopar.plan(model, base, global_batch_size=8, seq_len=32, profile=[four])
    (line,) = plan.settings.profile_sources
    assert line.endswith(
        "(its framework overheads, memory share and rank spread not applied: measured with 4 processes per node, "
        "the cluster has 2)"
    )
    assert plan.cluster.device.host.tp_overhead_s != 3e-4
    two = network(node_of_rank=("a", "a"), inter=None, tp_overhead_s=3e-4)
    matched = autopar.plan(model, base, global_batch_size=8, seq_len=32, profile=[two])
    assert "not applied" not in matched.settings.profile_sources[0]
    assert matched.cluster.device.host.tp_overhead_s == 3e-4
