"""Memory headroom: GiB of each device a user keeps free beyond its reserve, as a margin
for what the prediction may miss. No plan may use them: the same configuration priced
without them must fit in the capacity less the headroom, and a plan that needed them
gives way to one that does not."""

import math

import pytest

import autopar
from autopar import ConfigError
from autopar.cli import main
from autopar.graph import extract
from autopar.models import build_named_model
from autopar.present.explain import explain

BATCH = 1536
GIB = 2**30


@pytest.fixture(scope="module")
def gpt3():
    return extract(build_named_model("gpt3-175b"), seq_len=2048)


@pytest.fixture(scope="module")
def cluster():
    return autopar.preset("dgx-a100-80gb", nodes=128)


def test_headroom_is_reserved_memory_the_plan_never_uses(gpt3, cluster):
    """The planner's GPT-3 175B plan on 1,024 A100 peaks near 70 GiB of 80: with 12 GiB
    kept free it no longer fits, and the plan made with the headroom fits 68 GiB when
    priced without it; its peak is that price plus the headroom, to the byte."""
    plain = autopar.plan(gpt3, cluster, global_batch_size=BATCH)
    capacity = cluster.device.memory.capacity_bytes
    headroom = 12.0
    assert plain.prediction.memory_bytes_per_device > capacity - headroom * GIB  # it needs the headroom
    kept = autopar.plan(gpt3, cluster, global_batch_size=BATCH, memory_headroom_gib=headroom)
    assert kept.config != plain.config and kept.settings.memory_headroom_bytes == headroom * GIB
    without = autopar.estimate(gpt3, cluster, kept.config, global_batch_size=BATCH)
    assert without.prediction.memory_bytes_per_device <= capacity - headroom * GIB
    assert kept.prediction.memory_bytes_per_device == pytest.approx(
        without.prediction.memory_bytes_per_device + headroom * GIB, rel=1e-12
    )
    assert kept.prediction.step_time_s >= plain.prediction.step_time_s  # the fastest plan needed the room
    assert "(of it 12.0 headroom asked for)" in explain(kept)
    assert "headroom" not in explain(plain)
    assert autopar.Plan.from_json(kept.to_json()).settings.memory_headroom_bytes == headroom * GIB


def test_an_estimate_counts_the_headroom_in_its_peak(gpt3, cluster):
    config = {"tp": 8, "pp": 8, "micro_batch_size": 1, "recompute": "full", "zero_stage": 1}
    plain = autopar.estimate(gpt3, cluster, config, global_batch_size=BATCH)
    kept = autopar.estimate(gpt3, cluster, config, global_batch_size=BATCH, memory_headroom_gib=2.5)
    assert kept.config == plain.config
    assert kept.prediction.memory_bytes_per_device - plain.prediction.memory_bytes_per_device == pytest.approx(
        2.5 * GIB, rel=1e-9
    )


@pytest.mark.parametrize("value", [-1, math.nan, math.inf, "4", True, 79.0])
def test_a_headroom_that_is_not_a_margin_is_refused_in_one_line(gpt3, cluster, value):
    with pytest.raises(ConfigError) as err:
        autopar.plan(gpt3, cluster, global_batch_size=BATCH, memory_headroom_gib=value)
    message = str(err.value)
    assert message.startswith(f"memory_headroom_gib={value!r}" if value != 79.0 else "memory_headroom_gib=79 ")
    assert "\n" not in message and ("keep less free" in message if value == 79.0 else "a number >= 0" in message)


def test_the_cli_takes_it(capsys):
    args = ["plan", "--model", "gpt2-small", "--cluster", "dgx-a100-80gb:1", "--global-batch-size", "8"]
    assert main([*args, "--seq-len", "1024", "--memory-headroom", "70"]) == 0
    assert "(of it 70.0 headroom asked for)" in capsys.readouterr().out
    assert main([*args, "--seq-len", "1024", "--memory-headroom", "-2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autopar: error: memory_headroom_gib=-2.0 is not allowed") and err.count("\n") == 1


def test_refusals_say_their_figures_count_the_headroom(capsys):
    """A configuration that does not fit, and a model that fits nowhere on one node, are
    refused with figures that include the headroom asked for, and say so."""
    args = ["--model", "gpt3-13b", "--cluster", "dgx-a100-80gb:1", "--global-batch-size", "64", "--seq-len", "2048"]
    fixed = ["--set", "tp=8,pp=1,micro_batch_size=1,recompute=full,zero_stage=1"]
    assert main(["estimate", *args, *fixed, "--memory-headroom", "70"]) == 3
    assert "GiB needed per device (70.0 of it the headroom asked for), 80.0 GiB available." in capsys.readouterr().err
    with pytest.raises(autopar.InfeasiblePlanError) as err:
        autopar.plan(
            build_named_model("gpt3-13b"), "dgx-a100-80gb:1", global_batch_size=64, seq_len=2048, memory_headroom_gib=70
        )
    assert str(err.value).endswith("These figures count the 70 GiB of headroom asked for.")


def test_a_numpy_headroom_is_kept_as_a_number_the_plan_file_holds():
    """numpy's numbers are accepted as GiB, and the plan keeps a float (a float32 there
    made the plan unwritable)."""
    np = pytest.importorskip("numpy")
    kept = autopar.plan(
        build_named_model("gpt2-small"),
        "dgx-a100-80gb:1",
        global_batch_size=8,
        seq_len=1024,
        memory_headroom_gib=np.float32(2),
    )
    assert type(kept.settings.memory_headroom_bytes) is float and kept.settings.memory_headroom_bytes == 2 * GIB
    assert autopar.Plan.from_json(kept.to_json()).settings.memory_headroom_bytes == 2 * GIB
