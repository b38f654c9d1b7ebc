"""The static meta-device trace against a runtime dispatch-mode storage oracle on a real CPU run: equal to the byte."""

import pytest

from conftest import FIXTURES
from oracle import measure_cpu_dispatch_peak
from vramtrace import RunSpec, analyze


@pytest.mark.parametrize("config", ["tiny-gpt2", "tiny-llama-gqa", "tiny-bert"])
def test_static_trace_equals_runtime_dispatch_oracle(config):
    spec = RunSpec(str(FIXTURES / f"{config}.json"), batch=2, seq=24, device="cpu", precision="fp32")
    assert analyze(spec).peak_allocated_bytes == measure_cpu_dispatch_peak(spec)
