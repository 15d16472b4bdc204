"""Shared fixtures: small real plans, built once per session."""

import pytest

import autopar
from autopar.models import GPT, GPTConfig, build_named_model


@pytest.fixture(scope="session")
def gpt2_plan():
    return autopar.plan(
        build_named_model("gpt2-small"),
        autopar.preset("dgx-a100-80gb", nodes=1),
        global_batch_size=64,
        seq_len=1024,
    )


@pytest.fixture(scope="session")
def pipelined_plan():
    """A plan with pipeline and tensor parallelism, so every field is non-trivial; eager, so
    an export to a framework without inductor carries no note of it."""
    return autopar.estimate(
        build_named_model("gpt3-13b"),
        autopar.preset("dgx-a100-80gb", nodes=2),
        {"tp": 4, "pp": 2, "micro_batch_size": 1, "sequence_parallel": True, "compile": False},
        global_batch_size=32,
        seq_len=2048,
    )


@pytest.fixture()
def tiny_gpt():
    return GPT(GPTConfig(vocab_size=256, seq_len=64, dim=128, n_layers=4, n_heads=4))
