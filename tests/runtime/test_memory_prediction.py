"""The planner's peak memory against the runtime's, where the peak is not the steady
state: DDP allocates its gradient buckets a second time, once, early in training."""

import pytest
import torch
from parity import mse_loss

import autopar
from autopar.models import MLPConfig, MLPStack
from autopar.runtime.local import run_locally
from autopar.runtime.spmd import SPMDSettings

pytestmark = pytest.mark.multiprocess

WIDE = MLPConfig(in_dim=64, dim=256, ffn_dim=1024, n_layers=2, out_dim=8)
"""About a million parameters and, at 4 samples a micro-batch, a few KiB of
activations: the gradients (4 MiB) dwarf everything that is not model state."""


def _batches(batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, WIDE.in_dim, generator=g), torch.randn(batch, WIDE.out_dim, generator=g)


def test_ddp_peaks_at_its_bucket_rebuild_as_predicted():
    """Measured on two DDP ranks: the peak is weights, gradients, AdamW's two moments
    and one more copy of the gradients (the rebuilt buckets beside the old ones), a
    hand count of 5 x 4 bytes per parameter; the planner predicts the same."""
    cluster = autopar.preset("local-cpu", devices_per_node=2)
    with torch.device("meta"):
        model = MLPStack(WIDE)
    params = sum(p.numel() for p in model.parameters())
    plan = autopar.estimate(
        model,
        cluster,
        {"dp": 2, "tp": 1, "pp": 1, "micro_batch_size": 4, "zero_stage": 0, "dtype": "fp32"},
        global_batch_size=8,
        sample_input=torch.zeros(1, WIDE.in_dim, device="meta"),
    )
    hand = params * 4 * (1 + 1 + 2 + 1)
    run = run_locally(
        lambda: MLPStack(WIDE),
        plan,
        _batches,
        loss_fn=mse_loss,
        steps=1,
        warmup=0,
        settings=SPMDSettings(timeout_s=120, pg_timeout_s=60),
    )
    for peak in run.peak_memory_bytes:
        assert hand <= peak <= hand * 1.02, (peak, hand)
    allocated = plan.prediction.stages[0].memory
    allocated_bytes = allocated.total_bytes - allocated.reserve_bytes
    assert allocated_bytes == pytest.approx(hand, rel=0.02)
