"""A training script as a user writes it, for the launcher tests:
``autopar run --plan plan.json --nproc-per-node 2 train_gpt.py OUT [fail | fail-once]``:
``fail`` makes rank 1 raise at step 1, ``fail-once`` only in torchrun's first attempt
(a restart with ``--max-restarts`` then runs to the end)."""

import json
import os
import sys
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import record

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch.distributed as dist
from parity import LR, batches, build, token_loss

import autopar.runtime.launch as launch
from autopar.runtime.api import parallelize


@record
def main() -> None:
    out, mode = sys.argv[1], sys.argv[2:]
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    fail = mode == ["fail"] or (mode == ["fail-once"] and first_attempt)
    launch.init_distributed()
    plan = launch.plan_from_env()
    job = parallelize(build("gpt"), plan, loss_fn=token_loss)
    opt = job.optimizer(torch.optim.SGD, lr=LR)
    losses = []
    for step, batch in enumerate(job.shard(batches("gpt", 3, plan.config.global_batch_size))):
        if fail and step == 1 and dist.get_rank() == 1:
            raise RuntimeError("rank 1 fails on purpose")
        losses.append(job.step(batch))
        opt.step()
        opt.zero_grad()
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(losses))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
