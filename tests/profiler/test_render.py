"""Rendered reports: standalone HTML, Markdown with figure files, honest escaping."""

import base64
import re
from dataclasses import replace

from profile_factories import device, full, layers, network

from autopar.profiles.report import ProfileReport
from profiler.render import render_html, render_markdown

PNG = b"\x89PNG\r\n\x1a\n"


def test_html_stands_alone():
    html = render_html(full())
    images = re.findall(r"src='data:image/png;base64,([A-Za-z0-9+/=]+)'", html)
    assert len(images) == 5  # matmul, stream, unit times, unit rates, busbw
    assert all(base64.b64decode(i).startswith(PNG) for i in images)
    assert "http://" not in html and "https://" not in html and "<link" not in html
    assert html.startswith("<!DOCTYPE html>") and html.rstrip().endswith("</html>")
    assert "<td>layers.0</td>" in html and "Test device" in html
    assert "<td>intra</td><td>all_reduce+all_gather</td><td>10</td><td>1</td>" in html  # alpha us, busbw GB/s


def test_text_is_escaped():
    base = layers().layers
    odd = replace(base, units=(replace(base.units[0], fqn="<script>alert(1)</script>"),))
    html = render_html(ProfileReport(layers=odd))
    assert "<script>" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html


def test_markdown_writes_figures_next_to_it(tmp_path):
    md = render_markdown(full(), image_dir=tmp_path / "figs", link_prefix="figs/")
    files = sorted(p.name for p in (tmp_path / "figs").iterdir())
    assert files == ["busbw.png", "matmul.png", "stream.png", "unit_rates.png", "unit_times.png"]
    assert all((tmp_path / "figs" / f).read_bytes().startswith(PNG) for f in files)
    assert md.count("](figs/") == 5
    assert "| unit | x | fwd ms (min-max) |" in md
    assert "![" not in render_markdown(full())


def test_partial_reports_render_their_sections_only():
    html = render_html(network())
    assert "Network: gloo, 4 ranks" in html and "Layers:" not in html and "Device:" not in html
    assert len(re.findall("data:image/png", html)) == 1


def test_group_measurements_are_shown_when_taken():
    plain = render_markdown(network())
    assert "Framework time" not in plain and "streaming at once" not in plain
    text = render_markdown(
        network(tp_overhead_s=4e-4, fsdp_overhead_s=9e-4, fsdp_tensor_overhead_s=3e-5, memory_share=0.7)
    )
    assert "400 us per tensor-parallel layer forward" in text and "900 us per FSDP2 collective call" in text
    assert "30 us per parameter tensor of its unit" in text
    assert "streaming at once: 0.70 of what one rank has alone" in text


def test_a_measured_attention_kernel_is_tabled():
    """Shown where it was measured (GPU profiles), absent otherwise."""
    assert "Fused attention" not in render_markdown(full())
    text = render_markdown(device(kind="cuda", dtypes=("bf16",), attention_flop_per_s=(2.5e14, 5e14)))
    assert "| bf16 | 8x32x2048x128 | 1e+12 | 4 | 0% | 250.0 |" in text
    assert "| bf16 | 4x32x4096x128 | 1e+12 | 2 | 0% | 500.0 |" in text
