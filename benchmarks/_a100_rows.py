"""The A100 rows of ``planner_faithful.py``: Megatron-LM's runs (Narayanan et al. 2021,
table 1; Korthikanti et al. 2022) estimated as they ran, and Megatron-DeepSpeed's
(MT-NLG 530B over three GPU counts, BLOOM 176B), each against what its source reports."""

from __future__ import annotations

from _published_runs import BLOOM_STEP_S, BLOOM_TFLOPS, MT_NLG_2022, NARAYANAN_2021, gpt
from _score import AS_RAN, MEGATRON_LAYOUT, row

import autopar

A100_PEAK_TFLOPS = 312


def narayanan_rows() -> list[dict[str, object]]:
    """Narayanan et al. 2021, table 1, estimated as it ran; HFU x A100 peak against their TFLOP/s."""
    rows = []
    for label, hidden, heads, layers, gpus, batch, tp, pp, tflops in NARAYANAN_2021:
        plan = autopar.estimate(
            gpt(hidden, heads, layers),
            autopar.preset("dgx-a100-80gb", nodes=gpus // 8),
            {
                "tp": tp,
                "pp": pp,
                "micro_batch_size": 1,
                "recompute": "full",
                "zero_stage": 0,
                "dtype": "fp16",
                **AS_RAN,
            },
            global_batch_size=batch,
            seq_len=2048,
            attention="materialized",
            activations=MEGATRON_LAYOUT,
        )
        predicted = plan.prediction.hfu * A100_PEAK_TFLOPS
        config = f"tp={tp} pp={pp} dp={plan.config.dp} batch {batch}, full recompute"
        rows.append(
            row(
                f"Narayanan 2021 {label}",
                gpus,
                config,
                f"{tflops} TFLOP/s",
                f"{predicted:.0f} TFLOP/s",
                predicted / tflops,
                plan,
            )
        )
    return rows


def korthikanti_rows() -> list[dict[str, object]]:
    """Korthikanti et al. 2022, 530B with full and with selective recomputation; MFU against MFU."""
    rows = []
    for recompute, sp, mfu in (("full", False, 42.1), ("selective", True, 54.2)):
        plan = autopar.estimate(
            gpt(20480, 128, 105),
            autopar.preset("dgx-a100-80gb", nodes=280),
            {
                "tp": 8,
                "pp": 35,
                "micro_batch_size": 1,
                "recompute": recompute,
                "sequence_parallel": sp,
                "regather": sp,  # Megatron's sequence parallelism keeps the shards of its gathers
                "zero_stage": 0,
                **AS_RAN,
            },
            global_batch_size=2240,
            seq_len=2048,
            attention="materialized",
            activations=MEGATRON_LAYOUT,
        )
        p = plan.prediction
        config = f"tp=8 pp=35 dp=8 batch 2240, {recompute}{' + SP' if sp else ''}"
        rows.append(
            row(
                "Korthikanti 2022 530B", 2240, config, f"MFU {mfu}%", f"MFU {100 * p.mfu:.1f}%", p.mfu * 100 / mfu, plan
            )
        )
    return rows


def mt_nlg_rows() -> list[dict[str, object]]:
    """MT-NLG 530B over three GPU counts at one batch; step time against step time."""
    rows = []
    for gpus, step_s, tflops in MT_NLG_2022:
        fixed = {
            "tp": 8,
            "pp": 35,
            "micro_batch_size": 1,
            "schedule": "1f1b",
            "recompute": "full",
            "zero_stage": 1,
            **AS_RAN,
        }
        plan = autopar.plan(
            gpt(20480, 128, 105),
            autopar.preset("dgx-a100-80gb", nodes=gpus // 8),
            global_batch_size=1920,
            seq_len=2048,
            constraints=fixed,
            attention="materialized",
            activations=MEGATRON_LAYOUT,
        )
        predicted = plan.prediction.step_time_s
        rows.append(
            row(
                "MT-NLG 530B",
                gpus,
                f"tp=8 pp=35 dp={gpus // 280} batch 1920, full recompute, 1F1B, ZeRO-1",
                f"{step_s} s/step ({tflops} TFLOP/s)",
                f"{predicted:.1f} s/step",
                step_s / predicted,
                plan,
                series="MT-NLG 530B, 1920 x 2K tokens",
            )
        )
    return rows


def bloom_row() -> dict[str, object]:
    """BLOOM 176B as its README gives it; the logged step time against autopar's."""
    plan = autopar.estimate(
        gpt(14336, 112, 70, vocab=250880),
        autopar.preset("dgx-a100-80gb", nodes=48),
        {"tp": 4, "pp": 12, "micro_batch_size": 2, "recompute": "full", "zero_stage": 1, "dtype": "bf16", **AS_RAN},
        global_batch_size=2048,
        seq_len=2048,
        attention="materialized",
        activations=MEGATRON_LAYOUT,
    )
    step = plan.prediction.step_time_s
    return row(
        "BLOOM 176B",
        384,
        "tp=4 pp=12 dp=8 mbs 2 batch 2048, full recompute, ZeRO-1",
        f"{BLOOM_STEP_S} s/step ({BLOOM_TFLOPS} TFLOP/s)",
        f"{step:.1f} s/step",
        BLOOM_STEP_S / step,
        plan,
    )
