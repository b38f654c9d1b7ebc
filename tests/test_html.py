"""The HTML liveness report, the memory_viz snapshot and re-rendering saved reports.

Browser tests open the page in Debian's chromium through playwright (installed by .ci/run; skipped with the
reason when either is missing): the Llama-2-7b page (a CUDA target, so the page is the same on every machine) and
its comparison with layer checkpointing, at 1400x900 and 800x900, asserting through the DOM and the data
attributes the script sets on each timeline canvas (its plot box, y scale, view and capacity line's y) and through
the screenshot's pixels. Golden tests pin the report's embedded data, not its pixels: regenerate with
`python scripts/regen_goldens.py` after an intended change.
"""

from __future__ import annotations

import json
import pickle
import re
import shutil
from dataclasses import replace

import pytest

from conftest import FIXTURES, run_cli
from goldens import HTML_DATA, embedded_data, html_data, html_report
from vramtrace import RunSpec, analyze
from vramtrace.report.data import from_data
from vramtrace.report.sections import LeversSummary
from vramtrace.render.html import render_html
from vramtrace.render.snapshot import snapshot_of

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def report():
    return html_report()




def test_embedded_data_matches_golden(report):
    assert html_data(report) == json.loads(HTML_DATA.read_text())  # rewritten only by scripts/regen_goldens.py


def test_page_is_self_contained_and_names_are_escaped(report):
    evil = "</script><img src=x onerror=alert(1)><!--"
    rows = (replace(report.tensors[0], name=evil, module=evil),) + report.tensors[1:]
    html = render_html([replace(report, tensors=rows, model=replace(report.model, ref=evil))])
    assert html.count("</script>") == 2  # the data block and the code: a name cannot close either
    outside = re.sub(r'<script type="application/json" id="vramtrace-data">.*?</script>', "", html, flags=re.S)
    assert "<img src=x" not in outside and "&lt;/script&gt;&lt;img" in outside  # summary text is escaped
    assert not re.search(r"""(src|href)\s*=\s*["']?https?:""", html) and "cdn" not in html.lower()
    data = embedded_data(html)["reports"][0]
    assert evil in data["strings"] and evil in data["groups"]["label"]  # the name survives, as data


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


def test_saved_json_rerenders_without_tracing(tmp_path, capsys):
    out, html, again = tmp_path / "r.json", tmp_path / "a.html", tmp_path / "b.html"
    p = run_cli(capsys, FIXTURES / "tiny-gpt2.json", "--batch", "2", "--seq", "16", "--json", out, "--html", html, "-q")
    assert p.returncode == 0, p.stderr
    p = run_cli(capsys, out, "--html", again, "-q")
    assert p.returncode == 0, p.stderr
    assert embedded_data(html.read_text()) == embedded_data(again.read_text())
    p = run_cli(capsys, out, out, "--html", again, "-q")
    assert p.returncode == 0 and len(embedded_data(again.read_text())["reports"]) == 2


LLAMA = "meta-llama/Llama-2-7b"
GiB, MiB = 2**30, 2**20


def size_text(b: int) -> str:
    """The page's binary units, written here independently of vramtrace.units."""
    return f"{b / GiB:.2f} GiB" if b >= GiB else f"{b / MiB:.2f} MiB" if b >= MiB else None


@pytest.fixture(scope="module")
def llama():
    """Llama-2-7b at 4 x 2048 on an H100 80GB (does not fit), and the same with layer checkpointing."""
    from vramtrace import compare_reports

    spec = RunSpec(LLAMA, batch=4, seq=2048, device="cuda", gpu="H100-80GB")
    return analyze(spec, levers=False), compare_reports(spec, ("none", "layers"))


def live_bytes(report) -> list[int]:
    """Live bytes at each timeline step, summed from the report's storages."""
    diff = [0] * (report.num_steps + 1)
    for t in report.tensors:
        diff[t.birth] += t.bytes
        diff[t.death + 1] -= t.bytes
    out, acc = [], 0
    for d in diff[:-1]:
        acc += d
        out.append(acc)
    return out


def test_reserved_curve_bounds_the_live_bytes(llama):
    """The allocator model's per-step reserved curve (change points) never falls below what is live, ends at the
    predicted peak reserved and only changes where it says it does."""
    for report in (llama[0], *llama[1]):
        points = report.allocator.reserved_steps
        steps = [s for s, _ in points]
        assert steps[0] == 0 and steps == sorted(set(steps)) and steps[-1] < report.num_steps
        assert all(a[1] != b[1] for a, b in zip(points, points[1:]))  # change points only
        live = live_bytes(report)
        bounds = steps[1:] + [report.num_steps]
        for (s, reserved), end in zip(points, bounds):
            assert reserved >= max(live[s:end])
        assert max(b for _, b in points) == report.peak_reserved_bytes
        assert max(live) == report.peak_allocated_bytes


def test_lifetime_groups_fold_identical_layers(llama):
    report = llama[0]
    data = embedded_data(render_html([report]))["reports"][0]
    groups, where = data["groups"], data["tensors"]["group"]
    roots = [k for k, p in enumerate(groups["parent"]) if p < 0]
    fold = [k for k in roots if groups["label"][k] == "model.layers.* ×32"]
    assert len(fold) == 1 and groups["kind"][fold[0]] == "fold"
    layers = [groups["label"][k] for k, p in enumerate(groups["parent"]) if p == fold[0]]
    assert layers == [f"model.layers.{i}" for i in range(32)]
    # every storage sits in one node; the band holds exactly the storages alive over the whole step
    assert len(where) == len(report.tensors) and all(0 <= g < len(groups["label"]) for g in where)

    def root_of(k):
        while groups["parent"][k] >= 0:
            k = groups["parent"][k]
        return k

    band = [k for k in roots if groups["kind"][k] == "band"]
    assert len(band) == 1
    in_band = {t.id for t, g in zip(report.tensors, where) if root_of(g) == band[0]}
    whole = {t.id for t in report.tensors if t.birth == 0 and t.death == report.num_steps - 1}
    assert in_band == whole
    assert {t.category for t in report.tensors if t.id in whole} >= {"parameter", "optimizer_state"}
    # each layer holds the same number of storages (identical layers), outside the band
    per_layer = [sum(1 for g in where if groups["parent"][g] == fold[0] and groups["label"][g] == name)
                 for name in layers]
    assert len(set(per_layer)) == 1 and per_layer[0] > 0


def test_levers_table_shows_each_lever_and_its_peak(report):
    """A hand-built `levers` entry (the renderer's input): one row per lever and the combination, each with its
    peak, what it saves and whether it fits, in document order, the budget marked."""
    budget, base = 60 * MiB, 70 * MiB
    levers = {"budget_bytes": budget, "base_bytes": base, "basis": "peak reserved", "levers": [
        {"family": "checkpointing", "options": "--checkpointing layers", "cost": "recompute <b>", "fits": False,
         "compared_bytes": 64 * MiB, "saves_bytes": 6 * MiB, "peak_allocated_bytes": 63 * MiB,
         "peak_reserved_bytes": 64 * MiB, "recompute_overhead": 0.25},
        {"family": "fsdp", "options": "--fsdp 2", "cost": "hardware", "fits": True, "compared_bytes": 40 * MiB,
         "saves_bytes": 30 * MiB, "peak_allocated_bytes": 39 * MiB, "peak_reserved_bytes": 40 * MiB,
         "recompute_overhead": 0.0}],
        "combination": {"options": "--checkpointing layers --batch 1 --grad-accum 2", "compared_bytes": 50 * MiB,
                        "fits": True, "levers": [], "peak_allocated_bytes": 49 * MiB, "peak_reserved_bytes": 50 * MiB},
        "traces": 3}
    html = render_html([replace(report, levers=from_data(LeversSummary, levers))])
    m = re.search(r'<table class="levers" id="levers0">(.*?)</table>', html, re.S)
    assert m, "no levers table"
    rows = re.findall(r"<tr>(.*?)</tr>", m.group(1), re.S)[1:]
    text = [re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", r)).strip() for r in rows]
    assert len(text) == 4
    expect = [("this run", 70, "no"), ("--checkpointing layers", 64, "no"), ("--fsdp 2", 40, "yes"),
              ("--checkpointing layers --batch 1 --grad-accum 2", 50, "yes")]
    for line, (options, mib, fits) in zip(text, expect):
        assert line.startswith(options) and f"{mib:.2f} MiB" in line and f" {fits} " in f" {line} "
        if options != "this run":
            assert f"{70 - mib:.2f} MiB" in line  # saves
    assert "recompute &lt;b&gt;" in m.group(1)  # text, escaped
    widths = [float(w) for w in re.findall(r'class="fill[^"]*" style="width: ([0-9.]+)%', m.group(1))]
    assert widths[0] == 100 and widths[2] < widths[3] < widths[1] < widths[0]
    mark = re.search(r'class="budget" style="left: ([0-9.]+)%', m.group(1))
    assert abs(float(mark.group(1)) - 100 * 60 / 70) < 0.01
    fix = re.search(r'<div class="fix">(.*?)</div>', html, re.S)  # under the verdict, above the fold
    assert fix and re.search(r"cheapest lever that fits:\s*<code>--fsdp 2</code> \(40.00 MiB", fix.group(1))
    html = render_html([report])
    assert 'class="levers"' not in html and 'class="fix"' not in html  # no levers: neither


def count_colour(page, png: bytes, box: tuple[int, int, int, int], rgb: tuple[int, int, int]) -> int:
    """Pixels of the screenshot `png` within `box` (x, y, w, h) that have colour `rgb` (each channel within 12),
    decoded by the browser itself (no image library needed)."""
    import base64

    return page.evaluate("""async ([src, box, rgb]) => {
        const img = new Image(); img.src = src; await img.decode();
        const c = document.createElement('canvas'); c.width = img.width; c.height = img.height;
        const g = c.getContext('2d'); g.drawImage(img, 0, 0);
        const d = g.getImageData(box[0], box[1], box[2], box[3]).data;
        let n = 0;
        const near = (i) => [0, 1, 2].every((c) => Math.abs(d[i + c] - rgb[c]) <= 12);
        for (let i = 0; i < d.length; i += 4) if (near(i)) n++;
        return n; }""", ["data:image/png;base64," + base64.b64encode(png).decode(), list(box), list(rgb)])


def open_page(p, html: str, path, width: int):
    browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
    page = browser.new_page(viewport={"width": width, "height": 900})
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    path.write_text(html)
    page.goto(path.as_uri())
    page.wait_for_function("window.vramtraceReady === true", timeout=15000)
    return browser, page, errors


def timeline_state(page, k: int = 0) -> dict:
    """What the script drew on timeline k: its box on the page, plot box, y scale, capacity line and tick labels."""
    return page.evaluate("""(k) => {
        const c = document.querySelectorAll('canvas.timeline')[k], r = c.getBoundingClientRect();
        const ticks = [...c.parentElement.querySelectorAll('.yaxis span')].map((s) => {
            const b = s.getBoundingClientRect(); return {text: s.textContent, top: b.top, bottom: b.bottom}; });
        return {box: [r.left, r.top, r.width, r.height], plot: c.dataset.plot.split(',').map(Number),
                yMax: Number(c.dataset.yMax), view: c.dataset.view, ticks,
                capY: c.dataset.capacityY === undefined ? null : Number(c.dataset.capacityY)}; }""", k)


def check_timeline(page, report, k: int = 0) -> dict:
    """The axis and the capacity line of timeline k are drawn where the report says, above the fold."""
    st = timeline_state(page, k)
    left, top, width, height = st["box"]
    x0, ptop, pw, ph = st["plot"]
    assert top + height <= 900, "the timeline is below the fold"
    # a GiB axis: at least 4 labelled ticks, increasing upwards, covering the peaks
    values = [float(t["text"].removesuffix(" GiB")) for t in st["ticks"]]
    assert all(t["text"].endswith(" GiB") for t in st["ticks"]) and len(values) >= 4
    assert values == sorted(values) and values[0] == 0
    assert all(a["top"] > b["top"] for a, b in zip(st["ticks"], st["ticks"][1:]))
    assert all(t["bottom"] <= 900 for t in st["ticks"])
    assert st["yMax"] >= max(report.peak_allocated_bytes, report.peak_reserved_bytes)
    assert (values[-1] + values[1]) * GiB > st["yMax"] >= values[-1] * GiB
    # the 0 tick sits on the plot's bottom edge
    zero = st["ticks"][0]
    assert abs((zero["top"] + zero["bottom"]) / 2 - (top + ptop + ph)) <= 2
    # the capacity line: the GPU's memory less the CUDA context, on the same scale
    usable = report.fit.capacity_bytes - report.fit.cuda_context_bytes
    assert st["capY"] is not None, "no capacity line"
    assert abs(st["capY"] - (ptop + ph - usable / st["yMax"] * ph)) <= 1.5
    assert top + st["capY"] <= 900
    label = page.locator(".caplabel").nth(k).text_content()
    assert report.fit.gpu in label and size_text(usable) in label
    return st


def browser_test(test):
    """Marked `browser`, skipped with the reason without Debian's chromium."""
    skip = pytest.mark.skipif(CHROMIUM is None, reason="Debian chromium is not installed (.ci/run installs it)")
    return pytest.mark.browser(skip(test))


@browser_test
def test_llama_page_in_a_real_browser(llama, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (.ci/run installs it)")
    report = llama[0]
    with sync_api.sync_playwright() as p:
        browser, page, errors = open_page(p, render_html([report]), tmp_path / "llama.html", 1400)
        st = check_timeline(page, report)
        png = page.screenshot(path=str(tmp_path / "llama-1400.png"))
        # the capacity line's colour, across the plot, in the screenshot's timeline rows
        left, top, _, _ = st["box"]
        x0, _, pw, _ = st["plot"]
        y = round(top + st["capY"])
        assert count_colour(page, png, (round(left + x0), y - 1, round(pw), 2), (0xd0, 0, 0)) >= 0.8 * 2 * pw
        assert count_colour(page, png, (round(left + x0), y - 40, round(pw), 20), (0xd0, 0, 0)) < 0.1 * pw
        # the verdict and the breakdown at the peak, above the fold: every category live at the peak, in GiB/MiB
        verdict = page.locator(".verdict").first
        assert "does not fit on H100-80GB" in verdict.text_content() and verdict.bounding_box()["y"] < 900
        bd = page.locator(".bd").first.bounding_box()
        assert bd["y"] + bd["height"] <= 900
        rows = page.locator(".bdtable tr").all_text_contents()
        for cat, b in report.breakdown_at_peak.items():
            if b >= MiB:
                assert any(cat in r and size_text(b) in r for r in rows), (cat, rows)
        segments = page.locator(".bd .bar > div")
        assert segments.count() == sum(1 for b in report.breakdown_at_peak.values() if b)
        heights = [segments.nth(i).bounding_box()["height"] for i in range(segments.count())]
        assert abs(sum(heights) - page.locator(".bd .bar").bounding_box()["height"]) <= 3
        # the phase bands and the reserved curve are in the legend line
        assert "reserved" in page.locator(".tlbar .lines").text_content()
        # brush: drag over a third of the plot zooms to it; reset restores the whole step
        canvas = page.locator("canvas.timeline").first
        box = canvas.bounding_box()
        page.mouse.move(box["x"] + x0 + pw * 0.3, box["y"] + 150)
        page.mouse.down()
        page.mouse.move(box["x"] + x0 + pw * 0.6, box["y"] + 150, steps=4)
        page.mouse.up()
        v0, v1 = map(int, canvas.get_attribute("data-view").split(","))
        n = report.num_steps
        assert abs(v0 - 0.3 * n) <= 0.01 * n and abs(v1 - 0.6 * n) <= 0.01 * n
        assert page.locator(".reset").first.is_visible()
        page.locator(".reset").first.click()
        assert canvas.get_attribute("data-view") == f"0,{n}" and not page.locator(".reset").first.is_visible()
        # a click (no drag) opens the step's live set
        canvas.click(position={"x": x0 + pw * 0.5, "y": 150})
        assert "Live set at step" in page.locator("#livetitle").text_content()
        # lifetimes: the persistent band collapsed, the 32 layers folded into one row that unfolds on click
        labels = page.locator("#lifelabels")
        page.locator("#lifetitle").scroll_into_view_if_needed()
        band = page.locator(".lrow.node[data-kind=band]")
        assert band.count() == 1 and page.locator(".lrow[data-kind=category]").count() == 0
        fold = page.locator(".lrow.node", has_text="model.layers.* ×32")
        assert fold.count() == 1 and fold.locator(".lname").text_content() == "model.layers.* ×32"
        before = int(labels.get_attribute("data-rows"))
        fold.click()
        assert int(labels.get_attribute("data-rows")) == before + 32
        names = page.locator(".lrow .lname").all_text_contents()
        assert names[names.index("model.layers.* ×32") + 1] == "model.layers.0"
        band.click()
        assert page.locator(".lrow[data-kind=category]", has_text="optimizer_state").count() == 1
        page.screenshot(path=str(tmp_path / "llama-1400-full.png"), full_page=True)
        # 800 px: the same page reflows without a horizontal scrollbar, the axis and capacity line redrawn
        page.set_viewport_size({"width": 800, "height": 900})
        page.wait_for_function("document.querySelector('canvas.timeline').getBoundingClientRect().width <= 760")
        page.screenshot(path=str(tmp_path / "llama-800.png"))
        assert page.evaluate("document.documentElement.scrollWidth") <= 800
        st = timeline_state(page)
        assert st["capY"] is not None and len(st["ticks"]) >= 4 and st["box"][0] + st["box"][2] <= 800
        browser.close()
    assert errors == []


@browser_test
def test_llama_comparison_in_a_real_browser(llama, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (.ci/run installs it)")
    reports = llama[1]
    with sync_api.sync_playwright() as p:
        browser, page, errors = open_page(p, render_html(reports, ["none", "layers"]), tmp_path / "cmp.html", 1400)
        page.screenshot(path=str(tmp_path / "compare-1400.png"))
        states = [check_timeline(page, r, k) for k, r in enumerate(reports)]
        # columns: side by side on one row, one shared y scale and axis
        assert page.locator("canvas.timeline").count() == 2
        (a, b) = states
        assert abs(a["box"][1] - b["box"][1]) <= 1 and a["box"][0] + a["box"][2] <= b["box"][0]
        assert a["yMax"] == b["yMax"] and [t["text"] for t in a["ticks"]] == [t["text"] for t in b["ticks"]]
        assert a["capY"] == b["capY"]
        for k, r in enumerate(reports):  # each column's breakdown at the peak, above the fold
            bd = page.locator(".bd").nth(k)
            box = bd.bounding_box()
            assert box["y"] + box["height"] <= 900
            assert size_text(r.breakdown_at_peak["optimizer_state"]) in bd.text_content()
        # the summaries side by side: one column per report, the peaks on one line each, nothing clipped
        heads = page.locator("table.cmp tr").first.locator("th").all_text_contents()
        assert heads[1:] == ["none", "layers"]
        peaks = page.locator("table.cmp td.n b")
        assert [peaks.nth(k).text_content() for k in range(2)] == [size_text(r.peak_allocated_bytes) for r in reports]
        assert all(peaks.nth(k).evaluate("e => e.getClientRects().length") == 1 for k in range(2))
        assert page.evaluate("""() => [...document.querySelectorAll('table.cmp td.n')].every(
            (td) => td.scrollWidth <= td.clientWidth + 1)""")
        assert page.evaluate("document.documentElement.scrollWidth") <= 1400
        page.set_viewport_size({"width": 800, "height": 900})
        page.wait_for_timeout(300)
        page.screenshot(path=str(tmp_path / "compare-800.png"))
        assert page.evaluate("document.documentElement.scrollWidth") <= 800
        browser.close()
    assert errors == []


@browser_test
def test_report_in_a_real_browser(report, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (.ci/run installs it)")
    with sync_api.sync_playwright() as p:
        browser, page, errors = open_page(p, render_html([report, report], ["a", "b"]), tmp_path / "r.html", 1300)
        canvas = page.locator("canvas.timeline").first
        painted = page.evaluate("""() => { const c = document.querySelector('canvas.timeline');
            const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
            let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i] > 0) n++; return n; }""")
        assert painted > 1000  # the stacked timeline is drawn
        # a small model on an H100: MiB ticks, the capacity far above the scale is named, not drawn
        st = timeline_state(page)
        assert all(t["text"].endswith(" MiB") for t in st["ticks"]) and st["capY"] is None
        assert "above the scale" in page.locator(".caplabel").first.text_content()
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
