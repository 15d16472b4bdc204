"""autopar's ResNet CNN (batch norm, no token sequence) with data and pipeline
parallelism, against one process running the same micro-batches."""

import pytest
import torch
import torch.nn.functional as F
from parity import LR, RunResult, all_params, assert_parity, run
from test_models import make

from autopar.models import CNNConfig, ResNet
from autopar.runtime.api import parallelize

pytestmark = pytest.mark.multiprocess


def resnet():
    torch.manual_seed(0)
    return ResNet(CNNConfig(image_size=8, width=4, stages=2, blocks_per_stage=1, num_classes=4))


def _cnn_batches(plan, steps):
    g = torch.Generator().manual_seed(3)
    n = plan.config.global_batch_size
    return [(torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 4, (n,), generator=g)) for _ in range(steps)]


def _cnn_train(rank, world, plan, steps):
    job = parallelize(resnet(), plan, loss_fn=F.cross_entropy)
    opt = job.optimizer(torch.optim.SGD, lr=LR)
    losses = []
    for batch in job.shard(_cnn_batches(plan, steps)):
        losses.append(job.step(batch))
        opt.step()
        opt.zero_grad()
    return RunResult(losses=losses, params=all_params(job))


def _cnn_reference(plan, steps):
    """Batch norm normalises over the samples it sees, so the reference runs the same
    micro-batches (dp x num_microbatches of micro_batch_size each) and averages their
    gradients: the single-process equivalent of what the parallel run computes."""
    model = resnet()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    cfg = plan.config
    losses = []
    for x, y in _cnn_batches(plan, steps):
        chunks = list(zip(x.split(cfg.micro_batch_size), y.split(cfg.micro_batch_size)))
        total = 0.0
        for xs, ys in chunks:
            loss = F.cross_entropy(model(xs), ys) / len(chunks)
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return RunResult(losses=losses, params={n: p.detach().clone() for n, p in model.named_parameters()})


@pytest.mark.parametrize("case", [dict(dp=2), dict(pp=2)])
def test_resnet(case):
    plan = make(resnet(), sample=torch.zeros(1, 3, 8, 8), **case)
    assert_parity(run(_cnn_train, plan.config.world_size, plan, 4), _cnn_reference(plan, 4))
