"""Clusters: presets cite their numbers, files round-trip, bad values are refused clearly."""

import dataclasses
import json

import pytest

from autopar import ClusterError, DType, HostEffects, load_cluster, parse_cluster, preset, save_cluster
from autopar.cost.host import HOST_EFFECTS
from autopar.hardware import cluster_from_dict, cluster_to_dict, preset_names


@pytest.mark.parametrize("name", ["dgx-a100-80gb", "dgx-a100-40gb", "dgx-h100", "hgx-h200", "p3.16xlarge", "local-cpu"])
def test_every_preset_builds_and_cites_sources(name):
    cluster = preset(name, nodes=2)
    assert cluster.nodes == 2 and cluster.world_size == 2 * cluster.devices_per_node
    assert cluster.device.source and cluster.intra_node.source and cluster.inter_node.source
    assert cluster.device.preferred_dtype in cluster.device.roofline.peak_flops


def test_datasheet_numbers():
    a100 = preset("dgx-a100-80gb").device
    assert a100.roofline.peak_flops[DType.BF16] == 312e12 and a100.memory.capacity_bytes == 80 * 2**30
    assert preset("dgx-a100-40gb").device.memory.capacity_bytes == 40 * 2**30
    v100 = preset("p3.16xlarge").device
    assert DType.BF16 not in v100.roofline.peak_flops and v100.preferred_dtype is DType.FP16
    assert preset("dgx-h100").device.roofline.peak_flops[DType.BF16] == 989e12


@pytest.mark.parametrize("name", ["dgx-a100-80gb", "dgx-a100-40gb", "dgx-h100", "hgx-h200", "p3.16xlarge"])
def test_gpu_presets_have_no_host_effects(name):
    """Every cost of the host that GPU kernels hide is off on the GPU presets."""
    assert preset(name).device.host == HostEffects.none()


def test_host_effects_table_covers_every_field():
    """The table of where each host effect applies names every field, once, and says
    what it is on CPU processes and on GPUs; the local CPU preset sets some."""
    fields = [f.name for f in dataclasses.fields(HostEffects)]
    assert sorted(e.field for e in HOST_EFFECTS) == sorted(fields)
    assert all(e.prices and e.cpu_processes and e.gpus for e in HOST_EFFECTS)
    local = preset("local-cpu", devices_per_node=2).device.host
    assert local.exposed_weight_traffic and local.op_overhead_s > 0 and local != HostEffects.none()


def test_v100_refuses_bf16_with_a_clear_message():
    with pytest.raises(ClusterError, match="does not support dtype=bf16.*fp16"):
        preset("p3.16xlarge").device.peak(DType.BF16)


def test_json_round_trip(tmp_path):
    cluster = preset("hgx-h200", nodes=4)
    path = tmp_path / "c.json"
    save_cluster(cluster, path)
    assert load_cluster(path) == cluster
    assert parse_cluster(str(path)) == cluster
    assert parse_cluster("hgx-h200:4") == cluster


def test_a_saved_preset_with_its_nodes_edited_is_named_for_them(tmp_path):
    """``autopar presets --save dgx-h100:16`` then "nodes": 2 in the file: the plan's
    header and exports said "dgx-h100 x 16" over 2 nodes. A name a user chose is kept."""
    path = save_cluster(preset("dgx-h100", nodes=16), tmp_path / "c.json")
    data = json.loads(path.read_text())
    path.write_text(json.dumps(data | {"nodes": 2}))
    loaded = load_cluster(path)
    assert (loaded.nodes, loaded.name, loaded.kind) == (2, "dgx-h100 x 2", "dgx-h100")
    path.write_text(json.dumps(data | {"nodes": 2, "name": "our rack"}))
    assert load_cluster(path).name == "our rack"


def test_a_file_an_editor_saved_with_a_byte_order_mark_loads(tmp_path):
    """Some editors start a UTF-8 file with a byte-order mark, which is not JSON: such a
    cluster file was refused as "not valid JSON ... was it truncated?"."""
    cluster = preset("hgx-h200", nodes=4)
    path = save_cluster(cluster, tmp_path / "c.json")
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    assert load_cluster(path) == cluster


def test_saving_something_else_as_a_cluster_is_refused(tmp_path):
    """A string saved as a cluster wrote a file load_cluster then refused."""
    with pytest.raises(ClusterError, match=r"save_cluster takes a Cluster .* got str 'hgx-h200:4'"):
        save_cluster("hgx-h200:4", tmp_path / "c.json")
    assert not (tmp_path / "c.json").exists()


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"nodes": 0}, "nodes=0"),
        ({"devices_per_node": -1}, "devices_per_node=-1"),
    ],
)
def test_bad_sizes(tmp_path, bad, message):
    data = cluster_to_dict(preset("dgx-h100"))
    data.update(bad)
    path = tmp_path / "c.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ClusterError, match=message):
        load_cluster(path)


def test_bad_device_fields(tmp_path):
    data = cluster_to_dict(preset("dgx-h100"))
    data["device"]["memory"]["capacity_bytes"] = -5
    path = tmp_path / "c.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ClusterError, match=r"device\.memory: memory capacity_bytes=-5"):
        load_cluster(path)
    del data["device"]["memory"]["capacity_bytes"]
    path.write_text(json.dumps(data))
    with pytest.raises(ClusterError, match=r"device\.memory\.capacity_bytes: missing field"):
        load_cluster(path)
    data["device"]["memory_bytes"] = 80e9  # a flat device of another layout
    path.write_text(json.dumps(data))
    with pytest.raises(ClusterError, match=r"unknown field\(s\) memory_bytes for DeviceSpec"):
        load_cluster(path)


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ClusterError, match="unknown cluster preset 'dgx-z'.*dgx-a100-80gb"):
        preset("dgx-z")
    assert "local-cpu" in preset_names()


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ClusterError, match="does not exist"):
        load_cluster(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ClusterError, match="not valid JSON"):
        load_cluster(tmp_path / "bad.json")


def test_a_link_fit_per_collective_is_checked():
    from autopar.hardware import LinkSpec, OpLink

    with pytest.raises(ClusterError, match="op='broadcast' is not allowed: it must be one of all_reduce"):
        OpLink(op="broadcast", bandwidth_bytes_per_s=1e9, latency_s=0.0)
    with pytest.raises(ClusterError, match="all_gather latency_s=-1.0 is not allowed"):
        OpLink(op="all_gather", bandwidth_bytes_per_s=1e9, latency_s=-1.0)
    fit = OpLink(op="all_gather", bandwidth_bytes_per_s=1e9, latency_s=0.0)
    with pytest.raises(ClusterError, match="at most one fit"):
        LinkSpec(bandwidth_bytes_per_s=2e9, latency_s=1e-6, per_op=(fit, fit))
    link = LinkSpec(bandwidth_bytes_per_s=2e9, latency_s=1e-6, per_op=(fit,))
    assert link.for_op("all_gather") == (1e9, 0.0) and link.for_op("reduce_scatter") == (2e9, 1e-6)


def test_a_measured_curve_is_monotone_interpolated_and_checked():
    """A collective's measured curve: pool-adjacent-violators on a hand example, linear
    between sizes, flat below the smallest, the given slope past the largest; bad input
    named."""
    from autopar.hardware import CommCurve, LinkSpec, OpLink

    # 3 ms at 2 KiB then 2 ms at 4 KiB violate monotonicity: both become their mean, 2.5
    curve = CommCurve.from_measured(2, [4096, 1024, 2048, 8192], [2e-3, 1e-3, 3e-3, 4e-3])
    assert curve.nbytes == (1024.0, 2048.0, 4096.0, 8192.0)
    assert curve.time_s == pytest.approx((1e-3, 2.5e-3, 2.5e-3, 4e-3))
    # a spike before two lower sizes pools all three: (3 + 1 + 2) / 3
    assert CommCurve.from_measured(2, [1, 2, 3, 4], [1.0, 3.0, 1.0, 2.0]).time_s == pytest.approx((1.0, 2.0, 2.0, 2.0))
    assert curve.seconds(512, beyond_s_per_byte=1e-9) == pytest.approx(1e-3)
    assert curve.seconds(6144, beyond_s_per_byte=1e-9) == pytest.approx(2.5e-3 + 0.5 * 1.5e-3)
    assert curve.seconds(8192 + 1e6, beyond_s_per_byte=1e-9) == pytest.approx(4e-3 + 1e-3)
    with pytest.raises(ClusterError, match="group of >= 2 ranks, got ranks=1"):
        CommCurve(ranks=1, nbytes=(1.0, 2.0), time_s=(1.0, 2.0))
    with pytest.raises(ClusterError, match="got 2 sizes and 1 times"):
        CommCurve(ranks=2, nbytes=(1.0, 2.0), time_s=(1.0,))
    with pytest.raises(ClusterError, match="never decrease; build it from measurements with CommCurve.from_measured"):
        CommCurve(ranks=2, nbytes=(1.0, 2.0), time_s=(2.0, 1.0))
    with pytest.raises(ClusterError, match="curve nbytes=0.0 is not allowed"):
        CommCurve(ranks=2, nbytes=(0.0, 2.0), time_s=(1.0, 2.0))
    link = LinkSpec(
        bandwidth_bytes_per_s=1e9,
        latency_s=1e-5,
        per_op=(OpLink(op="all_reduce", bandwidth_bytes_per_s=1e9, latency_s=1e-5, curve=curve),),
    )
    assert link.curve_for("all_reduce", 2) is curve
    assert link.curve_for("all_reduce", 4) is None and link.curve_for("all_gather", 2) is None
    c = preset("local-cpu", devices_per_node=2)
    c = dataclasses.replace(c, intra_node=link)
    assert cluster_from_dict(json.loads(json.dumps(cluster_to_dict(c)))) == c
