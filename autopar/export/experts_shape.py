"""A mixture-of-experts model's experts, as the frameworks that build a model from flags
need them: their count, top-k and width, read from autopar's own MoE config or a
transformers config and its built blocks (shared experts, which blocks hold experts, the
router's score function, bias, groups and scaling), and the check every framework makes
of an expert-parallel degree."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from autopar.export.common import ExportError, config_float, config_int
from autopar.models.experts import is_routed_experts, unsplit_experts
from autopar.models.hf_config import EXPERT_COUNT_FIELDS
from autopar.models.moe import MoEConfig
from autopar.plan import Plan

if TYPE_CHECKING:
    from autopar.export.shape import ModelShape


@dataclass(frozen=True, kw_only=True)
class Experts:
    """The routed experts of a mixture-of-experts model (every block's MLP).

    Attributes:
        count: experts per layer.
        top_k: experts each token is routed to.
        ffn_hidden_size: one expert's hidden width; ``None`` where unknown.
        capacity_factor: the slots of a balanced routing each expert's buffer holds
            (tokens beyond are dropped); ``None`` for a dropless model, which runs every
            routed token.
        model_type: the transformers ``model_type`` (``mixtral``); ``None`` for
            autopar's own :class:`~autopar.models.moe.MoELlama`.
        shared_ffn_hidden_size: the hidden width of the shared experts every token runs
            beside its routed ones, all of them together (DeepSeek's ``n_shared_experts``
            x ``moe_intermediate_size``, Qwen2-MoE's ``shared_expert_intermediate_size``);
            ``None`` without.
        shared_gate: the shared experts' output is scaled by a learned sigmoid gate
            (Qwen2-MoE's ``shared_expert_gate``).
        renormalized: the top-k weights are renormalised to sum to 1 (the config's
            ``norm_topk_prob``, true where it does not say); else they stay the softmax
            over all experts (OLMoE, Qwen2-MoE).
        layers: which blocks, in order, hold experts (DeepSeek's first dense layers);
            ``None`` where every block does or it is unknown.
        score_function: how the router scores experts: ``softmax`` or ``sigmoid``.
        expert_bias: a learned per-expert bias chooses the top-k (DeepSeek-V3's
            auxiliary-loss-free balancing, told by its router's ``e_score_correction_bias``).
        probs_on_input: the routing weight scales the expert's input, not its output
            (Llama 4, whose router applies a sigmoid to the top-k logits).
        groups: (groups, groups each token may use) of a group-limited router.
        groups_by_best: the router ranks groups by their best expert (DeepSeek-V2's
            ``group_limited_greedy``), not by the sum of their top experts (DeepSeek-V3's).
        scaling_factor: what the routed experts' weights are multiplied by.
    """

    count: int
    top_k: int
    ffn_hidden_size: int | None
    capacity_factor: float | None
    model_type: str | None
    shared_ffn_hidden_size: int | None = None
    shared_gate: bool = False
    renormalized: bool = True
    layers: tuple[bool, ...] | None = None
    score_function: str = "softmax"
    expert_bias: bool = False
    probs_on_input: bool = False
    groups: tuple[int, int] | None = None
    groups_by_best: bool = False
    scaling_factor: float | None = None


def moe_experts(config: MoEConfig) -> Experts:
    """The experts of autopar's mixture-of-experts Llama: capacity-bounded buffers."""
    return Experts(
        count=config.n_experts,
        top_k=config.top_k,
        ffn_hidden_size=config.ffn_dim,
        capacity_factor=config.capacity_factor,
        model_type=None,
    )


def hf_experts(config: Any, blocks: list[nn.Module]) -> Experts | None:
    """The routed experts a transformers config counts (``num_local_experts`` and
    ``num_experts_per_tok`` in Mixtral's), dropless as transformers runs them, with what
    its config and ``blocks`` (the built blocks, in order) state of its shared experts,
    its dense layers and its router; None when it counts none."""
    count = next((n for name in EXPERT_COUNT_FIELDS if (n := config_int(config, name))), None)
    top_k = config_int(config, "num_experts_per_tok")
    if count is None or top_k is None:
        return None
    width = config_int(config, "moe_intermediate_size") or config_int(config, "intermediate_size")
    shared, gated = _shared_experts(blocks)
    if shared is None and (n := config_int(config, "n_shared_experts")) and width:
        shared = n * width
    holds = [any(is_routed_experts(m) for m in b.modules()) or bool(unsplit_experts(b)) for b in blocks]
    tensors = (name for b in blocks for name, _ in (*b.named_buffers(), *b.named_parameters()))
    biased = any(name.endswith("e_score_correction_bias") for name in tensors)
    groups, group_top = config_int(config, "n_group"), config_int(config, "topk_group")
    grouped = groups and group_top and groups > 1 and getattr(config, "topk_method", None) != "greedy"
    scaling = config_float(config, "routed_scaling_factor")
    model_type = getattr(config, "model_type", None)
    llama4 = model_type in ("llama4", "llama4_text")  # sigmoid of the top-k, on the input
    return Experts(
        count=count,
        top_k=top_k,
        ffn_hidden_size=width,
        capacity_factor=None,
        model_type=model_type or None,
        shared_ffn_hidden_size=shared or None,
        shared_gate=gated,
        # transformers' DeepSeek-V2 keeps the softmax weights whatever norm_topk_prob says
        renormalized=getattr(config, "norm_topk_prob", True) is not False and model_type != "deepseek_v2",
        layers=tuple(holds) if any(holds) and not all(holds) else None,
        score_function="sigmoid"
        if biased or llama4 or getattr(config, "scoring_func", None) == "sigmoid"
        else "softmax",
        expert_bias=biased,
        probs_on_input=llama4,
        groups=(groups, group_top) if grouped else None,
        groups_by_best=bool(grouped) and getattr(config, "topk_method", None) == "group_limited_greedy",
        scaling_factor=scaling if scaling not in (None, 1.0) else None,
    )


def _shared_experts(blocks: list[nn.Module]) -> tuple[int | None, bool]:
    """(hidden width, gated output) of the shared experts of the first block holding one
    (a module named ``shared_expert``/``shared_experts``: Qwen2-MoE, DeepSeek, Llama 4;
    its down projection's input width), or (None, False)."""
    for block in blocks:
        modules = dict(block.named_modules())
        for name, module in modules.items():
            last = name.rsplit(".", 1)[-1]
            down = getattr(module, "down_proj", None)
            if last in ("shared_expert", "shared_experts") and isinstance(down, nn.Linear):
                return down.in_features, f"{name}_gate" in modules
    return None, False


def require_experts(plan: Plan, shape: ModelShape) -> None:
    """ExportError unless a plan with expert parallelism has a model whose experts split
    evenly over its ``ep`` ranks (every framework asserts both)."""
    ep = plan.config.ep
    if ep == 1:
        return
    experts = shape.experts
    if experts is None:
        raise ExportError(
            f"ep={ep} splits a mixture-of-experts model's experts, but the model given for {plan.model.name} has "
            f"none (its config counts no experts); export a plan made with --set ep=1."
        )
    if experts.count % ep:
        allowed = [d for d in range(1, experts.count + 1) if experts.count % d == 0]
        raise ExportError(
            f"ep={ep} does not divide the model's {experts.count} experts per layer, which every framework "
            f"requires; make the plan with ep in {allowed}."
        )
