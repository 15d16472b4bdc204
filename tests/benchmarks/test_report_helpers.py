"""The benchmarks' rank correlation and CSV writer (no timing, no processes)."""

import csv
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import _report  # noqa: E402


def test_ranks_average_ties():
    assert _report.ranks([3.0, 1.0, 2.0, 2.0]) == [4.0, 1.0, 2.5, 2.5]


def test_spearman_matches_closed_form_without_ties():
    xs, ys = [1.0, 2.0, 3.0, 4.0, 5.0], [2.0, 1.0, 4.0, 3.0, 5.0]
    d2 = sum((a - b) ** 2 for a, b in zip(_report.ranks(xs), _report.ranks(ys)))
    n = len(xs)
    assert _report.spearman(xs, ys) == pytest.approx(1 - 6 * d2 / (n * (n * n - 1)))


def test_spearman_is_about_order_only():
    xs = [0.1, 0.5, 0.2, 3.0]
    assert _report.spearman(xs, [x ** 3 + 7 for x in xs]) == pytest.approx(1.0)
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
