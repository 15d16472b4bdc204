"""Test configuration: import the distributed stack once in the parent so that forked
ranks start in ~0.1 s."""

import torch
import torch.distributed.checkpoint
import torch.distributed.fsdp
import torch.distributed.pipelining
import torch.distributed.tensor.parallel

torch.set_num_threads(1)
