"""A rank that waits in barriers until told to stop, for the launcher-death test:
``autopar run --plan plan.json --nproc-per-node 2 wait_in_barriers.py DIR``. Each rank
writes its process id to ``DIR/rank-<r>.pid``; a ``DIR/stop`` file (or two minutes) ends it."""

import os
import sys
import time
from pathlib import Path

import torch.distributed as dist

import autopar.runtime.launch as launch

if __name__ == "__main__":
    out = Path(sys.argv[1])
    launch.init_distributed()
    (out / f"rank-{dist.get_rank()}.pid").write_text(str(os.getpid()))
    deadline = time.monotonic() + 120
    while not (out / "stop").exists() and time.monotonic() < deadline:
        dist.barrier()
        time.sleep(0.2)
