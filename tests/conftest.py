"""Test configuration: import the distributed stack once in the parent so that forked
ranks start in ~0.1 s."""

import pytest
import torch
import torch.distributed.checkpoint
import torch.distributed.fsdp
import torch.distributed.pipelining
import torch.distributed.tensor.parallel

torch.set_num_threads(1)


@pytest.fixture
def fake_world():
    """A two-rank fake process group in this process (collectives do nothing), rank 0,
    and after it none of what DTensor cached under it (ranks forked later would reuse it)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autopar.runtime.dry_run import forget_fake_sharding

    torch.distributed.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    yield
    torch.distributed.destroy_process_group()
    forget_fake_sharding()
