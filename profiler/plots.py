"""The report's figures as PNG bytes.

Built with ``matplotlib.figure.Figure`` directly, never ``pyplot``: pyplot keeps global
figure state and picks a GUI backend, neither of which a library should touch.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

from matplotlib.figure import Figure

from autopar.profiles.network_section import NetworkProfile
from autopar.profiles.sections import DeviceProfile, ModelProfile
from profiler.fit import coefficients

_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b")


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return buf.getvalue()


def matmul_curves(device: DeviceProfile) -> bytes:
    """Achieved FLOP/s against FLOPs per call, one line per precision, with each
    precision's best as a dashed line."""
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    for color, dt in zip(_COLORS, device.dtypes):
        pts = device.curve(dt)
        ax.plot([f for f, _ in pts], [r / 1e9 for _, r in pts], "o-", color=color, label=dt)
        ax.axhline(device.peak_flop_per_s(dt) / 1e9, color=color, linestyle="--", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("FLOPs per matmul call")
    ax.set_ylabel("achieved GFLOP/s")
    ax.set_title(f"Matmul throughput: {device.name}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return _png(fig)


def stream_bandwidth(device: DeviceProfile) -> bytes:
    """Streaming bandwidth against array size per kernel."""
    fig = Figure(figsize=(7, 3.5))
    ax = fig.subplots()
    for color, kernel in zip(_COLORS, ("copy", "add")):
        pts = sorted((b.array_bytes, b.achieved_bytes_per_s) for b in device.bandwidth if b.kernel == kernel)
        ax.plot([a / 2**20 for a, _ in pts], [r / 1e9 for _, r in pts], "o-", color=color, label=kernel)
    ax.axhline(
        device.memory_bandwidth_bytes_per_s / 1e9,
        color="grey",
        linestyle="--",
        linewidth=0.8,
        label="used by the cost model",
    )
    ax.set_xscale("log")
    ax.set_xlabel("array size (MiB)")
    ax.set_ylabel("GB/s")
    ax.set_title("Streaming memory bandwidth")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return _png(fig)


def unit_times(layers: ModelProfile) -> bytes:
    """Forward and backward time per distinct unit, and its share of the step."""
    units = layers.units
    names = [f"{u.fqn} (x{len(u.instances)})" for u in units]
    fig = Figure(figsize=(8, 0.5 + 0.45 * len(units)))
    ax = fig.subplots()
    ys = range(len(units))
    fwd = [u.fwd.median_s * 1e3 for u in units]
    bwd = [u.bwd.median_s * 1e3 for u in units]
    ax.barh(ys, fwd, color=_COLORS[0], label="forward")
    ax.barh(ys, bwd, left=fwd, color=_COLORS[1], label="backward")
    ax.errorbar(
        [f + b for f, b in zip(fwd, bwd)],
        ys,
        xerr=[
            [(u.fwd.median_s - u.fwd.min_s + u.bwd.median_s - u.bwd.min_s) * 1e3 for u in units],
            [(u.fwd.max_s - u.fwd.median_s + u.bwd.max_s - u.bwd.median_s) * 1e3 for u in units],
        ],
        fmt="none",
        ecolor="black",
        capsize=3,
        linewidth=0.8,
    )
    step = layers.step_s()
    right = max((u.fwd.max_s + u.bwd.max_s) * 1e3 for u in units)
    for y, u in zip(ys, units):
        ax.annotate(
            f"{100 * u.time_s * len(u.instances) / step:.0f}% of step", (right * 1.03, y), va="center", fontsize=8
        )
    ax.set_xlim(0, right * 1.25)
    ax.set_yticks(list(ys), names)
    ax.invert_yaxis()
    ax.set_xlabel("ms per call (median; whiskers: min-max)")
    ax.set_title(f"{layers.model}: batch {layers.batch}, seq {layers.seq_len}, {layers.dtype}")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=2, frameon=False)
    return _png(fig)


def unit_rates(layers: ModelProfile, peak_flop_per_s: float | None) -> bytes:
    """Achieved FLOP/s per unit against the device's best matmul rate."""
    units = [u for u in layers.units if u.fwd_flops > 0]
    fig = Figure(figsize=(8, 0.5 + 0.45 * max(1, len(units))))
    ax = fig.subplots()
    ax.barh(range(len(units)), [u.achieved_flop_per_s / 1e9 for u in units], color=_COLORS[2])
    if peak_flop_per_s:
        ax.axvline(peak_flop_per_s / 1e9, color="black", linestyle="--", label="best measured matmul")
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), frameon=False)
    ax.set_yticks(list(range(len(units))), [u.fqn for u in units])
    ax.invert_yaxis()
    ax.set_xlabel("achieved GFLOP/s (forward + backward)")
    ax.set_title("Achieved FLOP/s per unit")
    return _png(fig)


def bus_bandwidth(network: NetworkProfile, levels: Sequence[str] = ("intra", "inter", "mixed")) -> bytes:
    """Bus bandwidth against message size per op and level, with the fitted model."""
    present = [lv for lv in levels if any(s.level == lv for s in network.series)]
    fig = Figure(figsize=(7, 3.6 * len(present)))
    axes = fig.subplots(len(present), 1, squeeze=False)[:, 0]
    for ax, level in zip(axes, present):
        ops = list(dict.fromkeys(s.op for s in network.series if s.level == level))
        for color, op in zip(_COLORS, ops):
            series = [s for s in network.series if s.level == level and s.op == op]
            for k, s in enumerate(series):
                ax.plot(
                    [p.nbytes for p in s.points],
                    [p.busbw_bytes_per_s / 1e9 for p in s.points],
                    "o-",
                    color=color,
                    alpha=1.0 if k == 0 else 0.35,
                    markersize=3,
                    label=op if k == 0 else None,
                )
        fit = network.link(level) if level != "mixed" else None
        if fit is not None:
            sizes = sorted({p.nbytes for s in network.series if s.level == level for p in s.points})
            n = len(next(s for s in network.series if s.level == level).ranks)
            c_bw, c_lat = coefficients("all_reduce", level, n)
            model = [c_bw * x / (c_bw * x / fit.bandwidth_bytes_per_s + c_lat * fit.alpha_s) / 1e9 for x in sizes]
            ax.plot(
                sizes,
                model,
                "k--",
                linewidth=1,
                label=f"fit: {fit.bandwidth_bytes_per_s / 1e9:.3g} GB/s, {fit.alpha_s * 1e6:.3g} us",
            )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("busbw (GB/s)")
        ax.set_title(f"{network.backend}, {level} level")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    return _png(fig)
