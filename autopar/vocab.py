"""The vocabulary shared by the planner, the plan file and the runtime.

One definition of every mode a plan can name, so that the planner never emits a
word the runtime does not understand. Values are the strings written in plan files.

Glossary (used throughout autopar):

- *axis*: a named dimension of the device mesh (``pp``, ``dp``, ``tp``); *dim*: a
  tensor dimension.
- *unit*: a top-level sequential piece of a model that a pipeline stage holds whole
  (the embeddings, one transformer block, the final norm, the head).
- *leaf*: a module with parameters and no children that have parameters (a Linear,
  an Embedding, a norm); tensor-parallel styles are chosen per leaf.
"""

from __future__ import annotations

from enum import StrEnum


class MeshAxis(StrEnum):
    """Axes of the device mesh, outermost first: ranks are laid out row-major over
    (pp, dp, cp, tp), so a tensor-parallel group is consecutive ranks and stays inside a
    node whenever it can, and a context-parallel ring is the next-innermost (Megatron-LM's
    order, tp-cp-dp-pp). Gradients are reduced over ``dp`` and ``cp`` flattened into one
    axis, ``dp_cp``.

    Under HSDP (``ParallelConfig.dp_shard``) the ``dp`` axis splits row-major into
    (``dp_replicate``, ``dp_shard``): a shard group is ``dp_shard`` consecutive
    data-parallel ranks (stride ``tp``), the next-innermost after tp, so it stays inside
    a node when ``tp * dp_shard`` fits in one, and the replicate groups cross nodes.

    Expert parallelism (``ParallelConfig.ep``) borrows from ``dp_cp``: it splits
    row-major into (``ep_replicate``, ``ep``), so an expert-parallel group is ``ep``
    consecutive data- and context-parallel ranks (stride ``tp``), and the ranks holding
    the same experts are ``ep_replicate`` (stride ``tp * ep``), as torchtitan and
    Megatron-LM fold experts into data parallelism."""

    PP = "pp"
    DP = "dp"
    TP = "tp"
    CP = "cp"
    DP_CP = "dp_cp"
    DP_REPLICATE = "dp_replicate"
    DP_SHARD = "dp_shard"
    EP = "ep"
    EP_REPLICATE = "ep_replicate"


class Schedule(StrEnum):
    """Pipeline schedules of ``torch.distributed.pipelining`` that plans may name.

    ``interleaved-zb`` and ``zbv`` are the zero-bubble schedules of Qi et al. 2023, "Zero
    Bubble Pipeline Parallelism": they split each backward into the input gradient
    (``I``, on the critical path) and the weight gradient (``W``, deferred into what
    would be bubbles). ``interleaved-zb`` runs interleaved 1F1B's order with deferred
    weight gradients (the paper's ZB-H1 over virtual stages); ``zbv`` holds exactly two
    stages per rank in a V: rank ``r`` runs stages ``r`` and ``2p - 1 - r`` (ZB-V).
    ``dualpipev`` is torch's ``ScheduleDualPipeV`` (DeepSeek-AI 2024, "DeepSeek-V3
    Technical Report", DualPipe folded into the same V): its steady state pairs one
    micro-batch's forward with another's full backward (which torch 2.13 runs one after
    the other), and only its warm-up and drain split the backward.
    """

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved-1f1b"
    INTERLEAVED_ZB = "interleaved-zb"
    ZBV = "zbv"
    DUALPIPEV = "dualpipev"

    @property
    def multi_stage(self) -> bool:
        """Whether the schedule runs several stages per pipeline rank (virtual stages)."""
        return self in (Schedule.INTERLEAVED_1F1B, Schedule.INTERLEAVED_ZB, Schedule.ZBV, Schedule.DUALPIPEV)

    @property
    def zero_bubble(self) -> bool:
        """Whether the schedule splits the backward into input and weight gradients."""
        return self in (Schedule.INTERLEAVED_ZB, Schedule.ZBV, Schedule.DUALPIPEV)

    @property
    def v_shape(self) -> bool:
        """Whether the schedule places exactly two stages per rank in a V (``zbv``, ``dualpipev``)."""
        return self is Schedule.ZBV or self is Schedule.DUALPIPEV

    def rank_of_stage(self, index: int, pp: int) -> int:
        """The pipeline rank that runs stage ``index``: ``index % pp`` (round robin), or
        the V of ``zbv`` and ``dualpipev``, where stage ``i < p`` runs on rank ``i`` and
        stage ``i >= p`` on rank ``2p - 1 - i``, so the first and last stages share rank 0."""
        if self.v_shape and index >= pp:
            return 2 * pp - 1 - index
        return index % pp

    def stages_of_rank(self, rank: int, pp: int, num_stages: int) -> tuple[int, ...]:
        """The stages :meth:`rank_of_stage` puts on ``rank``, in pipeline order (the search
        asks this for every rank of every candidate, so it is not a scan of the stages)."""
        if self.v_shape:
            return (rank, 2 * pp - 1 - rank)
        return tuple(range(rank, num_stages, pp))


SPLIT_BACKWARD_EAGER = (
    "torch 2.13 splits the backward into input and weight gradients for eager blocks only: its zero-bubble "
    "schedules refuse torch.compile'd stage modules, and a compiled block's backward fails when run again for the "
    "weight gradients"
)
"""Why a zero-bubble schedule (:attr:`Schedule.zero_bubble`) runs eager blocks: what the
search leaves out and the constraints and the runtime refuse."""

SPLIT_BACKWARD_RECOMPUTE = (
    "torch 2.13's split backward reruns a fully recomputed unit's forward in the weight-gradient step once per "
    "group of parameters (9 times for a Llama block), which autopar does not price, and per-operator "
    "checkpointing ('op') refuses that second backward"
)
"""Why a zero-bubble schedule's units recompute nothing or only the attention cores
(``none``, ``selective``): what the search offers it."""


class Recompute(StrEnum):
    """Activation recomputation of a unit.

    ``selective`` recomputes only the attention core (scores, softmax, dropout), as in
    Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
    Models"; ``op`` keeps the unit's input and the outputs of a few operators (every
    other bias-free matmul, the attention cores, sequence-parallel reduce-scatters) and
    recomputes the rest, torchtitan's per-operator selective checkpointing; ``full``
    keeps only the unit's input and recomputes its whole forward. Listed from the least
    recomputation to the most.
    """

    NONE = "none"
    SELECTIVE = "selective"
    OP = "op"
    FULL = "full"

    @property
    def checkpoints_unit(self) -> bool:
        """The unit's forward runs under a checkpoint (its input kept, what it does not
        save recomputed in backward); the loss, outside the checkpoint, keeps its own."""
        return self in (Recompute.OP, Recompute.FULL)


SPLIT_BACKWARD_MODES = (Recompute.NONE, Recompute.SELECTIVE)
"""What a unit under a split backward (a zero-bubble schedule on a pipeline) may
recompute: :data:`SPLIT_BACKWARD_RECOMPUTE` says why not the others."""


class TPStyle(StrEnum):
    """Tensor-parallel style of one leaf module.

    ``column``: weight split over output features (Megatron's column-parallel linear);
    ``row``: split over input features, output all-reduced or reduce-scattered;
    ``vocab``: an embedding split over its vocabulary rows;
    ``sequence``: a norm run on a sequence shard (sequence parallelism);
    ``heads``: a norm over each attention head's features run on the head shards a
    column-parallel projection writes (Qwen3's ``q_norm``), its weight replicated;
    ``replicate``: every tensor-parallel rank holds and runs the whole leaf.
    """

    REPLICATE = "replicate"
    COLUMN = "column"
    ROW = "row"
    VOCAB = "vocab"
    SEQUENCE = "sequence"
    HEADS = "heads"


class Layout(StrEnum):
    """How a tensor lies on the tensor-parallel group: replicated (``R``), sharded along
    its features (``F``), partial sums to be reduced (``P``), or sharded along the
    sequence (``Q``, sequence parallelism)."""

    R = "R"
    F = "F"
    P = "P"
    Q = "Q"


STYLE_IO: dict[TPStyle, tuple[Layout, Layout]] = {
    TPStyle.REPLICATE: (Layout.R, Layout.R),
    TPStyle.COLUMN: (Layout.R, Layout.F),
    TPStyle.ROW: (Layout.F, Layout.P),
    TPStyle.VOCAB: (Layout.R, Layout.P),
    TPStyle.SEQUENCE: (Layout.Q, Layout.Q),
    TPStyle.HEADS: (Layout.F, Layout.F),
}
"""The layout each style takes in and gives out: what the planner prices and the runtime
realises (a column-parallel linear reads a replicated input and writes feature shards; a
row-parallel one reads feature shards and writes partial sums)."""


class DType(StrEnum):
    """Training precision. ``bf16``/``fp16`` mean mixed precision: compute in the low
    precision, fp32 master weights, gradients and optimizer state."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"

    @property
    def itemsize(self) -> int:
        """Bytes of one element in this precision."""
        return 4 if self is DType.FP32 else 2


class Optimizer(StrEnum):
    """Optimizers whose state size the memory model knows.

    ``adam``: two fp32 moments per parameter (Kingma & Ba 2015); ``sgd``: SGD with one
    fp32 momentum buffer; ``adafactor``: factored second moment, one fp32 row and one
    column vector per matrix and no momentum (Shazeer & Stern 2018).
    """

    ADAM = "adam"
    SGD = "sgd"
    ADAFACTOR = "adafactor"


class Attention(StrEnum):
    """Attention implementation assumed when a model calls
    ``F.scaled_dot_product_attention``.

    ``flash``: a fused kernel that keeps only q, k, v, the output and a log-sum-exp for
    backward (Dao et al. 2022); ``materialized``: scores and softmax probabilities of
    size heads x seq x seq are stored, as in an unfused implementation.
    """

    FLASH = "flash"
    MATERIALIZED = "materialized"


class ActivationLayout(StrEnum):
    """How the training program lays out a token model's activations, which decides
    whether its sequence-parallel collectives copy (:mod:`autopar.cost.layout_copies`).

    ``batch-first``: ``(batch, sequence, features)``, sequence shards on dimension 1, as
    autopar's runtime, torchtitan and transformers lay them: a reduce-scatter copies its
    input, and an all-gather of more than one sequence per micro-batch its output.
    ``sequence-first``: ``(sequence, batch, features)``, Megatron-LM's layout, which
    gathers and scatters the leading dimension without copying: for predicting a plan
    exported to Megatron-LM; autopar's runtime still lays activations out batch-first.
    """

    BATCH_FIRST = "batch-first"
    SEQUENCE_FIRST = "sequence-first"

    @property
    def megatron_kernels(self) -> bool:
        """Whether a plan in this layout is priced for Megatron-LM's kernels as well:
        Transformer Engine's FP8 layers keep their inputs in FP8
        (:mod:`autopar.cost.fp8`), and fused kernels keep sequence-parallel shards
        under compilation (:mod:`autopar.search.kernel_options`)."""
        return self is ActivationLayout.SEQUENCE_FIRST


ZERO_STAGES: tuple[int, ...] = (0, 1, 2, 3)
"""ZeRO stages (Rajbhandari et al. 2020) as autopar's runtime realises them: 0 DDP;
1 optimizer state sharded (ZeroRedundancyOptimizer); 2 FSDP2 without resharding after
forward; 3 FSDP2 with parameters resharded after forward. Stages 2 and 3 also run as HSDP
(``ParallelConfig.dp_shard``): FSDP2 on a 2-D (replicate, shard) mesh."""
