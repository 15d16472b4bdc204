"""Per-layer decisions earn their keep where layers differ: the searched mix of recompute
modes beats every uniform choice (Checkmate/Korthikanti-style selective recomputation)."""

import math

import torch

from autopar import InfeasiblePlanError, explain, plan
from autopar.hardware import Cluster, DeviceMemory, DeviceSpec, LinkSpec, Roofline
from autopar.models import CNNConfig, MLPConfig, MLPStack, ResNet
from autopar.vocab import DType, Recompute


def _one_device(memory_bytes: float) -> Cluster:
    device = DeviceSpec(
        name="toy",
        roofline=Roofline(peak_flops={DType.FP32: 10e12}, memory_bandwidth_bytes_per_s=500e9),
        memory=DeviceMemory(capacity_bytes=memory_bytes),
        preferred_dtype=DType.FP32,
    )
    link = LinkSpec(bandwidth_bytes_per_s=50e9, latency_s=5e-6)
    return Cluster(name="toy", nodes=1, devices_per_node=1, device=device, intra_node=link, inter_node=link)


def _uniform_times(model, cluster, fixed=None, **kw):
    out = {}
    for mode in (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL):
        try:
            out[mode] = plan(
                model, cluster, constraints={**(fixed or {}), "recompute": mode}, **kw
            ).prediction.step_time_s
        except InfeasiblePlanError:
            out[mode] = math.inf
    return out


def _squeezed(model, fits_at, fixed=None, **kw) -> Cluster:
    """A device between the all-recomputed and the nothing-recomputed footprints."""
    full = plan(model, _one_device(fits_at), constraints={**(fixed or {}), "recompute": "full"}, **kw).prediction
    none = plan(model, _one_device(fits_at), constraints={**(fixed or {}), "recompute": "none"}, **kw).prediction
    assert none.memory_bytes_per_device > full.memory_bytes_per_device
    return _one_device((full.memory_bytes_per_device + none.memory_bytes_per_device) / 2)


def test_cnn_mix_beats_every_uniform_choice():
    # the whole batch in one micro-batch: halving the micro-batch is the other way to
    # save activation memory (nearly free for a small CNN), which would hide the choice
    model = ResNet(CNNConfig(image_size=64, width=32, stages=3, blocks_per_stage=2))
    kw = dict(global_batch_size=16, sample_input=torch.zeros(1, 3, 64, 64))
    fixed = {"micro_batch_size": 16}
    cluster = _squeezed(model, 64 * 2**30, fixed, **kw)
    best = plan(model, cluster, constraints=fixed, **kw)
    modes = set(best.layer_strategies.recompute.values()) | {best.config.recompute}
    assert len(modes) > 1, "the best plan mixes recompute modes across blocks"
    uniform = _uniform_times(model, cluster, fixed, **kw)
    assert best.prediction.step_time_s < min(uniform.values())
    assert math.isinf(uniform[Recompute.NONE])
    text = explain(best)  # an image model: samples, no tokens, and nothing said of attention
    assert "  batch 16 samples, " in text and " tokens" not in text and "attention" not in text
    assert not best.model.has_attention
    assert not any("scaled_dot_product_attention" in n for n in best.notes)


def test_transformer_with_a_few_wide_layers():
    widths = (256, 256, 4096, 256, 256, 4096)
    model = MLPStack(MLPConfig(in_dim=256, dim=256, ffn_dim=256, n_layers=len(widths), out_dim=256, widths=widths))
    sample = torch.zeros(1, 512, 256)  # (batch, tokens, features)
    fixed = {"micro_batch_size": 32}  # as above: recomputation, not a smaller micro-batch
    cluster = _squeezed(model, 64 * 2**30, fixed, global_batch_size=32, sample_input=sample)
    best = plan(model, cluster, constraints=fixed, global_batch_size=32, sample_input=sample)
    recomputed = [u for u, m in best.layer_strategies.recompute.items() if m is Recompute.FULL]
    if best.config.recompute is Recompute.FULL:
        recomputed = [f"layers.{i}" for i in range(len(widths)) if f"layers.{i}" not in best.layer_strategies.recompute]
    wide = {f"layers.{i}" for i, w in enumerate(widths) if w == 4096}
    assert recomputed and set(recomputed) <= wide | {"inp", "out"}, "only the wide blocks are recomputed"
    uniform = _uniform_times(model, cluster, fixed, global_batch_size=32, sample_input=sample)
    assert best.prediction.step_time_s < min(uniform.values())
