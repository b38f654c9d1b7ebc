"""Print the size of the HTML liveness report and how long headless Chromium takes to make it interactive.

Reproduce: python benchmarks/bench_html.py [MODEL] [--batch 4] [--seq 2048]
Goal (issue 4): for meta-llama/Llama-2-7b at batch 4, seq 2048, <= 15 MB and interactive in <= 3 s. Needs
Debian's chromium (/usr/bin/chromium) and playwright. "Interactive" is the time from navigation until the page
has drawn its timelines and lifetimes and set `window.vramtraceReady` (its last statement).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from vramtrace import RunSpec, analyze
from vramtrace.render.html import render_html


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="meta-llama/Llama-2-7b")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    a = ap.parse_args()
    report = analyze(RunSpec(a.model, batch=a.batch, seq=a.seq))
    path = Path(tempfile.mkdtemp()) / "report.html"
    t0 = time.perf_counter()
    path.write_text(render_html([report]), encoding="utf-8")
    render_s = time.perf_counter() - t0
    print(f"model         : {a.model}, batch {a.batch}, seq {a.seq} ({report.num_steps:,} steps, "
          f"{len(report.tensors):,} storages)")
    print(f"report size   : {path.stat().st_size / 1e6:.2f} MB (10^6 bytes), rendered in {render_s:.2f} s")
    chromium = shutil.which("chromium")
    if chromium is None:
        print("interactive   : not measured (no chromium)")
        return
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        t0 = time.perf_counter()
        page.goto(path.as_uri())
        page.wait_for_function("window.vramtraceReady === true", timeout=60000)
        ready = time.perf_counter() - t0
        browser.close()
    print(f"interactive   : {ready:.2f} s in headless Chromium")


if __name__ == "__main__":
    main()
