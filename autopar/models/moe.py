"""A Llama whose MLP is a top-k routed mixture of SwiGLU experts (Mixtral, Jiang et al.
2024; routing as in Shazeer et al. 2017 and Fedus et al. 2022).

Each token's router logits pick ``top_k`` of ``n_experts`` experts; their outputs are
summed, weighted by the softmax probabilities of the picked experts renormalised to one
(Mixtral's rule). Experts run as batched matmuls over fixed-size buffers, one buffer
of ``capacity`` slots per expert and sample (GShard, Lepikhin et al. 2021):

- every shape is known before the router runs, so the model traces on the meta device
  and its FLOPs are counted from shapes: ``capacity_factor x top_k`` expert MLPs per
  token, the expected cost of the routed layer whatever the routing (``capacity =
  ceil(capacity_factor x seq x top_k / n_experts)``);
- a token routed to an expert whose buffer is full is dropped by that expert (it adds
  nothing, as in Switch and GShard); buffers are filled in token order, per sample, so a
  sample is routed the same whatever else is in its batch: data parallelism and
  micro-batching compute exactly what one process computes.

The router and the experts are one module with parameters, not ``nn.Linear`` layers:
the planner replicates it under tensor parallelism (every rank runs every expert on the
whole sequence, gathered from sequence shards under sequence parallelism) and shards the
attention, the embedding and the head. Under expert parallelism the runtime splits the
stacked expert weights over the ``ep`` ranks and exchanges each expert's buffer rows
with all-to-alls (:mod:`autopar.runtime.expert_parallel`); the routing is unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from autopar.errors import ConfigError
from autopar.models.llama import Block, Llama, LlamaConfig


@dataclass(frozen=True, kw_only=True)
class MoEConfig(LlamaConfig):
    """Sizes of a mixture-of-experts Llama: ``ffn_dim`` is one expert's width."""

    n_experts: int = 8
    top_k: int = 2
    capacity_factor: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.top_k <= self.n_experts:
            raise ConfigError(
                f"MoEConfig: top_k={self.top_k} is not allowed with n_experts={self.n_experts}; give 1 <= top_k <= "
                f"n_experts."
            )
        if not self.capacity_factor > 0:
            raise ConfigError(
                f"MoEConfig: capacity_factor={self.capacity_factor} is not allowed; give a number > 0 (1.0: the "
                f"slots of a perfectly balanced routing)."
            )

    def capacity(self, seq: int) -> int:
        """Slots per expert and sample for ``seq`` tokens."""
        return math.ceil(self.capacity_factor * seq * self.top_k / self.n_experts)


def swiglu_experts(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """SwiGLU MLPs of stacked experts on their rows: ``x`` is ``(experts, rows, dim)``, the
    weights ``(experts, dim, ffn)``, ``(experts, dim, ffn)`` and ``(experts, ffn, dim)``."""
    return torch.bmm(F.silu(torch.bmm(x, w1)) * torch.bmm(x, w3), w2)


class MoEFeedForward(nn.Module):
    """Top-k routing to capacity-bounded expert buffers (module docstring).

    One module owns the router (``router``: one row per expert) and the experts' SwiGLU
    weights stacked per expert (``w1``, ``w3``: ``(n_experts, dim, ffn_dim)``; ``w2``:
    ``(n_experts, ffn_dim, dim)``): the planner sees one replicated layer whose output
    has the block's ``(batch, seq, dim)`` shape, which the runtime can hand to a
    sequence-parallel residual stream by keeping its sequence shard.
    """

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.router = nn.Parameter(torch.empty(cfg.n_experts, cfg.dim))
        self.w1 = nn.Parameter(torch.empty(cfg.n_experts, cfg.dim, cfg.ffn_dim))
        self.w3 = nn.Parameter(torch.empty(cfg.n_experts, cfg.dim, cfg.ffn_dim))
        self.w2 = nn.Parameter(torch.empty(cfg.n_experts, cfg.ffn_dim, cfg.dim))

    def experts(self, x: torch.Tensor) -> torch.Tensor:
        """Every expert's SwiGLU MLP on its rows: ``(n_experts, rows, dim)`` in and out.
        Expert parallelism replaces it on an instance by one that sends each expert's
        rows to the rank holding it (:mod:`autopar.runtime.expert_parallel`)."""
        return swiglu_experts(x, self.w1, self.w3, self.w2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        e, k, cap = self.cfg.n_experts, self.cfg.top_k, self.cfg.capacity(s)
        probs = torch.softmax(F.linear(x, self.router).float(), dim=-1)
        weights, chosen = probs.topk(k, dim=-1)  # (b, s, k)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        chosen = chosen.reshape(b, s * k)  # assignments in token order
        hits = (chosen.unsqueeze(-1) == torch.arange(e, device=x.device)).long()  # (b, s*k, e)
        position = (hits.cumsum(dim=1) * hits).sum(dim=-1) - 1  # place in the expert's buffer
        kept = position < cap
        trash = e * cap  # one extra slot takes every dropped assignment
        slot = torch.where(kept, chosen * cap + position, torch.full_like(position, trash))
        routed = x.unsqueeze(2).expand(b, s, k, d).reshape(b, s * k, d)
        index = slot.unsqueeze(-1).expand(b, s * k, d)
        buffers = x.new_zeros(b, trash + 1, d).scatter(1, index, routed)[:, :trash]
        per_expert = buffers.reshape(b, e, cap, d).transpose(0, 1).reshape(e, b * cap, d)
        out = self.experts(per_expert).reshape(e, b, cap, d).transpose(0, 1).reshape(b, trash, d)
        out = torch.cat((out, out.new_zeros(b, 1, d)), dim=1).gather(1, index)  # dropped: zeros
        scale = weights.reshape(b, s * k, 1) * kept.unsqueeze(-1).to(x.dtype)
        return (out * scale).reshape(b, s, k, d).sum(dim=2)


class MoELlama(Llama):
    """Token ids ``(batch, seq)`` -> logits ``(batch, seq, vocab)``; a :class:`Llama`
    whose blocks' MLPs are :class:`MoEFeedForward`."""

    @staticmethod
    def block(cfg: LlamaConfig) -> nn.Module:
        """A Llama block with a mixture-of-experts MLP."""
        assert isinstance(cfg, MoEConfig)
        return Block(cfg, MoEFeedForward(cfg))

    def __init__(self, cfg: MoEConfig):
        super().__init__(cfg)
