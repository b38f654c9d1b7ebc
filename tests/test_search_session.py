"""`search.TraceSession` and the budget verdict that fit, sweep, the levers and the planner share: a sized spec is
traced once per spec (its peak equals analyze()'s there), the heap is refrozen after every trace (also a failing
one), the precision is resolved once into the session's spec, and the verdict compares peak reserved when there is
one (CUDA target), else peak allocated."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from conftest import FIXTURES
from vramtrace import RunSpec, analyze
from vramtrace.search import TraceSession, basis_text, compared_bytes, fits_budget, within

LLAMA = str(FIXTURES / "tiny-llama-gqa.json")


class CountingHeap:
    def __init__(self):
        self.refrozen = 0

    def refreeze(self):
        self.refrozen += 1


def test_session_traces_each_spec_once_and_refreezes():
    said, heap = [], CountingHeap()
    session = TraceSession.start(RunSpec(LLAMA, batch=2, seq=32), said.append, heap)
    assert session.spec.precision is not None  # resolved once, here
    sized = replace(session.spec, batch=3)
    first = session.trace(sized, "trace at 3")
    again = session.trace(sized, "trace at 3")
    assert again is first and said == ["trace at 3"] and heap.refrozen == 1
    real = analyze(RunSpec(LLAMA, batch=3, seq=32), levers=False)
    assert first.tables.peaks()[0] == real.peak_allocated_bytes
    assert first.num_layers == real.run.num_layers


class FailingSession(TraceSession):
    def record(self, spec, loaded, progress=None):
        raise RuntimeError("the step could not run")


def test_failing_trace_still_refreezes():
    heap = CountingHeap()
    session = FailingSession.start(RunSpec(LLAMA, batch=2, seq=32), lambda _m: None, heap)
    with pytest.raises(RuntimeError):
        session.trace(session.spec)
    assert heap.refrozen == 1 and not session.traces


def test_verdict_compares_reserved_when_there_is_one():
    cuda = SimpleNamespace(peak_allocated_bytes=90, peak_reserved_bytes=120)
    cpu = SimpleNamespace(peak_allocated_bytes=90, peak_reserved_bytes=None)
    assert compared_bytes(cuda) == 120 and compared_bytes(cpu) == 90
    assert not fits_budget(cuda, 100) and fits_budget(cpu, 100)
    assert within(90, None, 90) and not within(80, 91, 90)
    assert (basis_text(cuda), basis_text(cpu)) == ("peak reserved", "peak allocated")
