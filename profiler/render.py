"""A profile report as a document people read: HTML (standalone) or Markdown.

The content is built once as a list of blocks (headings, text, tables, figures) and
written out by one small emitter per format, so the two formats cannot say different
things. HTML embeds its figures as base64 PNG, so the file stands alone (mail it,
attach it to an issue); Markdown writes them next to the document or leaves them out.
"""

from __future__ import annotations

import html
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from autopar.present.page import figure, page, table
from autopar.present.units import significant, size
from autopar.profiles.network_section import NetworkProfile
from autopar.profiles.report import ProfileReport
from autopar.profiles.sections import DeviceProfile, ModelProfile, Provenance
from autopar.profiles.to_cluster import where_measured
from profiler import plots


@dataclass(frozen=True)
class _Heading:
    text: str
    level: int = 2


@dataclass(frozen=True)
class _Text:
    text: str


@dataclass(frozen=True)
class _Table:
    headers: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class _Figure:
    name: str
    caption: str
    make: Callable[[], bytes]


_Block = _Heading | _Text | _Table | _Figure


def summary(report: ProfileReport) -> list[str]:
    """One line per section of ``report``: what, where, when."""
    lines = []
    if report.device is not None:
        d = report.device
        lines.append(
            f"device: {d.name}, {len(d.matmul)} matmul shapes ({', '.join(d.dtypes)}), memory "
            f"{d.memory_bandwidth_bytes_per_s / 1e9:.1f} GB/s; {where_measured(d.provenance)}"
        )
    if report.layers is not None:
        m = report.layers
        lines.append(
            f"layers: {m.model} batch {m.batch} x seq {m.seq_len} {m.dtype}, {len(m.units)} distinct "
            f"units, step {m.step_s() * 1e3:.1f} ms on {m.device}; {where_measured(m.provenance)}"
        )
    if report.network is not None:
        n = report.network
        fits = ", ".join(
            f"{f.level} {f.bandwidth_bytes_per_s / 1e9:.3g} GB/s + {f.alpha_s * 1e6:.3g} us"
            for f in (n.link("intra"), n.link("inter"))
            if f is not None
        )
        lines.append(
            f"network: {n.backend} {n.world_size} ranks on {n.nodes} node(s), {fits}; {where_measured(n.provenance)}"
        )
    return lines


def _ms(seconds: float) -> str:
    return significant(seconds * 1e3)


def _mib(nbytes: float) -> str:
    return significant(nbytes / 2**20)


def _provenance(p: Provenance) -> _Text:
    sw = ", ".join(f"{k} {v}" for k, v in p.software.items())
    return _Text(
        f"Measured on {p.host} ({p.cpu}, {p.cpu_count} CPUs, {p.memory_bytes / 2**30:.1f} GiB, "
        f"accelerator: {p.accelerator}) at {p.created_utc} with {sw}. Command: `{p.command}`."
    )


def blocks(report: ProfileReport) -> list[_Block]:
    """The document's content, section by section."""
    out: list[_Block] = [
        _Heading("autopar profile report", 1),
        _Text("Measured: " + (", ".join(report.measured) or "nothing") + "."),
    ]
    out += [_Text(line) for line in summary(report)]
    if report.device is not None:
        out += _device_blocks(report.device)
    if report.layers is not None:
        out += _layer_blocks(report.layers, report.device)
    if report.network is not None:
        out += _network_blocks(report.network)
    return out


def _device_blocks(d: DeviceProfile) -> list[_Block]:
    rows = tuple(
        (
            p.dtype,
            f"{p.m}x{p.n}x{p.k}",
            f"{p.flops:.3g}",
            _ms(p.time.median_s),
            f"{100 * p.time.spread:.0f}%",
            f"{p.achieved_flop_per_s / 1e9:.1f}",
        )
        for p in d.matmul
    )
    bw = tuple(
        (b.kernel, size(b.array_bytes), _ms(b.time.median_s), f"{b.achieved_bytes_per_s / 1e9:.1f}")
        for b in d.bandwidth
    )
    blocks_: list[_Block] = [
        _Heading(f"Device: {d.name}"),
        _provenance(d.provenance),
        _Text(
            f"{d.kind}, {d.threads} thread(s), timer {d.timer}; memory {d.memory_bytes / 2**30:.1f} GiB"
            f"{' (shared by the processes of a node)' if d.memory_shared else ''}; streaming bandwidth used by the "
            f"cost model: {d.memory_bandwidth_bytes_per_s / 1e9:.1f} GB/s; framework overhead "
            f"{d.op_overhead_s * 1e6:.1f} us per op, {d.tp_overhead_s * 1e6:.0f} us per tensor-parallel layer; "
            f"AdamW step {d.optimizer_s_per_param * 1e9:.2f} ns per parameter (0: not measured)."
        ),
        _Figure(
            "matmul",
            "Achieved matmul FLOP/s against the FLOPs of one call (dashed: best per precision).",
            lambda: plots.matmul_curves(d),
        ),
        _Table(("dtype", "m x n x k", "FLOPs/call", "median ms", "spread", "GFLOP/s"), rows),
        _Figure("stream", "Streaming memory bandwidth against array size.", lambda: plots.stream_bandwidth(d)),
        _Table(("kernel", "array", "median ms", "GB/s"), bw),
    ]
    if d.attention:
        blocks_ += [
            _Text(
                "Fused attention: causal scaled_dot_product_attention forward and backward, FLOPs in the "
                "FlashAttention convention (half the score products under the mask, backward 2.5x the forward)."
            ),
            _Table(
                ("dtype", "batch x heads x seq x head dim", "FLOPs/call", "median ms", "spread", "TFLOP/s"),
                tuple(
                    (
                        p.dtype,
                        f"{p.batch}x{p.heads}x{p.seq_len}x{p.head_dim}",
                        f"{p.flops:.3g}",
                        _ms(p.time.median_s),
                        f"{100 * p.time.spread:.0f}%",
                        f"{p.achieved_flop_per_s / 1e12:.1f}",
                    )
                    for p in d.attention
                ),
            ),
        ]
    if d.skipped_dtypes:
        blocks_.append(_Text("Skipped: " + "; ".join(f"{k}: {v}" for k, v in d.skipped_dtypes.items())))
    return blocks_


def _layer_blocks(lay: ModelProfile, device: DeviceProfile | None) -> list[_Block]:
    peak = device.peak_flop_per_s(lay.dtype) if device is not None and lay.dtype in device.dtypes else None
    rows = []
    for u in lay.units:
        share = f"{100 * u.achieved_flop_per_s / peak:.0f}%" if peak else "-"
        redo = (
            "-"
            if u.recompute_bwd is None
            else (
                f"{_ms(u.recompute_bwd.median_s)} "
                f"(+{(u.recompute_bwd.median_s - u.bwd.median_s) / u.fwd.median_s:.2f} fwd)"
            )
        )
        rows.append(
            (
                u.fqn,
                str(len(u.instances)),
                f"{_ms(u.fwd.median_s)} ({_ms(u.fwd.min_s)}-{_ms(u.fwd.max_s)})",
                f"{_ms(u.bwd.median_s)} ({_ms(u.bwd.min_s)}-{_ms(u.bwd.max_s)})",
                redo,
                f"{u.fwd_flops / 1e9:.3g} / {u.bwd_flops / 1e9:.3g}",
                f"{u.achieved_flop_per_s / 1e9:.1f}",
                share,
                _mib(u.param_bytes),
                _mib(u.saved_bytes),
                _mib(u.peak_bytes),
            )
        )
    return [
        _Heading(f"Layers: {lay.model}"),
        _provenance(lay.provenance),
        _Text(
            f"Batch {lay.batch}, sequence {lay.seq_len}, input {tuple(lay.sample_shape)}, {lay.dtype} on "
            f"{lay.device} ({lay.threads} thread(s), timer {lay.timer}, {lay.warmup} warm-up run(s)). Identical "
            f"blocks are measured once; one training step's forward and backward: "
            f"{lay.step_s() * 1e3:.1f} ms. The backward recomputing is the backward with the unit's forward "
            f"under full recomputation's checkpoint, and what that adds as a fraction of the forward."
        ),
        _Figure("unit_times", "Forward and backward time per distinct unit.", lambda: plots.unit_times(lay)),
        _Table(
            (
                "unit",
                "x",
                "fwd ms (min-max)",
                "bwd ms (min-max)",
                "bwd recomputing ms",
                "GFLOP fwd / bwd",
                "GFLOP/s",
                "of best matmul",
                "params MiB",
                "saved MiB",
                "peak MiB",
            ),
            tuple(rows),
        ),
        _Figure(
            "unit_rates",
            "Achieved FLOP/s per unit against the best measured matmul.",
            lambda: plots.unit_rates(lay, peak),
        ),
    ]


def _network_blocks(n: NetworkProfile) -> list[_Block]:
    fits = tuple(
        (
            f.level,
            "+".join(f.ops),
            f"{f.alpha_s * 1e6:.3g}",
            f"{f.bandwidth_bytes_per_s / 1e9:.3g}",
            f"{100 * f.rms_rel_error:.0f}%",
            str(f.points),
        )
        for f in n.fits
    )
    series = []
    for s in n.series:
        small, large = s.points[0], s.points[-1]
        series.append(
            (
                s.level,
                s.op,
                s.label,
                f"{_ms(small.time.per_call_s)} @ {size(small.nbytes)}",
                f"{large.busbw_bytes_per_s / 1e9:.3g} @ {size(large.nbytes)}",
                f"{max(p.busbw_bytes_per_s for p in s.points) / 1e9:.3g}",
            )
        )
    nodes = {}
    for rank, label in enumerate(n.node_of_rank):
        nodes.setdefault(label, []).append(rank)
    out: list[_Block] = [
        _Heading(f"Network: {n.backend}, {n.world_size} ranks"),
        _provenance(n.provenance),
        _Text(
            "Nodes: " + "; ".join(f"{k}: ranks {', '.join(map(str, v))}" for k, v in nodes.items()) + ". "
            "Sizes as nccl-tests counts them; times are the slowest rank's, per call, the mean over repeats; busbw "
            "is nccl-tests' bus bandwidth."
        ),
        _Figure(
            "busbw",
            "Bus bandwidth against message size (dashed: the level's joint alpha-beta fit, drawn for an all-reduce).",
            lambda: plots.bus_bandwidth(n),
        ),
        _Table(("level", "ops", "alpha us", "busbw GB/s", "rms error", "points"), fits),
        _Table(("level", "op", "group", "smallest: ms", "largest: busbw GB/s", "best busbw GB/s"), tuple(series)),
    ]
    if n.tp_overhead_s or n.fsdp_overhead_s or n.fsdp_tensor_overhead_s:
        out.append(
            _Text(
                f"Framework time on the intra-node groups beyond the arithmetic and the fitted transfers: "
                f"{n.tp_overhead_s * 1e6:.0f} us per tensor-parallel layer forward (a column/row-parallel "
                f"pair), {n.fsdp_overhead_s * 1e6:.0f} us per FSDP2 collective call and "
                f"{n.fsdp_tensor_overhead_s * 1e6:.0f} us per parameter tensor of its unit (two ZeRO-3 units "
                f"of 2 and of 16 tensors), forward and backward."
                + (
                    f" FSDP2's copies around each collective at {n.fsdp_copy_bytes_per_s / 1e9:.2f} GB/s "
                    f"(units of 2.25 MiB)."
                    if n.fsdp_copy_bytes_per_s
                    else ""
                )
            )
        )
    if n.memory_share < 1:
        out.append(
            _Text(
                f"Memory bandwidth with every rank of a node streaming at once: {n.memory_share:.2f} of "
                f"what one rank has alone (per rank, time-sharing the cores included)."
            )
        )
    if n.sync_noise_s_per_sqrt_s or n.sync_speed_spread:
        s, d = n.sync_noise_s_per_sqrt_s, n.sync_speed_spread
        out.append(
            _Text(
                f"Ranks of a node finishing the same work apart: one standard deviation is {s * 1e3:.1f} ms "
                f"per square root of a second of work ({s * 0.1 * 1e3:.2f} ms after 10 ms, "
                f"{s * 1e3:.1f} ms after 1 s), and {d:.1%} of the work beyond that as the ranks' speeds "
                f"wander; each blocking collective waits for the last rank."
            )
        )
    if n.unfitted:
        out.append(_Text("Not fitted: " + "; ".join(f"{k}: {v}" for k, v in n.unfitted.items())))
    return out


def render_html(report: ProfileReport) -> str:
    """A standalone HTML document (figures embedded as base64 PNG), in autopar's page style."""
    parts = []
    for b in blocks(report):
        if isinstance(b, _Heading):
            parts.append(f"<h{b.level}>{html.escape(b.text)}</h{b.level}>")
        elif isinstance(b, _Text):
            parts.append(f"<p>{html.escape(b.text)}</p>")
        elif isinstance(b, _Table):
            parts.append(table(list(b.headers), [list(row) for row in b.rows]))
        else:
            parts.append(figure(b.make(), b.name, b.caption))
    return page("autopar profile", "\n".join(parts))


def render_markdown(report: ProfileReport, *, image_dir: str | Path | None = None, link_prefix: str = "") -> str:
    """Markdown; figures are written as PNG files into ``image_dir`` and linked as
    ``link_prefix + name.png`` (left out when ``image_dir`` is None)."""
    lines: list[str] = []
    for b in blocks(report):
        if isinstance(b, _Heading):
            lines += ["#" * b.level + " " + b.text, ""]
        elif isinstance(b, _Text):
            lines += [b.text, ""]
        elif isinstance(b, _Table):
            lines.append("| " + " | ".join(b.headers) + " |")
            lines.append("|" + "|".join("---" for _ in b.headers) + "|")
            lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in b.rows]
            lines.append("")
        elif image_dir is not None:
            directory = Path(image_dir)
            directory.mkdir(parents=True, exist_ok=True)
            (directory / f"{b.name}.png").write_bytes(b.make())
            lines += [f"![{b.caption}]({link_prefix}{b.name}.png)", ""]
    return "\n".join(lines)
