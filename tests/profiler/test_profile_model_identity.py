"""A layer profile knows the model it measured: another model is refused with both
named, the same model at another shape is used with a note, an old report still loads."""

import dataclasses
import glob
from pathlib import Path

import pytest
import torch

import autopar
from autopar.cli import main
from autopar.errors import ConfigError
from autopar.graph import extract, model_fingerprint
from autopar.hardware import preset
from autopar.models import GPT, GPTConfig
from autopar.profiles import ProfileModelError, ProfileReport, layer_calibration, parameter_shapes
from autopar.profiles.apply import measurements
from profiler.layers import LayerSweep, profile_model
from profiler.timing import Repeats

TINY = GPTConfig(vocab_size=128, seq_len=32, dim=32, n_layers=2, n_heads=2)
BATCH = 2
ESTIMATE = {"dp": 1, "tp": 1, "pp": 1, "micro_batch_size": BATCH, "dtype": "fp32"}
FAST = LayerSweep(repeats=Repeats(warmup=0, repeats=1, min_repeats=1), count_flops=False, measure_memory=False)
BENCHMARK_RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def _profile(cfg: GPTConfig, name: str) -> ProfileReport:
    """``cfg``'s GPT profiled at BATCH x its own sequence length, once per unit."""
    torch.manual_seed(0)
    model = GPT(cfg)
    return profile_model(model, torch.randint(0, cfg.vocab_size, (BATCH, cfg.seq_len)), sweep=FAST, name=name)


@pytest.fixture(scope="module")
def tiny() -> ProfileReport:
    return _profile(TINY, "tiny-gpt")


def _estimate(cfg: GPTConfig, profile, *, seq_len: int) -> autopar.Plan:
    cluster = preset("local-cpu", devices_per_node=1)
    return autopar.estimate(GPT(cfg), cluster, ESTIMATE, global_batch_size=2 * BATCH, seq_len=seq_len, profile=profile)


def _profile_notes(plan: autopar.Plan) -> list[str]:
    return [n for n in plan.notes if "layer profile" in n]


def _legacy(report: ProfileReport) -> dict:
    """``report`` as a file written before profiles recorded their model."""
    data = report.to_dict()
    del data["layers"]["model_fingerprint"], data["layers"]["parameter_shapes"]
    return data


def test_a_layer_profile_records_its_model_and_reads_it_back(tiny):
    model = GPT(TINY)
    assert tiny.layers.model_fingerprint == model_fingerprint(model)
    assert tiny.layers.parameter_shapes == parameter_shapes(model)
    assert tiny.layers.parameter_shapes["pos_embeddings.weight"] == (TINY.seq_len, TINY.dim)
    assert ProfileReport.from_dict(tiny.to_dict()) == tiny


@pytest.mark.parametrize(
    ("other", "why"),
    [
        (dataclasses.replace(TINY, dim=64), "their parameters differ (first: layers.0.attention.wk.bias (32,) there"),
        (dataclasses.replace(TINY, n_layers=3), "parameter(s) are in one model only (first: layers.2."),
        (dataclasses.replace(TINY, vocab_size=256), "tok_embeddings.weight (128, 32) there, (256, 32) here"),
    ],
)
def test_another_model_is_refused_naming_both(tiny, other, why):
    cluster = preset("local-cpu", devices_per_node=1)
    with pytest.raises(ProfileModelError) as info:
        autopar.plan(GPT(other), cluster, global_batch_size=4, seq_len=32, profile=tiny)
    msg = str(info.value)
    assert isinstance(info.value, ConfigError) and "\n" not in msg
    assert msg.startswith(
        f"the layer profile in report #1 measured tiny-gpt (30,592 parameters, fingerprint "
        f"{tiny.layers.model_fingerprint}) but the plan is for GPT ("
    )
    assert f"fingerprint {model_fingerprint(GPT(other))})" in msg and why in msg
    assert msg.endswith("profile this model with 'autopar profile model ...' or drop --profile.")


def test_a_layer_graph_of_another_model_is_refused(tiny):
    other = GPT(dataclasses.replace(TINY, dim=64))
    graph = extract(other, seq_len=32, dtype="fp32")
    with pytest.raises(ProfileModelError, match="is a LayerGraph, which does not list its parameter shapes"):
        autopar.plan(graph, preset("local-cpu", devices_per_node=1), global_batch_size=4, profile=tiny)


def test_widths_that_equal_the_seq_len_are_not_taken_for_a_position_table():
    """dim == seq_len in both models: every width looks sequence-sized, but the blocks
    are not the same blocks."""
    square = _profile(dataclasses.replace(TINY, dim=16, seq_len=16), "square")
    with pytest.raises(ProfileModelError, match=r"its unit layers\.0 \(signature \w+\) is not a unit"):
        _estimate(dataclasses.replace(TINY, dim=32, seq_len=32), square, seq_len=32)


def test_the_same_model_at_another_seq_len_is_used_with_a_note(tiny):
    plan = _estimate(TINY, tiny, seq_len=16)
    assert _profile_notes(plan) == [
        "The layer profile of tiny-gpt in report #1 was measured at batch 2, seq 32 and is applied at micro-batch 2, "
        "seq 16: its per-unit factors carry over through the device curves."
    ]
    assert _profile_notes(plan)[0] in autopar.explain(plan)
    unprofiled = _estimate(TINY, None, seq_len=16)
    assert plan.prediction.step_time_s != unprofiled.prediction.step_time_s  # the factors apply


def test_the_same_model_and_shapes_get_no_note_and_the_calibration_as_before(tiny):
    plan = _estimate(TINY, tiny, seq_len=32)
    assert _profile_notes(plan) == []
    cluster = preset("local-cpu", devices_per_node=1)
    assert measurements(cluster, tiny).calibration == layer_calibration(tiny, base=cluster)
    legacy = _estimate(TINY, _legacy(tiny), seq_len=32)  # how the profile was applied before it knew its model
    assert plan.prediction.step_time_s == legacy.prediction.step_time_s
    assert plan.prediction.step_time_s != _estimate(TINY, None, seq_len=32).prediction.step_time_s


def test_a_model_built_for_another_seq_len_is_the_same_model(tiny):
    """Only the position table differs, in its sequence dimension: the profiled model
    at its seq_len, the planned one at its own."""
    plan = _estimate(dataclasses.replace(TINY, seq_len=16), tiny, seq_len=16)
    (note,) = _profile_notes(plan)
    assert "measured at batch 2, seq 32 and is applied at micro-batch 2, seq 16" in note
    assert note.endswith("the profiled model was built for seq 32 (pos_embeddings.weight).")


def test_an_old_report_without_the_model_loads_and_is_matched_by_its_units(tiny):
    old = ProfileReport.from_dict(_legacy(tiny))
    assert (old.layers.model_fingerprint, old.layers.parameter_shapes) == ("", {})
    plan = _estimate(TINY, old, seq_len=16)
    notes = _profile_notes(plan)
    assert len(notes) == 2 and "was written before profiles recorded their model's fingerprint" in notes[0]
    assert "measured at batch 2, seq 32" in notes[1]
    with pytest.raises(ProfileModelError, match="tiny-gpt \\(fingerprint not recorded: the profile predates it\\)"):
        _estimate(dataclasses.replace(TINY, n_layers=3), old, seq_len=32)


@pytest.mark.parametrize("path", sorted(glob.glob(str(BENCHMARK_RESULTS / "profiler_cost_*.json"))))
def test_saved_reports_still_load(path):
    assert ProfileReport.load(path).layers is not None


def test_the_cli_prints_the_refusal_on_one_line(tiny, tmp_path, capsys):
    path = tiny.save(tmp_path / "tiny.json")
    args = ["plan", "--model", "gpt2-small", "--cluster", "local-cpu:1", "--global-batch-size", "4"]
    assert main([*args, "--seq-len", "32", "--profile", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err and captured.err.count("\n") == 1
    assert captured.err.startswith(f"autopar: error: the layer profile in {path} measured tiny-gpt (")
    assert "but the plan is for GPT (124," in captured.err and "drop --profile." in captured.err


def test_another_precision_is_named_in_the_note(tiny):
    cluster = preset("local-cpu", devices_per_node=1)
    plan = autopar.estimate(
        GPT(TINY), cluster, {**ESTIMATE, "dtype": "bf16"}, global_batch_size=2 * BATCH, seq_len=32, profile=tiny
    )
    (note,) = _profile_notes(plan)
    assert "measured at batch 2, seq 32 (fp32) and is applied at micro-batch 2, seq 32 (bf16)" in note


def test_a_profile_measured_on_cpu_processes_says_so_on_a_gpu_cluster(tiny):
    """The profile's per-unit factors (measured over predicted) carry the CPU's efficiency
    to whatever device the cluster has: planned for a DGX H100 it still applies, but the
    plan says where it was measured; for CPU processes, as the profile's own, it does not."""
    cluster = preset("dgx-h100", nodes=1)
    plan = autopar.estimate(
        GPT(TINY), cluster, {**ESTIMATE, "dp": 8}, global_batch_size=8 * BATCH, seq_len=32, profile=tiny
    )
    device = tiny.layers.device
    assert device.startswith("cpu-process: ") and tiny.layers.device_kind == "cpu"
    assert (
        f"The layer profile of tiny-gpt in report #1 was measured on {device} (cpu) and is applied to the cluster's "
        f"H100-SXM5-80GB: its per-unit factors (measured over predicted) carry that device's efficiency over; "
        f"profile the model on the cluster's devices for a prediction of them."
    ) in _profile_notes(plan)
    assert not any("was measured on" in n for n in _profile_notes(_estimate(TINY, tiny, seq_len=32)))
    # its factors are the CPU's measured over the CPU's predicted time, as on the machine
    # that measured it: they were its milliseconds over an H100's microseconds (600x and
    # more), which made the plan's compute as slow as the CPU's
    assert layer_calibration(tiny, base=cluster) == layer_calibration(tiny)
    plain = autopar.estimate(GPT(TINY), cluster, {**ESTIMATE, "dp": 8}, global_batch_size=8 * BATCH, seq_len=32)
    assert plan.prediction.step_time_s < 10 * plain.prediction.step_time_s
