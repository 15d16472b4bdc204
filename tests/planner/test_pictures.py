"""The plan's pictures and how a plan shows itself: memory per pipeline rank on integer
ticks, no pipeline timeline without a pipeline, a saved plan rendered again, a short
repr and Jupyter's HTML, and the one number format of ``autopar.present``."""

import argparse
import io
import re
import shutil
import subprocess

import pytest

import autopar
from autopar.errors import ConfigError, PlanFormatError
from autopar.models import build_named_model
from autopar.present.explain import explain, schedule_text
from autopar.present.report import (
    NO_PIPELINE,
    memory_figure,
    plan_html,
    render_plan_html,
    save_html,
    summary_html,
    timeline_figure,
)
from autopar.present.report_cli import add_report_parser
from autopar.present.units import duration, size


@pytest.fixture(scope="module")
def interleaved_plan():
    """8 stages on 4 pipeline ranks (2 per rank), tensor parallel inside each node."""
    return autopar.estimate(
        build_named_model("gpt3-6.7b"),
        autopar.preset("dgx-a100-80gb", nodes=4),
        {"tp": 8, "pp": 4, "schedule": "interleaved-1f1b", "virtual_stages": 2, "micro_batch_size": 1},
        global_batch_size=16,
        seq_len=2048,
    )


@pytest.fixture(scope="module")
def flat_plan():
    """No pipelining: every device holds the whole model."""
    return autopar.estimate(
        build_named_model("gpt2-small"),
        autopar.preset("dgx-a100-80gb", nodes=1),
        {"tp": 1, "pp": 1, "micro_batch_size": 8},
        global_batch_size=64,
        seq_len=1024,
    )


def _svg(fig) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg")
    return buf.getvalue()


def test_memory_has_one_bar_per_pipeline_rank_on_integer_ticks(interleaved_plan):
    c = interleaved_plan.config
    assert (c.pp, c.num_stages) == (4, 8)
    ax = memory_figure(interleaved_plan).axes[0]
    assert list(ax.get_xticks()) == [0, 1, 2, 3]
    assert all(len(bars) == c.pp for bars in ax.containers)
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert labels == [f"rank {r}\nstages {r}, {r + 4}" for r in range(4)]


def test_memory_svg_ticks_are_the_ranks(interleaved_plan):
    """Read back from the drawn picture: four x ticks, each a rank and the stages it holds,
    and nothing else (matplotlib writes each text as a comment before its glyphs)."""
    svg = _svg(memory_figure(interleaved_plan))
    xticks = re.findall(r'<g id="xtick_\d+">(.*?)</g>\s*</g>\s*</g>', svg, flags=re.S)
    assert len(xticks) == 4
    texts = re.findall(r"<!-- (.*?) -->", "".join(xticks))
    assert texts == [line for r in range(4) for line in (f"rank {r}", f"stages {r}, {r + 4}")]


def test_memory_bar_is_the_rank_peak(interleaved_plan):
    ax = memory_figure(interleaved_plan).axes[0]
    tops = [sum(bars[r].get_height() for bars in ax.containers) for r in range(4)]
    peak = interleaved_plan.prediction.memory_bytes_per_device / 2**30
    assert max(tops) == pytest.approx(peak)


def test_timeline_names_the_schedule_as_explain_does(interleaved_plan):
    words = schedule_text(interleaved_plan.config)
    assert words == "interleaved-1f1b with 2 stages per rank"
    assert words in explain(interleaved_plan)
    assert timeline_figure(interleaved_plan).axes[0].get_title().startswith(words)


def test_no_pipeline_timeline_without_a_pipeline(flat_plan):
    fig = timeline_figure(flat_plan)
    [ax] = fig.axes  # one bare axes holding the note, so that a notebook draws the figure
    assert not ax.axison and not ax.collections and [t.get_text() for t in ax.texts] == [NO_PIPELINE]
    page = plan_html(flat_plan)
    assert page.count("data:image/png;base64,") == 2
    assert NO_PIPELINE in page and "1f1b" not in page
    assert "no pipeline" in explain(flat_plan)


def test_saved_plan_renders_as_the_original(interleaved_plan, tmp_path):
    path = interleaved_plan.save(tmp_path / "plan.json")
    page = plan_html(interleaved_plan)
    assert render_plan_html(path) == render_plan_html(str(path)) == page
    assert render_plan_html(autopar.Plan.load(path)) == page
    assert save_html(path, tmp_path / "plan.html").read_text(encoding="utf-8") == page


def _report(*argv: str) -> int:
    """``autopar report ...`` on a parser of its own (the command line wires the same one)."""
    parser = argparse.ArgumentParser(prog="autopar")
    add_report_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["report", *argv])
    return args.func(args)


def test_report_command_writes_the_page_of_a_plan_file(interleaved_plan, tmp_path):
    plan = interleaved_plan.save(tmp_path / "plan.json")
    out = tmp_path / "report.html"
    assert _report(str(plan), "--html", str(out)) == 0
    assert out.read_text(encoding="utf-8") == plan_html(interleaved_plan)
    with pytest.raises(ConfigError, match="--html"):
        _report(str(plan), "--html", str(tmp_path))
    with pytest.raises(PlanFormatError):
        _report(str(tmp_path / "missing.json"), "--html", str(out))


def test_report_command_without_html_prints_the_explanation(interleaved_plan, tmp_path, capsys):
    assert _report(str(interleaved_plan.save(tmp_path / "plan.json"))) == 0
    assert capsys.readouterr().out == explain(interleaved_plan) + "\n"


def test_a_notebook_shows_the_report_of_a_plan_or_a_plan_file(interleaved_plan, tmp_path):
    path = interleaved_plan.save(tmp_path / "plan.json")
    for shown in (autopar.report(interleaved_plan), autopar.report(path)):
        assert shown._repr_html_() == summary_html(interleaved_plan)
    assert autopar.report(path).save(tmp_path / "p.html").read_text(encoding="utf-8") == plan_html(interleaved_plan)


def test_repr_is_one_short_line(interleaved_plan, flat_plan):
    for plan in (interleaved_plan, flat_plan):
        text = repr(plan)
        assert len(text) < 300 and "\n" not in text
        assert plan.config.short() in text and plan.model.name in text and plan.cluster.name in text
        assert f"step {plan.prediction.step_time_s:.3g} s" in text
        assert f"{plan.prediction.memory_bytes_per_device / 2**30:.1f} GiB per device" in text


def test_the_html_summary_is_a_fragment_with_the_pictures(interleaved_plan):
    shown = summary_html(interleaved_plan)
    assert shown.startswith("<div") and shown.endswith("</div>") and "<html" not in shown
    assert shown.count("data:image/png;base64,") == 3 and "Predicted" in shown


@pytest.mark.parametrize(
    "seconds, text",
    [
        (0.0, "0 s"),
        (2.16e-05, "21.6 us"),
        (3e-3, "3 ms"),
        (0.0123, "12.3 ms"),
        (0.00322, "3.22 ms"),
        (0.802, "802 ms"),
        (0.0009997, "1 ms"),
        (1.5, "1.5 s"),
        (16.14, "16.1 s"),
        (1234.0, "1230 s"),
        (9000.0, "2.5 h"),
        (3 * 86400.0, "3 d"),
        (4.5e-9, "4.5 ns"),
        (7e-6, "7 us"),
    ],
)
def test_durations(seconds, text):
    assert duration(seconds) == text


@pytest.mark.parametrize(
    "nbytes, text",
    [
        (0, "0 B"),
        (512, "512 B"),
        (1536, "1.5 KiB"),
        (154.9 * 2**20, "154.9 MiB"),
        (67.8 * 2**30, "67.8 GiB"),
        (80 * 2**30, "80.0 GiB"),
    ],
)
def test_sizes(nbytes, text):
    assert size(nbytes) == text


def test_explain_writes_no_exponent(interleaved_plan, flat_plan):
    for plan in (interleaved_plan, flat_plan):
        assert not re.search(r"\d[eE][+-]\d", explain(plan))


def _chromium() -> str | None:
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


@pytest.mark.skipif(_chromium() is None, reason="no chromium to render the page headless")
def test_page_renders_in_a_headless_browser(interleaved_plan, tmp_path):
    page = save_html(interleaved_plan, tmp_path / "plan.html")
    shot = tmp_path / "plan.png"
    subprocess.run(
        [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", f"--screenshot={shot}", page.as_uri()],
        check=True,
        capture_output=True,
        timeout=120,
    )
    assert shot.read_bytes().startswith(b"\x89PNG")
