"""A plan as Megatron-LM command-line arguments, in a launch script for ``pretrain_gpt.py``.

Flag names and their rules are Megatron-LM's (``megatron/training/arguments.py`` and the
validation in ``TransformerConfig``, Megatron-Core 0.16): how layers split over pipeline
stages, which ZeRO stage each data-parallel option realises, and how recomputation is
chosen per layer. Data, tokenizer, optimizer hyper-parameters and the training schedule
are not in a plan: the script passes its own arguments on, for the user to add them.
"""

from __future__ import annotations

from autopar.export.common import (
    CP_EXCHANGE,
    Blocks,
    Export,
    blocks_of,
    commented,
    expert_tp_note,
    experts_split_over_tp_note,
    header,
    kernel_options_note,
    mixed_recompute_note,
    outside_blocks_note,
    require_decoder,
    require_seq_multiple,
    sequence_parallel_notes,
    setting_notes,
    shell_line,
    torchrun,
    tp_note,
)
from autopar.export.megatron_model import model_args, router_args
from autopar.export.shape import ModelShape
from autopar.plan import Plan
from autopar.vocab import DType, Optimizer, Recompute, Schedule

SCRIPT = "pretrain_gpt.py"
"""Megatron-LM's GPT pre-training entry point (Llama-style models run through it too)."""
ONE_QUEUE = "CUDA_DEVICE_MAX_CONNECTIONS=1"
"""One CUDA work queue, so communication and computation kernels run in issue order:
what Megatron's tensor- and context-parallel layers require."""
DISPATCHER = ("--moe-token-dispatcher-type", "alltoall")
"""The token dispatcher expert parallelism and a fixed expert capacity run with."""
TP_COMM_OVERLAP_NOTE = (
    "the plan's asynchronous tensor parallelism is torch's micro-pipeline TP (inductor fuses the sequence-parallel "
    "all-gathers and reduce-scatters into the compiled blocks' matmuls); --tp-comm-overlap is Transformer Engine's "
    "userbuffers overlap, a different mechanism overlapping the same collectives (it needs Transformer Engine's "
    "layers), so how much of them hides, and the step time, may differ from the prediction"
)
"""What ``--tp-comm-overlap`` stands for when it carries a plan's ``async_tp``."""
FP8_NOTE = (
    "the plan's FP8 matmuls are written as Transformer Engine's hybrid format (--fp8-format hybrid: e4m3 forward, "
    "e5m2 backward, as the plan's) under Megatron-LM's default delayed scaling, whose scales come from a history of "
    "each tensor's largest values rather than its current one"
)
"""What ``--fp8-format hybrid`` stands for when it carries a plan's ``fp8``."""
FP8_BATCH_FIRST_NOTE = (
    "; Transformer Engine keeps the FP8 layers' inputs in FP8, where the plan, priced batch-first for torchao, keeps "
    "them in bf16: expect less activation memory than predicted (plan with --activations sequence-first to price it)"
)
"""Added to :data:`FP8_NOTE` for a plan priced for autopar's runtime."""


def export_megatron(plan: Plan, shape: ModelShape | None) -> Export:
    """The Megatron-LM launch script of ``plan``; ``shape`` fills the model's sizes.
    Raises ExportError for a context-parallel plan whose sequence length Megatron cannot
    split, and for a model that is not a decoder-only causal language model."""
    require_decoder(plan, f"Megatron-LM's {SCRIPT}")
    c = plan.config
    blocks = blocks_of(plan)
    notes: list[str] = []
    info: list[str] = []
    args: list[str] = [
        "--tensor-model-parallel-size",
        str(c.tp),
        "--pipeline-model-parallel-size",
        str(c.pp),
    ]
    kernels = kernel_options_note(plan, "Megatron-LM", writes_async_tp=True, writes_fp8=True)
    if kernels:
        notes.append(kernels)
    args += _context_parallel_args(plan, notes, info)
    args += _expert_args(plan, shape, notes, info)
    if c.sequence_parallel:
        args.append("--sequence-parallel")
    notes += sequence_parallel_notes(plan, "Megatron-LM", megatron=True)
    if c.async_tp:
        args.append("--tp-comm-overlap")
        notes.append(TP_COMM_OVERLAP_NOTE)
    args += _pipeline_args(plan, blocks, notes, info)
    args += ["--micro-batch-size", str(c.micro_batch_size), "--global-batch-size", str(c.global_batch_size)]
    args += _data_parallel_args(plan, notes)
    args += recompute_args(blocks, notes, chunked=c.virtual_stages > 1)
    args += {DType.BF16: ["--bf16"], DType.FP16: ["--fp16"], DType.FP32: []}[c.dtype]
    if c.fp8:
        args += ["--fp8-format", "hybrid"]
        batch_first = not plan.settings.megatron_kernels
        notes.append(FP8_NOTE + (FP8_BATCH_FIRST_NOTE if batch_first else ""))
    if c.reduce_dtype is DType.BF16:  # --bf16 alone accumulates and reduces gradients in fp32
        args.append("--grad-reduce-in-bf16")
    args += model_args(plan, blocks, shape, info, notes)
    if plan.settings.optimizer is Optimizer.SGD:
        args += ["--optimizer", "sgd"]
    notes += setting_notes(plan, "Megatron-LM", builds=(Optimizer.ADAM, Optimizer.SGD))
    note = tp_note(plan, "Megatron-LM")
    if note:
        notes.append(note)
    # Megatron requires one CUDA work queue under tensor or context parallelism (so
    # communication and computation kernels run in issue order), and more than one under
    # Megatron-FSDP
    one_queue = (c.tp > 1 or c.cp > 1) and "--use-megatron-fsdp" not in args
    env = [ONE_QUEUE] if one_queue else []
    launch = shell_line([*env, *torchrun(plan), SCRIPT, *args])
    body = "PLAN_ARGS=(\n" + "".join(f"    {line}\n" for line in _paired(args)) + ")\n"
    run = shell_line([*torchrun(plan), SCRIPT]) + ' "${PLAN_ARGS[@]}" "$@"\n'
    info.append(
        "data, tokenizer, optimizer and schedule are not in the plan: pass them to this script, e.g. "
        "--data-path ... --tokenizer-type ... --train-iters ... --lr ..."
    )
    text = (
        "#!/usr/bin/env bash\n"
        + commented(header(plan, "Megatron-LM") + info, notes)
        + "set -euo pipefail\n"
        + "".join(f"export {e}\n" for e in env)
        + body
        + run
    )
    return Export(target="megatron", text=text, filename="megatron_launch.sh", launch=launch, notes=tuple(notes))


def _context_parallel_args(plan: Plan, notes: list[str], info: list[str]) -> list[str]:
    """Context parallelism: Megatron's ``--context-parallel-size`` (its data-parallel
    size is then world / (tp * pp * cp), the plan's dp; its gradients and distributed
    optimizer span dp x cp, as the plan's do) and ``--cp-comm-type all_gather``, the
    exchange the plan assumes, instead of Megatron's default ring of point-to-point sends.
    Megatron asserts a sequence length that splits into 2 x cp chunks."""
    c = plan.config
    if c.cp == 1:
        return []
    require_seq_multiple(plan, "Megatron-LM's context parallelism", {"2 x cp": 2 * c.cp})
    notes.append(
        f"{CP_EXCHANGE}; written as --cp-comm-type all_gather, the same collective (Megatron's default, p2p, "
        f"passes them around a ring of point-to-point sends instead, overlapped with attention)"
    )
    info.append(
        "context parallelism runs in Transformer Engine's attention (Megatron's default --transformer-impl); "
        "all_gather is its spelling of the communication type"
    )
    return ["--context-parallel-size", str(c.cp), "--cp-comm-type", "all_gather"]


def _expert_args(plan: Plan, shape: ModelShape | None, notes: list[str], info: list[str]) -> list[str]:
    """Mixture of experts: the model's experts (``--num-experts``, ``--moe-router-topk``,
    ``--moe-ffn-hidden-size``; autopar's capacity-bounded buffers as Megatron's capacity
    factor, padded to capacity and dropping in token order, as the plan counts them) and
    expert parallelism: ``--expert-model-parallel-size`` with the all-to-all dispatcher
    the plan assumes (Megatron's default gathers every token instead), and expert tensor
    parallelism 1 (Megatron's default is tp), as the plan keeps whole experts under tp.
    Megatron asserts experts with ep > 1 and a count divisible by ep (checked by
    :func:`~autopar.export.experts_shape.require_experts` when the model is given)."""
    c = plan.config
    experts = shape.experts if shape is not None else None
    args: list[str] = []
    if experts is not None:
        args += ["--num-experts", str(experts.count), "--moe-router-topk", str(experts.top_k)]
        if experts.ffn_hidden_size is not None:
            args += ["--moe-ffn-hidden-size", str(experts.ffn_hidden_size)]
        args += router_args(experts, notes)
        if experts.top_k == 1 and experts.score_function == "softmax":
            # Megatron raises on top-1 routing without it (a softmax over one logit has no gradient)
            args.append("--moe-router-pre-softmax")
            notes.append(
                "Megatron-LM routes top-1 with --moe-router-pre-softmax, which it requires: the expert's output is "
                "scaled by its softmax probability, where the plan's model renormalises it to 1"
            )
        if experts.capacity_factor is not None:
            args += [
                "--moe-expert-capacity-factor",
                f"{experts.capacity_factor:g}",
                "--moe-pad-expert-input-to-capacity",
                "--moe-token-drop-policy",
                "position",
                *DISPATCHER,  # Megatron-Core releases up to 2025 refuse a capacity with another dispatcher
            ]
            notes.append(
                "Megatron-LM counts an expert's capacity over a rank's micro-batch (capacity factor x tokens x top-k "
                "/ experts), the plan's model per sample: the same slots in all, but a token is dropped when its "
                "expert's micro-batch buffer is full rather than its sample's"
            )
    if c.ep == 1:
        if experts is not None and c.tp > 1:
            notes.append(experts_split_over_tp_note(plan, "Megatron-LM"))
        return args
    args += ["--expert-model-parallel-size", str(c.ep), *([] if DISPATCHER[0] in args else DISPATCHER)]
    if c.tp > 1:
        args += ["--expert-tensor-parallel-size", "1"]
        notes.append(expert_tp_note(plan, "Megatron-LM", "--expert-tensor-parallel-size"))
    if experts is None:
        info.append(
            "expert parallelism needs the model's experts: add --num-experts, --moe-router-topk and "
            "--moe-ffn-hidden-size (autopar export --model NAME or --model-config PATH fills them)"
        )
    return args


def _pipeline_args(plan: Plan, blocks: Blocks, notes: list[str], info: list[str]) -> list[str]:
    """How layers split over (virtual) pipeline stages. Megatron splits evenly by
    default; an uneven split is its first/last stage sizes where the middle stages are
    even, else the explicit layout (Megatron-Core >= 0.13), which places every layer."""
    c = plan.config
    if c.pp == 1:
        return []
    if c.schedule is Schedule.GPIPE:
        notes.append(
            "Megatron-LM has no GPipe schedule: it runs 1F1B, which has the same bubble and keeps at most pp "
            "micro-batches of activations in flight instead of all of them (less memory than predicted)"
        )
    if c.schedule.zero_bubble:
        notes.append(
            f"Megatron-LM has no {c.schedule.value} (zero-bubble) schedule: written as interleaved 1F1B over the "
            f"same stages, stage i on rank i % pp, with full backwards (a longer bubble than predicted"
            f"{'; and other stage placement than the V' if c.schedule.v_shape else ''})"
        )
    if not blocks.count:
        notes.append("the plan's model has no repeated blocks; Megatron-LM splits its own layers evenly")
        return []
    counts = blocks.per_stage
    if blocks.even:
        if c.virtual_stages > 1:
            return ["--num-layers-per-virtual-pipeline-stage", str(counts[0])]
        return []
    if c.virtual_stages == 1:
        first_last = _first_last(counts)
        if first_last is not None:
            return first_last
    info.append(
        f"the plan's uneven split ({'/'.join(map(str, counts))} layers per stage) is written as "
        f"--pipeline-model-parallel-layout (Megatron-Core >= 0.13; E = embedding, t = layer, L = loss)"
    )
    return ["--pipeline-model-parallel-layout", _layout(counts)]


def _first_last(counts: tuple[int, ...]) -> list[str] | None:
    """``--decoder-first/last-pipeline-num-layers`` for ``counts`` when they describe it
    exactly: the middle stages hold the same (non-zero) number of layers and the ends
    at least one; None otherwise."""
    first, middle, last = counts[0], counts[1:-1], counts[-1]
    if first < 1 or last < 1 or len(set(middle)) > 1 or (middle and middle[0] < 1):
        return None
    args = []
    if not middle or first != middle[0]:
        args += ["--decoder-first-pipeline-num-layers", str(first)]
    if not middle or last != middle[0]:
        args += ["--decoder-last-pipeline-num-layers", str(last)]
    return args


def _layout(counts: tuple[int, ...]) -> str:
    """Megatron's pipeline layout string: stages joined by ``|`` in stage order (stage
    ``i`` on pipeline rank ``i % pp``, as in the plan), ``E`` the embedding on the first,
    ``L`` the loss on the last, ``t*n`` n transformer layers."""
    stages = []
    for i, n in enumerate(counts):
        layers = f"t*{n}" if n > 1 else "t" * n
        stages.append(("E" if i == 0 else "") + layers + ("L" if i == len(counts) - 1 else ""))
    return "|".join(stages)


def _data_parallel_args(plan: Plan, notes: list[str]) -> list[str]:
    """ZeRO stage -> Megatron's data-parallel options, sharded over the data- and
    context-parallel ranks together, as the plan does.

    Megatron's distributed optimizer shards the fp32 master weights and the optimizer
    state, and keeps whole bf16 weights and a whole fp32 gradient buffer: ``6 + 12/d``
    bytes per parameter (its ``docs/user-guide/features/dist_optimizer.md``). That is the
    plan's ZeRO-2 under a pipeline, whose stages accumulate whole gradients until the last
    micro-batch (:mod:`autopar.cost.memory`), and less than its ZeRO-1, so both are
    written as it. Without a pipeline the plan's ZeRO-2 shards its gradients too:
    Megatron-FSDP's ``optim_grads`` does, and ``optim_grads_params`` is ZeRO-3; it does
    not pipeline, so ZeRO-3 under a pipeline falls back to the distributed optimizer, with
    more memory than predicted (a plan priced for Megatron-LM's kernels never has it). HSDP
    is ``--num-distributed-optimizer-instances`` (the replicate groups): each instance
    shards over a block of consecutive data-parallel ranks, replicated across instances
    (Megatron-FSDP's hybrid sharding, its outer groups unsharded by default)."""
    c = plan.config
    if c.dp_cp == 1 or c.zero_stage == 0:
        return []
    hsdp = ["--num-distributed-optimizer-instances", str(c.replicate_size)] if c.dp_shard is not None else []
    if c.zero_stage >= 2 and c.pp == 1:
        strategy = "optim_grads" if c.zero_stage == 2 else "optim_grads_params"
        return [
            "--use-megatron-fsdp",
            "--data-parallel-sharding-strategy",
            strategy,
            "--ckpt-format",
            "fsdp_dtensor",
            *hsdp,
        ]
    if c.zero_stage == 3:
        notes.append(
            "ZeRO-3 written as --use-distributed-optimizer (ZeRO-1 memory): Megatron-FSDP (ZeRO-3) does not "
            "pipeline, so each device holds more than the plan predicts"
        )
    return ["--use-distributed-optimizer", *hsdp]


FULL_UNIFORM = ("--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1")
"""Every layer recomputed in full, each keeping its input only."""


def recompute_args(blocks: Blocks, notes: list[str], *, pipe_engine: bool = False, chunked: bool = False) -> list[str]:
    """Recompute flags. Megatron's ``selective`` recomputes the attention core, as
    autopar's does; ``full`` with the ``uniform`` method over 1 layer keeps each layer's
    input only; the ``block`` method recomputes the first N layers of every stage, which
    is the closest to a per-layer choice. On DeepSpeed's pipeline engine
    (``pipe_engine``: Megatron-DeepSpeed with pp > 1) a method other than ``uniform``
    recomputes nothing, so there a per-layer choice is written as every layer in full.
    ``chunked``: an interleaved pipeline, whose N Megatron-LM applies to each model chunk."""
    if not blocks.count:
        return []
    note = outside_blocks_note(blocks)
    if note:
        notes.append(note)
    if blocks.mode_counts()[Recompute.OP]:
        notes.append(
            "Megatron-LM has no per-operator selective recomputation (torchtitan's): the plan's op blocks are "
            "written as full recomputation (less memory, more compute than predicted)"
        )
        blocks = blocks.replacing(Recompute.OP, Recompute.FULL)
    uniform = blocks.uniform()
    if uniform is Recompute.NONE:
        return []
    if uniform is Recompute.SELECTIVE:
        return ["--recompute-granularity", "selective"]
    if uniform is Recompute.FULL:
        return list(FULL_UNIFORM)
    counts = blocks.mode_counts()
    if not counts[Recompute.FULL]:
        notes.append(mixed_recompute_note(blocks, "Megatron-LM applies one granularity: selective on every layer"))
        return ["--recompute-granularity", "selective"]
    if pipe_engine:
        notes.append(
            mixed_recompute_note(
                blocks,
                "DeepSpeed's pipeline engine recomputes whole layers only by the uniform method (any other recomputes "
                "none): wrote every layer in full, so no stage keeps more than the plan (more compute than predicted)",
            )
        )
        return list(FULL_UNIFORM)
    per_stage = [sum(m is Recompute.FULL for m in stage) for stage in blocks.stage_modes]
    n = max(per_stage)
    exact = not counts[Recompute.SELECTIVE] and all(
        all(m is Recompute.FULL for m in stage[:n]) and all(m is Recompute.NONE for m in stage[n:])
        for stage in blocks.stage_modes
    )
    if not exact:
        where = "model chunk (virtual stage)" if chunked else "pipeline stage"
        total = sum(min(n, len(stage)) for stage in blocks.stage_modes)
        notes.append(
            mixed_recompute_note(
                blocks,
                f"Megatron-LM's block method recomputes the first N layers of every {where} in full: wrote N = {n}, "
                f"the most any {where} recomputes, so none keeps more than the plan; that recomputes {total} of the "
                f"{blocks.count} layers in full where the plan recomputes {counts[Recompute.FULL]} (more compute than "
                f"predicted)",
            )
        )
    return ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", str(n)]


def _paired(args: list[str]) -> list[str]:
    """Script lines: each flag with its value, one flag a line."""
    lines: list[str] = []
    for word in args:
        if word.startswith("--") or not lines:
            lines.append(word)
        else:
            lines[-1] += f" {shell_line([word])}"
    return lines
