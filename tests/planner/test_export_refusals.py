"""autopar export's refusals: an unknown target, a plan file that is missing or not
JSON, an unwritable path and a plan predicted not to fit, each a typed error from the
API and one line from the command line."""

from dataclasses import replace

import pytest
import torch

import autopar
from autopar.cli import main
from autopar.errors import ConfigError, PlanFormatError
from autopar.export import ExportError, UnreadablePlanError, export
from autopar.models import build_named_model

from .test_export import variant


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


def _takers(message: str) -> set[str]:
    """The targets a refusal says take the plan as it is."""
    if message.endswith("No other target exports this plan as it is either."):
        return set()
    listed = message.rpartition("This plan exports as it is to ")[2].rstrip(".")
    return set(listed.replace(" and ", ", ").split(", "))


@pytest.mark.parametrize(
    "case, refused",
    [
        ("pp-cp", {"deepspeed", "accelerate"}),
        ("pp-reduce-bf16", {"torchtitan", "accelerate"}),
    ],
)
def test_a_refusal_names_only_the_targets_that_take_the_plan(pipelined_plan, case, refused):
    """A plan with pipeline and context parallelism is refused by DeepSpeed (no ring
    attention) and Accelerate (no pipelining); a pipelined plan reducing in bf16 by
    torchtitan (fp32 reductions only) and Accelerate. Each refusal names exactly the
    targets that export the plan, found by exporting it to every target."""
    plan = {
        "pp-cp": variant(pipelined_plan, dp=1, cp=2, zero_stage=1),
        "pp-reduce-bf16": variant(pipelined_plan, zero_stage=2, reduce_dtype="bf16"),
    }[case]
    targets = ("megatron", "deepspeed", "torchtitan", "accelerate")
    refusals = {}
    for target in targets:
        try:
            export(plan, target)
        except ExportError as exc:
            refusals[target] = str(exc)
    assert set(refusals) == refused
    for message in refusals.values():
        assert _takers(message) == set(targets) - refused


def test_models_a_decoder_trainer_does_not_build_are_refused(tmp_path, capsys):
    """Megatron-LM's and Megatron-DeepSpeed's pretrain_gpt.py and torchtitan build causal
    decoders of their own: a bidirectional BERT (a transformers masked LM) and an image
    model are refused by them, in one line that names the targets that run the model
    given (plain DeepSpeed and Accelerate), rather than written as a GPT of their sizes."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128
    )
    with torch.device("meta"):
        bert = transformers.BertForMaskedLM(config)
    cluster = autopar.preset("dgx-a100-80gb", nodes=1)
    plan = autopar.estimate(bert, cluster, {"tp": 2}, global_batch_size=8, seq_len=64)
    for target in ("megatron", "torchtitan", "deepspeed"):
        with pytest.raises(
            ExportError,
            match=r"BertForMaskedLM is not a decoder-only causal language model .* "
            r"This plan exports as it is to accelerate\.$",
        ):
            export(plan, target, model=bert)
    export(plan, "accelerate", model=bert)
    alone = autopar.estimate(bert, cluster, {"tp": 1}, global_batch_size=8, seq_len=64)
    assert "train.py" in export(alone, "deepspeed").launch
    resnet = build_named_model("resnet-small")
    image = autopar.plan(resnet, cluster, global_batch_size=64, sample_input=torch.zeros(1, 3, 32, 32, device="meta"))
    saved = image.save(tmp_path / "plan.json")
    for target in ("megatron", "torchtitan"):
        assert main(["export", str(saved), "--to", target]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "ResNet takes no token sequence" in err and "--seq-len" not in err
