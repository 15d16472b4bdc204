"""The routing a measured dry run assumes for dropless experts (autopar.runtime.assumed_routing),
against real routings counted as the runtime counts them (``bincount`` per expert)."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from autopar.runtime.assumed_routing import assumed_routing

CASES = [(64, 4, 2), (30, 8, 4), (7, 8, 2), (1000, 64, 8), (3, 4, 4)]
"""(tokens x top_k, experts, ep): divisible, with remainders, fewer rows than experts."""


def _round_robin(assignments: int, experts: int) -> torch.Tensor:
    """Every rank's routing when assignment ``i`` goes to expert ``i mod experts``: as
    even as integers allow, the first experts taking the remainder."""
    return torch.bincount(torch.arange(assignments) % experts, minlength=experts)


@pytest.mark.parametrize("assignments,experts,ep", CASES)
def test_balanced_splits_are_those_of_an_even_routing_on_every_rank(assignments, experts, ep):
    """At imbalance 1 each rank's counts are the round-robin routing's, its sends those
    counts' sums per ep rank, and its receives what the ep ranks, all routing the same
    way, send it: the exchange is consistent and sums to every rank's assignments."""
    counts = _round_robin(assignments, experts)
    n = experts // ep
    sent = counts.view(ep, n).sum(dim=1)
    routings = [assumed_routing(assignments, experts, ep, g, 1.0) for g in range(ep)]
    for g, r in enumerate(routings):
        assert list(r.expert_rows) == counts.tolist()
        assert r.send == sent.tolist()
        assert list(r.received_rows) == counts[g * n : (g + 1) * n].tolist() * ep
        assert r.recv == [routings[src].send[g] for src in range(ep)]
    assert sum(sum(r.recv) for r in routings) == ep * assignments


def test_an_imbalance_scales_the_measured_ranks_receives_up_to_every_row():
    """The busiest rank the planner prices receives ``imbalance`` times its even share
    from each source (rounded), never more than a source routes; its sends stay its own."""
    balanced = assumed_routing(64, 4, 2, 0, 1.0)
    skewed = assumed_routing(64, 4, 2, 0, 1.5)
    assert skewed.send == balanced.send == [32, 32]
    assert skewed.recv == [48, 48] and list(skewed.received_rows) == [24, 24] * 2
    assert assumed_routing(64, 4, 2, 1, 3.0).recv == [64, 64]


def test_the_local_expert_ids_are_those_of_the_real_counts_on_fake_tensors():
    """On real tensors the ids equal the runtime's (``repeat_interleave`` of the received
    counts); on fake ones the same op takes its size from the assumed counts."""
    r = assumed_routing(30, 8, 4, 1, 1.0)
    received = torch.tensor(r.received_rows)
    expected = torch.arange(2).repeat(4).repeat_interleave(received)
    assert torch.equal(r.local_ids(torch.device("cpu")), expected)
    with FakeTensorMode():
        ids = r.local_ids(torch.device("cpu"))
    assert isinstance(ids, FakeTensor) and ids.shape == expected.shape
