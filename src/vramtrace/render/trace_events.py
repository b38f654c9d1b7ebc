"""The predicted timeline as Chrome trace events (JSON), to open in ui.perfetto.dev or chrome://tracing.

The format is Google's "Trace Event Format" document (the Chrome trace event format,
https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU) in its JSON Object Format, as
Perfetto's JSON importer reads it (https://perfetto.dev/docs/getting-started/other-formats and
src/trace_processor/importers/json/json_trace_parser.cc in google/perfetto: a counter event becomes one track per
key of its args, named "<name> <key>"; duration events must nest).

Time is synthetic: the timeline's steps (one op each) have no duration, so one step is 1 µs of trace time, and
"ts" is the step index (an int, in µs, as the format counts it). One process (pid 1) holds:
- the counter "allocated by category": args {category: bytes live while the step runs}, one series per category
  the report holds, on a CUDA target also "allocator_remainder" (the blocks' unsplit remainders, at the peak step)
  (Perfetto: one track each, "allocated by category activation", ...; chrome://tracing stacks them), and the
  counter "total allocated" (args {"bytes": ...}), whose maximum is `peak_allocated_bytes`;
- thread "phases": one complete slice ("ph": "X") per run of steps in the same phase (forward, backward, ...);
- thread "ops": one complete slice per step, 1 µs long, named by its op, args module, phase, allocated_bytes;
- a process-scoped instant event ("ph": "i") "peak allocated" at the peak step.
A counter is sampled only at the steps where one of its values changes (and at step 0): a counter holds its value
until the next sample. Bytes are ints, exact in the importers' doubles below 2**53. "displayTimeUnit": "ns" only
sets how chrome://tracing prints times; today's Perfetto ignores it (stat json_display_time_unit), older trace
processors read it as ts in ns, which scales every event alike (one step = 1 ns).
"""

from __future__ import annotations

import json
from typing import Any

from ..analysis.categories import Category
from ..report.summary import MemoryReport
from .json_report import write_output

PID = 1
PHASES_TID, OPS_TID = 1, 2
STEP_US = 1  # µs of trace time per timeline step (synthetic: steps have no duration)
BY_CATEGORY = "allocated by category"
TOTAL = "total allocated"


def _categories(report: MemoryReport) -> list[str]:
    """The categories the report's storages have: Category's order first (bottom of the stack), then any other."""
    present = {t.category for t in report.tensors}
    if report.breakdown_at_peak.get(Category.ALLOCATOR_REMAINDER.value):
        present.add(Category.ALLOCATOR_REMAINDER.value)
    known = [c.value for c in Category if c.value in present]
    return known + sorted(present - set(known))


def _changes(report: MemoryReport) -> dict[int, dict[str, int]]:
    """Per step, the bytes each category gains (births) and loses (the step after a death). A storage is live on
    steps birth <= step <= death. Raises ValueError for a storage outside the report's steps."""
    n = report.num_steps
    changes: dict[int, dict[str, int]] = {}

    def add(birth: int, death: int, category: str, nbytes: int) -> None:
        at = changes.setdefault(birth, {})
        at[category] = at.get(category, 0) + nbytes
        if death + 1 < n:
            at = changes.setdefault(death + 1, {})
            at[category] = at.get(category, 0) - nbytes

    for t in report.tensors:
        if not 0 <= t.birth <= t.death < n:
            raise ValueError(f"storage {t.id} ({t.name or t.op}) lives on steps {t.birth}..{t.death}, outside "
                             f"the report's 0..{n - 1}")
        add(t.birth, t.death, t.category, t.bytes)
    remainder = report.breakdown_at_peak.get(Category.ALLOCATOR_REMAINDER.value, 0)
    if remainder:  # a CUDA target's unsplit block remainders (no storage): known at the peak step only
        add(report.peak_step, report.peak_step, Category.ALLOCATOR_REMAINDER.value, remainder)
    return changes


def _phase_runs(report: MemoryReport) -> dict[int, tuple[str, int]]:
    """{first step: (phase, number of steps)} for each run of consecutive steps in the same phase."""
    runs: dict[int, tuple[str, int]] = {}
    start = 0
    for i, (_, _, phase) in enumerate(report.steps):
        if i + 1 == len(report.steps) or report.steps[i + 1][2] != phase:
            runs[start] = (phase, i + 1 - start)
            start = i + 1
    return runs


def _metadata(report: MemoryReport) -> list[dict[str, Any]]:
    """Process and thread names ("ph": "M"), phases above ops."""
    ref = report.model.ref
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": PID, "tid": 0, "args": {"name": f"vramtrace: {ref} (predicted)"}}]
    for tid, name in ((PHASES_TID, "phases"), (OPS_TID, "ops")):
        events.append({"ph": "M", "name": "thread_name", "pid": PID, "tid": tid, "args": {"name": name}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": PID, "tid": tid, "args": {"sort_index": tid}})
    return events


def _other_data(report: MemoryReport) -> dict[str, Any]:
    """Flat scalars about the trace (the format's "otherData"; Perfetto shows "metadata" as json_metadata.*)."""
    from .._version import __version__

    run = report.run
    data: dict[str, Any] = {
        "generator": f"vramtrace {__version__}", "model": report.model.ref,
        "mode": run.mode.value, "batch": run.batch, "seq": run.seq,
        "device": run.device.value, "predicted_peak_allocated_bytes": report.peak_allocated_bytes,
        "peak_step": report.peak_step, "num_steps": report.num_steps,
        "time": f"synthetic: one timeline step = {STEP_US} us of trace time (ts = step index); steps have no "
                "duration",
        "counters": f"'{BY_CATEGORY} <category>' and '{TOTAL} bytes': bytes live while a step runs",
    }
    if report.peak_reserved_bytes is not None:
        data["predicted_peak_reserved_bytes"] = report.peak_reserved_bytes
    return {k: v for k, v in data.items() if v is not None}


def trace_events_of(report: MemoryReport) -> dict[str, Any]:
    """The trace as a JSON-ready dict: {"traceEvents": [...], "displayTimeUnit": "ns", "otherData": {...},
    "metadata": {...}} (see the module docstring for the tracks). Events come in ts order (metadata first); the
    "total allocated" counter's maximum equals `report.peak_allocated_bytes` (ints, bytes). Raises ValueError
    when a storage lives outside the report's steps."""
    cats = _categories(report)
    changes = _changes(report)
    runs = _phase_runs(report)
    live = dict.fromkeys(cats, 0)
    total, last_total = 0, None
    events = _metadata(report)
    for step in range(report.num_steps):
        ts = step * STEP_US
        if step in runs:
            phase, steps = runs[step]
            events.append({"ph": "X", "name": phase, "cat": "phase", "ts": ts, "dur": steps * STEP_US, "pid": PID,
                           "tid": PHASES_TID})
        delta = changes.get(step, {})
        if step == 0 or any(delta.values()):
            for cat, d in delta.items():
                live[cat] += d
            total += sum(delta.values())
            events.append({"ph": "C", "name": BY_CATEGORY, "ts": ts, "pid": PID, "tid": OPS_TID,
                           "args": dict(live)})
            if total != last_total:
                events.append({"ph": "C", "name": TOTAL, "ts": ts, "pid": PID, "tid": OPS_TID,
                               "args": {"bytes": total}})
                last_total = total
        if step < len(report.steps):
            op, module, phase = report.steps[step]
            events.append({"ph": "X", "name": op, "cat": "op", "ts": ts, "dur": STEP_US, "pid": PID, "tid": OPS_TID,
                           "args": {"module": module or "(root)", "phase": phase, "allocated_bytes": total}})
        if step == report.peak_step:
            events.append({"ph": "i", "s": "p", "name": "peak allocated", "ts": ts, "pid": PID, "tid": OPS_TID,
                           "args": {"bytes": report.peak_allocated_bytes, "op": report.peak_op,
                                    "module": report.peak_module or "(root)", "phase": report.peak_phase}})
    other = _other_data(report)
    return {"traceEvents": events, "displayTimeUnit": "ns", "otherData": other, "metadata": other}


def write_trace_events(report: MemoryReport, path: str) -> None:
    """Write `trace_events_of(report)` as compact JSON to `path` ('-' for stdout). Raises ReportWriteError."""
    write_output(path, json.dumps(trace_events_of(report), separators=(",", ":")) + "\n", "--trace-events")
