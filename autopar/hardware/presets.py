"""Preset clusters, and cluster specs on the command line. Every number names its source.

Bandwidths follow the convention of :mod:`autopar.hardware.links`: achievable bus
bandwidth per device in one direction. Datasheets give line rates; the achievable
fraction comes from published nccl-tests results and is stated next to each number.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from autopar.errors import ClusterError
from autopar.hardware.cluster import Cluster, load_cluster
from autopar.hardware.device import CPU_PROCESS, DeviceMemory, DeviceSpec, HostEffects, Roofline, time_shared
from autopar.hardware.links import LinkSpec
from autopar.vocab import DType

GIB = 2**30
MIB = 2**20

_A100_DATASHEET = "NVIDIA A100 Tensor Core GPU datasheet (2021): dense BF16/FP16 312 TFLOP/s, TF32 156, FP32 19.5"
_H100_DATASHEET = (
    "NVIDIA H100 Tensor Core GPU datasheet (SXM5): dense BF16/FP16 989 TFLOP/s (1979 with sparsity), dense "
    "FP8 1979, FP32 67"
)
_H200_DATASHEET = (
    "NVIDIA H200 Tensor Core GPU datasheet (SXM): dense BF16/FP16 989 TFLOP/s, dense FP8 1979, FP32 67, 141 GB "
    "HBM3e at 4.8 TB/s"
)
_V100_DATASHEET = (
    "NVIDIA V100 Tensor Core GPU datasheet (SXM2): FP16 tensor 125 TFLOP/s, FP32 15.7, 900 GB/s HBM2; no BF16"
)
_GPU_RESERVE = 1.5 * GIB
_GPU_FRAGMENTATION = 0.05
_RESERVE_NOTE = (
    "1.5 GiB reserved: CUDA context (~0.5 GiB) and NCCL communicator buffers (~1 GiB over the "
    "TP/DP/PP groups), which torch.cuda memory statistics do not show; 5% of allocations lost to "
    "caching-allocator fragmentation"
)
_EFFICIENCY = (
    "matmul 0.8 of peak: large cuBLAS GEMMs reach 75-90% of dense peak (NVIDIA Matrix Multiplication "
    "Background guide); memory 0.8 of peak: STREAM-like kernels reach ~80% of HBM bandwidth"
)

_A100_ATTENTION = (
    "fused attention 0.25 of peak, forward and backward, on the FLOPs it computes (causal: half the scores; "
    "backward 2.5x the forward): torch's FlashAttention backend ran forward and backward at 78.6 TFLOP/s on "
    "sm80, its forward alone at 136.4 (pytorch/pytorch#192799)"
)
_HOPPER_ATTENTION = (
    "fused attention 0.19 of peak, forward and backward, on the FLOPs it computes (causal: half the scores; "
    "backward 2.5x the forward): torch's scaled_dot_product_attention runs FlashAttention-2 first, whose "
    "forward reached 329.5 TFLOP/s on H100 at batch 1, 24 heads, 4608 tokens, head 128 (0.333; tritonbench, "
    "pytorch/pytorch#142132; cuDNN's kernel and FlashAttention-3 reached 631), and whose forward and "
    "backward together run at 0.576 of its forward's rate (78.6 against 136.4 TFLOP/s, pytorch/pytorch#192799)"
)
_MAMF = "Bekman, ml-engineering, Maximum Achievable Matmul FLOPS table (best shape, torch 2.7)"


def _gpu_memory(mib: int) -> DeviceMemory:
    return DeviceMemory(capacity_bytes=mib * MIB, reserved_bytes=_GPU_RESERVE, fragmentation=_GPU_FRAGMENTATION)


def _a100(memory_mib: int, hbm_bytes_per_s: float, label: str) -> DeviceSpec:
    return DeviceSpec(
        name=f"A100-SXM4-{label}",
        roofline=Roofline(
            peak_flops={DType.BF16: 312e12, DType.FP16: 312e12, DType.FP32: 19.5e12},
            memory_bandwidth_bytes_per_s=hbm_bytes_per_s,
            attention_efficiency=0.25,
        ),
        memory=_gpu_memory(memory_mib),
        compiles=True,
        source=f"{_A100_DATASHEET}; memory {memory_mib} MiB as nvidia-smi reports; {_EFFICIENCY}; {_A100_ATTENTION}; "
        f"{_RESERVE_NOTE}",
    )


def _h100() -> DeviceSpec:
    return DeviceSpec(
        name="H100-SXM5-80GB",
        roofline=Roofline(
            peak_flops={DType.BF16: 989e12, DType.FP16: 989e12, DType.FP32: 67e12},
            memory_bandwidth_bytes_per_s=3.35e12,
            fp8_flops=1979e12,
            fp8_matmul_efficiency=0.709,
            attention_efficiency=0.19,
        ),
        async_tp=True,
        compiles=True,
        memory=_gpu_memory(81559),
        source=f"{_H100_DATASHEET}; HBM3 3.35 TB/s; memory 81559 MiB as nvidia-smi reports; {_EFFICIENCY}; "
        f"FP8 matmul 0.709 of peak ({_MAMF}: 1402.6 of 1979 TFLOP/s; bf16 794.5 of 989, 0.803); "
        f"{_HOPPER_ATTENTION}; {_RESERVE_NOTE}",
    )


def _h200() -> DeviceSpec:
    return DeviceSpec(
        name="H200-SXM-141GB",
        roofline=Roofline(
            peak_flops={DType.BF16: 989e12, DType.FP16: 989e12, DType.FP32: 67e12},
            memory_bandwidth_bytes_per_s=4.8e12,
            fp8_flops=1979e12,
            fp8_matmul_efficiency=0.734,
            attention_efficiency=0.19,
        ),
        async_tp=True,
        compiles=True,
        memory=_gpu_memory(143771),
        source=f"{_H200_DATASHEET}; memory 143771 MiB as nvidia-smi reports; {_EFFICIENCY}; FP8 matmul 0.734 of "
        f"peak ({_MAMF}: 1453.4 of 1979 TFLOP/s); {_HOPPER_ATTENTION}; {_RESERVE_NOTE}",
    )


def _v100() -> DeviceSpec:
    return DeviceSpec(
        name="V100-SXM2-16GB",
        roofline=Roofline(
            peak_flops={DType.FP16: 125e12, DType.FP32: 15.7e12},
            memory_bandwidth_bytes_per_s=900e9,
            matmul_efficiency=0.75,
        ),
        memory=_gpu_memory(16160),
        preferred_dtype=DType.FP16,
        compiles=True,
        source=f"{_V100_DATASHEET}; memory 16160 MiB as nvidia-smi reports; matmul 0.75 of peak (V100 "
        f"tensor-core GEMMs reach 70-80%), memory 0.8 of peak; {_RESERVE_NOTE}",
    )


_NVLINK3 = LinkSpec(
    bandwidth_bytes_per_s=230e9,
    latency_s=2e-6,
    source="NVLink3 + NVSwitch, 300 GB/s per direction (600 GB/s total, A100 datasheet); nccl-tests all_reduce "
    "busbw on DGX A100 reaches ~230 GB/s; ~2 us per hop (NCCL LL protocol)",
)
_NVLINK4 = LinkSpec(
    bandwidth_bytes_per_s=360e9,
    latency_s=2e-6,
    source="NVLink4 + NVSwitch, 450 GB/s per direction (900 GB/s total, H100/H200 datasheets); nccl-tests "
    "all_reduce busbw without NVLS ~360 GB/s; ~2 us per hop",
)
_NVLINK2_HCM = LinkSpec(
    bandwidth_bytes_per_s=120e9,
    latency_s=3e-6,
    source="NVLink2 hybrid cube-mesh, 150 GB/s per direction (300 GB/s total, V100 datasheet); ~0.8 reached "
    "by NCCL rings on DGX-1/p3.16xlarge",
)
_HDR_IB = LinkSpec(
    bandwidth_bytes_per_s=22.5e9,
    latency_s=5e-6,
    source="DGX A100 datasheet: one 200 Gb/s HDR InfiniBand ConnectX-6 per GPU = 25 GB/s per direction; "
    "~90% achievable (nccl-tests); ~5 us per hop",
)
_NDR_IB = LinkSpec(
    bandwidth_bytes_per_s=45e9,
    latency_s=5e-6,
    source="DGX H100 / HGX H200 reference: one 400 Gb/s NDR InfiniBand ConnectX-7 per GPU = 50 GB/s per "
    "direction; ~90% achievable (nccl-tests); ~5 us per hop",
)
_P3_ETHERNET = LinkSpec(
    bandwidth_bytes_per_s=25e9 / 8 / 8 * 0.9,
    latency_s=30e-6,
    source="AWS p3.16xlarge: 25 Gb/s ENA per instance shared by 8 GPUs = 0.39 GB/s per GPU, ~90% "
    "achievable; TCP latency ~30 us",
)


def _dgx(name: str, device: DeviceSpec, intra: LinkSpec, inter: LinkSpec) -> Callable[[int, int], Cluster]:
    def build(nodes: int, devices_per_node: int) -> Cluster:
        return Cluster(
            name=f"{name} x {nodes}",
            nodes=nodes,
            devices_per_node=devices_per_node,
            device=device,
            intra_node=intra,
            inter_node=inter,
        )

    return build


_PROCESS_BYTES = 512 * MIB
"""A Python process with torch and gloo loaded holds ~300-400 MiB outside any tensor."""


def local_cpu_device(processes: int) -> DeviceSpec:
    """One of ``processes`` CPU processes of this machine (every node of a ``local-cpu``
    cluster runs here): memory is the machine's RAM split over the processes, and where
    the processes outnumber the cores, each gets its share of a core.

    The FLOP/s and bandwidth are nominal figures for one x86-64 core with AVX2/AVX-512
    FMA and one DDR channel; ``autopar profile device`` measures the real ones.
    """
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = 16 * GIB
    if ram / processes <= _PROCESS_BYTES:
        raise ClusterError(
            f"local-cpu with {processes} processes leaves {ram / processes / MIB:.0f} MiB of this machine's "
            f"{ram / GIB:.1f} GiB per process, less than the {_PROCESS_BYTES // MIB} MiB each process needs "
            f"before any tensor; use fewer than {ram // _PROCESS_BYTES} processes."
        )
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    share = min(1.0, cores / processes)
    device = DeviceSpec(
        name=CPU_PROCESS,
        roofline=Roofline(
            peak_flops={DType.FP32: 60e9, DType.BF16: 30e9},
            memory_bandwidth_bytes_per_s=10e9,
            matmul_efficiency=1.0,
            memory_efficiency=1.0,
        ),
        memory=DeviceMemory(capacity_bytes=float(ram) / processes - _PROCESS_BYTES),
        host=HostEffects(
            op_overhead_s=5e-6,
            tp_overhead_s=150e-6,
            sync_noise_s_per_sqrt_s=0.01,
            optimizer_bytes_per_s=7e9,
            exposed_weight_traffic=True,
        ),
        comm_overlap=0.0,
        preferred_dtype=DType.FP32,
        source="nominal: ~60 GFLOP/s fp32 per core (oneDNN/MKL SGEMM on one AVX-512 core), bf16 half of that "
        "without AMX; ~10 GB/s per core; memory = physical RAM / processes less 512 MiB for the "
        "interpreter and libraries, so memory per device counts tensor allocations only (what the "
        "runtime measures); framework overhead ~5 us per op and ~150 us per DTensor layer forward, as "
        "'autopar profile device' measured on a 2-core VM; ranks finishing the same work ~10 ms per "
        "sqrt(s) of it apart (2 processes on that VM: 5-18 ms over runs, 4: ~30 ms; 'autopar profile "
        "network'); no overlap of communication with compute (gloo uses the same cores); weight and "
        "gradient-accumulation traffic not hidden under the arithmetic (BLAS packs each weight, eager "
        "autograd accumulates in a pass of its own); an AdamW step at ~7 GB/s of its ideal traffic (a "
        "dozen eager passes). Measure with 'autopar profile device' for real numbers.",
    )
    return time_shared(device, share, f"{processes} processes time-share {cores} cores: {share:.2g} of a core each")


def _local_cpu(nodes: int, devices_per_node: int) -> Cluster:
    loopback = LinkSpec(
        bandwidth_bytes_per_s=0.4e9,
        latency_s=0.5e-3,
        source="gloo over loopback TCP on a 2-core VM: all_reduce busbw 0.3-0.9 GB/s, ~1 ms for 1 KB at 2 "
        "processes; measure with 'autopar profile network'",
    )
    return Cluster(
        name=f"local-cpu x {nodes}",
        nodes=nodes,
        devices_per_node=devices_per_node,
        device=local_cpu_device(nodes * devices_per_node),
        intra_node=loopback,
        inter_node=loopback,
    )


_PRESETS: dict[str, tuple[Callable[[int, int], Cluster], Callable[[], int], str]] = {
    "dgx-a100-80gb": (
        _dgx("dgx-a100-80gb", _a100(81920, 2.039e12, "80GB"), _NVLINK3, _HDR_IB),
        lambda: 8,
        "NVIDIA DGX A100: 8x A100 80GB, NVLink3/NVSwitch, 8x HDR InfiniBand",
    ),
    "dgx-a100-40gb": (
        _dgx("dgx-a100-40gb", _a100(40960, 1.555e12, "40GB"), _NVLINK3, _HDR_IB),
        lambda: 8,
        "NVIDIA DGX A100: 8x A100 40GB, NVLink3/NVSwitch, 8x HDR InfiniBand",
    ),
    "dgx-h100": (
        _dgx("dgx-h100", _h100(), _NVLINK4, _NDR_IB),
        lambda: 8,
        "NVIDIA DGX H100: 8x H100 SXM5 80GB, NVLink4/NVSwitch, 8x NDR InfiniBand",
    ),
    "hgx-h200": (
        _dgx("hgx-h200", _h200(), _NVLINK4, _NDR_IB),
        lambda: 8,
        "NVIDIA HGX H200: 8x H200 SXM 141GB, NVLink4/NVSwitch, 8x NDR InfiniBand",
    ),
    "p3.16xlarge": (
        _dgx("p3.16xlarge", _v100(), _NVLINK2_HCM, _P3_ETHERNET),
        lambda: 8,
        "AWS p3.16xlarge: 8x V100 16GB, NVLink2 hybrid cube-mesh, 25 Gb/s Ethernet",
    ),
    "local-cpu": (_local_cpu, lambda: os.cpu_count() or 1, "this machine: one gloo process per core, loopback TCP"),
}


def preset_names() -> dict[str, str]:
    """Preset name -> one-line description."""
    return {name: desc for name, (_, _, desc) in _PRESETS.items()}


def preset(name: str, *, nodes: int = 1, devices_per_node: int | None = None) -> Cluster:
    """A cluster of ``nodes`` nodes of a known type (see :func:`preset_names`);
    ``devices_per_node`` overrides the node's device count (e.g. 4 processes of
    ``local-cpu``)."""
    if not isinstance(name, str) or name not in _PRESETS:
        known = ", ".join(sorted(_PRESETS))
        raise ClusterError(
            f"unknown cluster preset {name!r}; known presets: {known}. Or give a cluster JSON file "
            f"(--cluster cluster.json; autopar.load_cluster in Python)."
        )
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise ClusterError(f"nodes={nodes!r} is not allowed for preset {name!r}: it must be a positive integer.")
    build, default_dpn, _ = _PRESETS[name]
    dpn = default_dpn() if devices_per_node is None else devices_per_node
    if isinstance(dpn, bool) or not isinstance(dpn, int) or dpn < 1:
        raise ClusterError(
            f"devices_per_node={dpn!r} is not allowed for preset {name!r}: it must be a positive integer."
        )
    return build(nodes, dpn)


def parse_cluster(spec: str) -> Cluster:
    """A cluster from a command-line spec: ``"dgx-a100-80gb:128"`` (preset:nodes), a
    preset name, or a cluster file's path."""
    if not isinstance(spec, str):
        raise ClusterError(
            f"cluster spec {spec!r} is not allowed: give 'preset:nodes' (e.g. 'dgx-h100:16') or a file path."
        )
    if spec.endswith(".json") or "/" in spec or Path(spec).exists():  # no preset name has a slash
        return load_cluster(spec)
    name, colon, count = spec.partition(":")
    if not colon:
        return preset(name)
    try:
        nodes = int(count)
    except ValueError:
        raise ClusterError(
            f"cluster spec {spec!r}: the node count after ':' must be an integer, e.g. 'dgx-a100-80gb:128'."
        ) from None
    return preset(name, nodes=nodes)
