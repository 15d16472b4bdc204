"""plan() names a contradiction in the fixed fields alone (degrees whose product is not
the device count, a schedule with stages per rank it cannot take) as estimate() does,
in one line, and the reasons it gives are about the values the user fixed, not the
ones the search tried."""

import pytest

import autopar
from autopar import ConfigError
from autopar.cli import main
from autopar.graph import extract
from autopar.models import build_named_model

CLUSTER = autopar.preset("dgx-a100-80gb", nodes=4)  # 32 devices
BATCH = 512


@pytest.fixture(scope="module")
def gpt3():
    """GPT-3 1.3B (24 blocks, 26 units, 16 heads) at 2048 tokens, on the meta device."""
    return extract(build_named_model("gpt3-1.3b"), seq_len=2048)


def _refusal(call, graph, fixed) -> str:
    with pytest.raises(ConfigError) as err:
        call(graph, CLUSTER, fixed, global_batch_size=BATCH)
    message = str(err.value)
    assert "\n" not in message
    return message


def _plan(graph, cluster, fixed, **kw):
    return autopar.plan(graph, cluster, constraints=fixed, **kw)


def test_degrees_whose_product_is_not_the_device_count(gpt3):
    message = _refusal(_plan, gpt3, {"dp": 4, "tp": 4, "pp": 4})
    assert message.startswith("dp x tp x pp = 4 x 4 x 4 = 64 does not divide the cluster's 32 devices; fix them")
    given = {"dp": 4, "cp": 1, "tp": 4, "pp": 4}
    assert _refusal(_plan, gpt3, given) == _refusal(autopar.estimate, gpt3, given)
    assert _refusal(_plan, gpt3, given).startswith("dp x cp x tp x pp = 4 x 1 x 4 x 4 = 64 but the cluster has 32")
    assert _refusal(_plan, gpt3, {"pp": 4, "dp": 16}).startswith("dp x pp = 16 x 4 = 64 does not divide the cluster's")


@pytest.mark.parametrize("extra", [{}, {"tp": 1}])
def test_an_interleaved_schedule_of_one_stage_per_rank(gpt3, extra):
    fixed = {"schedule": "interleaved-1f1b", "virtual_stages": 1, "pp": 4, **extra}
    message = _refusal(_plan, gpt3, fixed)
    assert message == (
        "constraint schedule='interleaved-1f1b' with virtual_stages=1 is not allowed: schedule='interleaved-1f1b' "
        "needs virtual_stages >= 2 (stages per pipeline rank); use schedule='1f1b' for one stage per rank."
    )
    assert _refusal(autopar.estimate, gpt3, fixed) == message


def test_the_reasons_are_about_what_was_fixed(gpt3):
    message = _refusal(_plan, gpt3, {"micro_batch_size": 3})
    assert "micro_batch_size=3 (dp=32): does not divide the 16 samples per data-parallel rank" in message
    assert "pp=32" not in message
    message = _refusal(_plan, gpt3, {"schedule": "interleaved-1f1b", "pp": 32})
    assert ": pp=32: more stages than the model's 26 units. Change the batch size" in message
    assert "tp x cp x pp" not in message


def test_the_context_parallel_degree_left_over_is_named(gpt3):
    message = _refusal(_plan, gpt3, {"dp": 2, "tp": 4, "pp": 2})
    assert "dp=2 tp=4 pp=2: they leave cp=2 of the 32 devices, a degree the search does not try at seq_len=2048" in (
        message
    )
    assert "set cp=2 to plan with it, or change dp, tp or pp" in message and "no candidate" not in message


def test_the_cli_says_it_in_one_line(capsys):
    args = ["plan", "--model", "gpt3-1.3b", "--cluster", "dgx-a100-80gb:4", "--global-batch-size", "512"]
    assert main([*args, "--seq-len", "2048", "--set", "dp=4", "--set", "tp=4", "--set", "pp=4"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err and captured.err.count("\n") == 1
    assert captured.err.startswith("autopar: error: dp x tp x pp = 4 x 4 x 4 = 64 does not divide the cluster's 32")


def test_estimate_num_microbatches_with_a_batch_dp_does_not_divide(gpt3):
    """dp defaults to the devices left (32); 24 samples do not split over them, which is
    the contradiction, not the micro-batch of 0 samples it would derive."""
    with pytest.raises(ConfigError) as err:
        autopar.estimate(gpt3, CLUSTER, {"num_microbatches": 2}, global_batch_size=24)
    assert str(err.value) == (
        "num_microbatches=2 splits each data-parallel rank's samples, but global batch 24 is not divisible by "
        "dp=32; fix dp, micro_batch_size or the batch size."
    )


def test_a_fixed_dp_no_split_reaches_says_which_degrees_were_tried(gpt3):
    """dp=1 pp=2 leave tp x cp = 16 of 32 devices: GPT-3 13B's 40 heads split over tp
    in 1, 2, 4 and 8, and the search tries cp > 1 only where each rank keeps 4,096
    tokens, which 2,048 never leaves; with cp=2 fixed the same degrees plan."""
    graph = extract(build_named_model("gpt3-13b"), seq_len=2048)
    message = _refusal(_plan, graph, {"dp": 1, "pp": 2})
    assert (
        "dp=1 pp=2: they leave 32 devices to tp x cp x pp, which no degrees the search tries make: tp in [1, 2, 4, 8] "
        "(dividing the devices and the layer shapes), cp in [1] (cp > 1 only where each rank keeps >= 4096 tokens "
        "of a sequence, here 2048; fix cp to try another), pp=2. Change the batch size" in message
    )
    assert "no candidate" not in message
    config = _plan(graph, CLUSTER, {"dp": 1, "pp": 2, "cp": 2}, global_batch_size=BATCH).config
    assert (config.dp, config.cp, config.tp, config.pp) == (1, 2, 8, 2)


def test_a_refusal_names_the_context_parallel_degrees_below_the_floor():
    """Llama 3 8B at 8K tokens on 1,024 H100 with tp=1 pp=1: dp x cp = 1,024 ranks, and
    the 256 sequences divide no dp the search tries (1,024 at cp=1, 512 at cp=2, the
    floor of 4,096 tokens per rank); cp=4 leaves dp=256 and plans. The refusal said only
    that the batch does not divide, as if no configuration could run."""
    graph = extract(build_named_model("llama3-8b"), seq_len=8192)
    cluster = autopar.preset("dgx-h100", nodes=128)
    fixed = {"tp": 1, "pp": 1, "zero_stage": 3}
    with pytest.raises(ConfigError) as err:
        autopar.plan(graph, cluster, constraints=fixed, global_batch_size=256)
    message = str(err.value)
    assert "global batch 256 is not divisible by dp=512" in message and "\n" not in message
    assert message.endswith(
        "cp=4, 8, 16, 32, ... would also split these 8,192 tokens: fix one (constraints={'cp': 4}, --set cp=4) to "
        "price it."
    )
    config = autopar.plan(graph, cluster, constraints={**fixed, "cp": 4}, global_batch_size=256).config
    assert (config.dp, config.cp) == (256, 4)
