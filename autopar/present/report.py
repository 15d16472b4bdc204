"""Pictures of a plan: the pipeline timeline per device, memory per pipeline rank by
category, step time by term; and HTML that holds them with the explanation (a standalone
page for ``autopar plan --html`` and saved plan files, a fragment for Jupyter).

Figures are built with ``matplotlib.figure.Figure`` directly (no pyplot, no global
backend state) and embedded as base64 PNG, so the page stands alone.
"""

from __future__ import annotations

import html
import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from matplotlib.figure import Figure

from autopar import codec
from autopar.plan import MemoryBreakdown, Plan
from autopar.present.explain import explain, schedule_text
from autopar.present.page import figure, page
from autopar.present.schedule_sim import makespan_s, simulate
from autopar.present.units import duration

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
NO_PIPELINE = "No pipeline (pp=1): every device runs the whole model, so there is no pipeline timeline."
NO_ZERO_BUBBLE_TIMELINE = (
    "{schedule}: the timeline simulation does not split backwards into input and weight gradients, so no "
    "timeline is drawn; the step time prices the schedule's bubble (autopar.cost.pipeline)."
)


def timeline_figure(plan: Plan, *, max_microbatches: int = 32) -> Figure:
    """Forward (blue) and backward (orange) of each micro-batch on each pipeline rank,
    simulated from the plan's per-stage times; white gaps are the bubble. A plan without
    pipelining has no timeline: its figure holds the one-line :data:`NO_PIPELINE` note,
    and a zero-bubble schedule's the :data:`NO_ZERO_BUBBLE_TIMELINE` note."""
    c = plan.config
    if c.pp == 1 or c.schedule.zero_bubble:
        note = NO_PIPELINE if c.pp == 1 else NO_ZERO_BUBBLE_TIMELINE.format(schedule=schedule_text(c))
        fig = Figure(figsize=(10, 0.6))
        ax = fig.add_subplot()  # an axes, so that Jupyter draws the figure (it skips one without)
        ax.set_axis_off()
        ax.text(0.5, 0.5, note, ha="center", va="center", transform=ax.transAxes)
        return fig
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
    ax.set_title(f"{schedule_text(c)}, pp={c.pp}: {shown}, {duration(makespan_s(ops))} (blue forward, orange backward)")
    fig.tight_layout()
    return fig


def memory_by_rank(plan: Plan) -> list[tuple[tuple[int, ...], MemoryBreakdown]]:
    """For each pipeline rank (device position), the stages it holds and its peak memory.

    A stage's prediction already counts every stage of its rank (the device holds them
    all), so the rank's peak is its most loaded stage's, not a sum; one bar per rank keeps
    an interleaved plan (``pp * v`` stages) from drawing the same device ``v`` times."""
    out = []
    for rank in range(plan.config.pp):
        held = [s for s in plan.prediction.stages if s.pipeline_rank == rank]
        peak = max(held, key=lambda s: s.memory.total_bytes)
        out.append((tuple(s.index for s in held), peak.memory))
    return out


def stages_label(indices: Sequence[int]) -> str:
    """``stage 3``, ``stages 0, 4`` or, for many, ``stages 0, 8, …, 40``: short enough
    for a tick label under a bar."""
    if len(indices) == 1:
        return f"stage {indices[0]}"
    if len(indices) <= 3:
        return "stages " + ", ".join(map(str, indices))
    return f"stages {indices[0]}, {indices[1]}, …, {indices[-1]}"


def memory_figure(plan: Plan) -> Figure:
    """Peak memory of each pipeline rank's devices by category, against the capacity:
    one bar per rank on integer ticks, labelled with the stages the rank holds (upright
    up to 12 ranks, turned beyond, where they would overlap)."""
    ranks = memory_by_rank(plan)
    fig = Figure(figsize=(min(24, max(7, 1.4 * len(ranks) + 4)), 3.8 if len(ranks) <= 12 else 4.6))
    ax = fig.add_subplot()
    xs = list(range(len(ranks)))
    bottom = [0.0] * len(ranks)
    for label, attr, color in _MEMORY:
        values = [getattr(memory, attr) / GIB for _, memory in ranks]
        ax.bar(xs, values, bottom=bottom, color=color, label=label, width=0.8)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.axhline(
        plan.prediction.memory_capacity_bytes / GIB, color="black", linestyle="--", linewidth=1, label="capacity"
    )
    labels = [f"rank {r}\n{stages_label(indices)}" for r, (indices, _) in enumerate(ranks)]
    ax.set_xticks(xs, labels, fontsize=8, rotation=0 if len(ranks) <= 12 else 90)
    ax.set_xlabel("pipeline rank (device position in the pipeline)")
    ax.set_ylabel("GiB per device")
    ax.set_title("Peak memory per device by pipeline rank")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig


def step_figure(plan: Plan) -> Figure:
    """The step time split into the terms of the cost model."""
    b = plan.prediction.breakdown
    fig = Figure(figsize=(9, 2.0))
    ax = fig.add_subplot()
    left = 0.0
    colors = {name: f"C{i}" for i, (name, _) in enumerate(b.terms())}  # a term keeps its colour in every plan
    for label, value in b.shown():
        ax.barh([0], [value], left=left, color=colors[label], label=f"{label} {duration(value)}")
        left += value
    ax.set_yticks([])
    ax.set_xlabel("seconds per step")
    ax.set_title(f"Step time {duration(plan.prediction.step_time_s)}")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig


def png_bytes(fig: Figure) -> bytes:
    """A figure as PNG."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    return buf.getvalue()


def _image(title: str, fig: Figure) -> str:
    """A figure under its heading, embedded so the HTML needs no other file."""
    return f"<h2>{title}</h2>{figure(png_bytes(fig), title)}"


def summary_html(plan: Plan) -> str:
    """The explanation and the pictures as an HTML fragment (what Jupyter shows for a
    plan). A plan without pipelining gets the one-line note instead of a timeline."""
    timeline = (
        f"<h2>Pipeline timeline</h2><p>{html.escape(NO_PIPELINE)}</p>"
        if plan.config.pp == 1
        else _image("Pipeline timeline", timeline_figure(plan))
    )
    return (
        f"<div class='autopar-plan'><pre>{html.escape(explain(plan))}</pre>{timeline}"
        f"{_image('Memory per pipeline rank', memory_figure(plan))}"
        f"{_image('Step time by term', step_figure(plan))}</div>"
    )


def plan_html(plan: Plan) -> str:
    """A standalone HTML page: the explanation and the pictures."""
    return page("autopar plan", summary_html(plan))


@dataclass(frozen=True)
class Report:
    """A plan's report, shown by Jupyter as the page ``autopar report --html`` writes
    (without the page around it): ``autopar.report(plan)`` as a cell's last line. The
    plan itself stays data and knows no renderer."""

    plan: Plan

    def _repr_html_(self) -> str:
        return summary_html(self.plan)

    def save(self, path: str | Path) -> Path:
        """Write the standalone page to ``path``."""
        return save_html(self.plan, path)


def report(plan: Plan | str | Path) -> Report:
    """The report of ``plan`` (a plan, or a plan file ``Plan.save`` or ``autopar plan
    --out`` wrote), for a notebook to show or to save as a page."""
    return Report(plan if isinstance(plan, Plan) else Plan.load(plan))


def render_plan_html(plan: Plan | str | Path) -> str:
    """:func:`plan_html` of a plan or of a saved plan file (``Plan.save``, ``autopar plan
    --out``), so a plan can be rendered again without planning it again."""
    return plan_html(plan if isinstance(plan, Plan) else Plan.load(plan))


def save_html(plan: Plan | str | Path, path: str | Path) -> Path:
    """Write :func:`render_plan_html` of ``plan`` (a plan or a plan file) to ``path``
    (atomically, its folders created, as the plan file is: a path ``--out`` takes, the
    page takes too)."""
    return codec.write_atomically(path, render_plan_html(plan))
