"""What every exporter shares: the result type, the errors, and the facts about a plan
that frameworks name differently (transformer blocks per stage, recompute per block,
tensor-parallel styles).

Frameworks count pipeline splits and recomputation in *transformer layers*, while a plan
lists module names per stage. :func:`blocks_of` finds the repeated blocks among the
plan's units (``layers.0`` .. ``layers.N``, ``model.layers.0`` ..) so each exporter can
say how many layers each stage holds and which layers recompute.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shlex
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autopar import codec
from autopar.cost.memory import optimizer_state_bytes
from autopar.errors import ConfigError, PlanFormatError
from autopar.graph.decoders import causal_lm_class, transformers_class
from autopar.hardware.device import device_kind
from autopar.plan import Plan
from autopar.present.units import count
from autopar.vocab import Optimizer, Recompute, TPStyle


class ExportError(ConfigError):
    """A plan cannot be exported as asked: an unknown target, a configuration the target
    framework cannot run, or an output path that cannot be written."""


class UnreadablePlanError(ExportError, PlanFormatError):
    """The plan file to export is missing, unreadable or malformed (both an
    :class:`ExportError` and a :class:`~autopar.errors.PlanFormatError`, so callers that
    catch either see it)."""


@dataclass(frozen=True, kw_only=True)
class Export:
    """A plan written for one framework.

    Attributes:
        target: the framework (``megatron``, ``deepspeed``, ``torchtitan``, ``accelerate``).
        text: the file the framework reads (a launch script, a JSON, TOML or YAML
            config), with the approximations said in comments where the format has them.
        filename: a default name for ``text``.
        launch: the command that runs a job with it, as one line.
        notes: where the framework has no exact equivalent of a plan's choice, what was
            written instead and why; empty when the export is exact.
    """

    target: str
    text: str
    filename: str
    launch: str
    notes: tuple[str, ...] = ()

    def launch_for(self, path: str | Path) -> str:
        """The launch line for the file saved at ``path`` instead of ``filename``."""
        return self.launch.replace(shlex.quote(self.filename), shlex.quote(str(path)))

    def text_for(self, path: str | Path) -> str:
        """``text`` as saved at ``path``: the launch line a JSON config quotes (DeepSpeed's)
        names ``path`` instead of ``filename``."""
        return self.text.replace(json.dumps(self.launch), json.dumps(self.launch_for(path)))

    def save(self, path: str | Path) -> Path:
        """Write :meth:`text_for` ``path`` to ``path`` (atomically); an unwritable path is
        an ExportError."""
        if Path(path).is_dir():  # checked first: the atomic write would leave its temporary file beside it
            raise ExportError(f"cannot write {str(path)!r}: it is a directory; give a file name.")
        try:
            return codec.write_atomically(path, self.text_for(path))
        except OSError as exc:
            raise ExportError(f"cannot write {str(path)!r} ({exc.strerror or type(exc).__name__}).") from None


def load_plan(plan: Plan | str | Path) -> Plan:
    """``plan`` itself, or the plan in the file it names (UnreadablePlanError if none)."""
    if isinstance(plan, Plan):
        return plan
    try:
        return Plan.load(plan)
    except PlanFormatError as exc:
        raise UnreadablePlanError(str(exc)) from None


_INDEXED = re.compile(r"^(.*)\.(\d+)$")


@dataclass(frozen=True, kw_only=True)
class Blocks:
    """The plan's transformer blocks: its most numerous family of units named
    ``<prefix>.<index>``.

    Attributes:
        names: block module names in order.
        per_stage: blocks each pipeline stage holds (``pp * virtual_stages`` entries, in
            the plan's stage order: stage ``i`` runs on pipeline rank ``i % pp``).
        modes: recompute mode of each block.
        stage_modes: ``modes`` split by stage.
        others_recomputed: units outside the blocks that recompute (embeddings, head).
    """

    names: tuple[str, ...]
    per_stage: tuple[int, ...]
    modes: tuple[Recompute, ...]
    stage_modes: tuple[tuple[Recompute, ...], ...]
    others_recomputed: tuple[str, ...]

    @property
    def count(self) -> int:
        """Number of blocks (a framework's ``num_layers``)."""
        return len(self.names)

    @property
    def even(self) -> bool:
        """Every stage holds the same number of blocks."""
        return len(set(self.per_stage)) == 1

    def uniform(self) -> Recompute | None:
        """The recompute mode of every block when they all share one, else None."""
        kinds = set(self.modes)
        return kinds.pop() if len(kinds) == 1 else None

    def mode_counts(self) -> Counter:
        """How many blocks take each recompute mode."""
        return Counter(self.modes)

    def replacing(self, mode: Recompute, by: Recompute) -> Blocks:
        """These blocks with ``mode`` written as ``by``: a framework without ``mode``."""
        swap = {mode: by}
        return dataclasses.replace(
            self,
            modes=tuple(swap.get(m, m) for m in self.modes),
            stage_modes=tuple(tuple(swap.get(m, m) for m in stage) for stage in self.stage_modes),
        )


def blocks_of(plan: Plan) -> Blocks:
    """The transformer blocks of ``plan`` and how its stages and recompute treat them.

    A model without repeated blocks has none (``count == 0``); the exporters then leave
    layer counts to the user.
    """
    families: Counter = Counter()
    for unit in plan.model.units:
        match = _INDEXED.match(unit)
        if match:
            families[match.group(1)] += 1
    prefix = families.most_common(1)[0][0] if families else None
    block_names = {u for u in plan.model.units if (m := _INDEXED.match(u)) and m.group(1) == prefix}
    default = plan.config.recompute
    strategies = plan.layer_strategies
    stage_modes = tuple(
        tuple(strategies.recompute_of(u, default) for u in stage if u in block_names) for stage in plan.stages
    )
    others = tuple(
        u
        for u in plan.model.units
        if u not in block_names and strategies.recompute_of(u, default) is not Recompute.NONE
    )
    return Blocks(
        names=tuple(u for u in plan.model.units if u in block_names),
        per_stage=tuple(len(m) for m in stage_modes),
        modes=tuple(m for stage in stage_modes for m in stage),
        stage_modes=stage_modes,
        others_recomputed=others,
    )


def mixed_recompute_note(blocks: Blocks, written: str) -> str:
    """The note for a plan whose recomputation of blocks the framework cannot express,
    saying what was ``written`` instead."""
    counts = ", ".join(f"{n} {mode.value}" for mode, n in sorted(blocks.mode_counts().items()))
    return f"the plan's recomputation ({counts}, of {blocks.count} blocks) has no exact equivalent; {written}"


def outside_blocks_note(blocks: Blocks) -> str | None:
    """The note for a plan that recomputes units outside the transformer blocks, which
    the frameworks do not checkpoint."""
    if not blocks.others_recomputed:
        return None
    return (
        f"the plan also recomputes {', '.join(blocks.others_recomputed)}, outside the transformer blocks; the "
        f"framework checkpoints blocks only, so those activations are kept (more memory than predicted)"
    )


INPUT_PROJECTIONS = frozenset(
    {
        "q_proj", "k_proj", "v_proj", "qkv_proj", "query_key_value", "c_attn", "query", "key", "value",
        "wq", "wk", "wv", "Wqkv", "gate_proj", "up_proj", "gate_up_proj", "w1", "w3", "fc1", "c_fc", "dense_h_to_4h",
    }
)  # fmt: skip
"""The names (in transformers' families, Meta's Llama and autopar's models) of the layers
that feed a block's attention or MLP, which Megatron-style splits make column-parallel."""


def tp_note(plan: Plan, framework: str) -> str | None:
    """A note when the plan's per-leaf tensor-parallel styles differ from the fixed
    Megatron-style split that ``framework`` applies (every block's attention and MLP
    column- then row-parallel, the embedding split over its vocabulary), else None."""
    if plan.config.tp == 1:
        return None
    blocks = blocks_of(plan)
    styles = plan.layer_strategies.tp
    sharded = {name for name in blocks.names if any(_inside(leaf, name) for leaf in styles)}
    signatures = {
        name: tuple(sorted((leaf[len(name) :], style.value) for leaf, style in styles.items() if _inside(leaf, name)))
        for name in sharded
    }
    differences = []
    if len(sharded) < blocks.count:
        differences.append(f"{blocks.count - len(sharded)} of {blocks.count} blocks replicated")
    if len(set(signatures.values())) > 1:
        differences.append("blocks split differently from each other")
    if any(not {TPStyle.COLUMN.value, TPStyle.ROW.value} <= {s for _, s in sig} for sig in signatures.values()):
        differences.append("blocks without a column-then-row split")
    rowed = sorted({leaf.rsplit(".", 1)[-1] for leaf, s in styles.items() if s is TPStyle.ROW} & INPUT_PROJECTIONS)
    if rowed:
        differences.append(f"{', '.join(rowed)} row-parallel, each output all-reduced, where it splits them by columns")
    outside = {style for leaf, style in styles.items() if not any(_inside(leaf, name) for name in blocks.names)}
    if TPStyle.VOCAB not in outside:
        differences.append("the embedding not split over its vocabulary")
    if not differences:
        return None
    return (
        f"{framework} splits every block's attention and MLP column- then row-parallel and the embedding over "
        f"its vocabulary; the plan's per-layer styles differ ({'; '.join(differences)}), so tensor-parallel "
        f"memory and communication will differ from the plan's prediction"
    )


OPTIMIZERS = {
    Optimizer.SGD: ("SGD", "SGD with one momentum buffer", "torch.optim.SGD with momentum"),
    Optimizer.ADAFACTOR: ("Adafactor", "Adafactor (factored second moments)", "torch.optim.Adafactor"),
}
"""Per optimizer other than Adam: its name, what the plan prices, what a script builds."""


def setting_notes(plan: Plan, framework: str, *, builds: tuple[Optimizer, ...] | None) -> list[str]:
    """Notes on what the plan was priced for that the exported file does not carry: a
    plan for CPU processes (``framework`` trains on CUDA GPUs), and an optimizer other
    than Adam, whose state the plan's memory counts. ``builds`` names the optimizers
    ``framework`` builds from its own configuration (Adam always among them), or None
    where the user's training script builds it."""
    notes = []
    if device_kind(plan.cluster.device.name) == "cpu":
        notes.append(
            f"the plan is for CPU processes ({plan.cluster.device.name}), and {framework} trains on CUDA GPUs, where "
            f"its predictions do not hold: plan on the GPU cluster it will run on (a preset such as --cluster "
            f"dgx-h100:2, or a profile taken there) and export that plan"
        )
    optimizer = plan.settings.optimizer
    if optimizer is Optimizer.ADAM or (builds is not None and optimizer in builds):
        return notes
    name, priced, cls = OPTIMIZERS[optimizer]
    state = optimizer_state_bytes(optimizer)
    more = optimizer_state_bytes(Optimizer.ADAM) - state
    if builds is None:
        notes.append(
            f"the plan prices {priced} ({state:g} bytes of state per parameter), and the training script builds the "
            f"optimizer: build {cls}; Adam would hold {more:g} more bytes per parameter than predicted"
        )
    else:
        notes.append(
            f"{framework} has no {name}: it trains with Adam, whose two moments take {more:g} more bytes per "
            f"parameter than the plan's optimizer state; plan with optimizer='adam' (--optimizer adam) to price what "
            f"it runs"
        )
    return notes


def _inside(leaf: str, unit: str) -> bool:
    return leaf.startswith(unit + ".")


def header(plan: Plan, target: str) -> list[str]:
    """Comment lines (without the comment marker) that open every exported file: where
    it came from and the configuration it writes."""
    c = plan.config
    split = f", split over cp {c.cp} ranks" if c.cp > 1 else ""
    return [
        f"{target} configuration exported by autopar from a plan for {plan.model.name} "
        f"({count(plan.model.num_params)} parameters) on {plan.cluster.describe()}",
        f"plan: {c.short()}; global batch {c.global_batch_size} = dp {c.dp} x micro-batch "
        f"{c.micro_batch_size} x {c.num_microbatches} micro-batches; sequence length {plan.model.seq_len}{split}",
    ]


CP_EXCHANGE = (
    "autopar plans context parallelism as torch's context_parallel runs it by default: before attention each "
    "rank all-gathers the keys and values of the other cp ranks' sequence shards (its all-gather rotation)"
)
"""What the plan assumes of the cp ranks' key/value exchange, for the exporters whose
framework offers another by default."""


def kernel_options_note(
    plan: Plan, framework: str, *, writes_async_tp: bool = False, writes_fp8: bool = False
) -> str | None:
    """The plan's compiled blocks, FP8 matmuls and asynchronous tensor parallelism, for an
    export that does not carry them over (``writes_async_tp``, ``writes_fp8``: it writes
    its own flag for them); None when the plan has none of them."""
    c = plan.config
    options = (
        (c.compile, "compiled blocks"),
        (c.fp8 and not writes_fp8, "FP8 matmuls"),
        (c.async_tp and not writes_async_tp, "asynchronous tensor parallelism"),
    )
    missing = [what for on, what in options if on]
    if not missing:
        return None
    listed = missing[0] if len(missing) == 1 else f"{', '.join(missing[:-1])} and {missing[-1]}"
    return (
        f"the plan's {listed} are not written for {framework}: its prediction assumes them; turn on "
        f"{framework}'s own equivalent, or expect a slower step"
    )


def fp8_inputs_note(plan: Plan, framework: str) -> str | None:
    """For an export other than Megatron-LM of an FP8 plan priced for Megatron-LM's kernels
    (its FP8 layers' inputs counted in FP8, as Transformer Engine keeps them): the
    framework keeps them in bf16, so the run holds more activations than predicted."""
    if not plan.config.fp8 or not plan.settings.megatron_kernels:
        return None
    return (
        f"the plan was priced for Megatron-LM's kernels, whose FP8 layers keep their inputs in FP8; {framework} keeps "
        f"them in bf16, so expect more activation memory than predicted: plan without --activations sequence-first "
        f"to price {framework}"
    )


def sequence_parallel_notes(plan: Plan, framework: str, *, megatron: bool) -> list[str]:
    """The notes for a sequence-parallel plan whose conventions differ from
    ``framework``'s (``megatron``: Megatron-LM and its DeepSpeed fork keep the shards of
    their gathers and lay activations out sequence-first; torchtitan and Accelerate hold
    the gathered copies and lay them out batch-first): what it keeps
    (:func:`_regather_note`) and the copies around its collectives the prediction
    assumes (:mod:`autopar.cost.layout_copies`)."""
    if not plan.config.sequence_parallel:
        return []
    notes = [_regather_note(plan, framework, regathers=megatron)]
    priced_first = plan.settings.megatron_kernels
    if megatron and not priced_first:
        notes.append(
            f"{framework} lays activations out sequence-first, so its sequence-parallel collectives make none of "
            f"the copies around the transfers that the plan's batch-first prediction counts: expect a faster step; "
            f"plan with --activations sequence-first to price {framework}"
        )
    elif priced_first and not megatron:
        notes.append(
            f"the plan was priced for sequence-first activations, but {framework} lays them out batch-first and "
            f"copies around its sequence-parallel collectives, which the prediction leaves out: expect a slower "
            f"step; plan with --activations batch-first for {framework}"
        )
    return [note for note in notes if note]


def _regather_note(plan: Plan, framework: str, *, regathers: bool) -> str | None:
    """The note for a sequence-parallel plan whose ``regather`` differs from what
    ``framework`` does; None where they agree."""
    if plan.config.regather == regathers:
        return None
    if regathers:
        return (
            f"{framework}'s sequence parallelism keeps the shards of its all-gathers and gathers again in the "
            f"backward, which the plan does not (regather=False): activation memory is lower, and the backward's "
            f"communication higher, than predicted"
        )
    return (
        f"the plan keeps the shards of its sequence-parallel all-gathers (regather=True), which {framework} does "
        f"not: it holds the gathered copies, so activation memory is higher than predicted and may not fit; plan "
        f"with regather=False for {framework}"
    )


def expert_tp_note(plan: Plan, framework: str, flag: str) -> str:
    """The note for a plan with expert and tensor parallelism, which ``framework`` writes
    with expert tensor parallelism 1 (``flag`` 1): whole experts on each rank, as the
    plan keeps them, but expert-parallel groups of consecutive ranks that take the tp
    ranks in (Megatron-LM's and torchtitan's layout), where the plan's take data- and
    context-parallel ranks only. For a plan with ``ep > 1`` and ``tp > 1``."""
    c = plan.config
    return (
        f"{framework} keeps whole experts on each rank, as the plan does under tp, with {flag} 1; its expert-parallel "
        f"groups then take the tp ranks in: each tp rank routes 1/{c.tp} of the tokens instead of all of them, and "
        f"expert gradients are reduced over dp x cp x tp / ep = {c.dp_cp * c.tp // c.ep} ranks instead of "
        f"{c.expert_replicas}, so expert compute and communication differ from the prediction ({flag} {c.tp} keeps "
        f"the plan's groups but splits every expert over tp)"
    )


def experts_split_over_tp_note(plan: Plan, framework: str) -> str:
    """The note for a mixture-of-experts plan with tensor but no expert parallelism:
    ``framework`` then splits every expert over the tp ranks (Megatron-LM's and
    torchtitan's expert tensor parallelism), where the plan replicates whole experts on
    each tp rank and runs them on the whole sequence. For ``ep == 1`` and ``tp > 1``."""
    return (
        f"{framework} splits every expert over the {plan.config.tp} tp ranks without expert parallelism, where the "
        f"plan keeps whole experts on each tp rank: expert memory is 1/{plan.config.tp} of the prediction and "
        f"tensor-parallel communication differs"
    )


def require_decoder(plan: Plan, trainer: str) -> None:
    """ExportError unless the plan's model is one ``trainer`` builds: a decoder-only causal
    language model (Megatron-LM's and Megatron-DeepSpeed's ``pretrain_gpt.py``, torchtitan
    build their own from flags or a flavor). A model that takes no token sequence (an image
    model, an MLP) is not one, nor a transformers class its causal-LM registry does not
    list (a bidirectional encoder such as BERT, an encoder-decoder): the trainer would
    launch another network than the one planned. Any other model passes, its sizes noted."""
    m = plan.model
    if m.seq_len <= 1:
        kind = "takes no token sequence"
    elif transformers_class(m.name) and not causal_lm_class(m.name):
        kind = "is not a decoder-only causal language model (transformers' causal-LM classes do not list it)"
    else:
        return
    raise ExportError(f"{trainer} trains the decoder-only causal language models it builds, and {m.name} {kind}.")


def require_seq_multiple(plan: Plan, framework: str, factors: dict[str, int]) -> None:
    """ExportError unless the plan's sequence length is a multiple of the product of
    ``factors`` (name -> value, e.g. ``{"2 x cp": 4}``), which ``framework`` asserts when
    it starts: context parallelism splits each sequence into ``2 * cp`` chunks, two per
    rank (a head and a tail, to balance the causal mask's work)."""
    divisor = math.prod(factors.values())
    seq_len = plan.model.seq_len
    if seq_len % divisor:
        product = " x ".join(factors)
        raise ExportError(
            f"{framework} needs a sequence length that is a multiple of {product} = {divisor}, but the plan has "
            f"seq_len={seq_len}; make the plan with --seq-len a multiple of {divisor}."
        )


def commented(lines: list[str], notes: list[str], marker: str = "#") -> str:
    """``lines`` then each note, as comment lines with ``marker``."""
    out = [f"{marker} {line}" for line in lines]
    out += [f"{marker} NOTE: {note}" for note in notes]
    return "\n".join(out) + "\n"


def shell_line(tokens: list[str]) -> str:
    """``tokens`` as one shell command line: words quoted where needed, and words that
    start with ``$`` (the node's rank, the master's address) left to the shell to expand."""
    return " ".join(f'"{t}"' if t.startswith("$") else shlex.quote(t) for t in tokens)


def torchrun(plan: Plan) -> list[str]:
    """The ``torchrun`` words that start the plan's world: one standalone node, or every
    node with its rank and the first node's address from the environment."""
    cluster = plan.cluster
    if cluster.nodes == 1:
        return ["torchrun", "--standalone", "--nproc-per-node", str(cluster.devices_per_node)]
    return [
        "torchrun",
        "--nnodes",
        str(cluster.nodes),
        "--nproc-per-node",
        str(cluster.devices_per_node),
        "--node-rank",
        "$NODE_RANK",
        "--master-addr",
        "$MASTER_ADDR",
        "--master-port",
        "${MASTER_PORT:-29500}",
    ]


def config_float(config: Any, name: str) -> float | None:
    """A config's number ``name``, as a float; None where it is absent or not a number."""
    value = getattr(config, name, None)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def config_int(config: Any, name: str) -> int | None:
    """A config's integer ``name``; None where it is absent or not an integer."""
    value = getattr(config, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None
