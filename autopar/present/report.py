"""Pictures of a plan: the pipeline timeline per device, memory per stage by category,
step time by term; and an HTML page that holds them with the explanation.

Figures are built with ``matplotlib.figure.Figure`` directly (no pyplot, no global
backend state) and embedded as base64 PNG, so the page stands alone.
"""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path

from matplotlib.figure import Figure

from autopar.plan import Plan
from autopar.present.explain import explain
from autopar.present.schedule_sim import makespan_s, simulate

GIB = 2**30
_COLORS = {"F": "#4C72B0", "B": "#DD8452"}
_MEMORY = [
    ("params", "params_bytes", "#4C72B0"),
    ("grads", "grads_bytes", "#55A868"),
    ("optimizer", "optimizer_bytes", "#C44E52"),
    ("activations", "activations_bytes", "#8172B3"),
    ("transient", "transient_bytes", "#CCB974"),
    ("pipeline buffers", "buffers_bytes", "#DA8BC3"),
    ("reserve", "reserve_bytes", "#937860"),
]
_STEP = [
    ("compute", "compute_s"),
    ("recompute", "recompute_s"),
    ("TP comm", "tp_comm_s"),
    ("PP comm", "pp_comm_s"),
    ("bubble", "bubble_s"),
    ("DP comm", "dp_comm_s"),
    ("optimizer", "optimizer_s"),
]


def timeline_figure(plan: Plan, *, max_microbatches: int = 32) -> Figure:
    """Forward (blue) and backward (orange) of each micro-batch on each pipeline rank,
    simulated from the plan's per-stage times; white gaps are the bubble."""
    c = plan.config
    m = min(c.num_microbatches, max_microbatches)
    stages = plan.prediction.stages
    ops = simulate(c.schedule, c.pp, c.virtual_stages, m, [s.forward_s for s in stages], [s.backward_s for s in stages])
    fig = Figure(figsize=(10, 0.45 * c.pp + 1.4))
    ax = fig.add_subplot()
    for op in ops:
        ax.broken_barh(
            [(op.start_s * 1e3, (op.end_s - op.start_s) * 1e3)],
            (op.rank - 0.4, 0.8),
            facecolors=_COLORS[op.kind],
            edgecolor="white",
            linewidth=0.3,
        )
    ax.set_yticks(range(c.pp), [f"rank {r}" for r in range(c.pp)])
    ax.invert_yaxis()
    ax.set_xlabel("time within one step (ms)")
    shown = f"first {m} of {c.num_microbatches} micro-batches" if m < c.num_microbatches else f"{m} micro-batches"
    ax.set_title(
        f"{c.schedule.value} pipeline, pp={c.pp}, v={c.virtual_stages}: {shown}, "
        f"{makespan_s(ops) * 1e3:.1f} ms (blue forward, orange backward)"
    )
    fig.tight_layout()
    return fig


def memory_figure(plan: Plan) -> Figure:
    """Peak memory of each stage's device by category, against the capacity."""
    stages = plan.prediction.stages
    fig = Figure(figsize=(max(7, 0.25 * len(stages) + 4), 3.6))
    ax = fig.add_subplot()
    xs = list(range(len(stages)))
    bottom = [0.0] * len(stages)
    for label, attr, color in _MEMORY:
        values = [getattr(s.memory, attr) / GIB for s in stages]
        ax.bar(xs, values, bottom=bottom, color=color, label=label, width=0.8)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.axhline(
        plan.prediction.memory_capacity_bytes / GIB, color="black", linestyle="--", linewidth=1, label="capacity"
    )
    ax.set_xlabel("pipeline stage")
    ax.set_ylabel("GiB per device")
    ax.set_title("Memory per device by stage")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig


def step_figure(plan: Plan) -> Figure:
    """The step time split into the terms of the cost model."""
    b = plan.prediction.breakdown
    fig = Figure(figsize=(9, 2.0))
    ax = fig.add_subplot()
    left = 0.0
    for i, (label, attr) in enumerate(_STEP):
        value = getattr(b, attr)
        if value <= 0:
            continue
        ax.barh([0], [value], left=left, color=f"C{i}", label=f"{label} {value:.3g} s")
        left += value
    ax.set_yticks([])
    ax.set_xlabel("seconds per step")
    ax.set_title(f"Step time {plan.prediction.step_time_s:.3g} s")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig


def png_bytes(fig: Figure) -> bytes:
    """A figure as PNG."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    return buf.getvalue()


def plan_html(plan: Plan) -> str:
    """A standalone HTML page: the explanation and the three pictures."""
    images = []
    for title, fig in (
        ("Pipeline timeline", timeline_figure(plan)),
        ("Memory per stage", memory_figure(plan)),
        ("Step time by term", step_figure(plan)),
    ):
        data = base64.b64encode(png_bytes(fig)).decode()
        images.append(f"<h2>{title}</h2><img alt='{title}' src='data:image/png;base64,{data}'>")
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>autopar plan</title>"
        "<style>body{font-family:sans-serif;max-width:1100px;margin:2em auto}pre{background:#f6f6f6;"
        "padding:1em;overflow-x:auto}img{max-width:100%}</style></head><body><h1>autopar plan</h1>"
        f"<pre>{html.escape(explain(plan))}</pre>{''.join(images)}</body></html>\n"
    )


def save_html(plan: Plan, path: str | Path) -> Path:
    """Write :func:`plan_html` to ``path``."""
    p = Path(path)
    p.write_text(plan_html(plan))
    return p
