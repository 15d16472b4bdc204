"""Hand-built reports with known numbers, for tests that must not depend on timing noise."""

from __future__ import annotations

from autopar.profiles.network_section import CommPoint, CommSeries, LinkFit, NetworkProfile
from autopar.profiles.report import ProfileReport
from autopar.profiles.sections import (
    AttentionPoint,
    BandwidthPoint,
    DeviceProfile,
    MatmulPoint,
    ModelProfile,
    Provenance,
    Timing,
    UnitMeasurement,
    WorkItem,
)


def prov(host: str = "testhost", created: str = "2026-11-29T12:00:00+00:00") -> Provenance:
    return Provenance(
        host=host,
        platform="Linux-test",
        cpu="Test CPU",
        cpu_count=2,
        memory_bytes=24.0 * 2**30,
        accelerator="none",
        software={"python": "3.11.7", "torch": "2.13.0+cpu"},
        created_utc=created,
        command="test",
    )


def exact(seconds: float) -> Timing:
    return Timing(median_s=seconds, min_s=seconds, max_s=seconds, repeats=3)


def device(
    *,
    rate_flop_per_s: float = 1e11,
    bandwidth: float = 1e10,
    kind: str = "cpu",
    dtypes=("fp32",),
    memory_bytes: float = 24.0 * 2**30,
    host: str = "testhost",
    attention_flop_per_s: tuple[float, ...] = (),
) -> ProfileReport:
    """A device whose matmuls all run at ``rate_flop_per_s`` (a flat curve), and whose
    causal bf16 attention runs at the given rates, one shape each (none: not measured)."""
    points = tuple(
        MatmulPoint(dtype=dt, m=n, n=n, k=n, flops=2.0 * n**3, time=exact(2.0 * n**3 / rate_flop_per_s))
        for dt in dtypes
        for n in (64, 256, 1024)
    )
    bw = tuple(
        BandwidthPoint(
            kernel=k, array_bytes=float(2**26), moved_bytes=float(m * 2**26), time=exact(m * 2**26 / bandwidth)
        )
        for k, m in (("copy", 2), ("add", 3))
    )
    attention = tuple(
        AttentionPoint(
            dtype="bf16", batch=8 // 2**i, heads=32, seq_len=2048 * 2**i, head_dim=128, flops=1e12, time=exact(1e12 / r)
        )
        for i, r in enumerate(attention_flop_per_s)
    )
    return ProfileReport(
        device=DeviceProfile(
            name="Test device",
            kind=kind,
            threads=1,
            memory_bytes=memory_bytes,
            memory_shared=kind == "cpu",
            reserved_bytes=0.0 if kind == "cpu" else 2.0**30,
            timer="wall-clock",
            matmul=points,
            bandwidth=bw,
            memory_bandwidth_bytes_per_s=bandwidth,
            attention=attention,
            provenance=prov(host),
        )
    )


def layers(
    *,
    fwd_s: float = 0.02,
    bwd_s: float = 0.04,
    matmul_flops: float = 1e9,
    other_flops: float = 0.0,
    nbytes: float = 1e6,
    kind: str = "cpu",
) -> ProfileReport:
    """One block unit measured at ``fwd_s``/``bwd_s`` with one kernel of known work."""
    unit = UnitMeasurement(
        fqn="layers.0",
        signature="sig-block",
        instances=("layers.0", "layers.1"),
        modules=("layers.0",),
        fwd=exact(fwd_s),
        bwd=exact(bwd_s),
        fwd_flops=matmul_flops,
        bwd_flops=2 * matmul_flops,
        param_bytes=4096.0,
        saved_bytes=1024.0,
        peak_bytes=2048.0,
        work=(WorkItem(name="w1", matmul_flops=matmul_flops, other_flops=other_flops, bytes=nbytes),),
    )
    return ProfileReport(
        layers=ModelProfile(
            model="Toy",
            batch=2,
            seq_len=16,
            sample_shape=(2, 16),
            dtype="fp32",
            device="Test device",
            device_kind=kind,
            threads=1,
            timer="wall-clock",
            warmup=1,
            units=(unit,),
            provenance=prov(),
        )
    )


def network(
    *,
    intra: tuple[float, float] | None = (1e-5, 1e9),
    inter: tuple[float, float] | None = (5e-5, 1e8),
    node_of_rank: tuple[str, ...] = ("a", "a", "b", "b"),
    kind: str = "cpu",
    per_op: dict[str, tuple[float, float]] | None = None,
    tp_overhead_s: float = 0.0,
    fsdp_overhead_s: float = 0.0,
    memory_share: float = 1.0,
    sync_noise_s_per_sqrt_s: float = 0.0,
    fsdp_copy_bytes_per_s: float = 0.0,
    fsdp_tensor_overhead_s: float = 0.0,
    sync_speed_spread: float = 0.0,
) -> ProfileReport:
    """A network with the given fitted (alpha_s, bandwidth) per level, jointly over two
    ops; one series each; at every measured level, a single-op fit
    ``(alpha_s, bandwidth)`` for each op in ``per_op``; and the given framework
    overheads, FSDP copy rate, memory share and sync noise."""
    fits = []
    series = []
    for level, fit in (("intra", intra), ("inter", inter)):
        if fit is None:
            continue
        alpha, bw = fit
        fits.append(
            LinkFit(
                level=level,
                ops=("all_reduce", "all_gather"),
                alpha_s=alpha,
                bandwidth_bytes_per_s=bw,
                rms_rel_error=0.01,
                points=8,
            )
        )
        fits += [
            LinkFit(level=level, ops=(op,), alpha_s=a, bandwidth_bytes_per_s=b, rms_rel_error=0.02, points=4)
            for op, (a, b) in (per_op or {}).items()
        ]
        pts = tuple(
            CommPoint(
                nbytes=float(s),
                time=exact(s / bw + 2 * alpha),
                algbw_bytes_per_s=s / (s / bw + 2 * alpha),
                busbw_bytes_per_s=s / (s / bw + 2 * alpha),
            )
            for s in (2**10, 2**20)
        )
        per_node, nodes = (2, 1) if level == "intra" else (1, 2)
        series.append(
            CommSeries(
                op="all_reduce",
                level=level,
                label=f"{level} group",
                ranks=(0, 1),
                per_node=per_node,
                nodes=nodes,
                points=pts,
            )
        )
    return ProfileReport(
        network=NetworkProfile(
            backend="gloo",
            device_kind=kind,
            world_size=len(node_of_rank),
            node_of_rank=node_of_rank,
            series=tuple(series),
            fits=tuple(fits),
            tp_overhead_s=tp_overhead_s,
            fsdp_overhead_s=fsdp_overhead_s,
            fsdp_tensor_overhead_s=fsdp_tensor_overhead_s,
            memory_share=memory_share,
            sync_noise_s_per_sqrt_s=sync_noise_s_per_sqrt_s,
            sync_speed_spread=sync_speed_spread,
            fsdp_copy_bytes_per_s=fsdp_copy_bytes_per_s,
            provenance=prov(),
        )
    )


def full() -> ProfileReport:
    """Every section."""
    return ProfileReport.merge(device(), layers(), network())
