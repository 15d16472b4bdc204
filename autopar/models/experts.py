"""Which modules hold mixture-of-experts layers that expert parallelism can split.

Two kinds: autopar's :class:`~autopar.models.moe.MoEFeedForward`, and a transformers
experts module that takes its tokens already routed, ``forward(hidden_states,
top_k_index, top_k_weights)`` (GPT-OSS: ``router_indices, routing_weights``) over
weights stacked over the experts in dimension 0 (Mixtral, Qwen2-MoE, Qwen3-MoE,
DeepSeek-V2/V3, GPT-OSS, ...). The planner offers ``ep > 1`` only for these
(:mod:`autopar.graph.trace` marks their stacked weights as experts), and the runtime
splits only these (:mod:`autopar.runtime.expert_parallel`): one test for both. Other
modules with stacked per-expert weights (transformers' Llama 4 experts, which run every
expert on every token) run whole on each rank, priced as the dense matmuls they are.
"""

from __future__ import annotations

import inspect

from torch import nn

from autopar.models.moe import MoEFeedForward

ROUTED_SIGNATURES = (
    ("hidden_states", "top_k_index", "top_k_weights"),
    ("hidden_states", "router_indices", "routing_weights"),
)
"""The forward arguments of a transformers experts module, in order: the tokens, each
token's top-k experts and their weights (GPT-OSS names the last two otherwise)."""
ROUTED_FORM = f"forward({', '.join(ROUTED_SIGNATURES[0])})"
"""The routed experts' forward as messages name it."""


def is_routed_experts(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers-style experts module: an int ``num_experts``,
    a forward taking the tokens, their top-k experts and weights (:data:`ROUTED_SIGNATURES`),
    and only its own parameters, each stacked over the experts in dimension 0."""
    n = getattr(module, "num_experts", None)
    if isinstance(module, MoEFeedForward) or not isinstance(n, int) or n < 1:
        return False
    params = list(module.named_parameters())
    if not params or any("." in name or p.dim() < 2 or p.shape[0] != n for name, p in params):
        return False
    names = tuple(inspect.signature(module.forward).parameters)
    return any(names[: len(signature)] == signature for signature in ROUTED_SIGNATURES)


def experts_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The model's experts modules by FQN: autopar's MoE layers and transformers' experts."""
    return {name: m for name, m in model.named_modules() if isinstance(m, MoEFeedForward) or is_routed_experts(m)}


def expert_count(module: nn.Module) -> int:
    """Experts of one experts module."""
    return module.cfg.n_experts if isinstance(module, MoEFeedForward) else int(module.num_experts)


def unsplit_experts(model: nn.Module) -> tuple[str, ...]:
    """Class names of the model's modules that stack weights over ``num_experts`` in
    dimension 0 but are not experts modules (:func:`experts_modules`): expert
    parallelism cannot split them."""
    split = set(experts_modules(model).values())
    found = []
    for m in model.modules():
        n = getattr(m, "num_experts", None)
        if m in split or not isinstance(n, int) or n < 2:
            continue
        if any(p.dim() == 3 and p.shape[0] == n for p in m.parameters(recurse=False)):
            found.append(type(m).__name__)
    return tuple(dict.fromkeys(found))


def routed_share(model: nn.Module, unsplit: tuple[str, ...]) -> dict[str, float]:
    """For each module of a class :func:`unsplit_experts` found (``unsplit``), by FQN, the share of its work that
    routing asks for: ``num_experts_per_tok / num_experts`` of the model's config. Such a
    module (transformers' Llama 4 experts) runs every expert on every token, the tokens
    not routed to an expert weighted zero; the rest is work no model FLOP counts. Empty
    where the config states no top-k."""
    top_k = getattr(getattr(model, "config", None), "num_experts_per_tok", None)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        return {}
    names = set(unsplit)
    return {
        fqn: min(top_k / m.num_experts, 1.0)
        for fqn, m in model.named_modules()
        if type(m).__name__ in names and isinstance(getattr(m, "num_experts", None), int)
    }
