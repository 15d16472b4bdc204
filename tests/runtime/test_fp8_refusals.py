"""FP8 plans the runtime cannot run stop in one typed line on every rank, before any
collective: torchao missing (runs without torchao installed), and compiled blocks around
emulated FP8 (torchao's emulation does not compile)."""

import sys

import pytest
from parity import make_plan, run, token_loss

import autopar
from autopar.runtime.api import parallelize
from autopar.runtime.errors import FP8Error
from autopar.runtime.fp8 import check_fp8, float8_api


def _fp8_plan(**config) -> autopar.Plan:
    world = config.get("dp", 1)
    cluster = autopar.preset("dgx-h100", nodes=1, devices_per_node=world)
    return make_plan("gpt", cluster=cluster, dtype="bf16", fp8=True, **config)


def _refusal(rank, world, plan, hide_torchao):
    """The FP8Error ``parallelize`` raises on this rank, as (type name, message); the
    forked worker hides torchao from imports when asked, leaving the parent untouched."""
    from parity import build

    if hide_torchao:
        sys.modules["torchao"] = None
        sys.modules["torchao.float8"] = None
    try:
        parallelize(build("gpt"), plan, loss_fn=token_loss, measure_memory=False)
    except FP8Error as exc:
        return type(exc).__name__, str(exc)
    return None


def test_missing_torchao_is_one_line_naming_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(FP8Error, match=r"fp8=True needs torchao's float8 training.*run `pip install torchao`") as info:
        float8_api()
    assert "\n" not in str(info.value)


@pytest.mark.multiprocess
def test_every_rank_refuses_a_fp8_plan_without_torchao():
    """Two ranks: both refuse with the same line (the check runs before the plan-agreement
    collective, on local facts only)."""
    results = run(_refusal, 2, _fp8_plan(dp=2, zero_stage=3), True, timeout_s=60)
    for name, message in results:
        assert name == "FP8Error"
        assert "pip install torchao" in message and "\n" not in message


def test_compiled_blocks_around_emulated_fp8_are_refused():
    pytest.importorskip("torchao.float8", reason="the check imports torchao first")
    import torch

    with pytest.raises(FP8Error, match=r"fp8=True with compile=True on cpu: FP8 is emulated there") as info:
        check_fp8(True, torch.device("cpu"))
    assert "\n" not in str(info.value)
    assert check_fp8(False, torch.device("cpu")) is not None


@pytest.mark.multiprocess
def test_every_rank_refuses_a_compiled_fp8_plan_on_cpu():
    pytest.importorskip("torchao.float8", reason="the check imports torchao first")
    plan = _fp8_plan(dp=2, zero_stage=0, compile=True)
    assert plan.config.compile and plan.config.fp8
    for name, message in run(_refusal, 2, plan, False, timeout_s=60):
        assert name == "FP8Error" and "compile=False" in message
