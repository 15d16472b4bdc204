"""autopar export's refusals: an unknown target, a plan file that is missing or not
JSON, an unwritable path and a plan predicted not to fit, each a typed error from the
API and one line from the command line."""

from dataclasses import replace

import pytest

import autopar
from autopar.cli import main
from autopar.errors import ConfigError, PlanFormatError
from autopar.export import ExportError, UnreadablePlanError, export
from autopar.models import build_named_model


def test_bad_inputs_are_typed_errors(tmp_path, gpt2_plan):
    with pytest.raises(ExportError, match="unknown export target 'slurm'; use one of megatron, deepspeed"):
        export(gpt2_plan, to="slurm")
    with pytest.raises(UnreadablePlanError, match="does not exist") as info:
        export(tmp_path / "missing.json", to="megatron")
    assert isinstance(info.value, ConfigError) and isinstance(info.value, PlanFormatError)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(UnreadablePlanError, match="not valid JSON"):
        export(tmp_path / "bad.json", to="deepspeed")
    with pytest.raises(ExportError, match="it is a directory"):
        export(gpt2_plan, to="deepspeed").save(tmp_path)
    (tmp_path / "file").write_text("")
    with pytest.raises(ExportError, match="cannot write"):
        export(gpt2_plan, to="deepspeed").save(tmp_path / "file" / "ds.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.json", "file"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--to", "slurm"], "autopar: error: unknown export target 'slurm'"),
        (["--to", "megatron", "--model", "gpt3-6.7b"], "autopar: error: the model given"),
    ],
)
def test_cli_errors_are_one_line(tmp_path, capsys, gpt2_plan, argv, message):
    plan_file = gpt2_plan.save(tmp_path / "plan.json")
    assert main(["export", str(plan_file), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1 and "Traceback" not in err


def test_cli_unreadable_plan_is_one_line(tmp_path, capsys):
    assert main(["export", str(tmp_path / "none.json"), "--to", "accelerate"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autopar: error: plan file") and err.count("\n") == 1


@pytest.mark.parametrize("to", ["megatron", "deepspeed", "torchtitan", "accelerate"])
def test_a_plan_predicted_not_to_fit_is_not_exported(to, tmp_path, capsys):
    """An estimate of GPT-2 medium on 8 V100 cut to 2 GiB does not fit; written for a
    framework it would run out of memory on the cluster, so every target refuses it in
    one line that says by how much, and the command writes nothing."""
    base = autopar.preset("p3.16xlarge", nodes=1)
    memory = replace(base.device.memory, capacity_bytes=2 * 2**30)
    cluster = replace(base, device=replace(base.device, memory=memory))
    model = build_named_model("gpt2-medium")
    plan = autopar.estimate(model, cluster, {"dp": 8}, global_batch_size=64, seq_len=1024)
    assert not plan.prediction.fits
    peak = f"{plan.prediction.memory_bytes_per_device / 2**30:.1f} GiB per device, more than the 2.0 GiB"
    with pytest.raises(ExportError, match=f"the plan does not fit: it predicts {peak}"):
        export(plan, to)
    saved = plan.save(tmp_path / "plan.json")
    assert main(["export", str(saved), "--to", to, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the plan does not fit" in err[0] and not (tmp_path / "out").exists()
