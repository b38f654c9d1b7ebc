"""`--trace-events`: the predicted timeline as Chrome trace events for ui.perfetto.dev.

Perfetto's `trace_processor` Python package (PyPI `perfetto`) does not parse a trace itself: it downloads a
`trace_processor_shell` binary on first use, which neither CI nor these tests can do (no network). So the trace
is checked here against the format's specification instead: Google's "Trace Event Format" document (the Chrome
trace event format) in its JSON Object Format, with the rules Perfetto's JSON importer adds (duration slices
nest; a counter event becomes one track per args key). The checker below is tested on broken traces too.

The expected values are recomputed from the report's storages (live on steps birth <= step <= death), never
taken from the exporter.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from dataclasses import replace

import pytest

from conftest import FIXTURES
from vramtrace import RunSpec, analyze
from vramtrace.cli import main
from vramtrace.render.trace_events import trace_events_of

TINY = str(FIXTURES / "tiny-llama-gqa.json")

# "ph" values of the Trace Event Format document: duration B/E, complete X, instant i (I: its old spelling),
# counter C, async b/n/e (S/T/p/F: legacy), flow s/t/f, sample P, object N/O/D, metadata M, memory dump V/v,
# mark R, context (/), linked ids =
PHASES = set("BEXiICbneSTpFstfPNODMVvR()=")
METADATA_NAMES = {"process_name", "process_labels", "process_sort_index", "thread_name", "thread_sort_index"}


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def chrome_trace_errors(trace) -> list[str]:
    """What makes `trace` (parsed JSON) break the Trace Event Format's JSON Object Format, as far as the event
    types vramtrace writes go: required keys and their types per "ph", numeric counter args, B/E balance,
    ts monotone per track in file order, and duration slices that nest on each thread (Perfetto's rule)."""
    errors: list[str] = []
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        return ["not a JSON object with a traceEvents list"]
    if trace.get("displayTimeUnit", "ms") not in ("ms", "ns"):
        errors.append(f"displayTimeUnit {trace['displayTimeUnit']!r} is not ms or ns")
    if not isinstance(trace.get("otherData", {}), dict):
        errors.append("otherData is not an object")
    last_ts: dict[tuple, float] = {}
    slices: dict[tuple, list[tuple[float, float, str]]] = {}
    open_b: dict[tuple, list[str]] = {}
    for k, e in enumerate(trace["traceEvents"]):
        where = f"event {k} ({e.get('ph') if isinstance(e, dict) else e!r})"
        if not isinstance(e, dict):
            errors.append(f"{where}: not an object")
            continue
        ph = e.get("ph")
        if ph not in PHASES:
            errors.append(f"{where}: unknown ph {ph!r}")
            continue
        if not isinstance(e.get("name"), str):
            errors.append(f"{where}: name is not a string")
        if not isinstance(e.get("pid"), int) or (ph != "C" and not isinstance(e.get("tid"), int)):
            errors.append(f"{where}: pid/tid not integers")
        if "cat" in e and not isinstance(e["cat"], str):
            errors.append(f"{where}: cat is not a string")
        if "args" in e and not isinstance(e["args"], dict):
            errors.append(f"{where}: args is not an object")
            continue
        args = e.get("args", {})
        if ph == "M":
            if e.get("name") not in METADATA_NAMES:
                errors.append(f"{where}: unknown metadata name {e.get('name')!r}")
            elif e["name"].endswith("_name") and not isinstance(args.get("name"), str):
                errors.append(f"{where}: {e['name']} without args.name")
            elif e["name"].endswith("_sort_index") and not isinstance(args.get("sort_index"), int):
                errors.append(f"{where}: {e['name']} without an integer args.sort_index")
            continue
        if not _number(e.get("ts")):
            errors.append(f"{where}: ts is not a number")
            continue
        track = (e["pid"], e.get("tid"), ph if ph in "CiI" else "slice") + ((e.get("name"),) if ph == "C" else ())
        if e["ts"] < last_ts.get(track, float("-inf")):
            errors.append(f"{where}: ts {e['ts']} goes back on its track")
        last_ts[track] = e["ts"]
        if ph == "X":
            if not _number(e.get("dur")) or e["dur"] < 0:
                errors.append(f"{where}: complete event without a non-negative dur")
            else:
                slices.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"], e["name"]))
        elif ph == "C":
            if not args or not all(_number(v) for v in args.values()):
                errors.append(f"{where}: counter args must be a non-empty object of numbers")
        elif ph in "iI":
            if e.get("s", "t") not in ("g", "p", "t"):
                errors.append(f"{where}: instant scope {e.get('s')!r} is not g, p or t")
        elif ph == "B":
            open_b.setdefault((e["pid"], e["tid"]), []).append(e["name"])
        elif ph == "E" and not open_b.get((e["pid"], e["tid"])):
            errors.append(f"{where}: E without an open B")
        elif ph == "E":
            open_b[(e["pid"], e["tid"])].pop()
    errors += [f"B without E on {t}: {names}" for t, names in open_b.items() if names]
    for thread, spans in slices.items():
        stack: list[tuple[float, float, str]] = []
        for start, end, name in sorted(spans, key=lambda s: (s[0], -s[1])):
            while stack and stack[-1][1] <= start:
                stack.pop()
            if stack and end > stack[-1][1]:
                errors.append(f"slice {name!r} [{start}, {end}) overlaps {stack[-1][2]!r} on {thread} without nesting")
            stack.append((start, end, name))
    return errors


def strict_json(text: str):
    """json.loads that refuses NaN and Infinity, which JSON (and the trace importers) do not have."""
    return json.loads(text, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(f"{c} is not JSON")))


@pytest.fixture(scope="module", params=["fp32", "bf16-mixed-accum"])
def report(request):
    # CUDA targets: no CPU kernel probe. The second: autocast copies, grad accumulation (repeated phases),
    # per-layer checkpointing, a peak outside the optimizer step
    if request.param == "fp32":
        return analyze(RunSpec(TINY, batch=2, seq=16, device="cuda", precision="fp32"))
    return analyze(RunSpec(TINY, batch=2, seq=16, device="cuda", precision="bf16-mixed", grad_accum=2,
                           checkpointing="layers"))


def counter_samples(trace: dict, name: str) -> list[tuple[int, dict]]:
    return [(e["ts"], e["args"]) for e in trace["traceEvents"] if e["ph"] == "C" and e["name"] == name]


def value_at(samples: list[tuple[int, dict]], ts: int) -> dict:
    """A counter's values at `ts`: those of its last sample at or before it (a counter holds its value)."""
    before = [args for t, args in samples if t <= ts]
    assert before, f"no counter sample at or before {ts}"
    return before[-1]


def live_by_category(report, step: int) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in report.tensors:
        if t.birth <= step <= t.death:
            out[t.category] = out.get(t.category, 0) + t.bytes
    return out


def test_trace_follows_the_format(report):
    text = json.dumps(trace_events_of(report))
    trace = strict_json(text)
    assert chrome_trace_errors(trace) == []
    assert trace["displayTimeUnit"] == "ns"
    assert trace["otherData"]["predicted_peak_allocated_bytes"] == report.peak_allocated_bytes
    assert trace["otherData"]["model"] == report.model.ref and "1 us" in trace["otherData"]["time"]
    names = {(e["name"], e["args"]["name"]) for e in trace["traceEvents"] if e["ph"] == "M" and "name" in e["args"]}
    assert {("thread_name", "ops"), ("thread_name", "phases")} <= names
    assert any(n == "process_name" and report.model.ref in v for n, v in names)


def test_counters_are_the_live_bytes_of_every_step(report):
    trace = trace_events_of(report)
    total = counter_samples(trace, "total allocated")
    by_cat = counter_samples(trace, "allocated by category")
    assert max(args["bytes"] for _, args in total) == report.peak_allocated_bytes
    assert all(isinstance(args["bytes"], int) for _, args in total)
    for step in range(report.num_steps):
        expected = live_by_category(report, step)
        assert value_at(total, step)["bytes"] == sum(expected.values()), step
        got = {c: b for c, b in value_at(by_cat, step).items() if b}
        assert got == expected, step
    at_peak = value_at(by_cat, report.peak_step)
    assert sum(at_peak.values()) == report.peak_allocated_bytes
    assert {c: b for c, b in at_peak.items() if b} == {c: b for c, b in report.breakdown_at_peak.items() if b}
    # every category series is in every sample (chrome://tracing stacks series sample by sample)
    assert len({tuple(args) for _, args in by_cat}) == 1
    assert set(by_cat[0][1]) == {t.category for t in report.tensors}


def test_counters_are_sampled_only_where_they_change(report):
    trace = trace_events_of(report)
    for name in ("total allocated", "allocated by category"):
        samples = counter_samples(trace, name)
        assert samples[0][0] == 0
        assert all(a != b for (_, a), (_, b) in zip(samples, samples[1:])), name
    n = report.num_steps
    changes = {t.birth for t in report.tensors} | {t.death + 1 for t in report.tensors if t.death + 1 < n}
    assert {ts for ts, _ in counter_samples(trace, "allocated by category")} <= changes | {0}
    assert len(counter_samples(trace, "allocated by category")) < report.num_steps


def test_ops_and_phases_are_slices(report):
    trace = trace_events_of(report)
    threads = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
               if e["ph"] == "M" and e["name"] == "thread_name"}
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    ops = [e for e in xs if threads[e["tid"]] == "ops"]
    assert [(e["ts"], e["dur"]) for e in ops] == [(i, 1) for i in range(report.num_steps)]
    assert [(e["name"], e["args"]["module"], e["args"]["phase"]) for e in ops] == [
        (op, module or "(root)", phase) for op, module, phase in report.steps]
    phases = [e for e in xs if threads[e["tid"]] == "phases"]
    covered = [e["name"] for e in phases for _ in range(e["dur"])]
    assert covered == [phase for _, _, phase in report.steps]  # the bands tile the steps, in order
    assert all(a["name"] != b["name"] for a, b in zip(phases, phases[1:]))  # one slice per run of a phase
    peak = [e for e in trace["traceEvents"] if e["ph"] == "i"]
    assert len(peak) == 1 and peak[0]["ts"] == report.peak_step
    assert peak[0]["args"]["bytes"] == report.peak_allocated_bytes


def test_checker_catches_broken_traces(report):
    """The format checker must be able to fail: each broken copy is caught."""
    good = trace_events_of(report)
    assert chrome_trace_errors(good) == []

    def broken(pred, change):
        t = copy.deepcopy(good)
        e = next(e for e in t["traceEvents"] if pred(e))
        change(e)
        return chrome_trace_errors(t)

    is_counter = lambda e: e["ph"] == "C"  # noqa: E731
    is_op = lambda e: e["ph"] == "X" and e["cat"] == "op"  # noqa: E731
    assert broken(is_counter, lambda e: e["args"].update(bytes="12"))
    assert broken(is_counter, lambda e: e.update(args={}))
    assert broken(is_op, lambda e: e.pop("dur"))
    assert broken(is_op, lambda e: e.update(ts="0"))
    assert broken(is_op, lambda e: e.update(ts=e["ts"] + 0.5))  # [0.5, 1.5) overlaps the next op's [1, 2)
    assert broken(lambda e: e["ph"] == "M", lambda e: e.update(name="thread_title"))
    assert broken(lambda e: e["ph"] == "i", lambda e: e.update(s="x"))
    late = copy.deepcopy(good)
    last_total = [e for e in good["traceEvents"] if e["ph"] == "C" and e["name"] == "total allocated"][-1]
    late["traceEvents"].append({**last_total, "ts": 0})
    assert any("goes back" in m for m in chrome_trace_errors(late))
    assert chrome_trace_errors({"traceEvents": [{"ph": "B", "name": "a", "pid": 1, "tid": 1, "ts": 0}]})
    assert chrome_trace_errors([good["traceEvents"]])  # the array format is not the object format


def test_storage_outside_the_steps_is_an_error(report):
    bad = (replace(report.tensors[0], death=report.num_steps),) + report.tensors[1:]
    with pytest.raises(ValueError, match="outside the report's"):
        trace_events_of(replace(report, tensors=bad))


def test_cli_writes_the_trace_from_a_real_process(tmp_path):
    out, saved = tmp_path / "t.json", tmp_path / "r.json"
    p = subprocess.run([sys.executable, "-m", "vramtrace.cli", TINY, "--batch", "2", "--seq", "16", "-q",
                        "--json", str(saved), "--trace-events", str(out)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    trace = strict_json(out.read_text())
    assert chrome_trace_errors(trace) == []
    peak = json.loads(saved.read_text())["peak_allocated_bytes"]
    assert max(args["bytes"] for _, args in counter_samples(trace, "total allocated")) == peak

    again = tmp_path / "again.json"  # re-rendered from the saved report, no trace
    assert main([str(saved), "-q", "--trace-events", str(again)]) == 0
    assert strict_json(again.read_text()) == trace

    # '-' writes to stdout, alone (no terminal report), and no file named '-'; so does --snapshot's pickle
    p = subprocess.run([sys.executable, "-m", "vramtrace.cli", str(saved), "--trace-events", "-"],
                       capture_output=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 0 and strict_json(p.stdout.decode()) == trace
    snap = tmp_path / "s.pickle"
    assert main([str(saved), "-q", "--snapshot", str(snap)]) == 0
    p = subprocess.run([sys.executable, "-m", "vramtrace.cli", str(saved), "--snapshot", "-"],
                       capture_output=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 0 and p.stdout == snap.read_bytes()
    assert not (tmp_path / "-").exists()


@pytest.mark.parametrize("args,status,needle", [
    ([TINY, "--batch", "1", "--seq", "8", "--trace-events", "/no/such/dir/t.json"], 1, "cannot write --trace-events"),
    ([TINY, "--batch", "1", "--seq", "8", "--trace-events", "."], 1, "--trace-events . is a directory"),
    ([TINY, "--batch", "1", "--seq", "8", "--json", "-", "--trace-events", "-"], 2,
     "--json and --trace-events both write to stdout"),
    (["fit", TINY, "--seq", "8", "--trace-events", "t.json"], 2, "fit and validate write no --trace-events"),
    (["validate", TINY, "--seq", "8", "--device", "cpu", "--trace-events", "t.json"], 2,
     "fit and validate write no --trace-events"),
])
def test_cli_errors_are_one_line(args, status, needle, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(args) == status
    err = capsys.readouterr().err
    assert err.startswith("Error: ") and needle in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "t.json").exists()  # refused before anything is written
