"""A plan as a DeepSpeed config JSON and the ``deepspeed`` launch line.

DeepSpeed's config holds the batch arithmetic, the ZeRO stage and the precisions: of
the training, of the gradients' reduction and of their accumulation. Its
tensor and pipeline parallelism for training come from Megatron-DeepSpeed (a fork of
Megatron-LM that runs on the DeepSpeed engine), whose command-line flags set them; a
plan with ``tp`` or ``pp`` above 1 is launched through it. JSON has no comments, so the
notes go in a top-level ``"autopar"`` entry, which DeepSpeed ignores.

DeepSpeed has no ring-attention context parallelism: its Ulysses sequence parallelism
splits attention heads with all-to-alls, another algorithm with other limits (heads
divisible by its degree) and costs, so a plan with ``cp > 1`` is refused.

Its expert parallelism for training is AutoEP (DeepSpeed >= 0.19): the config's
``expert_parallel`` section makes ``deepspeed.initialize`` replace the mixture-of-experts
layers of a transformers model it has a preset for (Mixtral, Qwen-MoE, DeepSeek) with
layers whose experts are split over ``autoep_size`` consecutive ranks. It neither runs
under Megatron-DeepSpeed (which builds its own model) nor knows autopar's own
mixture-of-experts Llama, so those plans with ``ep > 1`` are refused.
"""

from __future__ import annotations

import json

from autopar.export.common import (
    Blocks,
    Export,
    ExportError,
    blocks_of,
    fp8_inputs_note,
    header,
    kernel_options_note,
    mixed_recompute_note,
    outside_blocks_note,
    require_decoder,
    sequence_parallel_notes,
    setting_notes,
    shell_line,
    tp_note,
)
from autopar.export.megatron import ONE_QUEUE, recompute_args
from autopar.export.megatron_deepspeed import model_args
from autopar.export.shape import ModelShape
from autopar.models.moe import MoELlama
from autopar.plan import Plan
from autopar.vocab import DType, Optimizer, Recompute, Schedule

CONFIG_NAME = "ds_config.json"
MEGATRON_DEEPSPEED_SCRIPT = "pretrain_gpt.py"
"""Megatron-DeepSpeed's GPT pre-training entry point."""
AUTOEP_PRESETS = {
    "mixtral": "mixtral",
    "qwen2_moe": "qwen3_moe",
    "qwen3_moe": "qwen3_moe",
    "deepseek_v2": "deepseek_v2",
    "deepseek_v3": "deepseek_v3",
}
"""AutoEP's preset (``expert_parallel.preset_model``) for each transformers
``model_type`` it replaces the MoE layers of (DeepSpeed 0.19.8's registry)."""
FP16_LOSS_SCALING = {"loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2}
"""Dynamic loss scaling (``loss_scale`` 0) with DeepSpeed's documented starting values."""
ACTIVATION_CHECKPOINTING = {
    "partition_activations": False,
    "contiguous_memory_optimization": False,
    "cpu_checkpointing": False,
    "number_checkpoints": None,
    "synchronize_checkpoint_boundary": False,
    "profile": False,
}
"""``deepspeed.checkpointing``'s settings: plain recomputation, activations kept on the
device and unpartitioned (what the plan's memory model assumes)."""


def export_deepspeed(plan: Plan, shape: ModelShape | None) -> Export:
    """The DeepSpeed config of ``plan`` and how to launch it. ``shape`` names the model's
    experts for AutoEP and its sizes on a Megatron-DeepSpeed launch line. Raises
    ExportError for a context-parallel plan, and for an expert-parallel one AutoEP cannot
    run."""
    c = plan.config
    if c.cp > 1:
        raise ExportError(
            f"deepspeed has no ring-attention context parallelism (the plan has cp={c.cp}; its Ulysses sequence "
            f"parallelism is another algorithm); make a plan with --set cp=1 for deepspeed."
        )
    if c.tp > 1 or c.pp > 1:
        require_decoder(plan, f"Megatron-DeepSpeed's {MEGATRON_DEEPSPEED_SCRIPT} (which tp > 1 or pp > 1 needs)")
    blocks = blocks_of(plan)
    notes: list[str] = []
    config: dict = {
        "train_batch_size": c.global_batch_size,
        "train_micro_batch_size_per_gpu": c.micro_batch_size,
        "gradient_accumulation_steps": c.num_microbatches,
        "zero_optimization": {"stage": _zero_stage(plan, notes)},
    }
    kernels = kernel_options_note(plan, "DeepSpeed")
    if kernels:
        notes.append(kernels)
    inputs = fp8_inputs_note(plan, "DeepSpeed")
    if inputs:
        notes.append(inputs)
    if c.ep > 1:
        config["expert_parallel"] = _expert_parallel(plan, shape, notes)
    if c.dtype is DType.BF16:
        config["bf16"] = {"enabled": True}
    elif c.dtype is DType.FP16:
        config["fp16"] = {"enabled": True, **FP16_LOSS_SCALING}
    if c.dtype is not DType.FP32:  # DeepSpeed reduces and accumulates in the training precision unless told
        config["communication_data_type"] = c.reduce_dtype.value
        accumulation = _grad_accumulation(plan, config["zero_optimization"]["stage"], notes)
        if accumulation:
            config["data_types"] = accumulation
    recomputes = any(m is not Recompute.NONE for m in blocks.modes) or bool(blocks.others_recomputed)
    if recomputes:
        config["activation_checkpointing"] = dict(ACTIVATION_CHECKPOINTING)
    if c.tp > 1 or c.pp > 1:
        words = _megatron_deepspeed(plan, blocks, shape, config["zero_optimization"]["stage"], notes)
        notes += setting_notes(plan, "Megatron-DeepSpeed", builds=(Optimizer.ADAM, Optimizer.SGD))
    else:
        words = ["train.py", "--deepspeed", "--deepspeed_config", CONFIG_NAME]
        if recomputes:
            _plain_recompute_notes(blocks, notes)
        notes += setting_notes(plan, "DeepSpeed", builds=None)
    # Megatron-DeepSpeed's tensor-parallel layers require one CUDA work queue, as Megatron-LM's
    env = [ONE_QUEUE] if c.tp > 1 else []
    if env and plan.cluster.nodes > 1:
        notes.append(
            f"the deepspeed launcher passes {ONE_QUEUE} to the other nodes only from a .deepspeed_env file: add that "
            f"line to it in the directory you launch from"
        )
    launch = shell_line([*env, *_deepspeed(plan), *words])
    config["autopar"] = {"about": header(plan, "DeepSpeed"), "launch": launch, "notes": notes}
    text = json.dumps(config, indent=2) + "\n"
    return Export(target="deepspeed", text=text, filename=CONFIG_NAME, launch=launch, notes=tuple(notes))


def _expert_parallel(plan: Plan, shape: ModelShape | None, notes: list[str]) -> dict:
    """AutoEP's section for ``ep > 1``: experts split over ``ep`` consecutive ranks (the
    plan's expert-parallel groups when ``tp == 1``), whole experts per rank, the preset
    of the model's transformers family when the model is given (AutoEP detects it from
    the model otherwise)."""
    c = plan.config
    experts = shape.experts if shape is not None else None
    if experts is None and plan.model.name == MoELlama.__name__:  # the plan names autopar's own model
        raise _no_autoep("autopar's mixture-of-experts Llama")
    preset = AUTOEP_PRESETS.get(experts.model_type or "") if experts is not None else None
    if experts is not None and preset is None:
        raise _no_autoep(
            f"model_type {experts.model_type!r}" if experts.model_type else "autopar's mixture-of-experts Llama"
        )
    if c.tp > 1 or c.pp > 1:
        raise ExportError(
            f"deepspeed's expert parallelism (AutoEP) replaces a transformers model's MoE layers and does not run "
            f"under Megatron-DeepSpeed, which the plan's tp={c.tp} pp={c.pp} needs; make a plan with --set tp=1 "
            f"--set pp=1 for deepspeed."
        )
    section: dict = {"enabled": True, "autoep_size": c.ep}
    if experts is None:
        notes.append(
            "AutoEP finds the MoE layers when deepspeed.initialize is given a transformers model it has a preset for "
            f"({', '.join(sorted(set(AUTOEP_PRESETS.values())))}); add expert_parallel.preset_model to name one"
        )
        return section
    return {**section, "preset_model": preset}


def _no_autoep(kind: str) -> ExportError:
    """The refusal of an expert-parallel plan for a model AutoEP has no preset for."""
    return ExportError(
        f"deepspeed's expert parallelism (AutoEP) replaces the MoE layers of transformers models of types "
        f"{', '.join(AUTOEP_PRESETS)} only, not {kind}; make a plan with --set ep=1 for deepspeed."
    )


def _zero_stage(plan: Plan, notes: list[str]) -> int:
    """The ZeRO stage: the plan's, except under pipelining, where DeepSpeed's pipeline
    engine allows stage 0 or 1 only; HSDP becomes sharding over all of dp."""
    c = plan.config
    if c.pp > 1 and c.zero_stage > 1:
        notes.append(
            f"DeepSpeed's pipeline engine runs ZeRO stage 0 or 1 only: ZeRO-{c.zero_stage} written as stage 1, "
            f"so gradients{' and parameters' if c.zero_stage == 3 else ''} stay whole on each device (more memory "
            f"than the plan predicts)"
        )
        return 1
    if c.dp_shard is not None:
        notes.append(
            f"DeepSpeed has no hybrid sharding (MiCS is removed from it): the plan's HSDP (ZeRO-{c.zero_stage} "
            f"sharded over groups of {c.dp_shard}, replicated across {c.replicate_size}) written as ZeRO-"
            f"{c.zero_stage} over all {c.dp} data-parallel ranks (less memory per device, more inter-node traffic "
            f"than the plan predicts)"
        )
    return c.zero_stage


def _grad_accumulation(plan: Plan, stage: int, notes: list[str]) -> dict:
    """``data_types``: gradients held and summed over micro-batches in the precision
    autopar's runtime keeps them in, fp32, or bf16 where a pipelined plan reduces in bf16
    (:mod:`autopar.cost.memory`). DeepSpeed 0.19 keeps them in the training precision
    unless ``grad_accum_dtype`` says otherwise, and without ZeRO refuses any other
    (``DeepSpeedEngine._do_optimizer_sanity_check``: "unsupported mix"), so at ``stage``
    0 a note says what differs instead."""
    c = plan.config
    accumulate = DType.BF16 if c.reduce_dtype is DType.BF16 and c.pp > 1 else DType.FP32
    if stage > 0:
        return {"grad_accum_dtype": accumulate.value}
    notes.append(
        f"DeepSpeed without ZeRO keeps and accumulates gradients in {c.dtype.value} and refuses fp32 there "
        f"(data_types.grad_accum_dtype): 2 bytes per parameter where the plan predicts fp32's 4, summed in "
        f"{c.dtype.value}; make the plan with --set zero_stage=1 to keep them in fp32"
    )
    return {}


def _plain_recompute_notes(blocks: Blocks, notes: list[str]) -> None:
    """What plain DeepSpeed needs to recompute as the plan says: its config section only
    configures ``deepspeed.checkpointing``, which the model code calls around blocks."""
    notes.append(
        "DeepSpeed's config does not turn recomputation on: wrap each block the plan recomputes in "
        "deepspeed.checkpointing.checkpoint (a Hugging Face model: model.gradient_checkpointing_enable())"
    )
    counts = blocks.mode_counts()
    if counts[Recompute.SELECTIVE] or counts[Recompute.OP]:
        notes.append(
            "DeepSpeed checkpoints whole blocks: the plan's selective (attention core only) or per-operator "
            "recomputation has no equivalent; checkpointing those blocks in full is the closest (less memory, "
            "more compute)"
        )
    if blocks.uniform() is None and blocks.count:
        notes.append(mixed_recompute_note(blocks, "checkpoint only the blocks the plan names"))
    note = outside_blocks_note(blocks)
    if note:
        notes.append(note)


def _megatron_deepspeed(
    plan: Plan, blocks: Blocks, shape: ModelShape | None, zero_stage: int, notes: list[str]
) -> list[str]:
    """Megatron-DeepSpeed's script and flags for the model-parallel part of the plan (the
    flags it shares with Megatron-LM). Its pipeline runs on DeepSpeed's engine: one
    stage per rank, layers split evenly, DeepSpeed's own 1F1B-style schedule, and whole
    layers recomputed only by the ``uniform`` method. ``--zero-stage`` repeats the
    config's stage: the script reads its own flag (default 1) to build a ZeRO-3 model
    already partitioned."""
    c = plan.config
    notes.append(
        f"DeepSpeed takes tensor and pipeline parallelism (tp={c.tp}, pp={c.pp}) from Megatron-DeepSpeed: the "
        f"launch line runs its {MEGATRON_DEEPSPEED_SCRIPT} with Megatron's flags; for a Hugging Face model "
        f'without it, DeepSpeed\'s AutoTP training ("tensor_parallel": {{"autotp_size": {c.tp}}}) is the '
        f"closest for tp, and pipelining needs the model written as a deepspeed.pipe.PipelineModule"
    )
    note = tp_note(plan, "Megatron-DeepSpeed")
    if note:
        notes.append(note)
    if c.pp > 1 and (c.virtual_stages > 1 or c.schedule is Schedule.GPIPE):
        notes.append(
            f"DeepSpeed's pipeline engine runs its own 1F1B-style schedule with one stage per rank: the plan's "
            f"{c.schedule.value} schedule{f' with {c.virtual_stages} stages per rank' if c.virtual_stages > 1 else ''}"
            f" has no equivalent (bubble and activation memory differ from the prediction)"
        )
    if c.pp > 1 and blocks.count and not blocks.even:
        notes.append(
            f"Megatron-DeepSpeed splits layers evenly over pipeline stages; the plan's split "
            f"({'/'.join(map(str, blocks.per_stage))} layers per stage) has no flag there"
        )
    words = [
        MEGATRON_DEEPSPEED_SCRIPT,
        "--tensor-model-parallel-size",
        str(c.tp),
        "--pipeline-model-parallel-size",
        str(c.pp),
    ]
    if c.sequence_parallel:
        words.append("--sequence-parallel")
    notes += sequence_parallel_notes(plan, "Megatron-DeepSpeed", megatron=True)
    if c.pp == 1:
        words.append("--no-pipeline-parallel")
    words += ["--micro-batch-size", str(c.micro_batch_size), "--global-batch-size", str(c.global_batch_size)]
    words += model_args(plan, blocks, shape, notes)
    words += recompute_args(blocks, notes, pipe_engine=c.pp > 1)
    words += {DType.BF16: ["--bf16"], DType.FP16: ["--fp16"], DType.FP32: []}[c.dtype]
    if plan.settings.optimizer is Optimizer.SGD:  # Megatron's flag: SGD with momentum
        words += ["--optimizer", "sgd"]
    return [*words, "--zero-stage", str(zero_stage), "--deepspeed", "--deepspeed_config", CONFIG_NAME]


def _deepspeed(plan: Plan) -> list[str]:
    """The ``deepspeed`` launcher's words: every node of the plan's cluster, listed in a
    hostfile when there are several."""
    cluster = plan.cluster
    words = ["deepspeed", "--num_nodes", str(cluster.nodes), "--num_gpus", str(cluster.devices_per_node)]
    return [*words, "--hostfile", "hostfile"] if cluster.nodes > 1 else words
