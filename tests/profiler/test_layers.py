"""Per-unit profiles against independent references: the Megatron FLOP formula, the
activation bytes ``autopar.graph`` traces on fake tensors, and allocations we make
ourselves."""

import pytest
import torch
from torch import nn

from autopar.graph import extract
from autopar.models import GPT, CNNConfig, GPTConfig, Llama, LlamaConfig, MLPConfig, MLPStack, ResNet
from profiler.census import FlopLap, MemoryLap, math_attention
from profiler.errors import MeasurementError
from profiler.layers import LayerSweep, profile_model
from profiler.timing import Repeats
from profiler.unit_runners import BlockRunner

FAST = LayerSweep(repeats=Repeats(warmup=1, repeats=3, min_repeats=3, budget_s=2.0))
B, S, H, V, L = 2, 64, 128, 256, 4


@pytest.fixture(scope="module")
def gpt_report():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=V, seq_len=S, dim=H, n_layers=L, n_heads=4))
    x = torch.randint(0, V, (B, S))
    lines = []
    report = profile_model(model, x, sweep=FAST, progress=lines.append)
    return model, x, report, lines


def test_units_are_the_graphs_distinct_units(gpt_report):
    _, _, report, lines = gpt_report
    units = report.layers.units
    assert [u.fqn for u in units] == ["tok_embeddings+pos_embeddings", "layers.0", "norm+output"]
    assert units[1].instances == tuple(f"layers.{i}" for i in range(L))
    assert units[0].modules == ("tok_embeddings", "pos_embeddings")
    assert len(lines) == 6 and lines[2].startswith("[2/3] layers.0 (x4): measuring (2 untimed")
    assert lines[3].startswith("[2/3] layers.0 (x4): fwd ")
    lay = report.layers
    assert (lay.batch, lay.seq_len, lay.sample_shape, lay.dtype, lay.device_kind, lay.threads) == (
        B,
        S,
        (B, S),
        "fp32",
        "cpu",
        1,
    )
    for u in units:
        assert u.fwd.median_s > 0 and u.bwd.median_s > 0 and u.fwd.repeats >= 3


def test_flops_match_megatron(gpt_report):
    _, _, report, _ = gpt_report
    _, block, head = report.layers.units
    # Narayanan et al. 2021: 24 s h^2 + 4 s^2 h forward FLOPs per layer and sample (full, unmasked
    # attention, which the math kernel computes), 2 s h V for the head; backward twice forward.
    assert block.fwd_flops == B * (24 * S * H * H + 4 * S * S * H)
    assert block.bwd_flops == 2 * block.fwd_flops
    assert head.fwd_flops == B * 2 * S * H * V
    assert head.bwd_flops == 2 * head.fwd_flops


def test_saved_activations_match_the_fake_tensor_trace(gpt_report):
    model, x, report, _ = gpt_report
    graph = extract(model, sample_input=x, dtype="fp32")
    by_sig = {p.signature: p for p in graph.profiles}
    for u in report.layers.units[1:]:
        traced = by_sig[u.signature].saved_bytes * B
        assert u.saved_bytes == pytest.approx(traced, rel=0.01), u.fqn


def test_parameter_bytes_and_memory(gpt_report):
    model, _, report, _ = gpt_report
    pro, block, head = report.layers.units
    assert block.param_bytes == 4 * sum(p.numel() for p in model.layers["0"].parameters())
    assert head.param_bytes == 4 * (V * H + 2 * H)  # the head's weight is tied to the token embedding
    assert pro.param_bytes == 4 * (V * H + S * H)
    activation = B * S * H * 4
    for u in (block, head):
        assert u.peak_bytes > 0 and u.peak_bytes >= u.saved_bytes - activation


def test_work_items_carry_the_graphs_costs(gpt_report):
    model, x, report, _ = gpt_report
    graph = extract(model, sample_input=x, dtype="fp32")
    prof = next(p for p in graph.profiles if p.signature == report.layers.units[1].signature)
    work = report.layers.units[1].work
    assert sum(w.matmul_flops + w.other_flops for w in work) == pytest.approx(prof.fwd_flops * B, rel=1e-12)
    assert sum(w.matmul_flops for w in work) == pytest.approx(report.layers.units[1].fwd_flops, rel=1e-9)


class _Allocations:
    """A unit whose allocations we know: forward keeps 1 MiB and frees a 2 MiB temporary,
    backward allocates 3 MiB while the 1 MiB is alive: the peak is exactly 4 MiB."""

    def run(self, lap):
        mib = 2**18  # fp32 elements in a MiB
        lap.begin("fwd")
        kept = torch.ones(mib)
        temp = torch.ones(2 * mib)
        del temp
        lap.end("fwd")
        lap.begin("bwd")
        grad = torch.ones(3 * mib)
        lap.end("bwd")
        del kept, grad


def test_blocks_are_timed_recomputing_their_forward_and_the_rest_not(gpt_report):
    _model, _x, report, _lines = gpt_report
    timed = {u.fqn: u.recompute_bwd for u in report.layers.units}
    assert timed.pop("layers.0") is not None
    assert timed and all(t is None for t in timed.values())  # what runs before and after the blocks


def test_the_recomputing_run_reruns_the_blocks_forward_in_backward():
    """Counted, not timed: under the checkpoint the block's forward starts twice per run
    (once more in backward; a pre-hook, since the rerun stops once it has rebuilt what
    backward needs), without it once; the gradients are the same."""
    calls = []
    block = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
    block.register_forward_pre_hook(lambda *_: calls.append(1))
    runner = BlockRunner(block, ((torch.randn(4, 8),), {}, (True,)))
    lap = FlopLap()
    runner.run(lap)
    plain = [p.grad.clone() for p in block.parameters()]
    assert len(calls) == 1
    runner.run(lap, recompute=True)
    assert len(calls) == 3
    for p, g in zip(block.parameters(), plain):
        assert torch.allclose(p.grad, g)


def test_cpu_peak_memory_against_known_allocations():
    probe = MemoryLap(torch.device("cpu"), set())
    _Allocations().run(probe)
    assert probe.peak_bytes == 3 * 2**20 + 2**20


def test_saved_bytes_against_known_tensors():
    w = nn.Parameter(torch.ones(1000))
    x = torch.ones(1000, requires_grad=True)
    probe = MemoryLap(torch.device("cpu"), {w.untyped_storage().data_ptr()})

    class Mul:
        def run(self, lap):
            lap.begin("fwd")
            y = (x * w).sin()  # mul saves x and w (w is a parameter), sin saves its input
            lap.end("fwd")
            lap.begin("bwd")
            y.sum().backward()
            lap.end("bwd")

    Mul().run(probe)
    assert probe.saved_bytes == 2 * 4000  # x and the product; the parameter is not an activation


def test_flop_lap_counts_phases_separately():
    a = torch.ones(8, 16, requires_grad=True)
    b = torch.ones(16, 4, requires_grad=True)
    lap = FlopLap()
    with math_attention():
        lap.begin("fwd")
        y = a @ b
        lap.end("fwd")
        lap.begin("bwd")
        y.sum().backward()
        lap.end("bwd")
    assert lap.flops == {"fwd": 2 * 8 * 16 * 4, "bwd": 2 * 2 * 8 * 16 * 4}


@pytest.mark.parametrize(
    "make",
    [
        lambda: (MLPStack(MLPConfig(in_dim=32, dim=64, ffn_dim=128, n_layers=3, out_dim=8)), torch.randn(4, 32)),
        lambda: (
            ResNet(CNNConfig(image_size=16, width=8, stages=2, blocks_per_stage=2, num_classes=10)),
            torch.randn(2, 3, 16, 16),
        ),
        lambda: (
            Llama(LlamaConfig(vocab_size=128, seq_len=32, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128)),
            torch.randint(0, 128, (2, 32)),
        ),
    ],
    ids=["mlp", "cnn", "llama"],
)
def test_other_models_profile_every_distinct_unit(make):
    torch.manual_seed(0)
    model, x = make()
    graph = extract(model, sample_input=x, dtype="fp32")
    report = profile_model(model, x, sweep=FAST)
    units = report.layers.units
    assert [u.signature for u in units] == list(dict.fromkeys(graph.profiles[u.profile].signature for u in graph.units))
    assert sum(len(u.instances) for u in units) == len(graph.units)
    assert all(u.fwd.median_s > 0 and u.bwd.median_s >= 0 for u in units)
    by_sig = {p.signature: p for p in graph.profiles}
    for u in units:
        traced = sum(leaf.matmul_flops for leaf in by_sig[u.signature].leaves) * x.shape[0]
        assert u.fwd_flops >= traced > 0 or traced == 0, u.fqn


def test_bf16_model_is_measured_in_bf16():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=V, seq_len=32, dim=64, n_layers=2, n_heads=4)).to(torch.bfloat16)
    report = profile_model(model, torch.randint(0, V, (2, 32)), sweep=FAST)
    assert report.layers.dtype == "bf16"
    assert report.layers.units[1].param_bytes == 2 * sum(p.numel() for p in model.layers["0"].parameters())


def test_models_that_cannot_run_are_refused():
    with torch.device("meta"):
        meta = GPT(GPTConfig(vocab_size=V, seq_len=S, dim=H, n_layers=2, n_heads=4))
    with pytest.raises(MeasurementError, match="meta device"):
        profile_model(meta, torch.zeros(1, S, dtype=torch.long))
    mixed = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).to(torch.float64))
    with pytest.raises(MeasurementError, match="model.to"):
        profile_model(mixed, torch.zeros(1, 4))
    with pytest.raises(MeasurementError, match="no parameters"):
        profile_model(nn.ReLU(), torch.zeros(1, 4))
