"""The constraints a user fixes (any subset of :class:`~autopar.plan.ParallelConfig`'s
fields), checked and completed before any search: each value allowed, and the options
that need others (asynchronous TP needs compiled blocks and sequence parallelism, kept
shards of gathers need sequence parallelism, and eager blocks where autopar's runtime
runs the plan) or tensor parallelism at all."""

from __future__ import annotations

import math
import reprlib
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from autopar.errors import ConfigError, DeviceCountError
from autopar.plan import ParallelConfig
from autopar.search.integers import divisors
from autopar.vocab import (
    SPLIT_BACKWARD_EAGER,
    SPLIT_BACKWARD_MODES,
    SPLIT_BACKWARD_RECOMPUTE,
    ZERO_STAGES,
    DType,
    Recompute,
    Schedule,
)

CONFIG_FIELDS = tuple(f.name for f in fields(ParallelConfig))


def check_constraints(
    constraints: Mapping[str, Any] | None, *, what: str = "constraints", megatron_kernels: bool = False
) -> dict[str, Any]:
    """Validate the names and types of fixed fields (values are checked by ParallelConfig);
    ``what`` names the argument in the message for anything but a mapping.
    ``megatron_kernels``: the plan is priced for Megatron-LM (sequence-first activations),
    whose fused kernels keep the shards of sequence-parallel gathers, so ``regather`` goes
    with ``compile`` there."""
    if constraints is not None and not isinstance(constraints, Mapping):
        raise ConfigError(
            f"{what}={reprlib.repr(constraints)} is not allowed: give a mapping of config fields, "
            f"e.g. {{'tp': 8, 'pp': 16}}."
        )
    out = dict(constraints or {})
    unknown = sorted(set(out) - set(CONFIG_FIELDS), key=repr)
    if unknown:
        raise ConfigError(f"unknown constraint(s) {unknown}; allowed: {', '.join(CONFIG_FIELDS)}.")
    for name in ("dp", "tp", "pp", "cp", "ep", "micro_batch_size", "num_microbatches", "virtual_stages"):
        if name in out:
            v = out[name]
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"constraint {name}={v!r} is not allowed: it must be a positive integer.")
    conv = {"schedule": Schedule, "recompute": Recompute, "dtype": DType, "reduce_dtype": DType}
    for name, cls in conv.items():
        if name in out:
            try:
                out[name] = cls(out[name])
            except ValueError:
                allowed = ", ".join(repr(m.value) for m in cls)
                raise ConfigError(f"constraint {name}={out[name]!r} is not allowed; use one of {allowed}.") from None
    zero = out.get("zero_stage")
    if "zero_stage" in out and (isinstance(zero, bool) or not isinstance(zero, int) or zero not in ZERO_STAGES):
        raise ConfigError(f"constraint zero_stage={out['zero_stage']!r} is not allowed; use 0, 1, 2 or 3.")
    shard = out.get("dp_shard")
    if shard is not None and (isinstance(shard, bool) or not isinstance(shard, int) or shard < 2):
        raise ConfigError(
            f"constraint dp_shard={shard!r} is not allowed: give the FSDP shard group's size (an integer >= 2 "
            f"dividing dp), or None for plain FSDP."
        )
    if shard is not None and "zero_stage" in out and out["zero_stage"] < 2:
        raise ConfigError(
            f"constraint dp_shard={shard} with zero_stage={out['zero_stage']} is not allowed: HSDP shards through "
            f"FSDP2, which needs zero_stage 2 or 3; set zero_stage=2 or 3, or drop dp_shard."
        )
    if out.get("reduce_dtype", DType.BF16) not in (DType.FP32, DType.BF16):
        raise ConfigError(
            f"constraint reduce_dtype={out['reduce_dtype'].value!r} is not allowed: gradients reduce in 'fp32' (the "
            f"default) or 'bf16' (with dtype='bf16'); use one of those."
        )
    if out.get("reduce_dtype", DType.FP32) is not DType.FP32:  # FSDP2's reduce precision: ZeRO-2/3 only
        if "zero_stage" in out and out["zero_stage"] < 2:
            raise ConfigError(
                f"constraint reduce_dtype={out['reduce_dtype'].value!r} with zero_stage={out['zero_stage']} is not "
                f"allowed: FSDP2 reduces the gradients in it, which needs zero_stage 2 or 3; set zero_stage=2 or 3, "
                f"or drop reduce_dtype."
            )
        if "dtype" in out:  # ParallelConfig's own message, said before the search
            ParallelConfig(
                dp=2,
                tp=1,
                pp=1,
                micro_batch_size=1,
                num_microbatches=1,
                zero_stage=2,
                **{k: out[k] for k in ("dtype", "reduce_dtype")},
            )
    for name in ("sequence_parallel", "compile", "fp8", "async_tp", "regather"):
        if name in out and not isinstance(out[name], bool):
            raise ConfigError(
                f"constraint {name}={out[name]!r} is not allowed: use True or False (--set {name}=true or false)."
            )
    if out.get("async_tp"):  # it runs inside compiled blocks, on sequence-parallel collectives
        for needed in ("compile", "sequence_parallel"):
            if out.setdefault(needed, True) is False:
                raise ConfigError(
                    f"constraint async_tp=True with {needed}=False is not allowed: asynchronous TP fuses the "
                    f"sequence-parallel collectives into the compiled blocks; drop {needed}=False or async_tp=True."
                )
    if out.get("regather"):  # it keeps shards of sequence-parallel gathers, on eager blocks in autopar's runtime
        needs = (("sequence_parallel", True),) + ((("compile", False),) if not megatron_kernels else ())
        for needed, value in needs:
            if out.setdefault(needed, value) is not value:
                raise ConfigError(
                    f"constraint regather=True with {needed}={not value} is not allowed: it keeps the shards of "
                    f"sequence-parallel gathers, which autopar's runtime does with saved-tensor hooks on eager "
                    f"blocks; drop {needed}={not value} or regather=True"
                    + (
                        " (or price Megatron-LM's kernels with activations='sequence-first')."
                        if needed == "compile"
                        else "."
                    )
                )
    if out.get("pp") == 1 and out.get("schedule", Schedule.ONE_F_ONE_B) is not Schedule.ONE_F_ONE_B:
        raise ConfigError(
            f"constraint schedule={out['schedule'].value!r} with pp=1 is not allowed: it orders the micro-batches of "
            f"a pipeline, and pp=1 has no pipeline; drop one of them."
        )
    schedule = out.get("schedule")
    if schedule is not None and schedule.zero_bubble:  # torch splits the backward of eager blocks only
        if out.setdefault("compile", False):
            by = " (asynchronous TP, async_tp=True, runs in compiled blocks)" if out.get("async_tp") else ""
            drop = "async_tp=False" if out.get("async_tp") else "compile=False"
            raise ConfigError(
                f"constraint schedule={schedule.value!r} with compile=True{by} is not allowed: {SPLIT_BACKWARD_EAGER}; "
                f"use {drop} or schedule='interleaved-1f1b'."
            )
        if out.get("recompute", Recompute.NONE) not in SPLIT_BACKWARD_MODES:
            raise ConfigError(
                f"constraint schedule={schedule.value!r} with recompute={out['recompute'].value!r} is not allowed: "
                f"{SPLIT_BACKWARD_RECOMPUTE}; use recompute='none' or 'selective', or schedule='interleaved-1f1b'."
            )
    if out.get("pp") == 1 and out.get("virtual_stages", 1) > 1:
        raise ConfigError(
            f"constraint virtual_stages={out['virtual_stages']} with pp=1 is not allowed: it counts the stages of "
            f"each pipeline rank, and pp=1 has no pipeline; drop one of them."
        )
    schedule, stages = out.get("schedule"), out.get("virtual_stages")
    if schedule is not None and stages is not None:  # the pair ParallelConfig would refuse, said before the search
        try:  # on a pipeline: a schedule without one is refused below
            ParallelConfig(
                dp=1, tp=1, pp=2, micro_batch_size=1, num_microbatches=1, schedule=schedule, virtual_stages=stages
            )
        except ConfigError as err:
            raise ConfigError(
                f"constraint schedule={schedule.value!r} with virtual_stages={stages} is not allowed: {err}"
            ) from None
    if megatron_kernels:
        check_megatron_runs(out)
    if out.get("tp") == 1:  # each shards or fuses what tensor parallelism splits
        given = [name for name in ("async_tp", "regather", "sequence_parallel") if out.get(name) is True]
        if given:
            raise ConfigError(
                f"constraint {given[0]}=True with tp=1 is not allowed: it works on the tensor-parallel ranks' "
                f"shards of each layer, which tp=1 does not split; drop {given[0]}=True or allow tp > 1."
            )
    return out


def check_megatron_runs(fixed: Mapping[str, Any]) -> None:
    """A plan priced for Megatron-LM's kernels is one to run in Megatron-LM, so what
    Megatron-LM cannot run is refused when fixed (and left out of the search,
    :func:`autopar.search.space.enumerate_space`): its pipelines run 1F1B and
    interleaved 1F1B only, it shards parameters (ZeRO-3, Megatron-FSDP) only without a
    pipeline, it has no per-operator selective recomputation, and its sequence
    parallelism always keeps the shards of its gathers."""
    schedule = fixed.get("schedule")
    if schedule is not None and schedule.zero_bubble:
        raise ConfigError(
            f"constraint schedule={schedule.value!r} is not allowed with activations='sequence-first': the plan is "
            f"priced for Megatron-LM, which has no zero-bubble schedule; use schedule='1f1b' or 'interleaved-1f1b', "
            f"or plan for autopar's runtime (activations='batch-first')."
        )
    if fixed.get("zero_stage") == 3 and fixed.get("pp", 1) > 1:
        raise ConfigError(
            f"constraint zero_stage=3 with pp={fixed['pp']} is not allowed with activations='sequence-first': "
            f"Megatron-LM shards parameters (Megatron-FSDP) only without a pipeline; use zero_stage <= 2 or pp=1, or "
            f"plan for autopar's runtime (activations='batch-first')."
        )
    if fixed.get("recompute") is Recompute.OP:
        raise ConfigError(
            "constraint recompute='op' is not allowed with activations='sequence-first': Megatron-LM has no "
            "per-operator selective recomputation; use recompute='selective' or 'full' (or leave it to the search), "
            "or plan for autopar's runtime (activations='batch-first')."
        )
    if fixed.get("regather") is False and fixed.get("sequence_parallel"):
        raise ConfigError(
            "constraint regather=False with sequence_parallel=True is not allowed with activations='sequence-first': "
            "Megatron-LM's sequence parallelism always keeps the shards of its gathers and gathers again in the "
            "backward; drop regather=False, or plan for autopar's runtime (activations='batch-first')."
        )


DEGREES = ("dp", "cp", "tp", "pp")
"""The degrees whose product is the device count, in the order messages name them."""


def check_degrees(fixed: Mapping[str, Any], world: int) -> None:
    """The degrees ``fixed`` gives (any of :data:`DEGREES`) must multiply to ``world``
    devices, all four given, or to a divisor of it: else a DeviceCountError naming them,
    their product and the device count, which another device count may satisfy. The
    search checks the constraints with it before any candidate, and ``estimate`` its
    completed configuration, so both name the same contradiction."""
    given = {name: fixed[name] for name in DEGREES if name in fixed}
    product = math.prod(given.values())
    names, values = " x ".join(given), " x ".join(map(str, given.values()))
    if len(given) == len(DEGREES) and product != world:
        raise DeviceCountError(
            f"{names} = {values} = {product} but the cluster has {world} devices; fix them to multiply to {world}, "
            f"or plan for another cluster."
        )
    if world % product == 0:
        return
    if len(given) == 1:
        (name,) = given
        raise DeviceCountError(
            f"{name}={product} does not divide the cluster's {world} devices; fix {name} to one of "
            f"{divisors(world)}, or plan for another cluster."
        )
    raise DeviceCountError(
        f"{names} = {values} = {product} does not divide the cluster's {world} devices; fix them to a product "
        f"that does, or plan for another cluster."
    )
