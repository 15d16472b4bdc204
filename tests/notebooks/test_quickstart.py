"""The quickstart notebook runs and shows what it claims."""

import re

import pytest

from .conftest import has_png, run_notebook, text_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_quickstart(tmp_path):
    out = run_notebook("quickstart.ipynb", tmp_path)
    explain = text_of(out["plan"])
    assert "autopar plan: GPT (174.62B parameters)" in explain and "Why this plan" in explain
    fields = text_of(out["fields"])
    dp, tp, pp = map(int, re.search(r"dp=(\d+) tp=(\d+) pp=(\d+)", fields).groups())
    assert dp * tp * pp == 1024
    mem, cap = map(float, re.search(r"([\d.]+) GiB of (\d+) GiB", fields).groups())
    assert 0 < mem <= cap == 80
    [report] = [o["data"]["text/html"] for o in out["report"] if "text/html" in o.get("data", {})]
    report = "".join(report)
    assert "Why this plan" in report and report.count("data:image/png;base64,") == 3
    for tag in ("timeline", "memory", "step"):
        assert has_png(out[tag]), f"{tag} shows a picture"
    whatif = text_of(out["whatif"]).splitlines()
    rates = {line[:16].strip(): float(line[16:30].replace(",", "")) for line in whatif}
    assert rates["twice the nodes"] > rates["as planned"] and rates["H100 instead"] > rates["as planned"]
    budget = text_of(out["budget"])
    nodes = int(re.search(r"fewest DGX A100 80GB nodes: (\d+)", budget).group(1))
    assert 1 <= nodes <= 128
    days = float(re.search(r"steps, ([\d.]+) days", budget).group(1))
    assert 1 < days < 365
    constraints = text_of(out["constraints"])
    assert "tp=8 pp=16" in constraints and "fits: False" in constraints
