"""The HTML liveness report, the memory_viz snapshot and re-rendering saved reports.

Browser tests open the page in Debian's chromium through playwright (installed by .ci/run; skipped with the
reason when either is missing). Golden tests pin the report's embedded data, not its pixels: regenerate with
VRAMTRACE_REGEN_GOLDEN=1 after an intended change.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from dataclasses import replace

import pytest

from conftest import FIXTURES
from vramtrace import RunSpec, analyze
from vramtrace.reports.html import render_html
from vramtrace.reports.snapshot import snapshot_of

GOLDEN = FIXTURES.parent.parent / "tests" / "golden"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def report():
    # a CUDA target: no CPU kernel probe, so the golden data is the same on every machine
    return analyze(RunSpec(str(FIXTURES / "tiny-llama-gqa.json"), batch=2, seq=16, device="cuda", precision="fp32"))


def embedded_data(html: str) -> dict:
    m = re.search(r'<script type="application/json" id="vramtrace-data">(.*?)</script>', html, re.S)
    assert m, "no embedded data block"
    return json.loads(m.group(1))


def test_embedded_data_matches_golden(report):
    data = embedded_data(render_html([report], ["tiny-llama-gqa"]))  # no machine-specific path in the label
    path = GOLDEN / "tiny-llama-gqa.html-data.json"
    if os.environ.get("VRAMTRACE_REGEN_GOLDEN"):
        path.write_text(json.dumps(data, indent=0, sort_keys=True) + "\n")
    assert data == json.loads(path.read_text())


def test_page_is_self_contained_and_names_are_escaped(report):
    evil = "</script><img src=x onerror=alert(1)><!--"
    rows = (replace(report.tensors[0], name=evil, module=evil),) + report.tensors[1:]
    html = render_html([replace(report, tensors=rows, model={**report.model, "ref": evil})])
    assert html.count("</script>") == 2  # the data block and the code: a name cannot close either
    outside = re.sub(r'<script type="application/json" id="vramtrace-data">.*?</script>', "", html, flags=re.S)
    assert "<img src=x" not in outside and "&lt;/script&gt;&lt;img" in outside  # summary text is escaped
    assert not re.search(r"""(src|href)\s*=\s*["']?https?:""", html) and "cdn" not in html.lower()
    names = embedded_data(html)["reports"][0]["strings"]
    assert evil in names  # the name survives, as data


def test_snapshot_is_read_by_pytorch_memory_viz(report, tmp_path):
    from torch.cuda import _memory_viz

    snap = snapshot_of(report)
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps(snap))
    snap = pickle.loads(path.read_bytes())
    assert "base64" in _memory_viz.trace_plot(snap) and "base64" in _memory_viz.segment_plot(snap)
    text = _memory_viz.trace(snap)
    assert text.rstrip().splitlines()[-1].startswith("TOTAL MEM")
    _memory_viz.segsum(snap)
    live = peak = 0  # the allocator events replay to the predicted peak
    for e in snap["device_traces"][0]:
        live += e["size"] if e["action"] == "alloc" else -e["size"] if e["action"] == "free_completed" else 0
        peak = max(peak, live)
    assert peak == report.peak_allocated_bytes


def test_saved_json_rerenders_without_tracing(tmp_path):
    out, html, again = tmp_path / "r.json", tmp_path / "a.html", tmp_path / "b.html"
    cli = [sys.executable, "-m", "vramtrace.cli"]
    p = subprocess.run(cli + [str(FIXTURES / "tiny-gpt2.json"), "--batch", "2", "--seq", "16", "--json", str(out),
                              "--html", str(html), "-q"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    p = subprocess.run(cli + [str(out), "--html", str(again), "-q"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert embedded_data(html.read_text()) == embedded_data(again.read_text())
    p = subprocess.run(cli + [str(out), str(out), "--html", str(again), "-q"], capture_output=True, text=True)
    assert p.returncode == 0 and len(embedded_data(again.read_text())["reports"]) == 2


@pytest.mark.browser
@pytest.mark.skipif(CHROMIUM is None, reason="Debian chromium is not installed (.ci/run installs it)")
def test_report_in_a_real_browser(report, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (.ci/run installs it)")
    page_path = tmp_path / "report.html"
    page_path.write_text(render_html([report, report], ["a", "b"]))
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1300, "height": 900})
        errors = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(page_path.as_uri())
        page.wait_for_function("window.vramtraceReady === true", timeout=15000)
        canvas = page.locator("canvas.timeline").first
        painted = page.evaluate("""() => { const c = document.querySelector('canvas.timeline');
            const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
            let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i] > 0) n++; return n; }""")
        assert painted > 1000  # the stacked timeline is drawn
        box = canvas.bounding_box()
        canvas.hover(position={"x": box["width"] * 0.5, "y": 120})
        assert "step" in page.locator("#tip").text_content()
        canvas.click(position={"x": box["width"] * 0.5, "y": 120})
        assert page.locator("#liveset tr").count() > 1  # header + the live storages
        assert "Live set at step" in page.locator("#livetitle").text_content()
        page.locator("#liveset th").nth(6).click()  # sort by bytes
        page.locator("#tree summary").first.click()
        shot = tmp_path / "report.png"
        page.screenshot(path=str(shot), full_page=True)
        browser.close()
    assert shot.stat().st_size > 10_000
    assert errors == []
