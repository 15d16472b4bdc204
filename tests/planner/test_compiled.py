"""Compiled blocks: the trace's model of inductor's fused kernels against hand counts of
the bytes they move, and the plan choice built on it."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import transformers
from torch import nn

import autopar
from autopar.errors import ConfigError
from autopar.graph import extract
from autopar.graph.fusion import Fusion
from autopar.models.gpt import GPT, GPTConfig
from autopar.present.units import size

DIM, TOKENS = 64, 8
ROW = TOKENS * DIM * 4  # one sample's activation of DIM fp32 features: bytes


class _GeluBlock(nn.Module):
    """x + proj(gelu_tanh(fc(x))), the tanh GELU written out as transformers' GPT-2 does
    (seven element-wise ops)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(DIM, 4 * DIM)
        self.proj = nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        h = self.fc(x)
        g = 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * torch.pow(h, 3.0))))
        return x + self.proj(g)


class _ReuseBlock(nn.Module):
    """h = 2x; fc(h) + h: h is read again after a matmul ran."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x):
        h = x * 2.0
        return self.fc(h) + h


class _Blocks(nn.Module):
    def __init__(self, block: type[nn.Module]):
        super().__init__()
        self.blocks = nn.ModuleDict({str(i): block() for i in range(2)})

    def forward(self, x):
        for b in self.blocks.values():
            x = b(x)
        return x


def _block_profile(block: type[nn.Module]):
    graph = extract(_Blocks(block), sample_input=torch.randn(2, TOKENS, DIM), dtype="fp32")
    return graph.profile_of(0)


def _glue(profile, compiled: bool) -> tuple[float, float]:
    flows = [f.glue(compiled) for f in profile.flows]
    return sum(b for b, _ in flows), sum(k for _, k in flows)


def test_element_wise_chain_is_one_kernel_reading_its_input_once():
    """GELU's seven ops read fc's output (4 rows) once and write proj's input (4 rows)
    once; the residual add reads x and proj's output and writes the block's output."""
    profile = _block_profile(_GeluBlock)
    gelu = next(f for f in profile.flows if (f.src, f.dst) == (0, 1))
    assert gelu.glue(True) == (8 * ROW, 1)
    assert gelu.glue_bytes > 4 * gelu.glue(True)[0]  # eager moves every intermediate
    assert _glue(profile, True) == (8 * ROW + 3 * ROW, 2)
    for leaf in profile.leaves:  # a matmul moves what it moves in eager mode
        assert leaf.moved_bytes(True) == leaf.fwd_bytes == 5 * ROW
        assert leaf.kernels(True) == 1


def test_a_written_out_gelu_saves_its_input_and_output_compiled():
    """The same block's saved tensors (:mod:`autopar.graph.compiled_saved`): eager
    saves GELU's intermediates; compiled, fc's input x, fc's output h (4 rows, what
    GELU is recomputed from) and proj's input (4 rows) stay, and nothing else."""
    profile = _block_profile(_GeluBlock)
    compiled = sum(leaf.saved(True) for leaf in profile.leaves) + sum(f.saved(True) for f in profile.flows)
    eager = sum(leaf.saved(False) for leaf in profile.leaves) + sum(f.saved(False) for f in profile.flows)
    assert compiled == 9 * ROW
    assert eager > compiled


def test_a_result_read_after_a_matmul_is_written_and_read_back():
    """2x is written once (fc reads it) and read back by the add after fc ran: the mul
    moves 2 rows, the add reads 2 and writes 1; two kernels."""
    profile = _block_profile(_ReuseBlock)
    assert _glue(profile, True) == pytest.approx((5 * ROW, 2))


def test_merged_kernels_read_a_shared_input_once():
    """Two element-wise ops on x start two kernels; an op reading both results merges
    them into one, which reads x once."""
    charged = {"bytes": 0.0, "kernels": 0}

    def account(nbytes: float, kernels: int) -> None:
        charged["bytes"] += nbytes
        charged["kernels"] += kernels

    fusion = Fusion()
    fusion.fused_op([(1, 100.0)], [(2, 100.0)], account)
    fusion.fused_op([(1, 100.0)], [(3, 100.0)], account)
    assert charged == {"bytes": 200.0, "kernels": 2}
    fusion.fused_op([(2, 100.0), (3, 100.0)], [(4, 100.0)], account)
    fusion.write([4])
    assert charged == {"bytes": 200.0, "kernels": 1}


def _gpt2_pair():
    cfg = transformers.GPT2Config(n_layer=4, n_embd=768, n_head=12, n_positions=1024)
    with torch.device("meta"):
        hf = transformers.GPT2LMHeadModel(cfg)
        own = GPT(GPTConfig(vocab_size=cfg.vocab_size, seq_len=1024, dim=768, n_layers=4, n_heads=12))
    return hf, own


def test_compiled_gpt2_costs_what_the_same_model_in_fused_ops_costs():
    """transformers' GPT-2 runs its GELU as seven eager kernels where autopar's GPT calls
    one; compiled, both are the same kernels, so their predicted steps agree: at the fused
    attention kernel's rate (both call SDPA with ``is_causal=True`` on one unpadded
    sequence per row, and the kernel skips the masked half) and on a device that states
    no kernel rate (every core at the matmul rate on the counted FLOPs)."""
    hf, own = _gpt2_pair()
    h100 = autopar.preset("dgx-h100", nodes=1)
    roof = dataclasses.replace(h100.device.roofline, attention_efficiency=None)
    unstated = dataclasses.replace(h100, device=dataclasses.replace(h100.device, roofline=roof))

    def step(model, compiled: bool, cluster=h100) -> float:
        fixed = {"tp": 1, "pp": 1, "micro_batch_size": 8, "compile": compiled}
        return autopar.estimate(model, cluster, fixed, global_batch_size=64, seq_len=1024).prediction.step_time_s

    assert step(hf, False) > 1.2 * step(own, False)
    assert step(hf, True, unstated) == pytest.approx(step(own, True, unstated), rel=0.02)
    assert step(hf, True) == pytest.approx(step(own, True), rel=0.02)
    assert step(own, True) < step(own, False)


def _contrast(plan):
    (other,) = [a for a in plan.alternatives if a.status == "compile"]
    assert other.config == dataclasses.replace(plan.config, compile=not plan.config.compile)
    line = next(x for x in autopar.explain(plan).splitlines() if x.startswith("Compiled"))
    return other, line


def test_gpu_plans_compile_unless_told_not_to_and_say_what_eager_would_take():
    """On GPUs the search compiles the blocks (a compiled block never costs more, and
    transformers' GPT-2's seven-kernel GELU costs much more eager), explain prices the
    eager way, time and memory (eager saves the GELU's intermediates), and
    ``compile=False`` keeps it eager with the compiled way priced; on CPU
    processes plans compile only when asked."""
    hf, _ = _gpt2_pair()
    cluster = autopar.preset("dgx-h100", nodes=1)
    plan = autopar.plan(hf, cluster, global_batch_size=64, seq_len=1024)
    assert plan.config.compile and "compiled" in plan.config.short()
    eager, line = _contrast(plan)
    assert eager.slower_by > 0.15  # seven passes through memory for each GELU, one compiled
    assert "blocks compiled" in line and "this configuration eager: " in line
    assert line.endswith(f", {size(eager.memory_bytes_per_device)}")
    assert eager.memory_bytes_per_device > plan.prediction.memory_bytes_per_device  # GELU's tanh chain is saved
    told = autopar.plan(hf, cluster, global_batch_size=64, seq_len=1024, constraints={"compile": False})
    assert not told.config.compile
    compiled, line = _contrast(told)
    assert compiled.slower_by < 0 and "blocks run eager" in line and "this configuration compiled: " in line
    assert "not searched" not in line  # searched, and pinned off
    assert told.prediction.step_time_s == pytest.approx(eager.step_time_s, rel=0.05)
    assert told.prediction.step_time_s > plan.prediction.step_time_s
    with torch.device("meta"):
        small = GPT(GPTConfig(vocab_size=256, seq_len=32, dim=32, n_layers=2, n_heads=2))
    cpu = autopar.preset("local-cpu", nodes=1, devices_per_node=2)
    eager_on_cpu = autopar.plan(small, cpu, global_batch_size=4, seq_len=32)
    assert not eager_on_cpu.config.compile
    compiled, line = _contrast(eager_on_cpu)  # faster, yet not taken: the line says why
    assert compiled.slower_by < 0 and line.endswith(
        "(not searched: this device does not compile unasked; compile=True, --set compile=true, plans it)"
    )
    assert autopar.plan(small, cpu, global_batch_size=4, seq_len=32, constraints={"compile": True}).config.compile


def test_a_compile_constraint_must_be_a_bool():
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=256, seq_len=32, dim=32, n_layers=2, n_heads=2))
    cluster = autopar.preset("local-cpu", nodes=1, devices_per_node=2)
    with pytest.raises(ConfigError, match=r"constraint compile='yes' is not allowed: use True or False"):
        autopar.plan(model, cluster, global_batch_size=4, seq_len=32, constraints={"compile": "yes"})


def test_estimate_compiles_where_the_search_would():
    """``estimate`` fills ``compile`` as the search decides it: compiled on a GPU, eager on
    CPU processes, as given when given."""
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=256, seq_len=32, dim=32, n_layers=2, n_heads=2))
    gpu, cpu = autopar.preset("dgx-h100", nodes=1), autopar.preset("local-cpu", nodes=1, devices_per_node=2)
    fixed = {"tp": 1, "pp": 1}
    assert autopar.estimate(model, gpu, fixed, global_batch_size=8, seq_len=32).config.compile
    assert not autopar.estimate(model, cpu, fixed, global_batch_size=4, seq_len=32).config.compile
    told = {**fixed, "compile": False}
    assert not autopar.estimate(model, gpu, told, global_batch_size=8, seq_len=32).config.compile
