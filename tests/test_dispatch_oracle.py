"""The static meta-device trace against a runtime dispatch-mode storage oracle on a real CPU run: equal to the
byte. The dispatch oracle counts op outputs only, so the comparison leaves out the CPU kernel workspaces the
prediction adds (storages named 'kernel workspace', each born and freed in its op); the profiler oracle
(test_oracle_cpu.py) checks those. Under its dispatch mode the autograd engine never accumulates gradients in
place (the prediction follows the real engine, test_recorder_accumulation.py): in these configs no accumulation
falls at the peak."""

import pytest

from conftest import FIXTURES
from oracle import measure_cpu_dispatch_peak
from vramtrace import RunSpec, analyze


def _peak_without_workspaces(report) -> int:
    """Max over timeline steps of the bytes of live storages, kernel workspaces left out, from the report's
    per-storage rows (births and deaths), independently of the timeline's own curve."""
    steps = len(report.steps)
    delta = [0] * (steps + 1)
    for t in report.tensors:
        if t.name != "kernel workspace":
            delta[t.birth] += t.bytes
            delta[t.death + 1] -= t.bytes
    cur = peak = 0
    for d in delta[:steps]:
        cur += d
        peak = max(peak, cur)
    return peak


@pytest.mark.parametrize("config", ["tiny-gpt2", "tiny-llama-gqa", "tiny-bert"])
def test_static_trace_equals_runtime_dispatch_oracle(config):
    spec = RunSpec(str(FIXTURES / f"{config}.json"), batch=2, seq=24, device="cpu", precision="fp32")
    report = analyze(spec)
    assert any(t.name == "kernel workspace" for t in report.tensors)  # the prediction does add workspaces
    assert _peak_without_workspaces(report) == measure_cpu_dispatch_peak(spec)
