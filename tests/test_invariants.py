"""Invariants on every fixture: birth <= death, live bytes never negative, curve = sum of live storages,
peak = maximum of the curve, and the graph-optimal peak never above the eager one."""

import pytest

from conftest import FIXTURES
from vramtrace import RunSpec, analyze
from vramtrace.analysis.liveness import build_timeline
from vramtrace.tracer.building import load_model
from vramtrace.tracer.loading import resolve_config
from vramtrace.tracer.trace import FIRST_STEP_PHASES, STEADY_PHASES, trace_step


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("config", ["tiny-gpt2", "tiny-llama-gqa", "tiny-bert"])
def test_timeline_invariants(config, device):
    spec = RunSpec(str(FIXTURES / f"{config}.json"), batch=2, seq=16, device=device)
    traced = trace_step(spec, load_model(spec, resolve_config(spec.model)))
    block = 512 if device == "cuda" else 1
    for phases in (STEADY_PHASES, FIRST_STEP_PHASES):
        for optimal in (False, True):
            tl = build_timeline(traced.ops, traced.storages, phases, traced.counted_devices, block, optimal)
            n = len(tl.steps)
            curve = [0] * n
            for lt in tl.lifetimes:
                assert 0 <= lt.birth <= lt.death < n
                assert lt.bytes > 0 and lt.bytes % block == 0
                for i in range(lt.birth, lt.death + 1):
                    curve[i] += lt.bytes
            assert list(tl.live_bytes) == curve
            assert min(tl.live_bytes) >= 0 and min(tl.after_bytes) >= 0
            assert tl.peak_bytes == max(tl.live_bytes) == tl.live_bytes[tl.peak_step]
    eager = build_timeline(traced.ops, traced.storages, STEADY_PHASES, traced.counted_devices, block)
    optimal = build_timeline(traced.ops, traced.storages, STEADY_PHASES, traced.counted_devices, block, True)
    assert optimal.peak_bytes <= eager.peak_bytes


def test_report_breakdown_sums_to_peak():
    r = analyze(RunSpec(str(FIXTURES / "tiny-llama-gqa.json"), batch=2, seq=16))
    assert sum(r.breakdown_at_peak.values()) == r.peak_allocated_bytes
    assert r.breakdown_at_peak["parameter"] > 0 and r.breakdown_at_peak["optimizer_state"] > 0
    # steady state: the optimizer state exists at step start; in the first step it does not
    start = r.phases[0]
    assert start.name == "start of step" and start.bytes >= r.breakdown_at_peak["optimizer_state"]
