"""The routing a measured dry run assumes for dropless experts under expert parallelism.

On fake tensors (:mod:`autopar.runtime.dry_step`) the router's choices have no values,
so the split sizes of the all-to-alls that carry a dropless layer's rows
(:mod:`autopar.runtime.expert_parallel`) cannot be counted. The dry run takes the
routing the planner prices (:mod:`autopar.cost.expert_parallel`): every rank routes its
``tokens x top_k`` assignments evenly over the experts, and the measured rank receives
``routing_imbalance`` times its even share (1 by default,
:data:`autopar.cost.model.ROUTING_IMBALANCE`: a balanced router), never more than every
source's whole assignments. Integer counts are spread deterministically (the first
experts, and the first local experts of the receiving rank, take the remainder), so
they sum exactly, and at an imbalance of 1 every rank's receives are what the others
send it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def spread(total: int, parts: int) -> list[int]:
    """``total`` rows over ``parts`` as evenly as integers allow, the remainder one each
    to the first parts: sums to ``total``."""
    base, extra = divmod(total, parts)
    return [base + (i < extra) for i in range(parts)]


@dataclass(frozen=True, kw_only=True)
class AssumedRouting:
    """One rank's assumed dispatch of a dropless layer.

    Attributes:
        expert_rows: rows this rank routes to each expert (what ``bincount`` of its
            routing would give); they sum to its ``tokens x top_k`` assignments.
        received_rows: rows it receives for each of its local experts from each ep rank,
            source-major (``ep x local experts``), as the counts all-to-all returns them.
        ep: the ranks of the expert-parallel group.
    """

    expert_rows: tuple[int, ...]
    received_rows: tuple[int, ...]
    ep: int

    @property
    def send(self) -> list[int]:
        """Rows sent to each ep rank: the sums of its experts' rows."""
        n = len(self.expert_rows) // self.ep
        return [sum(self.expert_rows[g * n : (g + 1) * n]) for g in range(self.ep)]

    @property
    def recv(self) -> list[int]:
        """Rows received from each ep rank."""
        n = len(self.received_rows) // self.ep
        return [sum(self.received_rows[s * n : (s + 1) * n]) for s in range(self.ep)]

    def local_ids(self, device: torch.device) -> torch.Tensor:
        """The local expert of every received row, in the order they arrive: the same op
        as on real counts, with the output size given (fake tensors cannot size it)."""
        n = len(self.received_rows) // self.ep
        repeats = torch.tensor(self.received_rows, device=device)
        return torch.arange(n, device=device).repeat(self.ep).repeat_interleave(repeats, output_size=sum(self.recv))


def assumed_routing(assignments: int, experts: int, ep: int, rank: int, imbalance: float) -> AssumedRouting:
    """The dispatch ep rank ``rank`` of ``ep`` is assumed to run (module docstring):
    ``assignments`` (tokens x top_k) spread over ``experts``, and from each source the
    rows its local experts would get from an even spread, times ``imbalance``."""
    expert_rows = spread(assignments, experts)
    n = experts // ep
    mine = sum(expert_rows[rank * n : (rank + 1) * n])
    per_source = min(assignments, round(imbalance * mine))
    return AssumedRouting(expert_rows=tuple(expert_rows), received_rows=tuple(spread(per_source, n) * ep), ep=ep)
