"""ProfileReport: exact JSON round trip, merging, and clear errors for bad files."""

import json
import re
from dataclasses import replace

import pytest
from profile_factories import device, full, layers, network, prov

from autopar import codec
from autopar.errors import ProfileFormatError
from autopar.profiles.report import SCHEMA_VERSION, ProfileReport
from autopar.profiles.sections import Timing
from profiler.render import summary


def test_round_trip_is_exact(tmp_path):
    report = full()
    path = report.save(tmp_path / "sub" / "all.json")
    back = ProfileReport.load(path)
    assert back == report
    assert back.to_json() == path.read_text()


def test_awkward_floats_survive_bit_for_bit(tmp_path):
    odd = (0.1 + 0.2, 1e-300, 12345.678901234567, 2.0**-1074)
    t = Timing(median_s=odd[1], min_s=odd[3], max_s=odd[2], repeats=1)
    dev = device()
    unit = replace(layers().layers.units[0], fwd=t, param_bytes=odd[0])
    report = ProfileReport.merge(dev, ProfileReport(layers=replace(layers().layers, units=(unit,))))
    back = ProfileReport.load(report.save(tmp_path / "odd.json"))
    u = back.layers.units[0]
    assert (u.param_bytes, u.fwd.median_s, u.fwd.min_s, u.fwd.max_s) == (odd[0], odd[1], odd[3], odd[2])


def test_merge_joins_sections_and_later_wins():
    first = device(host="first")
    second = device(host="second")
    merged = ProfileReport.merge(first, layers(), second, network())
    assert merged.measured == ("device", "layers", "network")
    assert merged.device.provenance.host == "second"
    assert ProfileReport.merge(layers()).measured == ("layers",)


def test_merge_rejects_non_reports():
    with pytest.raises(ProfileFormatError, match="ProfileReport.load"):
        ProfileReport.merge(device(), {"device": None})
    with pytest.raises(ProfileFormatError, match="at least one"):
        ProfileReport.merge()


def _write(tmp_path, data, name="r.json"):
    p = tmp_path / name
    p.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return p


def test_unknown_versions_say_what_to_do(tmp_path):
    data = full().to_dict()
    with pytest.raises(ProfileFormatError, match=r"schema_version 2 .*upgrade autopar"):
        ProfileReport.load(_write(tmp_path, {**data, "schema_version": 2}))
    with pytest.raises(ProfileFormatError, match=r"schema_version 0 .*measure again"):
        ProfileReport.load(_write(tmp_path, {**data, "schema_version": 0}))
    assert SCHEMA_VERSION == 1


def test_malformed_files_name_the_field(tmp_path):
    data = full().to_dict()
    bad_type = json.loads(json.dumps(data))
    bad_type["network"]["series"][1]["points"][0]["nbytes"] = "lots"
    with pytest.raises(ProfileFormatError, match=r"network\.series\[1\]\.points\[0\]\.nbytes: expected a finite"):
        ProfileReport.load(_write(tmp_path, bad_type))
    missing = json.loads(json.dumps(data))
    del missing["device"]["matmul"][0]["flops"]
    with pytest.raises(ProfileFormatError, match=r"device\.matmul\[0\]\.flops: missing field"):
        ProfileReport.load(_write(tmp_path, missing))
    unknown = json.loads(json.dumps(data))
    unknown["layers"]["units"][0]["fwd_time"] = 1.0
    with pytest.raises(ProfileFormatError, match=r"layers\.units\[0\]: unknown field\(s\) fwd_time"):
        ProfileReport.load(_write(tmp_path, unknown))
    bad_literal = json.loads(json.dumps(data))
    bad_literal["device"]["kind"] = "tpu"
    with pytest.raises(ProfileFormatError, match=r"device\.kind: 'tpu' is not one of"):
        ProfileReport.load(_write(tmp_path, bad_literal))
    bad_precision = json.loads(json.dumps(data))
    bad_precision["device"]["matmul"][0]["dtype"] = "fp64"  # a precision the planner does not price
    with pytest.raises(ProfileFormatError, match=r"device\.matmul\[0\]\.dtype: 'fp64' is not one of 'fp32'"):
        ProfileReport.load(_write(tmp_path, bad_precision))
    for field, value, said in (
        ("dtype", "fp64", "dtype 'fp64' is not one of fp32, bf16, fp16"),
        ("batch", 0, "batch 0 is not a sample count"),
        ("seq_len", -1, "seq_len -1 is not a token count"),
        ("units", [], "it measured no unit"),
    ):  # each reached the planner and failed there with a traceback (a division, an enum)
        bad_layers = json.loads(json.dumps(data))
        bad_layers["layers"][field] = value
        with pytest.raises(ProfileFormatError, match=re.escape(said)):
            ProfileReport.load(_write(tmp_path, bad_layers))
    bad_timing = json.loads(json.dumps(data))
    bad_timing["layers"]["units"][0]["fwd"]["min_s"] = 5.0
    with pytest.raises(ProfileFormatError, match="inconsistent"):
        ProfileReport.load(_write(tmp_path, bad_timing))


def test_not_a_report(tmp_path):
    with pytest.raises(ProfileFormatError, match="not an autopar profile report"):
        ProfileReport.load(_write(tmp_path, {"nodes": 2}))
    with pytest.raises(ProfileFormatError, match="not valid JSON"):
        ProfileReport.load(_write(tmp_path, '{"schema": "autopar-profile", '))
    with pytest.raises(ProfileFormatError, match="does not exist"):
        ProfileReport.load(tmp_path / "nope.json")
    with pytest.raises(ProfileFormatError, match="JSON object"):
        ProfileReport.load(_write(tmp_path, [1, 2]))
    nan = full().to_dict()
    nan["layers"]["units"][0]["fwd"]["median_s"] = float("nan")
    with pytest.raises(ProfileFormatError, match=r"layers\.units\[0\]\.fwd\.median_s: expected a finite number"):
        ProfileReport.load(_write(tmp_path, json.dumps(nan)))


def test_timing_summary():
    t = Timing.of([3.0, 1.0, 2.0, 10.0])
    assert (t.median_s, t.min_s, t.max_s, t.repeats, t.mean_s) == (2.5, 1.0, 10.0, 4, 4.0)
    assert t.spread == pytest.approx(9.0 / 2.5)
    with pytest.raises(ProfileFormatError):
        Timing.of([])
    with pytest.raises(ProfileFormatError, match=r"0 <= min_s <= median_s, mean_s <= max_s"):
        Timing(median_s=2.0, min_s=1.0, max_s=3.0, repeats=3, mean_s=3.5)


def test_a_call_costs_the_mean_of_its_repeats_and_old_reports_their_median():
    """A step pays every call, the slow ones too: per_call_s is the mean; a report
    written before means were recorded (no mean_s) still loads, priced by its median."""
    tailed = Timing.of([1e-3, 1e-3, 4e-3])
    assert tailed.per_call_s == pytest.approx(2e-3) and tailed.median_s == 1e-3
    old = {k: v for k, v in codec.encode(tailed, error=ProfileFormatError).items() if k != "mean_s"}
    before = codec.decode(Timing, old, "time", error=ProfileFormatError)
    assert before.mean_s is None and before.per_call_s == 1e-3


def test_summary_lines_say_what_where_when():
    lines = summary(full())
    assert len(lines) == 3
    assert lines[0].startswith("device: Test device") and "host testhost" in lines[0]
    assert "layers: Toy batch 2" in lines[1] and "2026-11-29T12:00:00+00:00" in lines[1]
    assert "network: gloo 4 ranks on 2 node(s)" in lines[2] and "intra 1 GB/s" in lines[2]


def test_derived_numbers():
    dev = device(rate_flop_per_s=2e11).device
    assert dev.curve("fp32") == tuple((2.0 * n**3, pytest.approx(2e11)) for n in (64, 256, 1024))
    assert dev.peak_flop_per_s("fp32") == pytest.approx(2e11)
    with pytest.raises(ProfileFormatError, match="no bf16 matmul"):
        dev.peak_flop_per_s("bf16")
    lay = layers(fwd_s=0.5, bwd_s=1.0).layers
    assert lay.step_s() == pytest.approx(2 * 1.5)
    assert lay.units[0].achieved_flop_per_s == pytest.approx(3e9 / 1.5)
    net = network(node_of_rank=("a", "a", "a", "b")).network
    assert (net.nodes, net.ranks_per_node) == (2, 3)
    assert net.link("inter").bandwidth_bytes_per_s == 1e8
    assert network(inter=None).network.link("inter") is None
    assert prov().host == "testhost"


def test_attention_points_round_trip_and_older_reports_have_none(tmp_path):
    """A GPU profile's attention sweep survives the file exactly; a report written before
    it existed (no ``attention`` field) reads as one that measured none."""
    report = device(kind="cuda", dtypes=("bf16",), attention_flop_per_s=(2.5e14, 3.5e14))
    back = ProfileReport.load(report.save(tmp_path / "gpu.json"))
    assert back == report and back.device.attention_flop_per_s("bf16") == pytest.approx(3e14, rel=1e-12)
    data = report.to_dict()
    del data["device"]["attention"]
    assert ProfileReport.from_dict(data).device.attention == ()


def test_a_kernel_timed_at_zero_is_refused_naming_where(tmp_path):
    """A matmul point whose times were zeroed (hand-edited) loaded, then ended a plan in
    a ZeroDivisionError traceback; it is refused on load, naming the file and the point."""
    data = json.loads(full().to_json())
    data["device"]["matmul"][1]["time"] = {"median_s": 0.0, "min_s": 0.0, "max_s": 0.0, "repeats": 3}
    path = tmp_path / "zero.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileFormatError) as err:
        ProfileReport.load(path)
    assert str(err.value).startswith(f"profile {str(path)!r}: device.matmul[1]: a kernel of flops=")
    assert "timed at median_s=0.0 is not allowed" in str(err.value)


@pytest.mark.parametrize(
    ("edit", "where", "says"),
    [
        (lambda d: d["device"].update(memory_bytes=0.0), "device", "memory_bytes=0.0 with reserved_bytes="),
        (
            lambda d: d["network"]["series"][1]["points"][0].update(nbytes=-1024.0),
            "network.series[1].points[0]",
            "a message of nbytes=-1024.0 is not allowed",
        ),
        (
            lambda d: d["layers"]["units"][0]["bwd"].update(median_s=0.0, min_s=0.0, mean_s=0.0),
            "layers.units[0]",
            "unit '",
        ),
    ],
    ids=["no memory", "a negative message", "a backward of no time"],
)
def test_impossible_sizes_are_refused_naming_the_file_and_field(tmp_path, edit, where, says):
    """A device of no memory, a collective of negative bytes, a unit whose backward took
    no time: refused on load with the file and field, where they failed later naming
    neither (a cluster capacity of 0, a curve of -1024 bytes) or planned at an MFU of
    172%."""
    data = json.loads(full().to_json())
    edit(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileFormatError) as err:
        ProfileReport.load(path)
    assert str(err.value).startswith(f"profile {str(path)!r}: {where}: {says}")
