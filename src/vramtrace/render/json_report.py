"""JSON renderer: the MemoryReport as stable-keyed JSON (bytes are ints)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..report.summary import MemoryReport
from ..errors import ReportWriteError


def check_writable(path: str, option: str = "--json") -> None:
    """Fail early (before tracing) when `path` (given to `option`) cannot be written. '-' means stdout.

    Leaves the file system as it found it: no file is created, an existing one is not modified, so a run that
    fails after this check writes nothing. Raises ReportWriteError."""
    if path == "-":
        return
    p = Path(path).expanduser()
    parent = p.parent if str(p.parent) else Path(".")
    if p.is_dir():
        raise ReportWriteError(f"{option} {path} is a directory; pass a file path")
    if not parent.is_dir():
        raise ReportWriteError(f"cannot write {option} {path}: directory {parent} does not exist")
    try:
        if p.exists():  # an existing file is opened, never truncated: a failed run leaves it as it was
            with open(p, "a"):
                pass
        else:  # made and removed at once: a failed run leaves no file behind
            with open(p, "x"):
                pass
            p.unlink()
    except OSError as e:
        raise ReportWriteError(f"cannot write {option} {path}: {e.strerror}") from e


def write_output(path: str, data: str | bytes, option: str) -> None:
    """Write `data` to the file `path`, or to stdout for '-' (bytes to its binary buffer), for `option`.
    Raises ReportWriteError."""
    try:
        if path == "-":
            if isinstance(data, bytes):
                sys.stdout.flush()
                sys.stdout.buffer.write(data)
                sys.stdout.buffer.flush()
            else:
                sys.stdout.write(data)
        elif isinstance(data, bytes):
            Path(path).expanduser().write_bytes(data)
        else:
            Path(path).expanduser().write_text(data, encoding="utf-8")
    except OSError as e:
        raise ReportWriteError(f"cannot write {option} {path}: {e.strerror}") from e


def write_json(report: MemoryReport | dict, path: str) -> None:
    """Write the report (or plain JSON data, e.g. a validate result) to `path` ('-' for stdout).
    Raises ReportWriteError."""
    data = report.to_dict() if isinstance(report, MemoryReport) else report
    write_output(path, json.dumps(data) + "\n", "--json")  # no indent: json's C encoder only runs without one


def read_json_report(path: str) -> MemoryReport | None:
    """The MemoryReport saved at `path` by `--json`, or None when `path` is not a vramtrace JSON report
    (e.g. a model's config.json). Raises ReportWriteError for a report it cannot read."""
    p = Path(path).expanduser()
    if p.suffix != ".json" or not p.is_file():
        return None
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or "schema_version" not in data or "peak_allocated_bytes" not in data:
        return None
    try:
        return MemoryReport.from_dict(data)
    except (TypeError, ValueError, AttributeError) as e:  # a key unknown or missing, a value of the wrong shape or
        # out of its enum (report.data.from_data)
        raise ReportWriteError(f"{path} looks like a vramtrace report but cannot be read ({e}); write it again") from e
