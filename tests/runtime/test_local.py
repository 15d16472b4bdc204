"""``run_locally``, the runner of the demo and the measured benchmarks, trains what
``parallelize`` trains: its losses equal a single-process run of the same model, data
and optimizer."""

import pytest
import torch
from parity import MLP_CFG, build, make_plan, megatron_styles, mse_loss

from autopar.runtime.local import run_locally
from autopar.runtime.spmd import SPMDSettings

pytestmark = pytest.mark.multiprocess

LR = 1e-3
ADAM_LOSS_ATOL = 1e-5
"""``run_locally`` trains with AdamW, which turns gradient noise of a few ulps into
parameter differences of up to ~lr x 1e-2 where a gradient is nearly zero (it divides
by the square root of a tiny second moment); after two such steps the loss (~1) moves by far less than
1e-5, while a wrong layout moves it by more than 1e-2 at once."""


def _mlp_batches(batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, MLP_CFG.in_dim, generator=g), torch.randn(batch, MLP_CFG.out_dim, generator=g)


def _reference_losses(steps: int, global_batch: int) -> list[float]:
    """``run_locally``'s loop in one process: same seed, batches and AdamW."""
    torch.manual_seed(0)
    model = build("mlp")
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for i in range(steps):
        x, y = _mlp_batches(global_batch, 1000 + i)
        loss = mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_tensor_parallel_mlp_runs_with_a_sample_input():
    """An MLP takes no token ids, so sharding its layers needs one micro-batch of its
    inputs to trace; ``run_locally`` hands it to ``parallelize``."""
    plan = make_plan("mlp", tp=2, styles=megatron_styles("mlp"))
    sample = _mlp_batches(plan.config.micro_batch_size, 0)[0]
    got = run_locally(
        lambda: build("mlp"),
        plan,
        _mlp_batches,
        loss_fn=mse_loss,
        steps=3,
        warmup=1,
        measure_memory=False,
        lr=LR,
        settings=SPMDSettings(timeout_s=90, pg_timeout_s=30),
        sample_input=sample,
    )
    expected = _reference_losses(3, plan.config.global_batch_size)
    torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(expected), rtol=0, atol=ADAM_LOSS_ATOL)
    assert len(got.step_times_s) == 2
