"""The golden files' contents, made one way for the tests that compare with them and for the script that writes them
(`python scripts/regen_goldens.py`, after an intended change of the terminal report or the HTML page's data): a
test never rewrites a golden file.

Both reports are of a CUDA target (no CPU kernel probe), so the golden text and data are the same on every machine.
"""

from __future__ import annotations

import io
import json
import re
from dataclasses import replace
from pathlib import Path

from rich.console import Console

from vramtrace import RunSpec, analyze
from vramtrace.render.html import render_html
from vramtrace.render.terminal import render

GOLDEN = Path(__file__).resolve().parent / "golden"
FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "configs" / "tiny-llama-gqa.json"
WIDTHS = (80, 120)


def terminal_report():
    """tiny-llama-gqa, batch 2 x 16, fp32 on a 2 MiB GPU (so the verdict and the levers show), its model label fixed."""
    r = analyze(RunSpec(str(FIXTURE), batch=2, seq=16, device="cuda", precision="fp32", gpu_memory_bytes=2 << 20))
    return replace(r, model=replace(r.model, ref="tiny-llama-gqa"))


def html_report():
    """tiny-llama-gqa, batch 2 x 16, fp32, CUDA target."""
    return analyze(RunSpec(str(FIXTURE), batch=2, seq=16, device="cuda", precision="fp32"))


def rendered(report, width: int) -> str:
    """The terminal report as plain text, `width` columns."""
    console = Console(width=width, file=io.StringIO(), color_system=None, record=True)
    render(report, console)
    return console.export_text()


def embedded_data(html: str) -> dict:
    """The JSON data block an HTML report embeds."""
    m = re.search(r'<script type="application/json" id="vramtrace-data">(.*?)</script>', html, re.S)
    assert m, "no embedded data block"
    return json.loads(m.group(1))


def html_data(report) -> dict:
    """The embedded data of `report`'s page, labelled without a machine-specific path."""
    return embedded_data(render_html([report], ["tiny-llama-gqa"]))


def terminal_path(width: int) -> Path:
    return GOLDEN / f"terminal-{width}.txt"


HTML_DATA = GOLDEN / "tiny-llama-gqa.html-data.json"


def write_all() -> list[Path]:
    """Write every golden file from this checkout's code; the paths written."""
    report = terminal_report()
    written = []
    for width in WIDTHS:
        terminal_path(width).write_text(rendered(report, width))
        written.append(terminal_path(width))
    HTML_DATA.write_text(json.dumps(html_data(html_report()), indent=0, sort_keys=True) + "\n")
    return written + [HTML_DATA]
