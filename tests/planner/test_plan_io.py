"""Plan files: exact round trip, versioned, malformed input named precisely."""

import dataclasses
import json
import re

import pytest

from autopar import Plan, PlanFormatError, Recompute


def eager(plan: Plan) -> Plan:
    """``plan`` with its blocks not compiled: what a file older than version 6 held."""
    return dataclasses.replace(plan, config=dataclasses.replace(plan.config, compile=False))


@pytest.mark.parametrize("fixture", ["gpt2_plan", "pipelined_plan"])
def test_exact_round_trip(fixture, request, tmp_path):
    plan = request.getfixturevalue(fixture)
    text = plan.to_json()
    again = Plan.from_json(text)
    assert again == plan
    assert again.to_json() == text
    path = tmp_path / "p.json"
    plan.save(path)
    assert Plan.load(path) == plan


def test_unknown_schema_version(gpt2_plan):
    data = json.loads(gpt2_plan.to_json())
    data["schema_version"] = 99
    with pytest.raises(PlanFormatError, match="schema_version 99 is not supported"):
        Plan.from_dict(data)


def test_another_json_file_is_said_not_to_be_a_plan():
    """A cluster file or any other JSON object given as a plan read 'schema_version None
    is not supported ... Re-create the plan with this autopar version'."""
    with pytest.raises(PlanFormatError, match=r"not an autopar plan \(no schema_version or config; its keys: "):
        Plan.from_dict({"name": "dgx-h100", "nodes": 2})


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d["config"].__setitem__("tp", "8"), r"plan.config.tp: expected an integer, got '8'"),
        (
            lambda d: d["config"].__setitem__("schedule", "zigzag"),
            r"plan.config.schedule: 'zigzag' is not one of 'gpipe'",
        ),
        (lambda d: d["layer_strategies"]["tp"].__setitem__("x", "diagonal"), r"plan.layer_strategies.tp\['x'\]"),
        (lambda d: d["config"].pop("dp"), r"plan.config.dp: missing field"),
        (lambda d: d["config"].__setitem__("extra", 1), r"plan.config: unknown field"),
        (lambda d: d["cluster"].__setitem__("nodes", 0), r"plan.cluster: .*nodes=0"),
    ],
)
def test_malformed_fields_are_named(pipelined_plan, mutate, message):
    data = json.loads(pipelined_plan.to_json())
    mutate(data)
    with pytest.raises(PlanFormatError, match=message):
        Plan.from_dict(data)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("step_time_s", 0.0, "step_time_s=0.0 must be > 0"),  # explain divided by it
        ("step_time_s", -1.0, "step_time_s=-1.0 must be > 0"),
        ("stages", [], "stages must list at least one stage"),  # explain took the max of none
        ("memory_bytes_per_device", 1e15, "fits is true with memory_bytes_per_device=1000000000000000.0 above"),
        ("mfu", -0.5, "mfu=-0.5 must be >= 0"),
    ],
)
def test_a_prediction_edited_past_what_any_prediction_is_refused(pipelined_plan, field, value, message):
    """A hand-edited prediction that no cost model makes is refused at load, in one line
    naming the field, rather than crashing ``autopar report`` or reading as a plan."""
    data = json.loads(pipelined_plan.to_json())
    assert data["prediction"]["fits"]
    data["prediction"][field] = value
    with pytest.raises(PlanFormatError, match=re.escape(f"plan.prediction: {message}")) as info:
        Plan.from_dict(data)
    assert "\n" not in str(info.value) and "make the plan again" in str(info.value)


def test_inconsistent_plan_refused(pipelined_plan):
    data = json.loads(pipelined_plan.to_json())
    data["stages"] = data["stages"][:1]
    with pytest.raises(PlanFormatError, match="stages but pp x virtual_stages"):
        Plan.from_dict(data)


@pytest.mark.parametrize("field", ["num_microbatches", "micro_batch_size"])
def test_a_plan_whose_batch_does_not_add_up_is_refused(pipelined_plan, field):
    """dp x micro-batch x micro-batches must be the plan's global batch: a hand-edited
    file that breaks it would run another batch than the one planned."""
    data = json.loads(pipelined_plan.to_json())
    data["config"][field] *= 2
    with pytest.raises(PlanFormatError, match="batch arithmetic is inconsistent"):
        Plan.from_dict(data)


def test_missing_and_broken_files(tmp_path):
    with pytest.raises(PlanFormatError, match="does not exist"):
        Plan.load(tmp_path / "none.json")
    (tmp_path / "x.json").write_text("[1, 2")
    with pytest.raises(PlanFormatError, match="not valid JSON"):
        Plan.load(tmp_path / "x.json")


def test_an_hsdp_plan_round_trips(gpt2_plan):
    from dataclasses import replace

    c = gpt2_plan.config
    assert c.dp % 2 == 0 and c.dp > 2
    plan = replace(gpt2_plan, config=replace(c, zero_stage=3, dp_shard=2))
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.config.dp_shard == 2
    assert json.loads(plan.to_json())["config"]["dp_shard"] == 2


def test_a_version_2_plan_file_loads_as_plain_fsdp(gpt2_plan):
    """Version 2 had no dp_shard and no cp: its plans read as one shard group of all of dp."""
    data = json.loads(gpt2_plan.to_json())
    data["schema_version"] = 2
    del data["model"]["has_attention"]  # version 11
    del data["config"]["async_tp"], data["config"]["regather"], data["config"]["reduce_dtype"]
    del data["config"]["dp_shard"], data["config"]["cp"], data["prediction"]["breakdown"]["cp_comm_s"]
    del (
        data["config"]["ep"],
        data["prediction"]["breakdown"]["ep_comm_s"],
        data["config"]["compile"],
        data["config"]["fp8"],
    )
    old = Plan.from_dict(data)
    assert old == eager(gpt2_plan) and old.config.dp_shard is None and old.config.shard_size == gpt2_plan.config.dp
    data["config"]["dp_shard"] = 2
    with pytest.raises(PlanFormatError, match="config.dp_shard needs schema_version 3"):
        Plan.from_dict(data)


def test_a_version_3_plan_file_loads_without_context_parallelism(gpt2_plan):
    """Version 3 had no cp: its plans read with cp=1; a cp field needs version 4."""
    data = json.loads(gpt2_plan.to_json())
    data["schema_version"] = 3
    del data["model"]["has_attention"]  # version 11
    del data["config"]["async_tp"], data["config"]["regather"], data["config"]["reduce_dtype"]
    del data["config"]["cp"], data["prediction"]["breakdown"]["cp_comm_s"]
    del (
        data["config"]["ep"],
        data["prediction"]["breakdown"]["ep_comm_s"],
        data["config"]["compile"],
        data["config"]["fp8"],
    )
    old = Plan.from_dict(data)
    assert old == eager(gpt2_plan) and old.config.cp == 1 and old.config.dp_cp == old.config.dp
    data["config"]["cp"] = 2
    with pytest.raises(PlanFormatError, match="config.cp needs schema_version 4"):
        Plan.from_dict(data)


def test_a_version_4_plan_file_loads_without_expert_parallelism(gpt2_plan):
    """Version 4 had no ep: its plans read with ep=1; an ep field needs version 5."""
    data = json.loads(gpt2_plan.to_json())
    data["schema_version"] = 4
    del data["model"]["has_attention"]  # version 11
    del data["config"]["async_tp"], data["config"]["regather"], data["config"]["reduce_dtype"]
    del (
        data["config"]["ep"],
        data["prediction"]["breakdown"]["ep_comm_s"],
        data["config"]["compile"],
        data["config"]["fp8"],
    )
    old = Plan.from_dict(data)
    assert old == eager(gpt2_plan) and old.config.ep == 1 and old.config.expert_replicas == old.config.dp_cp
    data["config"]["ep"] = 2
    with pytest.raises(PlanFormatError, match="config.ep needs schema_version 5"):
        Plan.from_dict(data)


def test_a_version_5_plan_file_loads_without_compiled_blocks(gpt2_plan):
    """Version 5 had no compile: its plans read as eager; a compile field needs version 6."""
    data = json.loads(gpt2_plan.to_json())
    data["schema_version"] = 5
    del data["model"]["has_attention"]  # version 11
    del data["config"]["async_tp"], data["config"]["regather"], data["config"]["reduce_dtype"]
    del data["config"]["compile"], data["config"]["fp8"]
    old = Plan.from_dict(data)
    assert old == eager(gpt2_plan) and old.config.compile is False
    data["config"]["compile"] = True
    with pytest.raises(PlanFormatError, match="config.compile needs schema_version 6"):
        Plan.from_dict(data)


def test_a_version_6_plan_file_loads_and_op_recompute_needs_version_7(gpt2_plan):
    """Version 6 had no ``op`` recompute mode: its plans read unchanged; naming ``op``,
    as the default or for one unit, needs version 7."""
    data = json.loads(gpt2_plan.to_json())
    data["schema_version"] = 6
    del data["model"]["has_attention"]  # version 11
    del data["config"]["async_tp"], data["config"]["regather"], data["config"]["reduce_dtype"]
    assert Plan.from_dict(data) == gpt2_plan
    for where in ("config", "unit"):
        bad = json.loads(json.dumps(data))
        if where == "config":
            bad["config"]["recompute"] = "op"
        else:
            bad["layer_strategies"]["recompute"] = {"layers.0": "op"}
        with pytest.raises(PlanFormatError, match="recompute 'op' needs schema_version 7"):
            Plan.from_dict(bad)
        bad["schema_version"] = 7
        assert Plan.from_dict(bad).layer_strategies.recompute_of("layers.0", Plan.from_dict(bad).config.recompute) is (
            Recompute.OP
        )


def test_a_version_7_plan_file_loads_without_async_tp(gpt2_plan):
    """Version 7 had no async_tp: its plans read with synchronous tensor parallelism; an
    async_tp field needs version 8."""
    data = json.loads(gpt2_plan.to_json())
    assert data["config"]["async_tp"] is False
    data["schema_version"] = 7
    del data["model"]["has_attention"]  # version 11
    del data["config"]["async_tp"], data["config"]["regather"], data["config"]["reduce_dtype"]
    assert Plan.from_dict(data) == gpt2_plan
    data["config"]["async_tp"] = False
    with pytest.raises(PlanFormatError, match="config.async_tp needs schema_version 8"):
        Plan.from_dict(data)


def test_a_version_8_plan_file_loads_and_dualpipev_needs_version_9(gpt2_plan):
    """Version 8 had no dualpipev schedule: its plans read unchanged; naming it needs version 9."""
    data = json.loads(gpt2_plan.to_json())
    data["schema_version"] = 8
    del data["model"]["has_attention"]  # version 11
    del data["config"]["regather"], data["config"]["reduce_dtype"]
    assert Plan.from_dict(data) == gpt2_plan
    data["config"].update(schedule="dualpipev", virtual_stages=2)
    with pytest.raises(PlanFormatError, match="schedule 'dualpipev' needs schema_version 9 or later \\(got 8\\)"):
        Plan.from_dict(data)


def test_a_version_9_plan_file_loads_holding_the_gathers(gpt2_plan):
    """Version 9 had no regather: its plans read holding the sequence-parallel gathers; a
    regather field needs version 10."""
    data = json.loads(gpt2_plan.to_json())
    data["schema_version"] = 9
    del data["config"]["regather"], data["config"]["reduce_dtype"]
    del data["model"]["has_attention"]
    assert Plan.from_dict(data) == gpt2_plan
    data["config"]["regather"] = False
    with pytest.raises(PlanFormatError, match="config.regather needs schema_version 10 or later \\(got 9\\)"):
        Plan.from_dict(data)


def test_a_version_10_plan_file_loads_and_heads_needs_version_11(gpt2_plan):
    """Version 10 had no per-head norm style and no has_attention: its plans read as
    models with attention; naming either needs version 11."""
    data = json.loads(gpt2_plan.to_json())
    assert data["model"]["has_attention"] is True
    data["schema_version"] = 10
    del data["model"]["has_attention"], data["config"]["reduce_dtype"]
    assert Plan.from_dict(data) == gpt2_plan
    data["layer_strategies"]["tp"] = {"transformer.h.0.ln_1": "heads"}
    with pytest.raises(PlanFormatError, match="the style 'heads' and model.has_attention need schema_version 11"):
        Plan.from_dict(data)


def test_a_version_11_plan_file_reduces_in_fp32_and_reduce_dtype_needs_version_12(gpt2_plan):
    """Version 11 had no reduce_dtype: its plans read reducing gradients in fp32; naming
    it needs version 12."""
    data = json.loads(gpt2_plan.to_json())
    assert data["schema_version"] == 12 and data["config"]["reduce_dtype"] == "fp32"
    data["schema_version"] = 11
    del data["config"]["reduce_dtype"]
    assert Plan.from_dict(data) == gpt2_plan
    data["config"]["reduce_dtype"] = "fp32"
    with pytest.raises(PlanFormatError, match="config.reduce_dtype needs schema_version 12 or later \\(got 11\\)"):
        Plan.from_dict(data)


def test_saving_onto_a_directory_is_refused_before_writing(gpt2_plan, tmp_path):
    """A directory (or an empty path) as the file to write raises before any temporary file
    appears beside it, which the atomic rename would otherwise leave behind."""
    target = tmp_path / "plans"
    target.mkdir()
    with pytest.raises(IsADirectoryError):
        gpt2_plan.save(target)
    with pytest.raises(IsADirectoryError):
        gpt2_plan.save("")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plans"]
    assert list(target.iterdir()) == []
