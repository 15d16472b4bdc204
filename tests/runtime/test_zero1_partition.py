"""ZeRO-1's partition of optimizer state over the data-parallel ranks, built on a fake
two-rank process group in this process."""

import torch
import torch.distributed as dist
from torch import nn

from autopar.runtime.optimizer import ShardedOptimizer


def _block() -> nn.Module:
    """Three large weights and two small ones, as a transformer block's MLP and attention."""
    return nn.Sequential(
        nn.Linear(64, 256, bias=False),
        nn.Linear(256, 64, bias=False),
        nn.Linear(64, 256, bias=False),
        nn.Linear(64, 64, bias=False),
        nn.Linear(64, 64, bias=False),
    )


def _owned(opt: ShardedOptimizer) -> int:
    return sum(p.numel() for inner in opt.inner if inner is not None for g in inner.param_groups for p in g["params"])


def test_a_rank_with_several_stages_owns_half_of_their_state(fake_world):
    """Four stages on one pipeline rank (interleaved): the two data-parallel ranks own
    the optimizer state of the rank's parameters within one weight of half each, as one
    balanced partition over all of them. Partitioned stage by stage, the first rank took
    two of each stage's three large weights (32768 of the 53248 elements per stage, 62%)."""
    stages = [_block() for _ in range(4)]
    total = sum(p.numel() for s in stages for p in s.parameters())
    largest = max(p.numel() for s in stages for p in s.parameters())
    opt = ShardedOptimizer(stages, torch.optim.Adam, {"lr": 1e-3}, dp_group=dist.group.WORLD)
    assert abs(_owned(opt) - total / 2) <= largest / 2
