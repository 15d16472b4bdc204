"""The scoreboard's torchtitan rows: Llama 3.1 trained with FSDP2, DTensor tensor and
context parallelism, ``torch.compile`` and torchao Float8, the PyTorch engine autopar's own
runtime uses, so these rows check the cost model of autopar's runtime most directly.

Each is estimated as it ran (``autopar.estimate``, nothing picked) on the hosts its document
describes, and compared in tokens/s per GPU (torchtitan divides the tokens of a data-parallel
rank by its tensor, context and pipeline ranks, so this is the global rate over the GPUs).
Memory is shown beside the prediction where published; it is not scored, but a published
configuration predicted not to fit counts as a false out-of-memory.
"""

from __future__ import annotations

from _published_runs import (
    TORCHTITAN_405B,
    TORCHTITAN_2024,
    TORCHTITAN_CP,
    TORCHTITAN_H200,
    TORCHTITAN_TP,
    grand_teton_h100,
    llama,
)
from _score import row

import autopar

SEQ = 8192
"""The llama3 train configs' sequence length at the commits the documents name."""


def llama31(size: str, seq: int = SEQ) -> object:
    """Llama 3.1 8B or 70B (Dubey et al. 2024, table 3) on the meta device."""
    if size == "8B":
        return llama(4096, 32, 32, 8, 14336, 128256, seq)
    return llama(8192, 80, 64, 8, 28672, 128256, seq)


def _techniques(compiled: bool, fp8: bool) -> str:
    return f"{'compiled' if compiled else 'eager'} bf16{' + Float8' if fp8 else ''}"


def _scored(
    run: str, gpus: int, config: str, tps: float, plan: autopar.Plan, memory: float | None, *, digits: int = 0
) -> dict[str, object]:
    """A row in tokens/s per GPU (the global rate over the GPUs, as torchtitan reports it)."""
    predicted = plan.prediction.tokens_per_s / gpus
    return row(
        run,
        gpus,
        config,
        f"{tps:g} tokens/s",
        f"{predicted:.{digits}f} tokens/s",
        predicted / tps,
        plan,
        memory=f"{memory} GiB" if memory else "-",
    )


def fsdp_rows() -> list[dict[str, object]]:
    """Tables 1 and 3 of the December 2024 document: Llama 3.1 8B with FSDP on 8 and 128 H100,
    eager, compiled, and compiled with Float8."""
    rows = []
    for gpus, batch, compiled, fp8, tps, memory in TORCHTITAN_2024:
        plan = autopar.estimate(
            llama31("8B"),
            grand_teton_h100(gpus // 8),
            {"micro_batch_size": 2, "recompute": "op", "zero_stage": 3, "compile": compiled, "fp8": fp8},
            global_batch_size=batch,
            seq_len=SEQ,
        )
        config = f"FSDP {gpus} (ZeRO-3) local batch 2, per-op selective recompute, {_techniques(compiled, fp8)}"
        rows.append(_scored("torchtitan Llama 3.1 8B", gpus, config, tps, plan, memory))
    return rows


def tensor_parallel_rows() -> list[dict[str, object]]:
    """FSDP with 8-way tensor parallelism (sequence parallel, as torchtitan's plan runs it),
    compiled: table 4 of the December 2024 document and the June 2025 async-TP document,
    synchronous and asynchronous."""
    rows = []
    for size, gpus, local, recompute, fp8, overlapped, tps, memory in TORCHTITAN_TP:
        fixed = {
            "tp": 8,
            "sequence_parallel": True,
            "micro_batch_size": local,
            "recompute": recompute,
            "zero_stage": 3,
            "compile": True,
            "fp8": fp8,
            "async_tp": overlapped,
        }
        plan = autopar.estimate(
            llama31(size), grand_teton_h100(gpus // 8), fixed, global_batch_size=gpus // 8 * local, seq_len=SEQ
        )
        checkpointing = "full recompute" if recompute == "full" else "per-op selective recompute"
        config = (
            f"FSDP {gpus // 8} TP 8 (sequence parallel{', async' if overlapped else ''}) local batch {local}, "
            f"{checkpointing}, {_techniques(True, fp8)}"
        )
        rows.append(_scored(f"torchtitan Llama 3.1 {size}", gpus, config, tps, plan, memory))
    return rows


def context_parallel_rows() -> list[dict[str, object]]:
    """Table 2 of the December 2024 document: one sequence of 32K-256K tokens per FSDP rank
    on 8 H100, FSDP x CP = 8, full recomputation, compiled with Float8."""
    rows = []
    for cp, seq, tps, memory in TORCHTITAN_CP:
        fixed = {"cp": cp, "micro_batch_size": 1, "recompute": "full", "zero_stage": 3, "compile": True, "fp8": True}
        plan = autopar.estimate(llama31("8B", seq), grand_teton_h100(1), fixed, global_batch_size=8 // cp, seq_len=seq)
        config = (
            f"FSDP {8 // cp} x CP {cp}, {seq // 1024}K tokens, local batch 1, full recompute, {_techniques(True, True)}"
        )
        rows.append(_scored("torchtitan Llama 3.1 8B", 8, config, tps, plan, memory))
    return rows


def llama405b_rows() -> list[dict[str, object]]:
    """Tables 5 and 6 of the December 2024 document: Llama 3.1 405B on 512 H100 with FSDP,
    TP 8 (asynchronous) and PP 8, compiled with Float8, full recomputation; 1F1B and
    interleaved 1F1B at 8K tokens, and 1F1B with context parallelism 1-8 at 32K-256K. Its
    FP8 all-gathers are priced as bf16 ones. With pipelining torchtitan shards without
    resharding after the forward (``parallelize_llama.py`` at 9dec370), autopar's ZeRO-2."""
    rows = []
    for schedule, stages, cp, seq, local, tps, memory in TORCHTITAN_405B:
        m = 8  # the code's default, the pipeline degree (_published_runs.TORCHTITAN_405B says why)
        fixed = {
            "tp": 8,
            "pp": 8,
            "cp": cp,
            "sequence_parallel": True,
            "schedule": schedule,
            "virtual_stages": stages,
            "num_microbatches": m,
            "micro_batch_size": local // m,
            "recompute": "full",
            "zero_stage": 2,
            "compile": True,
            "fp8": True,
            "async_tp": True,
        }
        dp = 512 // (64 * cp)
        plan = autopar.estimate(
            llama(16384, 126, 128, 8, 53248, 128256, seq),
            grand_teton_h100(64),
            fixed,
            global_batch_size=dp * local,
            seq_len=seq,
        )
        config = (
            f"FSDP {dp}{f' x CP {cp}' if cp > 1 else ''} TP 8 (async) PP 8 {schedule} ({m} micro-batches), "
            f"{seq // 1024}K tokens, local batch {local}, full recompute, {_techniques(True, True)}"
        )
        rows.append(_scored("torchtitan Llama 3.1 405B", 512, config, tps, plan, memory, digits=1))
    return rows


def h200_rows() -> list[dict[str, object]]:
    """Trainy's June 2025 runs on H200 hosts: FSDP over 32 and 64 GPUs, compiled with Float8.
    Its FP8 all-gathers of the weights are priced as bf16 gathers (autopar's runtime gathers
    bf16), which the backward and forward hide in both cases at this size."""
    rows = []
    for hosts, tps, memory in TORCHTITAN_H200:
        gpus = 8 * hosts
        fixed = {"micro_batch_size": 2, "recompute": "op", "zero_stage": 3, "compile": True, "fp8": True}
        plan = autopar.estimate(
            llama31("8B"), autopar.preset("hgx-h200", nodes=hosts), fixed, global_batch_size=2 * gpus, seq_len=SEQ
        )
        config = (
            f"FSDP {gpus} (ZeRO-3) local batch 2, per-op selective recompute, {_techniques(True, True)} "
            "(its FP8 all-gathers priced as bf16)"
        )
        rows.append(_scored("torchtitan Llama 3.1 8B (H200, Trainy)", gpus, config, tps, plan, memory))
    return rows


def torchtitan_rows() -> list[dict[str, object]]:
    """Every torchtitan row, in the order above."""
    return fsdp_rows() + tensor_parallel_rows() + context_parallel_rows() + llama405b_rows() + h200_rows()
