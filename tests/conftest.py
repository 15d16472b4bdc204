"""Test configuration: import the distributed stack once in the parent so that forked
ranks start in ~0.1 s (shared/TORCH-CPU.md, fork harness)."""

import torch
import torch.distributed.checkpoint  # noqa: F401
import torch.distributed.fsdp  # noqa: F401
import torch.distributed.pipelining  # noqa: F401
import torch.distributed.tensor.parallel  # noqa: F401

torch.set_num_threads(1)
