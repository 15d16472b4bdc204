"""The benchmarks' rank correlation, CSV writer and foreign-CPU accounting."""

import csv
import datetime
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import _foreign_cpu
import _report


def test_ranks_average_ties():
    assert _report.ranks([3.0, 1.0, 2.0, 2.0]) == [4.0, 1.0, 2.5, 2.5]


def test_spearman_matches_closed_form_without_ties():
    xs, ys = [1.0, 2.0, 3.0, 4.0, 5.0], [2.0, 1.0, 4.0, 3.0, 5.0]
    d2 = sum((a - b) ** 2 for a, b in zip(_report.ranks(xs), _report.ranks(ys)))
    n = len(xs)
    assert _report.spearman(xs, ys) == pytest.approx(1 - 6 * d2 / (n * (n * n - 1)))


def test_spearman_is_about_order_only():
    xs = [0.1, 0.5, 0.2, 3.0]
    assert _report.spearman(xs, [x**3 + 7 for x in xs]) == pytest.approx(1.0)
    assert _report.spearman(xs, [-x for x in xs]) == pytest.approx(-1.0)


def test_spearman_undefined_and_mismatched():
    assert math.isnan(_report.spearman([1.0, 1.0], [1.0, 2.0]))
    with pytest.raises(ValueError, match="pairs"):
        _report.spearman([1.0], [1.0, 2.0])


def test_write_csv_dated_next_to_results(tmp_path, monkeypatch):
    monkeypatch.setattr(_report, "result_path", lambda name, suffix: tmp_path / f"{name}{suffix}")
    path = _report.write_csv("bench", [{"a": 1, "b": "x"}, {"a": 2, "b": "y"}])
    assert list(csv.DictReader(path.open())) == [{"a": "1", "b": "x"}, {"a": "2", "b": "y"}]


def test_markdown_table_has_the_csv_columns_and_rows(tmp_path, monkeypatch):
    monkeypatch.setattr(_report, "result_path", lambda name, suffix: tmp_path / f"{name}{suffix}")
    rows = [{"model": "gpt", "ratio": "x1.20"}, {"model": "mlp", "ratio": "x0.90"}]
    table = _report.markdown_table(rows).splitlines()
    assert table == ["| model | ratio |", "|---|---|", "| gpt | x1.20 |", "| mlp | x0.90 |"]
    written = list(csv.DictReader(_report.write_csv("bench", rows).open()))
    assert [list(r.values()) for r in written] == [line.strip("| ").split(" | ") for line in table[2:]]
    assert _report.markdown_table([]) == ""


# ---- what other processes took of the CPU (_foreign_cpu) ----


def _stat_file(tmp_path, user, nice, system, steal):
    path = tmp_path / "stat"
    path.write_text(f"cpu  {user} {nice} {system} 999 0 7 11 {steal} 0 0\ncpu0 1 2 3 4\n")
    return path


def test_between_subtracts_our_time_from_the_machine_busy_time():
    start = _foreign_cpu.CpuSample(wall_s=10.0, busy_s=100.0, steal_s=5.0, ours_s=40.0)
    end = _foreign_cpu.CpuSample(wall_s=14.0, busy_s=107.0, steal_s=6.0, ours_s=43.0)
    got = _foreign_cpu.between(start, end)
    # 7 busy core-seconds in 4 s, 3 of them ours: 4 / 4 = 1 core; 1 s stolen in 4 s
    assert got.foreign_cores == pytest.approx(1.0)
    assert got.steal_cores == pytest.approx(0.25)


def test_sample_reads_user_nice_system_and_steal_ticks(tmp_path):
    ticks = os.sysconf("SC_CLK_TCK")
    got = _foreign_cpu.sample(_stat_file(tmp_path, 3 * ticks, ticks, 2 * ticks, 5 * ticks))
    assert got.busy_s == pytest.approx(6.0)  # interrupts (7, 11) left out
    assert got.steal_s == pytest.approx(5.0)


def test_without_proc_stat_nothing_is_claimed(tmp_path):
    assert _foreign_cpu.sample(tmp_path / "missing") is None
    assert _foreign_cpu.between(None, None) is None
    assert _foreign_cpu.describe([None]) == "not measured (no /proc/stat)"


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="needs Linux's /proc/stat")
def test_a_process_we_do_not_wait_for_counts_as_foreign_and_our_own_work_does_not():
    """Our time is this process's and its reaped children's (os.times): a child still
    running is not in it, so the machine's busy time counts it as foreign; once reaped,
    it is ours. Checked against this process's own clocks, whatever else the machine runs."""
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass\n"
    children_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    child = subprocess.Popen([sys.executable, "-c", spin])
    start, own = _foreign_cpu.sample(), time.process_time()
    t = time.process_time()
    while time.process_time() - t < 0.3:
        pass
    mid, own_spent = _foreign_cpu.sample(), time.process_time() - own
    # the running child is not ours: only our own spin is
    assert mid.ours_s - start.ours_s == pytest.approx(own_spent, abs=0.05)
    child.wait()
    end = _foreign_cpu.sample()
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    reaped = (children.ru_utime - children_before.ru_utime) + (children.ru_stime - children_before.ru_stime)
    assert reaped >= 0.4  # the child spun for half a second of its own CPU time
    # reaped, it is ours (its CPU time, give or take clock ticks and our own few ms)
    assert end.ours_s - mid.ours_s == pytest.approx(reaped, abs=0.05)


def test_a_second_run_of_a_day_never_overwrites_the_first(tmp_path):
    """A result whose hand-written notes follow the table stays as it was: the next run
    of the day numbers its files, Markdown, CSV and profiles alike, and a script that
    writes several names (planner_exact, planner_exact_parts) numbers them all alike."""
    assert _report.free_tag(tmp_path, "bench", "2026-12-07") == ""
    (tmp_path / "bench_2026-12-07.md").write_text("notes")
    (tmp_path / "other_2026-12-07.md").write_text("another benchmark's")
    assert _report.free_tag(tmp_path, "bench", "2026-12-08") == ""
    assert _report.free_tag(tmp_path, "bench", "2026-12-07") == "-2"
    assert _report.free_tag(tmp_path, "other", "2026-12-07") == "-2"
    (tmp_path / "bench_2026-12-07.md").unlink()
    (tmp_path / "bench_2026-12-07_profiles.json").write_text("{}")
    (tmp_path / "bench_parts_2026-12-07-2.csv").write_text("")
    assert _report.free_tag(tmp_path, "bench", "2026-12-07") == "-3"
    assert _report.free_tag(tmp_path, "nothing", "2026-12-07") == ""


def test_one_run_keeps_one_tag(tmp_path, monkeypatch):
    """The files one script run writes share their tag, whatever their names, and a day's
    earlier result stays."""
    monkeypatch.setattr(_report, "RESULTS", tmp_path)
    monkeypatch.setattr(sys, "argv", ["benchmarks/bench_once.py"])
    _report._run_tag.cache_clear()
    day = datetime.date.today().isoformat()
    (tmp_path / f"bench_once_{day}.md").write_text("notes")
    csv_path = _report.write_csv("bench_once_parts", [{"a": 1}])
    md_path = _report.write_result("bench_once", "title", "body")
    _report._run_tag.cache_clear()
    assert (csv_path.name, md_path.name) == (f"bench_once_parts_{day}-2.csv", f"bench_once_{day}-2.md")
    assert (tmp_path / f"bench_once_{day}.md").read_text() == "notes"
