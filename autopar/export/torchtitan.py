"""A plan as a torchtitan job config (TOML) and the ``torchrun`` line that trains with it.

Field names are those of torchtitan's ``JobConfig`` (``torchtitan/config/job_config.py``),
read by torchtitan 0.2.x from ``--job.config_file``. torchtitan 0.3 replaced TOML files
with Python config functions (``--module``/``--config``); the same fields live there on
``Trainer.Config`` (``parallelism``, ``training``), a few renamed, so this file is a
reference for them rather than an input.

torchtitan's data parallelism is DDP (replicate) or FSDP2 (shard); its pipelining takes
the modules of each stage by name, so the plan's split, even or not, interleaved or not,
is written exactly. Its context parallelism is torch's ``context_parallel`` with the
all-gather rotation the plan assumes; its data-parallel degrees exclude ``cp``
(replicate x shard x cp x tp x pp is the world), and FSDP2 shards over shard x cp. Its
expert parallelism splits a mixture-of-experts model's experts over ``ep`` ranks of the
shard x cp (x tp) ranks, as ``ParallelDims`` lays them out, with whole experts per rank
(expert tensor parallelism 1), as the plan keeps them.
"""

from __future__ import annotations

import json

from autopar.export.common import (
    Blocks,
    Export,
    ExportError,
    blocks_of,
    commented,
    expert_tp_note,
    experts_split_over_tp_note,
    fp8_inputs_note,
    header,
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
from autopar.export.shape import ModelShape
from autopar.parallel_config import ParallelConfig
from autopar.plan import Plan
from autopar.vocab import SPLIT_BACKWARD_EAGER, DType, Optimizer, Recompute, Schedule

CONFIG_NAME = "torchtitan.toml"
SCHEDULES = {
    Schedule.GPIPE: "GPipe",
    Schedule.ONE_F_ONE_B: "1F1B",
    Schedule.INTERLEAVED_1F1B: "Interleaved1F1B",
    Schedule.INTERLEAVED_ZB: "InterleavedZeroBubble",
    Schedule.ZBV: "ZBVZeroBubble",
    Schedule.DUALPIPEV: "DualPipeV",
}
"""autopar's schedules by their names in ``torch.distributed.pipelining`` (what torchtitan
passes on)."""


def export_torchtitan(plan: Plan, shape: ModelShape | None) -> Export:
    """The torchtitan job config of ``plan``. torchtitan builds the model from its own
    ``[model]`` name and flavor: ``shape`` only says whether the model has experts, and
    whether they drop tokens (torchtitan's do not), for the notes. Raises ExportError for a sequence length
    torchtitan's models cannot split, for gradients reduced in bf16, which torchtitan does not offer, for a
    zero-bubble schedule with compiled blocks, which torch does not run, and for a model that is not a
    decoder-only causal language model."""
    require_decoder(plan, "torchtitan")
    c = plan.config
    if c.reduce_dtype is not DType.FP32:
        raise ExportError(
            f"torchtitan reduces gradients in float32 only (training.mixed_precision_reduce), and the plan reduces "
            f"them in {c.reduce_dtype.value}, holding half the gradient bytes it would: make the plan with --set "
            f"reduce_dtype=fp32 for torchtitan."
        )
    if c.schedule.zero_bubble and c.pp > 1 and c.compile:  # a hand-edited plan: the planner never makes one
        raise ExportError(
            f"the plan runs schedule {c.schedule.value!r} with compiled blocks, which torchtitan's torch refuses: "
            f"{SPLIT_BACKWARD_EAGER}; make the plan with --set compile=false, or another schedule."
        )
    # its models assert it: tensor parallelism shards the sequence over tp, context
    # parallelism cuts it into 2 x cp chunks
    require_seq_multiple(plan, "torchtitan", {"tp": c.tp, "2 x cp": 2 * c.cp})
    blocks = blocks_of(plan)
    notes: list[str] = setting_notes(plan, "torchtitan", builds=(Optimizer.ADAM,))
    renamed: list[str] = []
    parallelism = {**_data_parallel(plan, notes), "tensor_parallel_degree": c.tp}
    # torch's micro-pipeline TP in the compiled blocks, as autopar's runtime enables it
    parallelism["enable_async_tensor_parallel"] = c.async_tp
    parallelism["pipeline_parallel_degree"] = c.pp
    parallelism["pipeline_parallel_schedule"] = SCHEDULES[c.schedule]
    parallelism["pipeline_parallel_microbatch_size"] = c.micro_batch_size
    if c.pp > 1:
        parallelism["module_fqns_per_model_part"] = _torchtitan_stages(plan.stages, renamed)
    parallelism["context_parallel_degree"] = c.cp
    if c.cp > 1:
        parallelism["context_parallel_rotate_method"] = "allgather"
    if c.ep > 1:
        # ParallelDims takes 1 or tp; its expert mesh (efsdp x ep x etp) then spans shard x cp x tp
        parallelism["expert_parallel_degree"] = c.ep
        parallelism["expert_tensor_parallel_degree"] = 1
        if c.tp > 1:
            notes.append(expert_tp_note(plan, "torchtitan", "expert_tensor_parallel_degree"))
    if c.tp > 1 and not c.sequence_parallel:
        notes.append(
            "torchtitan always runs norms on sequence shards under tensor parallelism (sequence parallelism), "
            "which the plan does not: activation memory is lower and communication differs from the prediction"
        )
    notes += sequence_parallel_notes(plan, "torchtitan", megatron=False)
    inputs = fp8_inputs_note(plan, "torchtitan")
    if inputs:
        notes.append(inputs)
    note = tp_note(plan, "torchtitan")
    if note:
        notes.append(note)
    experts = shape.experts if shape is not None else None
    if experts is not None and c.ep == 1 and c.tp > 1:
        notes.append(experts_split_over_tp_note(plan, "torchtitan"))
    if experts is not None and experts.capacity_factor is not None:
        notes.append(
            f"torchtitan's mixture of experts is dropless: every routed token runs, where the plan's model drops "
            f"tokens beyond each expert's capacity (capacity factor {experts.capacity_factor:g}) and computes its "
            f"full buffers: expert compute and memory follow the routing instead of the plan's fixed buffers"
        )
    if c.dtype is DType.FP16:
        notes.append("torchtitan has no fp16 mixed precision: bfloat16 written instead (same memory)")
    training = {
        # with pipelining, a rank's whole batch per step is split into micro-batches;
        # without, each step of gradient accumulation loads one micro-batch
        "local_batch_size": c.micro_batch_size * (c.num_microbatches if c.pp > 1 else 1),
        "global_batch_size": c.global_batch_size,
        "seq_len": plan.model.seq_len,
        "mixed_precision_param": "float32" if c.dtype is DType.FP32 else "bfloat16",
    }
    sections = {
        "parallelism": parallelism,
        "training": training,
        "activation_checkpoint": _activation_checkpoint(blocks, plan.config, notes),
    }
    if c.compile:  # the blocks, as autopar's runtime compiles them; the loss stays eager
        sections["compile"] = {"enable": True, "components": ["model"]}
    if c.fp8:  # torchao's tensorwise recipe, the head left in bf16 as the plan prices it
        sections["quantize.linear.float8"] = {"recipe_name": "tensorwise", "filter_fqns": ["output"]}
    launch = shell_line([*torchrun(plan), "-m", "torchtitan.train", "--job.config_file", CONFIG_NAME])
    info = [
        "for torchtitan 0.2.x (--job.config_file); torchtitan >= 0.3 takes the same fields on Trainer.Config",
        "add [model] name and flavor (and [job], [optimizer], [lr_scheduler]) for the model to train",
    ]
    if c.ep > 1:
        info.append("expert_parallel_degree acts on MoE models only: choose a [model] flavor with experts")
    if c.fp8:
        info.append('FP8 matmuls: add converters = ["quantize.linear.float8"] to [model]')
    if c.pp > 1:
        placement = "in a V (rank r runs stages r and 2pp-1-r)" if c.schedule.v_shape else "on rank i % pp"
        info.append(f"module_fqns_per_model_part lists the plan's stages by module name; stage i runs {placement}")
    info += renamed
    text = commented(header(plan, "torchtitan") + info, notes) + "".join(_toml(n, s) for n, s in sections.items())
    return Export(target="torchtitan", text=text, filename=CONFIG_NAME, launch=launch, notes=tuple(notes))


TRANSFORMERS_NAMES = {"model.embed_tokens": "tok_embeddings", "model.norm": "norm", "lm_head": "output"}
"""transformers decoders' module names that torchtitan's decoders (Llama, Qwen3) call
otherwise; ``model.layers.N`` is ``layers.N``, and the rotary table is a buffer there."""


def _torchtitan_stages(stages: tuple[tuple[str, ...], ...], info: list[str]) -> list[list[str]]:
    """The plan's stages by module name, in torchtitan's names where the plan is of a
    transformers decoder laid out as its Llama (``model.layers.N`` between an embedding
    and a head), else as the plan names them."""
    names = [m for stage in stages for m in stage]
    known = set(TRANSFORMERS_NAMES) | {"model.rotary_emb"}
    if not all(m in known or (m.startswith("model.layers.") and m[13:].isdigit()) for m in names):
        return [list(stage) for stage in stages]
    info.append(
        "module names are torchtitan's decoders' (tok_embeddings, layers.N, norm, output), mapped from the "
        "transformers model the plan was made for"
    )
    return [
        [TRANSFORMERS_NAMES.get(m, m.removeprefix("model.")) for m in stage if m != "model.rotary_emb"]
        for stage in stages
    ]


def _data_parallel(plan: Plan, notes: list[str]) -> dict:
    """ZeRO stage -> torchtitan's replicate/shard degrees. ZeRO-0 is DDP, which
    torchtitan runs only as the sole parallelism; ZeRO-2 is FSDP2 without resharding
    after forward and ZeRO-3 with it, as autopar's runtime realises them, HSDP its
    replicate and shard degrees (torchtitan's HSDP; its mesh puts the shard dimension
    inside the replicate one, as autopar's does); ZeRO-1 has no equivalent and becomes
    ZeRO-2. Under context parallelism torchtitan always shards with FSDP2 over the
    data- and context-parallel ranks together (the plan's ``state_shards``), even when
    dp is 1; under expert parallelism too, as its experts' data-parallel mesh lies inside
    the shard degree."""
    c = plan.config
    if c.dp_cp == 1:
        return {"data_parallel_replicate_degree": 1, "data_parallel_shard_degree": 1}
    if c.zero_stage == 0 and c.tp == 1 and c.pp == 1 and c.cp == 1:
        if c.ep == 1:
            return {"data_parallel_replicate_degree": c.dp, "data_parallel_shard_degree": 1}
        notes.append(
            "torchtitan shards expert-parallel models with FSDP (the experts' data-parallel mesh lies inside its "
            "shard degree): ZeRO-0 written as FSDP without resharding after forward (ZeRO-2: less memory, "
            "gradients reduce-scattered)"
        )
    elif c.zero_stage == 0:
        notes.append(
            "torchtitan runs DDP only without tensor, pipeline or context parallelism: ZeRO-0 written as FSDP "
            "without resharding after forward (ZeRO-2: less memory, gradients reduce-scattered)"
        )
    if c.zero_stage == 1:
        notes.append(
            "torchtitan has no optimizer-only sharding (ZeRO-1): written as FSDP without resharding after "
            "forward (ZeRO-2: gradients sharded too, less memory than predicted)"
        )
    return {
        "data_parallel_replicate_degree": c.replicate_size,
        "data_parallel_shard_degree": c.shard_size,
        "fsdp_reshard_after_forward": "always" if c.zero_stage == 3 else "never",
    }


def _activation_checkpoint(blocks: Blocks, config: ParallelConfig, notes: list[str]) -> dict:
    """Recompute -> torchtitan's activation checkpointing: ``full`` per block, per-op
    ``selective`` for ``op`` (the same policy), every N-th block in full for a plan that
    recomputes some blocks in full and others not, and per-op ``selective`` on every
    block for one that recomputes none in full (its only mode between none and full)."""
    note = outside_blocks_note(blocks)
    if note:
        notes.append(note)
    counts = blocks.mode_counts()
    uniform = blocks.uniform()
    if not blocks.count or uniform is Recompute.NONE:
        return {"mode": "none"}
    if uniform is Recompute.FULL:
        return {"mode": "full"}
    selective_op = {"mode": "selective", "selective_ac_option": "op"}
    if uniform is Recompute.OP:
        return selective_op
    if not counts[Recompute.FULL]:
        if counts[Recompute.SELECTIVE]:
            notes.append(
                "torchtitan's selective checkpointing is per operator (autopar's op: it keeps matmul and attention "
                "outputs and recomputes the rest), not autopar's attention-core recomputation: memory and compute "
                "differ"
            )
        if uniform is None:
            notes.append(mixed_recompute_note(blocks, "torchtitan applies one mode: per-operator selective on all"))
        return selective_op
    # Blocks the plan recomputes in part (op, selective) are written in full with the rest:
    # as torchtitan's every-N-th block they would keep everything (more memory than
    # predicted). torchtitan counts the blocks each process builds from 1 and checkpoints
    # those the count divides: floor(held / N) of a pipeline rank's held blocks, at least
    # its recomputed k while N <= held // k; the largest such N on every rank is written.
    # A rank holds the stages the schedule places on it (a V for ZB-V and DualPipeV).
    ranks: dict[int, tuple[int, int]] = {}
    for stage, modes in enumerate(blocks.stage_modes):
        rank = config.rank_of_stage(stage)
        held, recomputed = ranks.get(rank, (0, 0))
        ranks[rank] = (held + len(modes), recomputed + sum(m is not Recompute.NONE for m in modes))
    every = min(held // k for held, k in ranks.values() if k)
    written = sum(held // every for held, _ in ranks.values())
    partial = counts[Recompute.OP] + counts[Recompute.SELECTIVE]
    notes.append(
        mixed_recompute_note(
            blocks,
            f"torchtitan checkpoints every N-th block in full: wrote N = {every} "
            f"({written} blocks, on each pipeline rank at least as many as the plan's "
            f"{blocks.count - counts[Recompute.NONE]} recompute there)"
            + (f"; its {partial} partly recomputed blocks are checkpointed in full: more compute" if partial else ""),
        )
    )
    return {"mode": "selective", "selective_ac_option": str(every)}


def _toml(name: str, values: dict) -> str:
    """One TOML table. Values are ints, bools, strings and lists of lists of strings,
    whose JSON spelling is TOML's too."""
    lines = [f"\n[{name}]"]
    for key, value in values.items():
        lines.append(f"{key} = {json.dumps(value)}")
    return "\n".join(lines) + "\n"
