"""A cluster value in the wrong unit is refused in one line naming the field, the value,
its unit and the fix, instead of planning as fitting with absurd times (989 for 989
TFLOP/s gave a step of 7639 days at an MFU of 134%), while every preset, time-shared CPU
processes and slow but real links still load."""

import dataclasses
import json
import os

import pytest

from autopar import ClusterError, DType, load_cluster, preset, save_cluster
from autopar.cli import main
from autopar.hardware import LinkSpec, OpLink, cluster_to_dict, preset_names
from autopar.hardware.device import DeviceSpec, time_shared
from autopar.hardware.links import MAX_LATENCY_S, MIN_LINK_BYTES_PER_S
from autopar.hardware.magnitudes import MIN_FLOP_PER_S, MIN_MEMORY_BYTES_PER_S
from autopar.hardware.presets import local_cpu_device

H100 = "device 'H100-SXM5-80GB' roofline"


def _edited(path, edit):
    """A two-node DGX H100 cluster file with one field changed by ``edit(data)``."""
    data = cluster_to_dict(preset("dgx-h100", nodes=2))
    edit(data)
    path.write_text(json.dumps(data))
    return path


def _set(*keys_and_value):
    *keys, value = keys_and_value

    def edit(data):
        for key in keys[:-1]:
            data = data[key]
        data[keys[-1]] = value

    return edit


CASES = {
    "a peak in TFLOP/s": (
        _set("device", "roofline", "peak_flops", "bf16", 989),
        "device",
        f"{H100} peak_flops[bf16]=989.0 FLOP/s is below 1e8 FLOP/s, slower than any real hardware: the field is in "
        "FLOP/s (989 TFLOP/s is 9.89e14, 989 GFLOP/s is 9.89e11); fix the cluster file.",
    ),
    "a matmul curve of 2 FLOP/s": (
        _set("device", "roofline", "matmul_curves", {"bf16": [[1, 2]]}),
        "device",
        f"{H100} matmul_curves[bf16] at best 2.0 FLOP/s is below 1e8 FLOP/s, slower than any real hardware: the field "
        "is in FLOP/s (each point is [FLOPs per call, FLOP/s]; 2 TFLOP/s is 2e12, 2 GFLOP/s is 2e9); fix the cluster "
        "file, or profile larger matmuls.",
    ),
    "a latency in ms": (
        _set("intra_node", "latency_s", 2),
        "intra_node",
        "link latency_s=2.0 s is above 1 s, longer than any real link: the field is in seconds per hop (2 ms is "
        "0.002, 2 us is 2e-6); fix the cluster file.",
    ),
    "a memory bandwidth in TB/s": (
        _set("device", "roofline", "memory_bandwidth_bytes_per_s", 3.35),
        "device",
        f"{H100} memory_bandwidth_bytes_per_s=3.35 B/s is below 1e8 B/s, slower than any real hardware: the field is "
        "in B/s (3.35 TB/s is 3.35e12, 3.35 GB/s is 3.35e9); fix the cluster file.",
    ),
    "a link bandwidth in GB/s": (
        _set("inter_node", "bandwidth_bytes_per_s", 45),
        "inter_node",
        "link bandwidth_bytes_per_s=45.0 B/s is below 1e6 B/s, slower than any real hardware: the field is in B/s "
        "(45 GB/s is 4.5e10, 45 MB/s is 4.5e7); fix the cluster file.",
    ),
    "an FP8 peak in TFLOP/s": (
        _set("device", "roofline", "fp8_flops", 1979),
        "device",
        f"{H100} fp8_flops=1979.0 FLOP/s is below 1e8 FLOP/s, slower than any real hardware: the field is in FLOP/s "
        "(0: no FP8 matmuls; 1979 TFLOP/s is 1.98e15, 1979 GFLOP/s is 1.98e12); fix the cluster file.",
    ),
    "a memory capacity in GiB": (
        _set("device", "memory", "capacity_bytes", 80),
        "device.memory",
        "memory capacity_bytes=80.0 is below 1048576 (1 MiB), smaller than any device: the field is in bytes (80 GiB "
        "is 8.59e10); fix the cluster file.",
    ),
    "a peak a thousand times too large": (
        _set("device", "roofline", "peak_flops", "bf16", 989e15),
        "device",
        f"{H100} peak_flops[bf16]=9.89e+17 FLOP/s is above 1e17 FLOP/s, faster "
        "than any real device: the field is in FLOP/s (989 TFLOP/s is 9.89e14); fix the cluster file.",
    ),
    "a capacity of 1e300 bytes": (
        _set("device", "memory", "capacity_bytes", 1e300),
        "device.memory",
        "memory capacity_bytes=1e+300 is above 3.52e13 (32 TiB), more than any device holds: the field is in bytes "
        "(80 GiB is 8.59e10); fix the cluster file.",
    ),
    "a per-collective fit in GB/s": (
        _set("intra_node", "per_op", [{"op": "reduce_scatter", "bandwidth_bytes_per_s": 0.4, "latency_s": 1e-4}]),
        "intra_node.per_op[0]",
        "reduce_scatter bandwidth_bytes_per_s=0.4 B/s is below 1e6 B/s, slower than any real hardware: the field is "
        "in B/s (0.4 GB/s is 4e8, 0.4 MB/s is 4e5); fix the cluster file.",
    ),
    "a per-collective latency in ms": (
        _set("intra_node", "per_op", [{"op": "all_gather", "bandwidth_bytes_per_s": 4e8, "latency_s": 1.5}]),
        "intra_node.per_op[0]",
        "all_gather latency_s=1.5 s is above 1 s, longer than any real link: the field is in seconds per hop (1.5 ms "
        "is 0.0015, 1.5 us is 1.5e-6); fix the cluster file.",
    ),
}


@pytest.mark.parametrize(("edit", "where", "message"), list(CASES.values()), ids=list(CASES))
def test_a_value_in_the_wrong_unit_is_refused_in_one_line(tmp_path, edit, where, message):
    path = _edited(tmp_path / "c.json", edit)
    with pytest.raises(ClusterError) as err:
        load_cluster(path)
    assert str(err.value) == f"cluster file {str(path)!r}.{where}: {message}"


@pytest.mark.parametrize(
    "case", ["a peak in TFLOP/s", "a matmul curve of 2 FLOP/s", "a latency in ms", "a memory capacity in GiB"]
)
def test_the_reported_files_stop_the_command_with_one_line(tmp_path, capsys, case):
    """The first three files of the reports planned as fitting (rc 0); the fourth, a
    capacity in GiB, was refused for its reserve above it, or ended in a traceback with
    no reserve; now the command exits 2."""
    edit, where, message = CASES[case]
    path = _edited(tmp_path / "c.json", edit)
    argv = ["plan", "--model", "gpt2-small", "--cluster", str(path), "--global-batch-size", "16", "--seq-len", "1024"]
    try:
        code = main(argv)
    except SystemExit as stopped:
        code = stopped.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.strip().splitlines() == [f"autopar: error: cluster file {str(path)!r}.{where}: {message}"]


@pytest.mark.parametrize("name", sorted(preset_names()))
@pytest.mark.parametrize("nodes", [1, 2, 4096])
def test_every_preset_still_loads_and_round_trips(tmp_path, name, nodes):
    """Every preset at one node, two and fewest_nodes' default limit of 4096 (local-cpu:
    as many processes as this machine's memory allows, the most time-shared it gets)."""
    if name == "local-cpu":
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        most = max(1, ram // (512 * 2**20) - 1)
        cluster = preset(name, nodes=1, devices_per_node=min(nodes, most))
    else:
        cluster = preset(name, nodes=nodes)
    assert load_cluster(save_cluster(cluster, tmp_path / "c.json")) == cluster


def test_a_time_shared_process_is_bounded_as_the_whole_device():
    """A CPU process with a thousandth of a core states 60 MFLOP/s, below the bound,
    yet is a real device: the bounds apply to the whole device. Whole devices below
    them are refused, the message saying both figures."""
    thin = time_shared(local_cpu_device(1), 1e-3, "a test")
    assert thin.roofline.peak_flops[DType.FP32] == pytest.approx(6e7)
    assert thin.roofline.memory_bandwidth_bytes_per_s < MIN_MEMORY_BYTES_PER_S
    half = time_shared(local_cpu_device(1), 0.5, "a test")
    roofline = dataclasses.replace(half.roofline, peak_flops={DType.FP32: 30.0, DType.BF16: 15.0})
    with pytest.raises(ClusterError) as err:
        dataclasses.replace(half, roofline=roofline)
    assert str(err.value) == (
        "device 'cpu-process' roofline peak_flops[fp32]=30.0 FLOP/s, 60 FLOP/s for the whole device of which it has "
        "0.5, is below 1e8 FLOP/s, slower than any real hardware: the field is in FLOP/s (30 TFLOP/s is 3e13, 30 "
        "GFLOP/s is 3e10); fix the cluster file."
    )


def test_a_curve_is_bounded_by_its_fastest_point():
    """A 1x1x1 matmul is dispatch-bound (about 1e6 FLOP/s on a CPU), so only the curve's
    fastest point must reach the bound."""
    cpu = local_cpu_device(1)
    measured = {DType.FP32: ((2.0, 7e5), (1.7e10, 5e10))}
    device = dataclasses.replace(cpu, roofline=dataclasses.replace(cpu.roofline, matmul_curves=measured))
    assert device.roofline.matmul_curves[DType.FP32][0] == (2.0, 7e5)


def test_the_bounds_themselves_are_allowed_and_just_past_them_is_not():
    h100 = preset("dgx-h100").device
    at = dataclasses.replace(
        h100.roofline,
        peak_flops={DType.BF16: MIN_FLOP_PER_S},
        memory_bandwidth_bytes_per_s=MIN_MEMORY_BYTES_PER_S,
        matmul_curves={DType.BF16: ((1e6, MIN_FLOP_PER_S),)},
        fp8_flops=MIN_FLOP_PER_S,
    )
    assert dataclasses.replace(h100, roofline=at).roofline == at
    for change in ({"peak_flops": {DType.BF16: 0.99e8}}, {"memory_bandwidth_bytes_per_s": 0.99e8}):
        with pytest.raises(ClusterError, match="is below 1e8"):
            dataclasses.replace(h100, roofline=dataclasses.replace(at, **change))
    assert LinkSpec(bandwidth_bytes_per_s=MIN_LINK_BYTES_PER_S, latency_s=MAX_LATENCY_S).latency_s == 1.0
    assert OpLink(op="all_reduce", bandwidth_bytes_per_s=MIN_LINK_BYTES_PER_S, latency_s=MAX_LATENCY_S).op
    with pytest.raises(ClusterError, match=r"^link bandwidth_bytes_per_s=999999.0 B/s is below 1e6 B/s"):
        LinkSpec(bandwidth_bytes_per_s=999_999, latency_s=0.0)
    with pytest.raises(ClusterError, match=r"^link latency_s=1.001 s is above 1 s"):
        LinkSpec(bandwidth_bytes_per_s=1e9, latency_s=1.001)


def test_slow_but_real_hardware_loads():
    """What the repository's profiles and tests use at their slowest: a 25 Mbit shaped
    link (3.1e6 B/s), gloo over loopback with a 1 ms hop, 1 GFLOP/s and 100 MB/s."""
    link = LinkSpec(bandwidth_bytes_per_s=25e6 / 8, latency_s=1e-3)
    cpu = local_cpu_device(1)
    roofline = dataclasses.replace(cpu.roofline, peak_flops={DType.FP32: 1e9}, memory_bandwidth_bytes_per_s=1e8)
    device = DeviceSpec(
        name="slow", roofline=roofline, memory=cpu.memory, host=cpu.host, preferred_dtype=DType.FP32, comm_overlap=0.0
    )
    cluster = dataclasses.replace(preset("local-cpu", devices_per_node=1), device=device, intra_node=link)
    assert cluster.intra_node.bandwidth_bytes_per_s == pytest.approx(3.125e6)
    assert cluster.device.roofline.peak_flops == {DType.FP32: 1e9}


def test_a_preset_is_saved_as_a_cluster_file_to_edit(tmp_path, capsys):
    """``autopar presets --save SPEC FILE`` writes the cluster the spec names, which
    loads back equal; edited (half the inter-node bandwidth) it plans as edited; an
    unknown preset is one line, exit 2, nothing written."""
    path = tmp_path / "cluster.json"
    assert main(["presets", "--save", "dgx-h100:16", str(path)]) == 0
    assert capsys.readouterr().out.startswith(f"wrote {path}: dgx-h100 x 16, 128 x H100-SXM5-80GB")
    assert load_cluster(path) == preset("dgx-h100", nodes=16)
    edited = _edited(tmp_path / "edited.json", _set("inter_node", "bandwidth_bytes_per_s", 22.5e9))
    assert load_cluster(edited).inter_node.bandwidth_bytes_per_s == 22.5e9
    assert main(["presets", "--save", "dgx-h200:2", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("autopar: error: unknown cluster preset 'dgx-h200'")
    assert not (tmp_path / "x.json").exists()
