"""Expert parallelism: each mixture-of-experts layer's experts split over the ``ep`` ranks.

The ``ep`` mesh (:func:`autopar.runtime.mesh.expert_meshes`) is ``ep`` consecutive
data- and context-parallel ranks; ep rank ``g`` holds experts ``[g * E / ep, (g + 1) * E
/ ep)`` of every layer, as DTensors ``Shard(0)`` on that mesh, so distributed checkpoints
reshard across plans. Routing stays where it is (every rank routes its own tokens); each
expert's rows travel to the rank holding it and back by two all-to-alls over the ep
group, whose backward are two more (torch's ``all_to_all_single_autograd``):

- autopar's :class:`~autopar.models.moe.MoEFeedForward` fills fixed-size buffers
  ``(E, rows, dim)``: the all-to-all sends expert block ``g`` to ep rank ``g`` in equal
  splits, the local experts run on the rows of every ep rank at once, and the reverse
  all-to-all returns them;
- a transformers experts module (``forward(hidden_states, top_k_index,
  top_k_weights)``, GPT-OSS's naming the last two otherwise, over weights stacked over
  ``num_experts`` in dimension 0, :func:`autopar.models.experts.is_routed_experts`:
  Mixtral, Qwen2-MoE, Qwen3-MoE, ...) is dropless: the assignments are sorted by expert,
  the ranks exchange their counts per expert (one more all-to-all, without gradient),
  the rows travel with those split sizes, the module's own forward runs on its local
  experts (weights of one, so it returns each expert's output row by row), and the
  outputs come back, are weighted by the routing weights and summed per token.

Each expert sees the rows of all ep ranks of its group, so its local gradient is the sum
of their losses' gradients. Dense gradients are averaged over the ``dp x cp`` ranks;
expert gradients are averaged over the ``ep_replicate`` ranks (data parallelism wraps the
experts modules on that mesh, :mod:`autopar.runtime.data_parallel`) and divided by ``ep``
here (a hook on the local weights), which together is the mean over all ``dp x cp``
ranks: the full batch's gradient, as one process computes it. A wrapped module's other
weights (autopar's router) are averaged over ``ep`` after backward
(:class:`SharedWeightSync`), which completes their mean over ``dp x cp``.

A measured dry run (fake tensors, :mod:`autopar.runtime.dry_step`) runs capacity-bounded
experts as they are (equal splits, known shapes). Dropless experts' split sizes depend on
the routing of real tokens, which fake tensors lack: there they take the routing the
planner prices (:mod:`autopar.runtime.assumed_routing`: balanced, or the plan's routing
imbalance), and the same ops run on rows of those sizes.

Refused before any collective (:func:`check_expert_parallel`): a model without experts
modules, and an expert count ``ep`` does not divide. Context parallelism refuses
capacity-bounded experts at any ``ep`` (:func:`autopar.runtime.context_parallel.check_context_parallel`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed import _functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from autopar.models.experts import ROUTED_FORM, expert_count, experts_modules
from autopar.models.moe import MoEFeedForward, swiglu_experts
from autopar.plan import Plan
from autopar.runtime.assumed_routing import assumed_routing
from autopar.runtime.errors import ExpertParallelError
from autopar.vocab import MeshAxis

STACKED_WEIGHTS = ("w1", "w3", "w2")
"""The stacked expert weights of :class:`~autopar.models.moe.MoEFeedForward` (its router stays whole)."""


def check_expert_parallel(model: nn.Module, plan: Plan) -> None:
    """Refuse an ``ep > 1`` plan the runtime cannot run on ``model`` (module docstring)."""
    cfg = plan.config
    if cfg.ep == 1:
        return
    found = experts_modules(model)
    if not found:
        raise ExpertParallelError(
            f"ep={cfg.ep}: {type(model).__name__} has no experts module (autopar's MoEFeedForward, or a module with "
            f"stacked expert weights and {ROUTED_FORM}); use ep=1."
        )
    for name, module in found.items():
        if expert_count(module) % cfg.ep:
            raise ExpertParallelError(
                f"ep={cfg.ep} does not divide the {expert_count(module)} experts of {name!r}; use an ep dividing "
                f"{expert_count(module)}."
            )


def apply_expert_parallel(stage: nn.Module, ep_mesh: DeviceMesh, routing_imbalance: float) -> None:
    """Keep this ep rank's experts of every experts module of ``stage`` (DTensors
    ``Shard(0)`` on ``ep_mesh``, no communication) and route their rows over the group.
    ``routing_imbalance``: the plan's, which dropless experts assume on fake tensors
    (:mod:`autopar.runtime.assumed_routing`)."""
    for module in experts_modules(stage).values():
        names = (
            STACKED_WEIGHTS if isinstance(module, MoEFeedForward) else tuple(n for n, _ in module.named_parameters())
        )
        for name in names:
            full = getattr(module, name)
            rows = full.shape[0] // ep_mesh.size()
            local = full.detach()[ep_mesh.get_local_rank() * rows :][:rows].clone()
            sharded = DTensor.from_local(
                local, ep_mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride()
            )
            setattr(module, name, nn.Parameter(sharded, requires_grad=full.requires_grad))
        if isinstance(module, MoEFeedForward):
            module.experts = _StackedDispatch(module, ep_mesh)
        else:
            module.forward = _RoutedDispatch(module, ep_mesh, routing_imbalance)


def experts_placement(shard_ranks: int) -> Callable[[nn.Parameter], Shard | None]:
    """FSDP2's placement for the weights of an experts module sharded over
    ``shard_ranks`` ranks: an expert stack whose local experts do not split evenly over
    them (1 local expert over 8 ranks, at ``ep`` = the expert count) is sharded along its
    second dimension instead of its experts, as torchtitan does; FSDP2's default, the
    first dimension, would leave the whole stack on the first ranks and none on the
    others. Other weights keep the default."""

    def place(p: nn.Parameter) -> Shard | None:
        if not is_expert_param(p) or p.to_local().shape[0] % shard_ranks == 0:
            return None
        return Shard(1)

    return place


def sharded_experts(stage: nn.Module) -> list[nn.Module]:
    """The experts modules of ``stage`` whose weights are split over an ep mesh."""
    return [m for m in experts_modules(stage).values() if any(is_expert_param(p) for p in m.parameters())]


class SharedWeightSync:
    """Averages over the ep group the gradients of the other weights of the wrapped
    experts modules (the router of :class:`~autopar.models.moe.MoEFeedForward`).

    Data parallelism wraps a whole experts module on the ``ep_replicate`` mesh, so such a
    weight's gradient is averaged over ``ep_replicate`` only; its mean over the ``ep``
    ranks completes the mean over every ``dp x cp`` rank. Every ep rank holds the same
    shard of it (the ``ep_replicate`` position is the same), so one all-reduce of the
    local values per step suffices. Call after backward.
    """

    def __init__(self, stages: list[nn.Module], ep_mesh: DeviceMesh | None):
        self._group = ep_mesh.get_group() if ep_mesh is not None else None
        self._params = [
            p for stage in stages for m in sharded_experts(stage) for p in m.parameters() if not is_expert_param(p)
        ]

    @torch.no_grad()
    def sync(self) -> None:
        """Average the gradients of the shared weights over the ep group, in one all-reduce."""
        grads = [_local_grad(p) for p in self._params if p.grad is not None]
        if self._group is None or not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self._group)
        flat /= dist.get_world_size(self._group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def _local_grad(p: torch.Tensor) -> torch.Tensor:
    assert p.grad is not None
    return p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad


def is_expert_param(p: torch.Tensor) -> bool:
    """Whether ``p`` is an expert weight split over the ep mesh."""
    return isinstance(p, DTensor) and MeshAxis.EP.value in (p.device_mesh.mesh_dim_names or ())


def _local_weight(p: torch.Tensor, ep: int) -> torch.Tensor:
    """This rank's experts of ``p`` as a plain tensor whose gradient is divided by ``ep``
    (module docstring: with the ``ep_replicate`` mean it is the full batch's)."""
    local = p.to_local() if isinstance(p, DTensor) else p
    if local.requires_grad:
        local.register_hook(lambda g: g / ep)
    return local


class _StackedDispatch:
    """``MoEFeedForward.experts`` under expert parallelism: ``(E, rows, dim)`` in and out."""

    def __init__(self, module: MoEFeedForward, ep_mesh: DeviceMesh):
        self.module = module
        self.group = ep_mesh.get_group()
        self.ep = ep_mesh.size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        e, rows, d = x.shape
        n = e // self.ep
        received = _all_to_all(x.contiguous(), None, None, self.group)  # (ep sources x n local experts, rows, d)
        per_expert = received.view(self.ep, n, rows, d).transpose(0, 1).reshape(n, self.ep * rows, d)
        w = [_local_weight(getattr(self.module, name), self.ep) for name in STACKED_WEIGHTS]
        out = swiglu_experts(per_expert, *w).view(n, self.ep, rows, d).transpose(0, 1).contiguous()
        return _all_to_all(out.view(e, rows, d), None, None, self.group)


class _RoutedDispatch:
    """A transformers experts module's forward under expert parallelism (module docstring)."""

    def __init__(self, module: nn.Module, ep_mesh: DeviceMesh, imbalance: float):
        self.module = module
        self.forward: Callable[..., torch.Tensor] = module.forward
        self.group = ep_mesh.get_group()
        self.ep = ep_mesh.size()
        self.rank = ep_mesh.get_local_rank()
        self.imbalance = imbalance

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> Any:
        tokens, k = top_k_index.shape
        n = expert_count(self.module) // self.ep
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        if isinstance(hidden_states, FakeTensor):
            send, recv, local_ids = self._assumed_counts(flat)
        else:
            send, recv, local_ids = self._routed_counts(flat)
        rows = _all_to_all(hidden_states[order // k].contiguous(), recv, send, self.group)
        ids = local_ids()
        with _local_experts(self.module, n, self.ep):
            ones = rows.new_ones(rows.shape[0], 1)
            out = self.forward(rows, ids.unsqueeze(-1), ones)
        back = _all_to_all(out.contiguous(), send, recv, self.group)
        per_assignment = back[torch.argsort(order)].view(tokens, k, -1)
        return (per_assignment * top_k_weights.unsqueeze(-1).to(back.dtype)).sum(dim=1).to(hidden_states.dtype)

    def _routed_counts(self, flat: torch.Tensor) -> tuple[list[int], list[int], Callable[[], torch.Tensor]]:
        """Rows sent to and received from each ep rank, counted from the routing
        ``flat`` and exchanged, and the builder of the local expert id of each received row."""
        experts = expert_count(self.module)
        n = experts // self.ep
        counts = torch.bincount(flat, minlength=experts)
        received_counts = funcol.wait_tensor(funcol.all_to_all_single(counts, None, None, self.group))
        send = counts.view(self.ep, n).sum(dim=1).tolist()
        recv = received_counts.view(self.ep, n).sum(dim=1).tolist()
        return (
            send,
            recv,
            lambda: torch.arange(n, device=flat.device).repeat(self.ep).repeat_interleave(received_counts),
        )

    def _assumed_counts(self, flat: torch.Tensor) -> tuple[list[int], list[int], Callable[[], torch.Tensor]]:
        """:meth:`_routed_counts` on fake tensors, whose routing has no values: the
        planner's routing (:mod:`autopar.runtime.assumed_routing`). The counts still
        travel, as in a real step; what comes back is not read."""
        routing = assumed_routing(flat.numel(), expert_count(self.module), self.ep, self.rank, self.imbalance)
        counts = torch.tensor(routing.expert_rows, device=flat.device)
        funcol.wait_tensor(funcol.all_to_all_single(counts, None, None, self.group))
        return routing.send, routing.recv, lambda: routing.local_ids(flat.device)


@contextmanager
def _local_experts(module: nn.Module, n: int, ep: int) -> Iterator[None]:
    """Run ``module`` as the module of its ``n`` local experts: plain local weights
    (gradients to the DTensor parameters, divided by ``ep``) and ``num_experts = n``."""
    saved = dict(module._parameters)
    count = module.num_experts
    try:
        for name, p in saved.items():
            if p is not None:
                module._parameters[name] = _local_weight(p, ep)  # type: ignore[assignment]
        module.num_experts = n
        yield
    finally:
        module._parameters.update(saved)
        module.num_experts = count


def _all_to_all(x: torch.Tensor, output_splits: list[int] | None, input_splits: list[int] | None, group: Any) -> Any:
    """All-to-all of ``x``'s rows over ``group`` (differentiable: its backward is the reverse one)."""
    return funcol.wait_tensor(funcol.all_to_all_single_autograd(x, output_splits, input_splits, group))
