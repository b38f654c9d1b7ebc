"""Invariants on every fixture, checked on the trace's records rather than on what `build_timeline` derives from
them: a storage is born before it is freed and never read after it; every free is of a storage that exists and
matches a finalizer; the live-bytes curve equals the sum over storages live at each op, computed here from the
records alone; the peak is the curve's maximum; the graph-optimal peak is never above the eager one."""

import math

import pytest

from conftest import FIXTURES
from seam import recording
from vramtrace import RunSpec, analyze
from vramtrace.analysis.categories import PERSISTENT, Category
from vramtrace.analysis.liveness import build_timeline
from vramtrace.analysis.storages import storage_table
from vramtrace.tracer.recorder import StepRecorder

CONFIGS = ["tiny-gpt2", "tiny-llama-gqa", "tiny-bert"]


def _check_records(traced, rows) -> None:
    by_sid = {s.sid: s for s in rows}
    assert len(by_sid) == len(rows) == len(traced.storages)  # one row per storage
    assert [o.index for o in traced.ops] == list(range(len(traced.ops)))
    for s in rows:
        assert s.nbytes >= 0 and s.op_index >= -1
        if s.free_after is not None:  # born before it is freed, freed within the step
            assert s.op_index <= s.free_after < len(traced.ops), s
        if s.category in PERSISTENT - {Category.KEPT}:
            assert s.free_after is None, s  # parameters, optimizer state, inputs and buffers outlive the step
    allocated = {}
    for o in traced.ops:
        for sid in o.allocates:
            assert sid not in allocated, f"storage {sid} allocated twice"
            allocated[sid] = o.index
            assert by_sid[sid].op_index == o.index  # born at the op that allocated it
        for sid in o.reads:  # a storage is never read after eager freed it
            s = by_sid[sid]
            assert s.free_after is None or s.free_after >= o.index, (o, s)
            assert s.op_index <= o.index, (o, s)
    for s in rows:
        assert s.last_use <= (s.free_after if s.free_after is not None else len(traced.ops)), s


def _expected_curves(traced, rows, step, block, optimal):
    """(live, after) at each op of recorded step `step`, summed from the storages' rows: live at op k when born at
    or before k (born before the step and freed in it or later: from its start) and not freed before k; with
    `optimal`, a non-persistent storage dies at its last use instead."""
    steps = [o.index for o in traced.ops if o.step == step]
    included = set(steps)
    nxt = {k: (steps[i + 1] if i + 1 < len(steps) else math.inf) for i, k in enumerate(steps)}
    live = {k: 0 for k in steps}
    after = {k: 0 for k in steps}
    for s in rows:
        if s.device not in traced.counted_devices or s.nbytes == 0:
            continue
        nbytes = -(-s.nbytes // block) * block
        if s.op_index in included:
            born = s.op_index
        elif s.op_index < steps[0] and (s.free_after is None or s.free_after >= steps[0]):
            born = steps[0]
        else:
            continue  # a storage of another step (the first step's temporaries in a steady timeline)
        last = math.inf if s.free_after is None else s.free_after  # last op index it is live at
        if optimal and s.category not in PERSISTENT:
            last = min(last, max(s.last_use, born))
        for k in steps:
            if born <= k <= last:
                live[k] += nbytes
                kept = last >= nxt[k] if nxt[k] != math.inf else (s.free_after is None or s.free_after > k) and last >= k
                after[k] += nbytes if kept else 0
    return [live[k] for k in steps], [after[k] for k in steps]


@pytest.mark.parametrize(("device", "loop", "extra"), [("cpu", "trainer", {}), ("cuda", "script", {}),
                                                     ("cpu", "function", {"grad_accum": 2, "zero_grad": "zeros"})])
@pytest.mark.parametrize("config", CONFIGS)
def test_timeline_invariants(config, device, loop, extra):
    spec = RunSpec(str(FIXTURES / f"{config}.json"), batch=2, seq=16, device=device, loop=loop, **extra)
    traced = recording(spec)
    rows = storage_table(traced.ops, traced.storages, traced.marks, loop)
    _check_records(traced, rows)
    block = 512 if device == "cuda" else 1
    for step in range(traced.steps):
        for optimal in (False, True):
            tl = build_timeline(traced.ops, rows, step, traced.counted_devices, block, optimal)
            live, after = _expected_curves(traced, rows, step, block, optimal)
            assert list(tl.live_bytes) == live
            assert list(tl.after_bytes) == after
            assert min(live) > 0 and min(after) > 0  # parameters are live throughout
            assert tl.peak_bytes == max(live) == live[tl.peak_step]
            for lt in tl.lifetimes:
                assert 0 <= lt.birth <= lt.death < len(tl.steps) and lt.bytes > 0 and lt.bytes % block == 0
    eager = build_timeline(traced.ops, rows, traced.steps - 1, traced.counted_devices, block)
    optimal = build_timeline(traced.ops, rows, traced.steps - 1, traced.counted_devices, block, True)
    assert optimal.peak_bytes <= eager.peak_bytes


@pytest.mark.parametrize("config", CONFIGS)
def test_recorded_frees_are_the_finalizers(config, monkeypatch):
    """Each op's `frees` are exactly the storages whose finalizer fired after it; a storage is freed once. The
    recorder the trace made is kept when it stops listening (`StepRecorder.detach`, which writes the frees)."""
    spec = RunSpec(str(FIXTURES / f"{config}.json"), batch=2, seq=16, device="cpu", checkpointing="layers")
    recorders, detach = [], StepRecorder.detach
    monkeypatch.setattr(StepRecorder, "detach", lambda self: (detach(self), recorders.append(self))[0])
    recording(spec)
    assert len(recorders) == 1
    rec = recorders[0]
    freed_by_op = [sid for o in rec.ops for sid in o.frees]
    assert len(freed_by_op) == len(set(freed_by_op))
    assert {sid: o.index for o in rec.ops for sid in o.frees} == {
        sid: i for sid, i in rec.free_after.items() if i >= 0}
    assert all(0 <= sid < len(rec.storages) for sid in rec.free_after)
    assert any(s.op == "torch.get_rng_state" for s in rec.storages)  # the RNG-state bridge registered its stash


def test_report_breakdown_sums_to_peak():
    r = analyze(RunSpec(str(FIXTURES / "tiny-llama-gqa.json"), batch=2, seq=16))
    assert sum(r.breakdown_at_peak.values()) == r.peak_allocated_bytes
    assert r.breakdown_at_peak["parameter"] > 0 and r.breakdown_at_peak["optimizer_state"] > 0
    # steady state: the optimizer state exists at step start; in the first step it does not
    start = r.phases[0]
    assert start.name == "start of step" and start.bytes >= r.breakdown_at_peak["optimizer_state"]
