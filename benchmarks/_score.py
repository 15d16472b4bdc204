"""One scored row of ``planner_faithful.py``: what a published run ran, what it reported,
what autopar predicts for it, and what autopar picked where the source is silent."""

from __future__ import annotations

import autopar

AS_RAN = {"compile": False, "fp8": False}
"""What every run but torchtitan's used: its own hand-fused kernels (eager here), bf16 matmuls."""
MEGATRON_LAYOUT = "sequence-first"
"""Megatron-LM, Megatron-Core and Megatron-DeepSpeed lay activations out (sequence, batch,
hidden): their sequence-parallel collectives make no copies (``autopar.cost.layout_copies``)."""


def picked(plan: autopar.Plan) -> str:
    """What autopar chose where the source is silent."""
    c = plan.config
    schedule = c.schedule.value + (f" v={c.virtual_stages}" if c.virtual_stages > 1 else "") if c.pp > 1 else "no pp"
    recompute = c.recompute.value + (" (some units differ)" if plan.layer_strategies.recompute else "")
    return f"mbs {c.micro_batch_size}, {schedule}, recompute {recompute}, ZeRO-{c.zero_stage}"


def row(
    run: str,
    gpus: int,
    config: str,
    published: str,
    predicted: str,
    ratio: float,
    plan: autopar.Plan,
    *,
    memory: str = "-",
    series: str = "",
) -> dict[str, object]:
    p = plan.prediction
    return {
        "run": run,
        "GPUs": gpus,
        "config": config,
        "published": published,
        "predicted": predicted,
        "error": f"{100 * (ratio - 1):+.1f}%",
        "published memory": memory,
        "predicted memory": f"{p.memory_bytes_per_device / 2**30:.1f} GiB",
        "fits": "yes" if p.fits else "NO",
        "series": series,
    }
