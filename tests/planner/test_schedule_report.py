"""The schedule simulator against the closed-form bubble, and the plan's pictures."""

import base64
import dataclasses
import itertools

import pytest

from autopar.cost.pipeline import inflight_microbatches, pipeline_time_s
from autopar.present.report import memory_figure, plan_html, save_html, step_figure, timeline_figure
from autopar.present.schedule_sim import makespan_s, rank_order, simulate
from autopar.vocab import Schedule


@pytest.mark.parametrize(
    "schedule, pp, v, m",
    [
        (Schedule.GPIPE, 4, 1, 8),
        (Schedule.ONE_F_ONE_B, 4, 1, 8),
        (Schedule.ONE_F_ONE_B, 8, 1, 8),
        (Schedule.INTERLEAVED_1F1B, 4, 2, 8),
        (Schedule.INTERLEAVED_1F1B, 4, 3, 12),
        (Schedule.INTERLEAVED_1F1B, 2, 2, 4),
    ],
)
def test_equal_stages_match_the_closed_form_bubble(schedule, pp, v, m):
    f, b = 1.0, 2.0
    ops = simulate(schedule, pp, v, m, [f] * (pp * v), [b] * (pp * v))
    assert makespan_s(ops) == pytest.approx(pipeline_time_s([v * (f + b)] * pp, m, v))


def test_unbalanced_stages_are_bounded_by_the_formula():
    """The formula (m - 1) max c + sum c is the fill-and-drain bound for one stage per rank."""
    f, b = [1.0, 3.0, 1.0], [2.0, 6.0, 2.0]
    ops = simulate(Schedule.ONE_F_ONE_B, 3, 1, 6, f, b)
    assert makespan_s(ops) <= pipeline_time_s([x + y for x, y in zip(f, b)], 6, 1) + 1e-9


def test_1f1b_holds_at_most_its_inflight_count():
    """Forwards whose backward has not run yet never exceed inflight_microbatches."""
    pp, m = 4, 8
    for r in range(pp):
        live = peak = 0
        for kind, _, _ in rank_order(Schedule.ONE_F_ONE_B, pp, 1, m, r):
            live += 1 if kind == "F" else -1
            peak = max(peak, live)
        assert peak == inflight_microbatches(Schedule.ONE_F_ONE_B, pp, 1, m, r)


def test_every_operation_runs_once():
    ops = simulate(Schedule.INTERLEAVED_1F1B, 4, 2, 8, [1.0] * 8, [2.0] * 8, p2p_s=0.1)
    assert len(ops) == 2 * 8 * 8 and len({(o.stage, o.microbatch, o.kind) for o in ops}) == 128
    for rank in range(4):
        mine = sorted((o for o in ops if o.rank == rank), key=lambda o: o.start_s)
        assert all(a.end_s <= b.start_s + 1e-12 for a, b in itertools.pairwise(mine))


def test_the_step_figure_shows_every_term_of_the_step(pipelined_plan):
    """Context- and expert-parallel exchanges are terms of the step like the others: the
    bars add up to the title's step time (the figure left both out), and a float residue
    (a bubble of 1e-14 s) is no bar."""
    p = pipelined_plan.prediction
    b = dataclasses.replace(p.breakdown, cp_comm_s=0.25, ep_comm_s=0.5, bubble_s=1e-14)
    plan = dataclasses.replace(pipelined_plan, prediction=dataclasses.replace(p, breakdown=b, step_time_s=b.total_s))
    ax = step_figure(plan).axes[0]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    names = [name for name, _ in b.shown()]
    assert "CP comm" in names and "EP comm" in names and "bubble" not in names
    assert len(legend) == len(names) and all(text.startswith(f"{name} ") for text, name in zip(legend, names))
    assert sum(r.get_width() for r in ax.patches) == pytest.approx(b.total_s, rel=1e-3)


def test_pictures_and_html(pipelined_plan, tmp_path):
    for fig in (timeline_figure(pipelined_plan), memory_figure(pipelined_plan), step_figure(pipelined_plan)):
        assert fig.axes and fig.axes[0].has_data()
    page = plan_html(pipelined_plan)
    assert page.count("data:image/png;base64,") == 3 and "Predicted" in page
    png = base64.b64decode(page.split("data:image/png;base64,")[1].split("'")[0])
    assert png.startswith(b"\x89PNG")
    assert save_html(pipelined_plan, tmp_path / "r.html").read_text() == page
