"""Published training runs for ``planner_faithful.py``: what each source states, the
models they trained (built on the meta device), the clusters they ran on, and the FLOP
counts they divided by.

Every number here is copied from the source named above its table; where a source
leaves a choice unsaid, the table says so and ``planner_faithful.py`` lets
``autopar.plan`` pick it.
"""

from __future__ import annotations

from dataclasses import replace

import autopar
from autopar.vocab import DType

# Narayanan et al. 2021, table 1 (A100 80GB, fp16, full recomputation, materialized attention).
# (label, hidden, heads, layers, gpus, batch, tp, pp, published TFLOP/s per GPU incl. recompute)
NARAYANAN_2021 = [
    ("1.7B", 2304, 24, 24, 32, 512, 1, 1, 137),
    ("3.6B", 3072, 32, 30, 64, 512, 2, 1, 138),
    ("7.5B", 4096, 32, 36, 128, 512, 4, 1, 142),
    ("18.4B", 6144, 48, 40, 256, 1024, 8, 1, 135),
    ("39.1B", 8192, 64, 48, 512, 1536, 8, 2, 138),
    ("76.1B", 10240, 80, 60, 1024, 1792, 8, 4, 140),
    ("145.6B", 12288, 96, 80, 1536, 2304, 8, 8, 148),
    ("310.1B", 16384, 128, 96, 1920, 2160, 8, 16, 155),
    ("529.6B", 20480, 128, 105, 2520, 2520, 8, 35, 163),
    ("1008B", 25600, 160, 128, 3072, 3072, 8, 64, 163),
]

# Llama Team 2024, table 4: (gpus, tp, cp, pp, dp, sequence length, sequences per dp rank, BF16 MFU %).
# The two 8K-token rows hold the global batch (2048 sequences) over 8,192 and 16,384 GPUs. Section
# 3.3.2 says how they ran: FSDP that "shards optimizer states and gradients, but for model shards we
# do not reshard after forward computation" (autopar's ZeRO-2); an interleaved schedule whose "first
# model chunk on the first stage has only the embedding" and last chunk only the output and loss, so
# one layer per chunk: 126 layers and those two on 16 x 8 stages (V = 8); and "sequences of 8K
# tokens without activation checkpointing". Micro-batches of one sequence.
LLAMA3_VIRTUAL_STAGES = 8
LLAMA3_2024 = [
    (8192, 8, 1, 16, 64, 8192, 32, 43),
    (16384, 8, 1, 16, 128, 8192, 16, 41),
    (16384, 8, 16, 16, 8, 131072, 16, 38),
]

# NVIDIA/Megatron-LM README.md, "Training Speed and Scalability" (commit f2e5db402c, 2024-07-15),
# table images/model_table.png: GPT models on H100, vocabulary 131,072, sequence 4096, data-parallel
# 48, Megatron-Core r0.8.0 with data-, tensor- and pipeline-parallel communication overlapped. The labels
# count untied embeddings (1.7B: 1.754B parameters untied, 1.485B tied; 7.1B: 7.12B against 6.58B; 177B:
# 177.1B against 175.5B), so the output layer holds its own weight.
# Recomputation, micro-batch and schedule are not stated.
# (label, heads, hidden, layers, tp, pp, gpus, batch, published TFLOP/s per GPU, published MFU %)
MEGATRON_CORE_2024 = [
    ("1.7B", 16, 2048, 24, 1, 1, 48, 192, 408.8, 41),
    ("7.1B", 32, 4096, 30, 2, 1, 96, 192, 465.9, 47),
    ("16B", 48, 6144, 32, 4, 1, 192, 192, 489.1, 49),
    ("32B", 56, 7168, 48, 8, 1, 384, 192, 459.6, 46),
    ("70B", 64, 8192, 84, 8, 2, 768, 384, 419.7, 42),
    ("119B", 80, 10240, 92, 8, 4, 1536, 768, 420.5, 43),
    ("177B", 96, 12288, 96, 8, 6, 2304, 1152, 432.8, 44),
    ("314B", 128, 16384, 96, 8, 8, 3072, 1536, 474.4, 48),
    ("462B", 144, 18432, 112, 8, 16, 6144, 3072, 459.9, 47),
]

# Same README, strong scaling: "the standard GPT-3 model (... slightly more than 175 billion
# parameters due to larger vocabulary size) from 96 H100 GPUs to 4608 GPUs, using the same batch
# size of 1152 sequences throughout ... a reduction in MFU from 47% to 42%". The degrees are not
# stated; the table's 177B row (the same model and batch on 2304 GPUs) uses tp=8 pp=6.
# (gpus, published MFU %)
MEGATRON_CORE_STRONG = [(96, 47), (4608, 42)]

# NVIDIA/Megatron-LM megatron/core/transformer/moe/README.md at commit 0b981f9c53 (2024-08-02):
# "boosts Mixtral 8X7B bf16 training to achieve 438 TFLOPS as of MCore v0.8", and its "Reference
# Best Parallel Mapping" of MCore v0.8: Mixtral 8x7B (dropless, all-to-all dispatcher, BF16,
# vocabulary 32K) on 64 H100 80GB, sequence 4096, TP 1, EP 8, PP 4, VP 8, MBS 1, GBS 256.
MIXTRAL_8X7B_TFLOPS = 438.0

# bigscience-workshop/bigscience train/tr11-176B-ml/README.md (commit 00327f8c): BLOOM 176B on 384
# A100 80GB (48 nodes, "4 OmniPath links" per node), TP 4, PP 12, DP 8, MBS 2, GBS 2048, sequence
# 2048, bf16, Megatron-DeepSpeed with activation checkpointing and its own ZeRO-1; hidden 14336,
# 70 layers, 112 heads, vocabulary padded to 250880 (tied). Section "Important checkpoints": the
# log line at iteration 85376 reads "elapsed time per iteration (s): 104.70 ... TFLOPs: 149.77".
BLOOM_STEP_S = 104.70
BLOOM_TFLOPS = 149.77

# Smith et al. 2022, "Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B", section 2.4, as
# quoted by cli99/llm-analysis examples/megatron-turing-nlg/README.md (commit b60b392f): global batch
# 1920 on 280, 350 and 420 DGX A100 servers, 60.1, 50.2 and 44.4 s per iteration (126, 121, 113
# TFLOP/s per GPU); tensor 8 and pipeline 35 from the same folder's run_train.sh. The model as in
# Korthikanti et al. 2022 (hidden 20480, 105 layers, 128 heads, sequence 2048). One model at one
# batch over growing GPU counts: a strong-scaling series. (gpus, published s/step, TFLOP/s per GPU)
# Hardware: Selene's DGX A100 servers, eight 80 GB A100 each (Microsoft Research blog, "Using DeepSpeed
# and Megatron to Train Megatron-Turing NLG 530B", 2021-10-11; llm-analysis's example assumes 40 GB).
# ZeRO stage 1: DeepSpeed's PipelineEngine refuses ZeRO-2 and -3 ("ZeRO-2 and ZeRO-3 are incompatible
# with pipeline parallelism", deepspeed/runtime/pipe/engine.py).
MT_NLG_2022 = [(2240, 60.1, 126), (2800, 50.2, 121), (3360, 44.4, 113)]

# pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, tables 1 and 3: Llama 3.1 8B,
# FSDP, local batch 2, per-operator selective activation checkpointing (selective_ac_option 'op'
# in the train config), eager, with torch.compile, and with
# torch.compile and Float8 (torchao, tensorwise), on H100 96GB HBM2e (2.4 TB/s, 500 W, 400 Gb/s RDMA
# per GPU). Sequence 8192 from train_configs/llama3_8b.toml at the torchtitan commit the document
# names (9dec370).
# (gpus, global batch, compiled, FP8, published tokens/s per GPU, published memory GiB)
TORCHTITAN_2024 = [
    (8, 16, False, False, 5762, 82.4),
    (8, 16, True, False, 6667, 77.0),
    (8, 16, True, True, 8532, 76.8),
    (128, 256, False, False, 5605, 67.0),
    (128, 256, True, False, 6514, 62.0),
    (128, 256, True, True, 8380, 61.8),
]

# Same document, table 4: Llama 3.1 70B on 256 H100 (FSDP 32, TP 8), local batch 16 per data-parallel
# rank, full activation checkpointing, torch.compile + Float8: 829 tokens/s per GPU, 71.9 GiB; with
# AsyncTP, 876 tokens/s per GPU, 67.6 GiB.
# pytorch/torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md (same hosts), the vanilla
# TP columns: Llama 3 70B on 256 H100 (FSDP 32, TP 8, compile, full AC, local batch 16) and Llama 3 8B
# on 64 H100 (FSDP 8, TP 8, compile, per-op SAC, local batch 12), bf16 and float8 tensorwise.
# Sequence 8192 from the llama3 train configs at the commits the documents name (9dec370, 820504e).
# (model, gpus, local batch, recompute, Float8, async TP, published tokens/s per GPU, published memory GiB)
TORCHTITAN_TP = [
    ("70B", 256, 16, "full", True, False, 829.0, 71.9),
    ("70B", 256, 16, "full", True, True, 876.0, 67.6),
    ("70B", 256, 16, "full", False, False, 597.3, None),
    ("70B", 256, 16, "full", True, False, 809.8, None),
    ("70B", 256, 16, "full", False, True, 652.4, None),
    ("70B", 256, 16, "full", True, True, 942.4, None),
    ("8B", 64, 12, "op", False, False, 4378.0, None),
    ("8B", 64, 12, "op", True, False, 5078.1, None),
    ("8B", 64, 12, "op", False, True, 4809.4, None),
    ("8B", 64, 12, "op", True, True, 5570.1, None),
]

# llama3_h100_202412_torchtitan.md tables 5 and 6: Llama 3.1 405B on 512 H100, TP 8 and PP 8, torch.compile
# + Float8 (with FP8 all-gathers, llama3_405b.toml) + async TP, full activation checkpointing. Stages: 1 per
# rank (1F1B) or 2 (interleaved, generate_split_points at commit 9dec370). Micro-batches are not stated, and
# neither the document nor llama3_405b.toml sets them: the code's default there is the pipeline degree, 8
# (pipeline_llama.py; its help text says "the number of pipeline stages"), for both schedules. The published
# memory does not tell the count apart: interleaved's 72.7 GiB is predicted 64.2 for 8 micro-batches of 4 and
# 72.0 for 16 of 2, where the 1F1B row (8 of 4) is predicted 6.0 under its own. Table 5: FSDP 8, local batch
# 32, sequence 8192.
# Table 6: 1F1B, FSDP x CP = 8, local batch 8, one sequence of 32K-256K tokens.
# (schedule, stages per rank, cp, sequence length, local batch, published tokens/s per GPU, memory GiB)
TORCHTITAN_405B = [
    ("1f1b", 1, 1, 8192, 32, 100.0, 82.5),
    ("interleaved-1f1b", 2, 1, 8192, 32, 128.0, 72.7),
    ("1f1b", 1, 1, 32768, 8, 76.0, 75.3),
    ("1f1b", 1, 2, 65536, 8, 47.0, 75.9),
    ("1f1b", 1, 4, 131072, 8, 31.0, 77.1),
    ("1f1b", 1, 8, 262144, 8, 16.0, 84.9),
]

# llama3_h100_202412_torchtitan.md table 2: Llama 3.1 8B on 8 H100, FSDP x CP = 8, local batch 1, full
# activation checkpointing, torch.compile + Float8, one sequence of 32K-256K tokens per FSDP rank.
# (cp, sequence length, published tokens/s per GPU, published memory GiB)
TORCHTITAN_CP = [
    (1, 32768, 3890.0, 83.9),
    (2, 65536, 2540.0, 84.2),
    (4, 131072, 1071.0, 84.0),
    (8, 262144, 548.0, 84.5),
]

# pytorch/torchtitan benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md: Llama 3.1 8B with FSDP on
# 4 and 8 hosts of 8 H200 (NVLink, 400 Gb/s per GPU), local batch 2, torch.compile + Float8 (with
# FP8 all-gathers), per-op selective checkpointing and sequence 8192 from the llama3_8b train config
# at the commit it names (e7c0cae). (hosts, published tokens/s per GPU, published memory GiB)
TORCHTITAN_H200 = [(4, 10938.0, 47.96), (8, 10753.0, 46.97)]

# NVIDIA/Megatron-LM examples/llama/README.md (commit 20441fa1cc), "FP8 Performance": Llama 3 8B, 70B and
# 405B on H100 in Transformer Engine's FP8 ("hybrid"), sequence 8192, micro-batch 1, with the table's global
# batch and degrees. Its configurations "follow those defined in NeMo Framework's performance scripts":
# NVIDIA/NeMo scripts/performance/recommended_model_configs/model_configs_h100.csv (commit 000e8c17a3) lists
# the same rows with no recomputation (recompute_layers 0), no activation offload and no CUDA graphs, and
# scripts/performance/llm/pretrain_llama3_70b.py (commit 07a643a82d) and pretrain_llama31_405b.py turn on
# Transformer Engine's tensor-parallel communication overlap (userbuffers) for FP8 on H100. The same scripts
# reduce and accumulate gradients in bf16: scripts/performance/helpers.py, set_precision_configs, sets
# recipe.trainer.plugins.grad_reduce_in_fp32 = False for bf16 and FP8 runs alike (since commit 78f445f8,
# 2025-01-30; the Llama 3 recipes' pretrain_performance_optimizations set it too). Which commit of the
# scripts made the published table is not stated.
# (label, dim, layers, heads, kv heads, ffn, gpus, global batch, tp, pp, cp, vp, published tokens/s per GPU)
MEGATRON_FP8_LLAMA3 = [
    ("8B", 4096, 32, 32, 8, 14336, 8, 128, 1, 1, 2, 1, 13812.0),
    ("70B", 8192, 80, 64, 8, 28672, 64, 128, 4, 8, 1, 5, 1621.0),
    ("405B", 16384, 126, 128, 8, 53248, 1024, 512, 8, 8, 2, 8, 315.0),
]

# Published runs not scored yet (their configuration left unsaid, or what autopar does not model): listed
# after the table, not scored. (source, configuration, published)
NOT_SCORED = [
    (
        "Zhang et al. 2022, OPT (section 2.4 Training Efficiency)",
        "OPT-175B, 992 A100 80GB, FSDP + Megatron tensor parallelism, FP16 weights (degrees, batch not stated)",
        "up to 147 TFLOP/s per GPU (a maximum, and no configuration to estimate)",
    ),
]


def megatron_flops(
    batch: int,
    seq: int,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    ffn: int,
    vocab: int,
    *,
    topk=1,
    glu=False,
) -> float:
    """FLOPs of one step as Megatron-LM counts them for its TFLOP/s and MFU (Narayanan et al.
    2021, appendix, extended to grouped-query attention, gated MLPs and top-k experts): every
    GEMM three times, attention scores over the whole ``seq x seq`` square, no recomputation.
    Assumes ``heads x head dim == hidden``, true of every model it is used for here."""
    attention = 1 + kv_heads / heads + seq / hidden
    mlp = ffn / hidden * topk * (1.5 if glu else 1.0)
    logits = vocab / (2 * layers * hidden)
    return 12 * batch * seq * layers * hidden**2 * (attention + mlp + logits)


def gpt(hidden: int, heads: int, layers: int, *, vocab: int = 51200, seq: int = 2048, tied: bool = True):
    """A GPT on the meta device, its output layer sharing the embedding's weight (``tied``)
    or holding its own."""
    import torch

    from autopar.models.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=vocab, seq_len=seq, dim=hidden, n_layers=layers, n_heads=heads, tie_embeddings=tied)
    with torch.device("meta"):
        return GPT(cfg)


def llama(dim: int, layers: int, heads: int, kv_heads: int, ffn: int, vocab: int, seq: int):
    """A Llama on the meta device."""
    import torch

    from autopar.models.llama import Llama, LlamaConfig

    cfg = LlamaConfig(
        dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=kv_heads, ffn_dim=ffn, vocab_size=vocab, seq_len=seq
    )
    with torch.device("meta"):
        return Llama(cfg)


def mixtral_8x7b(seq: int):
    """Mixtral 8x7B (Jiang et al. 2024: dim 4096, 32 layers, 32 heads, 8 KV heads, 8 experts of
    width 14336, top-2, vocabulary 32000) with autopar's capacity-bounded experts at capacity
    factor 1: the balanced cost of a dropless layer."""
    import torch

    from autopar.models.moe import MoEConfig, MoELlama

    cfg = MoEConfig(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=32000, seq_len=seq, rope_theta=1e6
    )
    with torch.device("meta"):
        return MoELlama(cfg)


# The dense peaks (TFLOP/s) of the two H100 parts torchtitan's footnote 2 brackets its 500 W HBM2e
# H100 between: SXM5 (H100 datasheet) and NVL (the same datasheet's NVL column, 1671 BF16 and 3341
# FP8 with sparsity, halved). The document does not know the exact value.
H100_SXM_PEAKS = (989.0, 1979.0)
H100_NVL_PEAKS = (835.5, 1670.5)

HOPPER_FUSED_ATTENTION = 0.38
"""Fraction of the bf16 peak a Hopper-native fused attention kernel reaches, forward and backward
(the presets' convention, ``Roofline.attention_efficiency``), for the runs that did not use torch's
scaled_dot_product_attention: Transformer Engine's cuDNN attention (Megatron-Core) and Meta's own
(Llama 3, kernel unstated). cuDNN's Hopper kernels run training shapes 1.7-2.3x faster than the
FlashAttention-2 torch runs (huggingface/transformers#48163): 2.0 x the H100 preset's 0.19."""


def with_attention(cluster: autopar.Cluster, efficiency: float) -> autopar.Cluster:
    """``cluster`` whose devices' fused attention kernel reaches ``efficiency`` of peak."""
    device = cluster.device
    roofline = replace(device.roofline, attention_efficiency=efficiency)
    return replace(cluster, device=replace(device, roofline=roofline))


def grand_teton_h100(nodes: int, peak_tflops: tuple[float, float] | None = None) -> autopar.Cluster:
    """torchtitan's H100 hosts as its benchmark describes them: the DGX H100 preset with 96 GB
    of HBM2e at 2.4 TB/s per GPU (same NVLink, 400 Gb/s per GPU between hosts), at the (bf16,
    FP8) dense peaks ``peak_tflops``; by default the middle of the range its footnote gives
    for the 500 W part (between the SXM and NVL peaks), within 9.2% of either end. Its
    attention is torch's scaled_dot_product_attention, as the preset assumes."""
    low, high = H100_NVL_PEAKS, H100_SXM_PEAKS
    bf16, fp8 = peak_tflops or ((low[0] + high[0]) / 2, (low[1] + high[1]) / 2)
    base = autopar.preset("dgx-h100", nodes=nodes)
    device = base.device
    peaks = {
        dtype: bf16 * 1e12 if dtype is not DType.FP32 else flops for dtype, flops in device.roofline.peak_flops.items()
    }
    device = replace(
        device,
        name="H100-96GB-HBM2e-500W",
        roofline=replace(device.roofline, memory_bandwidth_bytes_per_s=2.4e12, peak_flops=peaks, fp8_flops=fp8 * 1e12),
        memory=replace(device.memory, capacity_bytes=96e9),
    )
    return replace(base, name=f"grand-teton-h100 x {nodes}", device=device)
