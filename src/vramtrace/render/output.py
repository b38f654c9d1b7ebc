"""The public renderers of a `MemoryReport`: functions of the report (the report imports no renderer).

`print_report` (rich, terminal), `report_json` (what `--json` writes), `write_html` (what `--html` writes). They are
re-exported from the package root."""

from __future__ import annotations

import json

from ..report.summary import MemoryReport
from . import html, json_report, terminal


def print_report(report: MemoryReport, width: int | None = None) -> None:
    """Print the terminal report (rich) of `report` to stdout, `width` columns (None: the terminal's)."""
    from rich.console import Console

    terminal.render(report, Console(width=width))


def report_json(report: MemoryReport, path: str | None = None) -> str:
    """The JSON report of `report` (what `--json` writes) as a string; also written to `path` when given ('-':
    stdout). Raises ReportWriteError when `path` cannot be written."""
    if path is not None:
        json_report.write_json(report, path)
    return json.dumps(report.to_dict())


def write_html(report: MemoryReport, path: str) -> None:
    """Write the self-contained HTML report of `report` (what `--html` writes) to `path`; a `--compile` report
    draws its eager step beside it on one scale (`MemoryReport.html_pages`). Raises ReportWriteError."""
    reports, labels = report.html_pages()
    html.write_html(reports, path, labels)
