"""The Plan: what the planner decided, what it predicts, and why. Plain frozen data.

A plan file is the contract between the planner (which may run on a laptop) and the
runtime (which runs it on the cluster). ``Plan.to_json`` / ``Plan.from_json`` round-trip
exactly through :mod:`autopar.codec`; unknown schema versions and malformed fields are
refused with the path of the offending field. Rendering a plan for people is
:mod:`autopar.present`'s.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from autopar import codec
from autopar.errors import PlanFormatError
from autopar.hardware.cluster import Cluster
from autopar.parallel_config import ParallelConfig
from autopar.plan_checks import device_problem, prediction_problem
from autopar.vocab import ActivationLayout, Attention, Optimizer, Recompute, Schedule, TPStyle

SCHEMA_VERSION = 12
"""2: the cluster's device is nested by concern (roofline, memory, host effects);
3: ``ParallelConfig.dp_shard`` (HSDP); 4: ``ParallelConfig.cp`` (context parallelism)
and ``StepBreakdown.cp_comm_s``; 5: ``ParallelConfig.ep`` (expert parallelism) and
``StepBreakdown.ep_comm_s``; 6: ``ParallelConfig.compile`` (compiled blocks) and ``fp8`` (FP8 matmuls); 7: the
recompute mode ``op`` (per-operator selective recomputation); 8: ``ParallelConfig.async_tp``
(asynchronous tensor parallelism); 9: the schedule ``dualpipev``; 10: ``ParallelConfig.regather``
(sequence-parallel gathers kept as shards); 11: the tensor-parallel style ``heads`` and
``ModelSummary.has_attention``; 12: ``ParallelConfig.reduce_dtype`` (gradients reduced in
bf16). Older files read as plans without the newer axes."""
READABLE_VERSIONS = (2, 3, 4, 5, 6, 7, 8, 9, 10, 11, SCHEMA_VERSION)
_INTRODUCED = {
    "dp_shard": 3,
    "cp": 4,
    "ep": 5,
    "compile": 6,
    "fp8": 6,
    "async_tp": 8,
    "regather": 10,
    "reduce_dtype": 12,
}
"""The schema version that introduced each newer ``config`` field."""
_OP_RECOMPUTE_SINCE = 7
"""The schema version that introduced the recompute mode ``op``."""
_DUALPIPEV_SINCE = 9
"""The schema version that introduced the schedule ``dualpipev``."""
_HEADS_SINCE = 11
"""The schema version that introduced the style ``heads`` and ``model.has_attention``."""


@dataclass(frozen=True, kw_only=True)
class LayerStrategies:
    """Per-layer decisions.

    Attributes:
        tp: leaf-module FQN -> tensor-parallel style; leaves not listed are replicated.
        recompute: unit FQN -> recompute mode, only where it differs from
            ``ParallelConfig.recompute``.
    """

    tp: Mapping[str, TPStyle] = field(default_factory=dict)
    recompute: Mapping[str, Recompute] = field(default_factory=dict)

    def tp_style(self, fqn: str) -> TPStyle:
        """The style of leaf ``fqn`` (replicate when not listed)."""
        return self.tp.get(fqn, TPStyle.REPLICATE)

    def recompute_of(self, unit: str, default: Recompute) -> Recompute:
        """The recompute mode of ``unit`` given the config's default."""
        return self.recompute.get(unit, default)


@dataclass(frozen=True, kw_only=True)
class MemoryBreakdown:
    """Peak bytes on one device of a stage, by what they hold."""

    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activations_bytes: float
    transient_bytes: float
    buffers_bytes: float
    reserve_bytes: float

    @property
    def total_bytes(self) -> float:
        """The sum of every term: the predicted peak."""
        return (
            self.params_bytes
            + self.grads_bytes
            + self.optimizer_bytes
            + self.activations_bytes
            + self.transient_bytes
            + self.buffers_bytes
            + self.reserve_bytes
        )


@dataclass(frozen=True, kw_only=True)
class StagePrediction:
    """One pipeline stage: per-micro-batch times and per-device memory.

    ``forward_s``/``backward_s`` are per micro-batch and include tensor-parallel
    communication (with the waits on the group's slowest rank at its blocking
    collectives, :func:`autopar.cost.host.ranks_wait_s`) and recomputation; ``dp_comm_s`` is the
    step's exposed data-parallel
    communication (on the ranks of the first and last stages with the all-reduce of tied
    weights' gradients, which :class:`StepBreakdown` counts as ``pp_comm_s``) and
    ``optimizer_s`` the optimizer step, with the check before it that every rank's loss
    and gradients are finite.
    """

    index: int
    pipeline_rank: int
    units: tuple[str, ...]
    forward_s: float
    backward_s: float
    tp_comm_s: float
    pp_comm_s: float
    recompute_s: float
    dp_comm_s: float
    optimizer_s: float
    inflight_microbatches: float
    memory: MemoryBreakdown


@dataclass(frozen=True, kw_only=True)
class StepBreakdown:
    """The step time split into terms that add up to it (critical path of the slowest
    pipeline rank). ``pp_comm_s`` holds the point-to-point transfers and the all-reduce
    of tied weights' gradients between the first and last stages; ``dp_comm_s`` what the
    data-parallel collectives expose."""

    compute_s: float
    recompute_s: float
    tp_comm_s: float
    pp_comm_s: float
    bubble_s: float
    dp_comm_s: float
    optimizer_s: float
    cp_comm_s: float = 0.0
    ep_comm_s: float = 0.0

    def terms(self) -> tuple[tuple[str, float], ...]:
        """Every term by the name explanations and reports give it, in the order they show
        them."""
        return (
            ("compute", self.compute_s),
            ("recompute", self.recompute_s),
            ("TP comm", self.tp_comm_s),
            ("CP comm", self.cp_comm_s),
            ("EP comm", self.ep_comm_s),
            ("PP comm", self.pp_comm_s),
            ("bubble", self.bubble_s),
            ("DP comm", self.dp_comm_s),
            ("optimizer", self.optimizer_s),
        )

    def shown(self) -> tuple[tuple[str, float], ...]:
        """The terms worth showing: above a ten-thousandth of the step (a float residue,
        such as the bubble of a plan without pipelining, is not a term)."""
        return tuple((name, v) for name, v in self.terms() if v > 1e-4 * self.total_s)

    @property
    def total_s(self) -> float:
        """Sum of the terms (equals ``Prediction.step_time_s``)."""
        return sum(v for _, v in self.terms())


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """What the cost model predicts for one step of a configuration.

    ``mfu`` counts model FLOPs without recomputation, ``hfu`` with it (Chowdhery et al.
    2022, PaLM, appendix B; both count causal attention's whole score matrix, as PaLM's,
    Megatron-LM's and torchtitan's counts do, though a flash kernel computes about half
    of it), both against the device's peak in the plan's ``dtype``: a
    plan with FP8 matmuls is measured against the bf16 peak, which its matmuls exceed,
    so its HFU can pass 100%. ``memory_bytes_per_device`` is the peak on the most loaded
    device, compared with ``memory_capacity_bytes``.
    """

    step_time_s: float
    samples_per_s: float
    tokens_per_s: float
    tflops_per_device: float
    mfu: float
    hfu: float
    memory_bytes_per_device: float
    memory_capacity_bytes: float
    fits: bool
    breakdown: StepBreakdown
    stages: tuple[StagePrediction, ...]


@dataclass(frozen=True, kw_only=True)
class Alternative:
    """A configuration the search also considered, and why it lost.

    ``status``: ``runner-up`` (fits, slower by ``slower_by`` as a fraction of the
    winner's step time), ``out-of-memory`` (needs ``over_memory_bytes`` more than a
    device has, even with its best per-layer choices) or ``sharding`` (the winner with
    the other data-parallel sharding, plain FSDP or its best HSDP shard group, slower by
    ``slower_by``) or ``compile`` (the winner with its blocks compiled the other way;
    ``slower_by`` is negative where compiling would be faster but was not chosen) or
    ``fp8`` (the winner with its linear layers the other way, FP8 or not) or ``degrees``
    (the fastest configuration of another mix of dp, cp, tp, pp and ep than the winner's).
    ``config.recompute`` is the mode most of its units take, and ``unit_recompute`` how
    many units take each other mode (the search picks recomputation per unit), so that
    the same configuration given to ``autopar.estimate`` without a ``recompute`` prices
    the same choice.
    """

    config: ParallelConfig
    status: Literal["runner-up", "out-of-memory", "sharding", "compile", "fp8", "async_tp", "regather", "degrees"]
    step_time_s: float
    memory_bytes_per_device: float
    slower_by: float
    over_memory_bytes: float
    reason: str
    unit_recompute: Mapping[Recompute, int] = field(default_factory=dict)

    def short(self) -> str:
        """The configuration's compact text (:meth:`ParallelConfig.short`), its recompute
        followed by how many units the search gave another mode, where it gave some:
        ``recompute=op(3 none)``; ``config.recompute`` is the mode most units take."""
        text = self.config.short()
        if not self.unit_recompute:
            return text
        mode = f"recompute={self.config.recompute.value}"
        others = ",".join(f"{n} {m.value}" for m, n in sorted(self.unit_recompute.items(), key=lambda kv: kv[0].value))
        return text.replace(mode, f"{mode}({others})", 1)


@dataclass(frozen=True, kw_only=True)
class ModelSummary:
    """Enough about the model to check that the runtime is handed the same one."""

    name: str
    num_params: int
    units: tuple[str, ...]
    fingerprint: str
    seq_len: int
    global_batch_size: int
    flops_per_sample: float
    has_attention: bool = True
    """The model runs attention cores (an image model of convolutions does not): what the
    plan's attention setting applies to."""


@dataclass(frozen=True, kw_only=True)
class PlanSettings:
    """Inputs of the search other than the model and the cluster."""

    optimizer: Optimizer = Optimizer.ADAM
    attention: Attention = Attention.FLASH
    profile_sources: tuple[str, ...] = ()
    solver: str = "highs"
    routing_imbalance: float = 1.0
    """Dropless experts' busiest expert-parallel rank over the mean rows
    (:attr:`autopar.cost.model.CostModel.routing_imbalance`)."""
    activations: ActivationLayout = ActivationLayout.BATCH_FIRST
    """The activation layout the plan was priced for (:class:`autopar.vocab.ActivationLayout`)."""
    searched: bool = True
    """The configuration was searched (``autopar.plan``); False where it was given and
    priced as it is (``autopar.estimate``)."""
    memory_headroom_bytes: float = 0.0
    """Bytes of each device kept free at the user's request (``memory_headroom_gib``),
    part of the cluster's reserve in this plan: no configuration was allowed them."""

    @property
    def megatron_kernels(self) -> bool:
        """The plan is priced for Megatron-LM's kernels (sequence-first activations,
        :attr:`autopar.vocab.ActivationLayout.megatron_kernels`)."""
        return self.activations.megatron_kernels


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A parallel training plan: the config, the per-stage and per-layer decisions, the
    predicted cost and the alternatives it beat."""

    config: ParallelConfig
    stages: tuple[tuple[str, ...], ...]
    layer_strategies: LayerStrategies
    prediction: Prediction
    alternatives: tuple[Alternative, ...]
    model: ModelSummary
    cluster: Cluster
    settings: PlanSettings = PlanSettings()
    notes: tuple[str, ...] = ()
    search_time_s: float = 0.0
    candidates_evaluated: int = 0
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        if len(self.stages) != self.config.num_stages:
            raise PlanFormatError(
                f"plan has {len(self.stages)} stages but pp x virtual_stages = "
                f"{self.config.pp} x {self.config.virtual_stages} = {self.config.num_stages}."
            )
        if self.config.world_size != self.cluster.world_size:
            raise PlanFormatError(
                f"plan uses dp x cp x tp x pp = {self.config.world_size} devices but its cluster has "
                f"{self.cluster.world_size}."
            )
        c = self.config
        if c.dp * c.micro_batch_size * c.num_microbatches != self.model.global_batch_size:
            raise PlanFormatError(
                f"plan batch arithmetic is inconsistent: dp x micro_batch_size x num_microbatches = {c.dp} x "
                f"{c.micro_batch_size} x {c.num_microbatches} = {c.dp * c.micro_batch_size * c.num_microbatches}, "
                f"but its global batch is {self.model.global_batch_size}. The file was edited or damaged: make the "
                f"plan again (autopar plan, or autopar.estimate for a fixed configuration)."
            )
        listed = [u for stage in self.stages for u in stage]
        if tuple(listed) != self.model.units:
            raise PlanFormatError(
                "plan stages do not cover the model's units once each, in order: "
                f"stages list {len(listed)} units, the model has {len(self.model.units)}."
            )

    def __repr__(self) -> str:
        """One line (model, cluster, configuration, predicted step time and memory): the
        field-by-field repr of a plan runs to tens of kilobytes. The full text is
        ``autopar.explain(plan)``; the HTML summary (for a notebook, through
        ``IPython.display.HTML``) ``autopar.present.report.summary_html(plan)``: a plan is
        data and knows no renderer."""
        p = self.prediction
        fit = "" if p.fits else ", DOES NOT FIT"
        return (
            f"<autopar Plan {_cut(self.model.name)} on {_cut(self.cluster.name)}: {self.config.short()}; "
            f"step {p.step_time_s:.3g} s, {p.memory_bytes_per_device / 2**30:.1f} GiB per device{fit}>"
        )

    def stage_of_rank(self, pipeline_rank: int) -> tuple[int, ...]:
        """Indices of the stages a pipeline rank runs, in order (:meth:`ParallelConfig.rank_of_stage`)."""
        return self.config.stages_of_rank(pipeline_rank)

    def eager_contrast(self) -> Alternative | None:
        """The plan's own choices priced with eager blocks, where the search priced them:
        its ``compile`` alternative when that differs from the plan in compiling alone
        (same degrees, kernels and recomputation per mode), else None. The search picks
        recomputation again for the eager contrast, so it may differ."""
        eager = replace(self.config, compile=False, async_tp=False)
        overrides = Counter(m for m in self.layer_strategies.recompute.values() if m is not self.config.recompute)
        for alternative in self.alternatives:
            if alternative.status != "compile" or alternative.config != eager:
                continue
            return alternative if dict(alternative.unit_recompute) == dict(overrides) else None
        return None

    def to_dict(self) -> dict[str, Any]:
        """JSON-able data, the inverse of :meth:`from_dict`."""
        data = codec.encode(self, error=PlanFormatError)
        return {f: data[f] for f in _PLAN_FIELDS}

    def to_json(self) -> str:
        """The plan file's text."""
        return json.dumps(self.to_dict(), indent=1, allow_nan=False) + "\n"

    @staticmethod
    def from_dict(data: Any, *, origin: str = "plan") -> Plan:
        """Parse plan data; raises PlanFormatError naming any bad field."""
        if not isinstance(data, dict):
            raise PlanFormatError(f"{origin}: expected a JSON object, got {type(data).__name__}.")
        other = codec.misfiled(data, "plan", "a plan")
        if other:
            raise PlanFormatError(f"{origin} {other}.")
        version = data.get("schema_version")
        if "schema_version" not in data and "config" not in data:
            keys = ", ".join(sorted(map(str, data))[:5]) or "none"
            raise PlanFormatError(
                f"{origin}: not an autopar plan (no schema_version or config; its keys: {keys}); give a file "
                f"written by 'autopar plan --out' or Plan.save."
            )
        if isinstance(version, bool) or version not in READABLE_VERSIONS:
            raise PlanFormatError(
                f"{origin}: schema_version {version!r} is not supported; this autopar reads versions "
                f"{', '.join(map(str, READABLE_VERSIONS))}. Re-create the plan with this autopar version."
            )
        config = data.get("config") if isinstance(data.get("config"), dict) else {}
        for name, since in _INTRODUCED.items():
            if version < since and name in config:
                raise PlanFormatError(f"{origin}: config.{name} needs schema_version {since} or later (got {version}).")
        if version < _OP_RECOMPUTE_SINCE and Recompute.OP.value in _recompute_values(data, config):
            raise PlanFormatError(
                f"{origin}: recompute 'op' needs schema_version {_OP_RECOMPUTE_SINCE} or later (got {version})."
            )
        if version < _DUALPIPEV_SINCE and config.get("schedule") == Schedule.DUALPIPEV.value:
            raise PlanFormatError(
                f"{origin}: schedule 'dualpipev' needs schema_version {_DUALPIPEV_SINCE} or later (got {version})."
            )
        if version < _HEADS_SINCE and (TPStyle.HEADS.value in _tp_values(data) or "has_attention" in _model(data)):
            raise PlanFormatError(
                f"{origin}: the style 'heads' and model.has_attention need schema_version {_HEADS_SINCE} or later "
                f"(got {version})."
            )
        data = {**data, "schema_version": SCHEMA_VERSION}  # an older file is a plan without the newer axes
        plan = codec.decode(Plan, data, origin, error=PlanFormatError)
        where, problem = "config", device_problem(plan.config, plan.cluster)
        if not problem:
            where, problem = "prediction", prediction_problem(plan.prediction, plan.model)
        if problem:
            raise PlanFormatError(
                f"{origin}.{where}: {problem}. The file was edited or damaged: make the plan again (autopar plan, "
                f"or autopar.estimate for a fixed configuration)."
            )
        return plan

    @staticmethod
    def from_json(text: str, *, origin: str = "plan") -> Plan:
        """Parse the text written by :meth:`to_json`."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanFormatError(f"{origin}: not valid JSON ({exc}).") from None
        return Plan.from_dict(data, origin=origin)

    def save(self, path: str | Path) -> Path:
        """Write the plan file (atomically: a crash never leaves half a file)."""
        return codec.write_atomically(path, self.to_json())

    @staticmethod
    def load(path: str | Path) -> Plan:
        """Read a plan file written by :meth:`save`."""
        if not isinstance(path, (str, Path)):
            raise PlanFormatError(f"Plan.load({path!r}): give the path of a plan file (a str or pathlib.Path).")
        remedy = f"create one with 'autopar plan ... --out {path}'"
        data = codec.read_json(path, what="plan file", error=PlanFormatError, remedy=remedy)
        return Plan.from_dict(data, origin=f"plan file {str(path)!r}")


_PLAN_FIELDS = (
    "schema_version",
    "config",
    "stages",
    "layer_strategies",
    "prediction",
    "alternatives",
    "model",
    "cluster",
    "settings",
    "notes",
    "search_time_s",
    "candidates_evaluated",
)


def _cut(name: str, limit: int = 40) -> str:
    """``name``, or its first ``limit - 1`` characters and an ellipsis."""
    return name if len(name) <= limit else name[: limit - 1] + "…"


def _strategies(data: dict[str, Any]) -> dict[str, Any]:
    """A plan file's per-layer strategies (empty where it has none)."""
    return data["layer_strategies"] if isinstance(data.get("layer_strategies"), dict) else {}


def _tp_values(data: dict[str, Any]) -> list[Any]:
    """The tensor-parallel styles a plan file names."""
    strategies = _strategies(data)
    return list(strategies["tp"].values()) if isinstance(strategies.get("tp"), dict) else []


def _model(data: dict[str, Any]) -> dict[str, Any]:
    """A plan file's model summary (empty where it has none)."""
    return data["model"] if isinstance(data.get("model"), dict) else {}


def _recompute_values(data: dict[str, Any], config: dict[str, Any]) -> list[Any]:
    """The recompute modes a plan file names, its default's and its per-unit ones."""
    strategies = _strategies(data)
    per_unit = strategies.get("recompute") if isinstance(strategies.get("recompute"), dict) else {}
    return [config.get("recompute"), *per_unit.values()]
