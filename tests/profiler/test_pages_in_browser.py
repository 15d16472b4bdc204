"""The plan and profile pages as a reader sees them: rendered by headless Chromium
(Debian's ``chromium``, which CI installs) at a desktop and a phone width, every image
decodes and the page never scrolls sideways (wide tables and text scroll in their own
boxes)."""

import html
import json
import re
import shutil
import subprocess

import pytest
from profile_factories import full

import autopar
from autopar.models import build_named_model
from autopar.present.report import plan_html
from profiler.render import render_html

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium); CI installs it"
)

PROBE = """<script>addEventListener('load', () => {
  const images = [...document.images];
  const root = document.documentElement;
  document.body.setAttribute('data-probe', JSON.stringify({
    images: images.length,
    broken: images.filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.alt),
    overflow_px: root.scrollWidth - root.clientWidth,
  }));
});</script>"""
"""Measures, once the page has loaded, what the test checks; written into the DOM that
Chromium dumps."""


def _probe(page: str, tmp_path, width_px: int) -> dict:
    """Load ``page`` (with the probe appended) in headless Chromium at ``width_px``."""
    path = tmp_path / f"page_{width_px}.html"
    path.write_text(page.replace("</body>", PROBE + "</body>"), encoding="utf-8")
    done = subprocess.run(
        [
            CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", f"--window-size={width_px},900",
            "--virtual-time-budget=10000", "--dump-dom", path.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    found = re.search(r'data-probe="([^"]*)"', done.stdout)
    assert found, done.stderr[-2000:]
    return json.loads(html.unescape(found.group(1)))


def _plan_page() -> str:
    plan = autopar.estimate(
        build_named_model("gpt3-6.7b"),
        autopar.preset("dgx-a100-80gb", nodes=4),
        {"tp": 8, "pp": 4, "schedule": "interleaved-1f1b", "virtual_stages": 2, "micro_batch_size": 1},
        global_batch_size=16,
        seq_len=2048,
    )
    return plan_html(plan)


@pytest.mark.parametrize("width_px", [1280, 420])
@pytest.mark.parametrize(
    ("name", "make", "images"), [("plan", _plan_page, 3), ("profile", lambda: render_html(full()), 5)]
)
def test_page_loads_its_images_and_fits_the_window(name, make, images, width_px, tmp_path):
    seen = _probe(make(), tmp_path, width_px)
    assert seen["images"] == images and seen["broken"] == [], seen
    assert seen["overflow_px"] <= 0, f"the {name} page scrolls sideways by {seen['overflow_px']} px at {width_px} px"
