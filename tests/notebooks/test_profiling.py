"""The profiling notebook measures this machine, shows it, and plans with it."""

import os
import re

import pytest

from profiler import ProfileReport

from .conftest import has_png, run_notebook, text_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

NUMBER = r"[\d.]+(?:e[+-]\d+)?"


def table(text: str, header: str) -> list[list[str]]:
    """The whitespace-separated rows that follow the line starting with ``header``, up
    to the first blank line."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith(header)) + 1
    rows = []
    for line in lines[start:]:
        if not line.strip():
            break
        rows.append(line.split())
    return rows


def test_profiling(tmp_path):
    out = run_notebook("profiling.ipynb", tmp_path)
    for tag in ("matmul", "stream", "unit_times", "unit_rates", "busbw"):
        assert has_png(out[tag]), f"{tag} shows a picture"

    # the device: every matmul measured at a positive rate; the best is the table's maximum
    device = text_of(out["device"])
    rows = [r for r in table(device, "n ") if r[0].isdigit()]
    assert [int(r[0]) for r in rows] == [16, 32, 64, 128, 256, 512, 1024, 2048]
    fp32_column = [float(r[2]) for r in rows]
    assert all(rate > 0 for r in rows for rate in map(float, r[1:3]))
    best_fp32 = float(re.search(rf"best fp32 matmul: ({NUMBER}) GFLOP/s", device).group(1))
    assert best_fp32 == pytest.approx(max(fp32_column), abs=0.06)
    bandwidth = float(re.search(rf"memory bandwidth .*: ({NUMBER}) GB/s", device).group(1))
    assert bandwidth > 0

    # the layers: a unit that does FLOPs achieves a positive rate below the device's best matmul
    layers = text_of(out["layers"])
    step_ms = float(re.search(rf"forward \+ backward of the whole model ({NUMBER}) ms", layers).group(1))
    peak = float(re.search(rf"best fp32 matmul of the device: ({NUMBER}) GFLOP/s", layers).group(1))
    assert peak == best_fp32
    units = {r[0]: r for r in table(layers, "unit ")}
    assert list(units) == ["tok_embeddings+pos_embeddings", "layers.0", "norm+output"]
    assert units["layers.0"][1] == "4", "the 4 identical blocks are measured once"
    for name in ("layers.0", "norm+output"):
        gflop, rate = float(units[name][4]), float(units[name][5])
        assert gflop > 0 and 0 < rate < peak, f"{name}: {rate} GFLOP/s against a best matmul of {peak}"
    summed = sum(int(r[1]) * (float(r[2]) + float(r[3])) for r in units.values())
    assert summed == pytest.approx(step_ms, rel=0.01, abs=0.1)

    # the network: the fitted link the cost model uses is slower than memory and has a latency
    network = text_of(out["network"])
    assert "gloo: 2 ranks on 1 node" in network
    fits = table(network, "level ")
    joint = next(r for r in fits if r[1] == "all_reduce+all_gather+reduce_scatter+send_recv")
    latency_us, link_gbs = float(joint[2]), float(joint[3])
    assert latency_us > 0 and 0 < link_gbs < bandwidth

    # the report: JSON that loads, an HTML page with its figures embedded, Markdown with its figures
    report_text = text_of(out["report"])
    assert "wrote 5 figures into profile_figures/" in report_text
    report = ProfileReport.load(tmp_path / "profile.json")
    assert report.measured == ("device", "layers", "network")
    assert report.device.peak_flop_per_s("fp32") / 1e9 == pytest.approx(best_fp32, abs=0.06)
    page = (tmp_path / "profile.html").read_text()
    assert page.count("src='data:image/png;base64,") == 5
    assert "Layers: GPT" in page and "Network: gloo, 2 ranks" in page
    markdown = (tmp_path / "profile.md").read_text()
    linked = re.findall(r"\]\((profile_figures/\w+\.png)\)", markdown)
    assert len(linked) == 5 and all((tmp_path / path).stat().st_size > 0 for path in linked)

    # the cluster: measured numbers are the ones measured above; peaks never below the datasheet's
    cluster = text_of(out["cluster"])
    rows = {m.group(1): m.group(2, 3, 4) for m in re.finditer(rf"^(.+\)) +({NUMBER}) +({NUMBER}) +({NUMBER})x$",
                                                                cluster, re.MULTILINE)}
    assert len(rows) == 8
    nominal_fp32, measured_fp32, _ = rows["peak fp32 (GFLOP/s)"]
    assert float(measured_fp32) == pytest.approx(max(float(nominal_fp32), best_fp32), rel=0.01)
    # per process: the streaming bandwidth times what a process keeps while the other
    # streams too, beyond the share of a core it has anyway
    time_share = min(1.0, (os.cpu_count() or 1) / 2)
    kept = float(re.search(rf"bandwidth kept while both processes stream: ({NUMBER})", cluster).group(1))
    assert kept == pytest.approx(report.network.memory_share, abs=0.006) and 0 < kept <= 1
    expected = bandwidth * min(1.0, report.network.memory_share / time_share)
    assert float(rows["memory bandwidth per process (GB/s)"][1]) == pytest.approx(expected, rel=0.01, abs=0.06)
    assert float(rows["link busbw (GB/s)"][1]) == pytest.approx(link_gbs, rel=0.01)
    assert float(rows["link latency (us)"][1]) == pytest.approx(latency_us, rel=0.01, abs=1)
    for label in ("fp32 attention projection (GFLOP/s)", "fp32 MLP up (GFLOP/s)", "fp32 output head (GFLOP/s)"):
        nominal, measured, _ = rows[label]
        assert float(nominal) == 60, "local-cpu's nominal fp32 rate, the same at every size"
        assert 0 < float(measured) <= best_fp32 * 1.01, "interpolated on the measured curve"
    assert "measured (report #1" in cluster and "fitted alpha-beta (report #1" in cluster

    # the calibration: measured time is the layer table's, and the factor is measured over roofline
    calibration = {r[0]: list(map(float, r[1:])) for r in table(text_of(out["calibration"]), "unit ")}
    for name in ("layers.0", "norm+output"):
        measured_ms, roofline_ms, factor = calibration[name]
        assert measured_ms == pytest.approx(float(units[name][2]) + float(units[name][3]), abs=0.02)
        assert roofline_ms > 0 and factor == pytest.approx(measured_ms / roofline_ms, rel=0.02, abs=0.01)

    # the plan lists the three measurements it used
    explain = text_of(out["plan"])
    dp, tp, pp = map(int, re.search(r"dp=(\d+) x tp=(\d+) x pp=(\d+)", explain).groups())
    assert dp * tp * pp == 2
    used = explain.split("Measurements used:")[1]
    for what in ("device cpu-process", "layers of GPT (batch 4, seq 128, fp32)", "network gloo x 2 ranks"):
        assert what in used
    compare = text_of(out["compare"])
    steps = [float(s) for s in re.findall(rf"predicted step ({NUMBER}) s", compare)]
    assert len(steps) == 2 and all(s > 0 for s in steps)
    assert "measurements listed: False / True" in compare
