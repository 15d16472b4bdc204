"""The ring itself: under ``ring_attention`` each rank's SDPA over its head-tail shard
of q, k and v gives the rows (and the gradients) of full-sequence causal attention at
those positions, on the CPU kernel through autopar's handler; nothing stays installed."""

import pytest
import torch
import torch.nn.functional as F
from parity import run
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental._context_parallel import _attention as cp_attention

from autopar.runtime.context_parallel import local_positions
from autopar.runtime.ring_attention import ring_attention

pytestmark = pytest.mark.multiprocess

SEQ, BATCH, HEAD_DIM = 16, 2, 8


def _installed():
    options = cp_attention._cp_options
    return (
        F.scaled_dot_product_attention,
        DTensor._op_dispatcher._custom_op_handlers,
        options.enable_load_balance,
        options.rotate_method,
    )


def _ring_against_full(rank, world, q_heads, kv_heads):
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(BATCH, q_heads, SEQ, HEAD_DIM, generator=g)
    k, v = (torch.randn(BATCH, kv_heads, SEQ, HEAD_DIM, generator=g) for _ in range(2))
    grad_out = torch.randn(BATCH, q_heads, SEQ, HEAD_DIM, generator=g)
    gqa = q_heads != kv_heads
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=gqa).backward(grad_out)

    mine = local_positions(SEQ, world, rank, "cpu")
    local = [t.index_select(2, mine).requires_grad_() for t in (q, k, v)]
    before = _installed()
    with ring_attention(mesh):
        out = F.scaled_dot_product_attention(*local, is_causal=True, enable_gqa=gqa)
        out.backward(grad_out.index_select(2, mine))
    expected_out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa).index_select(2, mine)
    errors = [(out - expected_out).abs().max().item()]
    errors += [(t.grad - f.grad.index_select(2, mine)).abs().max().item() for t, f in zip(local, full)]
    after = _installed()
    return errors, all(a is b or a == b for a, b in zip(before, after))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (4, 2)])
def test_the_ring_computes_full_causal_attention_at_each_ranks_positions(world, q_heads, kv_heads):
    """cp=2 and 4, multi-head and grouped-query: output and dq, dk, dv of each rank's
    tokens equal one process's full-sequence attention to fp32 rounding (the ring merges
    partial softmaxes by log-sum-exp in another order), and the SDPA function, DTensor's
    handlers and torch's ring options are the ones from before the context."""
    for errors, restored in run(_ring_against_full, world, q_heads, kv_heads):
        assert max(errors) < 1e-5, errors
        assert restored
