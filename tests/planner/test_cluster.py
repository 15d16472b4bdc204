"""Clusters: presets cite their numbers, files round-trip, bad values are refused clearly."""

import json

import pytest

from autopar import Cluster, ClusterError, DType
from autopar.presets import preset_names


@pytest.mark.parametrize("name", ["dgx-a100-80gb", "dgx-a100-40gb", "dgx-h100", "hgx-h200", "p3.16xlarge", "local-cpu"])
def test_every_preset_builds_and_cites_sources(name):
    cluster = Cluster.preset(name, nodes=2)
    assert cluster.nodes == 2 and cluster.world_size == 2 * cluster.devices_per_node
    assert cluster.device.source and cluster.intra_node.source and cluster.inter_node.source
    assert cluster.device.preferred_dtype in cluster.device.peak_flops


def test_datasheet_numbers():
    a100 = Cluster.preset("dgx-a100-80gb").device
    assert a100.peak_flops[DType.BF16] == 312e12 and a100.memory_bytes == 80 * 2**30
    assert Cluster.preset("dgx-a100-40gb").device.memory_bytes == 40 * 2**30
    v100 = Cluster.preset("p3.16xlarge").device
    assert DType.BF16 not in v100.peak_flops and v100.preferred_dtype is DType.FP16
    assert Cluster.preset("dgx-h100").device.peak_flops[DType.BF16] == 989e12


def test_v100_refuses_bf16_with_a_clear_message():
    with pytest.raises(ClusterError, match="does not support dtype=bf16.*fp16"):
        Cluster.preset("p3.16xlarge").device.peak(DType.BF16)


def test_json_round_trip(tmp_path):
    cluster = Cluster.preset("hgx-h200", nodes=4)
    path = tmp_path / "c.json"
    cluster.save(path)
    assert Cluster.from_json(path) == cluster
    assert Cluster.parse(str(path)) == cluster
    assert Cluster.parse("hgx-h200:4") == cluster


@pytest.mark.parametrize("bad, message", [
    ({"nodes": 0}, "nodes=0"),
    ({"devices_per_node": -1}, "devices_per_node=-1"),
])
def test_bad_sizes(tmp_path, bad, message):
    data = Cluster.preset("dgx-h100").to_dict()
    data.update(bad)
    path = tmp_path / "c.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ClusterError, match=message):
        Cluster.from_json(path)


def test_bad_device_fields(tmp_path):
    data = Cluster.preset("dgx-h100").to_dict()
    data["device"]["memory_bytes"] = -5
    path = tmp_path / "c.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ClusterError, match="memory_bytes=-5"):
        Cluster.from_json(path)
    del data["device"]["memory_bytes"]
    path.write_text(json.dumps(data))
    with pytest.raises(ClusterError, match="missing field 'memory_bytes'"):
        Cluster.from_json(path)


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ClusterError, match="unknown cluster preset 'dgx-z'.*dgx-a100-80gb"):
        Cluster.preset("dgx-z")
    assert "local-cpu" in preset_names()


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ClusterError, match="does not exist"):
        Cluster.from_json(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ClusterError, match="not valid JSON"):
        Cluster.from_json(tmp_path / "bad.json")


def test_a_link_fit_per_collective_is_checked():
    from autopar.cluster import LinkSpec, OpLink

    with pytest.raises(ClusterError, match="op='broadcast' is not allowed: it must be one of all_reduce"):
        OpLink(op="broadcast", bandwidth_bytes_per_s=1e9, latency_s=0.0)
    with pytest.raises(ClusterError, match="all_gather latency_s=-1.0 is not allowed"):
        OpLink(op="all_gather", bandwidth_bytes_per_s=1e9, latency_s=-1.0)
    fit = OpLink(op="all_gather", bandwidth_bytes_per_s=1e9, latency_s=0.0)
    with pytest.raises(ClusterError, match="at most one fit"):
        LinkSpec(bandwidth_bytes_per_s=2e9, latency_s=1e-6, per_op=(fit, fit))
    link = LinkSpec(bandwidth_bytes_per_s=2e9, latency_s=1e-6, per_op=(fit,))
    assert link.for_op("all_gather") == (1e9, 0.0) and link.for_op("reduce_scatter") == (2e9, 1e-6)
