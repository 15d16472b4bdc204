"""A plan as a Hugging Face Accelerate config (YAML, what ``accelerate config`` writes)
and the ``accelerate launch`` line.

Accelerate trains with DDP or FSDP, and since 1.10 composes FSDP2 with the tensor
parallelism of a transformers model's own ``tp_plan`` (its ``parallelism_config``). It
has no pipeline parallelism for training: a plan with ``pp > 1`` is refused.

With FSDP2 (``fsdp_version: 2``) the sharding strategy is ``fsdp_reshard_after_forward``
(Accelerate deprecates ``fsdp_sharding_strategy`` there and refuses a strategy name as
its value): true is FULL_SHARD (ZeRO-3), false is SHARD_GRAD_OP (ZeRO-2); NO_SHARD
(ZeRO-0) is plain DDP, ``distributed_type: MULTI_GPU``. HYBRID_SHARD (HSDP) is FSDP2 on
the ``parallelism_config``'s (dp_replicate, dp_shard) mesh: the plan's replicate groups
and shard group size. Context parallelism is the ``parallelism_config``'s ``cp_size``
(torch's ``context_parallel``, with the all-gather rotation the plan assumes), which
Accelerate runs under FSDP2 only, sharding over dp_shard x cp as the plan does. Its
``ParallelismConfig`` has no expert-parallel axis: a plan with ``ep > 1`` is refused.
"""

from __future__ import annotations

from autopar.export.common import (
    Blocks,
    Export,
    ExportError,
    blocks_of,
    commented,
    fp8_inputs_note,
    header,
    kernel_options_note,
    mixed_recompute_note,
    outside_blocks_note,
    require_seq_multiple,
    sequence_parallel_notes,
    setting_notes,
    shell_line,
)
from autopar.export.shape import ModelShape
from autopar.plan import Plan
from autopar.vocab import DType, Recompute

CONFIG_NAME = "accelerate_config.yaml"
MIXED_PRECISION = {DType.BF16: "bf16", DType.FP16: "fp16", DType.FP32: "no"}
TORCH_NAMES = {DType.BF16: "bfloat16", DType.FP16: "float16"}


def export_accelerate(plan: Plan, shape: ModelShape | None) -> Export:
    """The Accelerate config of ``plan``; ``shape`` names the block class FSDP wraps.
    Raises ExportError for a pipelined or expert-parallel plan, and for a
    context-parallel one whose sequence length torch cannot split."""
    c = plan.config
    if c.pp > 1:
        raise ExportError(
            f"accelerate cannot run pipeline parallelism (the plan has pp={c.pp}); make a plan with --set pp=1 for "
            f"accelerate."
        )
    if c.ep > 1:
        raise ExportError(
            f"accelerate's ParallelismConfig has no expert-parallel axis (the plan has ep={c.ep}; its Megatron-LM "
            f"plugin's expert_model_parallel_size runs Megatron's own models); make a plan with --set ep=1 for "
            f"accelerate."
        )
    if c.cp > 1:
        require_seq_multiple(plan, "Accelerate's context parallelism", {"2 x cp": 2 * c.cp})
    blocks = blocks_of(plan)
    notes: list[str] = setting_notes(plan, "Accelerate", builds=None)
    info = [
        f"per-device batch {c.micro_batch_size}; gradient accumulation {c.num_microbatches} steps: "
        f"Accelerator(gradient_accumulation_steps={c.num_microbatches}) and a DataLoader of batch_size "
        f"{c.micro_batch_size}",
    ]
    kernels = kernel_options_note(plan, "Accelerate")
    if kernels:
        notes.append(kernels)
    inputs = fp8_inputs_note(plan, "Accelerate")
    if inputs:
        notes.append(inputs)
    fsdp = c.tp > 1 or c.cp > 1 or (c.dp > 1 and c.zero_stage > 0)
    config: dict = {"compute_environment": "LOCAL_MACHINE", "debug": False}
    if fsdp:
        config["distributed_type"] = "FSDP"
        config["fsdp_config"] = _fsdp(plan, blocks, shape, notes)
    else:
        config["distributed_type"] = "MULTI_GPU" if c.world_size > 1 else "NO"
        if any(m is not Recompute.NONE for m in blocks.modes):
            notes.append(
                "Accelerate's config turns recomputation on only with FSDP: call model.gradient_checkpointing_enable() "
                "(a Hugging Face model) or checkpoint the blocks the plan recomputes in the training script"
            )
    if fsdp and c.dp_cp > 1 and c.dtype is not DType.FP32 and c.reduce_dtype is DType.FP32:
        notes.append(
            f"Accelerate's FSDP reduces gradients in {c.dtype.value} under mixed_precision {MIXED_PRECISION[c.dtype]}, "
            f"and the plan reduces them in fp32: give FullyShardedDataParallelPlugin(mixed_precision_policy="
            f"MixedPrecisionPolicy(param_dtype=torch.{TORCH_NAMES[c.dtype]}, reduce_dtype=torch.float32)) to the "
            f"Accelerator, or make the plan with --set reduce_dtype={c.dtype.value}"
        )
    if c.tp > 1 or c.cp > 1 or c.dp_shard is not None:
        config["parallelism_config"] = {
            "parallelism_config_dp_replicate_size": c.replicate_size,
            "parallelism_config_dp_shard_size": c.shard_size,
            "parallelism_config_tp_size": c.tp,
            "parallelism_config_cp_size": c.cp,
        }
    if c.cp > 1:
        config["parallelism_config"]["parallelism_config_cp_comm_strategy"] = "allgather"
        info.append(
            "context parallelism: run each step inside accelerator.maybe_context_parallel(buffers=[inputs, labels, "
            "...], buffer_seq_dims=[...]) with the model's attention in torch's scaled_dot_product_attention"
        )
    if c.tp > 1:
        notes.append(
            f"Accelerate's tensor parallelism (tp={c.tp}) applies a transformers model's own tp_plan, not the "
            f"plan's per-layer styles; other models cannot use it"
        )
        if c.sequence_parallel:
            notes.append(
                "Accelerate's tensor parallelism follows the model's tp_plan for norms; the plan's sequence "
                "parallelism is kept only where that tp_plan shards them"
            )
        notes += sequence_parallel_notes(plan, "Accelerate", megatron=False)
    config.update(
        {
            "machine_rank": 0,
            "main_training_function": "main",
            "mixed_precision": MIXED_PRECISION[c.dtype],
            "num_machines": plan.cluster.nodes,
            "num_processes": c.world_size,
            "rdzv_backend": "static",
            "same_network": True,
            "use_cpu": False,
        }
    )
    words = ["accelerate", "launch", "--config_file", CONFIG_NAME]
    if plan.cluster.nodes > 1:
        words += ["--machine_rank", "$NODE_RANK", "--main_process_ip", "$MASTER_ADDR", "--main_process_port", "29500"]
    launch = shell_line([*words, "train.py"])
    text = commented(header(plan, "Accelerate") + info, notes) + _yaml(config)
    return Export(target="accelerate", text=text, filename=CONFIG_NAME, launch=launch, notes=tuple(notes))


def _fsdp(plan: Plan, blocks: Blocks, shape: ModelShape | None, notes: list[str]) -> dict:
    """The FSDP2 section: resharding by ZeRO stage, one FSDP unit per transformer block,
    activation checkpointing of whole blocks."""
    c = plan.config
    if c.zero_stage == 1:
        notes.append(
            "FSDP has no optimizer-only sharding (ZeRO-1): written as fsdp_reshard_after_forward false "
            "(SHARD_GRAD_OP, ZeRO-2: gradients sharded too, less memory than predicted)"
        )
    if c.zero_stage == 0:
        notes.append(
            "Accelerate composes tensor and context parallelism with FSDP only: ZeRO-0 written as "
            "fsdp_reshard_after_forward false (SHARD_GRAD_OP, ZeRO-2: less memory than predicted)"
        )
    section: dict = {
        "fsdp_activation_checkpointing": _checkpointing(blocks, notes),
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
    }
    if shape is not None and shape.block_class:
        section["fsdp_transformer_layer_cls_to_wrap"] = shape.block_class
    section.update(
        {
            "fsdp_offload_params": False,
            "fsdp_reshard_after_forward": c.zero_stage == 3,
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_version": 2,
        }
    )
    return section


def _checkpointing(blocks: Blocks, notes: list[str]) -> bool:
    """Whether FSDP checkpoints every wrapped block in full: on when the plan recomputes
    any block (per-block and selective choices have no equivalent; recomputing all of
    them in full never keeps more than the plan)."""
    note = outside_blocks_note(blocks)
    if note:
        notes.append(note)
    uniform = blocks.uniform()
    if not blocks.count or uniform is Recompute.NONE:
        return False
    if uniform is not Recompute.FULL:
        written = "FSDP's activation checkpointing recomputes every block in full (less memory, more compute)"
        notes.append(mixed_recompute_note(blocks, written))
    return True


def _yaml(config: dict) -> str:
    """The config as YAML: a mapping of scalars and one level of nested mappings, in
    the spelling ``accelerate config`` writes."""
    lines = []
    for key, value in config.items():
        if isinstance(value, dict):
            lines.append(f"{key}:")
            lines += [f"  {k}: {_scalar(v)}" for k, v in value.items()]
        else:
            lines.append(f"{key}: {_scalar(value)}")
    return "\n".join(lines) + "\n"


def _scalar(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str) and value in ("no", "yes", "true", "false", "null"):
        return f"'{value}'"
    return str(value)
