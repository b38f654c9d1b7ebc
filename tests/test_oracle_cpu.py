"""Predictions for --device cpu against real CPU runs (profiler allocator events), within 0.1%: the CPU kernels'
own buffers (oneDNN bf16 matmul scratchpads on AVX-512 CPUs, flash-attention buffers) are measured per op
signature on this CPU, so this holds under ONEDNN_MAX_CPU_ISA=AVX2 and without it (test_oracle_avx2.py)."""

import pytest

from conftest import FIXTURES
from oracle import measure_cpu_peak
from vramtrace import RunSpec, analyze

CONFIGS = ["tiny-gpt2", "tiny-llama-gqa", "tiny-bert"]


@pytest.mark.parametrize("precision,mode", [("fp32", "train"), ("bf16-mixed", "train"), ("bf16", "train"),
                                            ("fp32", "inference"), ("bf16", "inference")])
@pytest.mark.parametrize("config", CONFIGS)
def test_cpu_prediction_matches_profiler(config, precision, mode):
    spec = RunSpec(str(FIXTURES / f"{config}.json"), batch=2, seq=32, device="cpu", precision=precision, mode=mode)
    predicted = analyze(spec).peak_allocated_bytes
    measured = measure_cpu_peak(spec)
    assert abs(predicted - measured) <= 0.001 * measured, (predicted, measured)


@pytest.mark.parametrize("optimizer", ["sgd-momentum", "adam", "none"])
def test_cpu_prediction_other_optimizers(optimizer):
    spec = RunSpec(str(FIXTURES / "tiny-llama-gqa.json"), batch=2, seq=16, device="cpu", precision="fp32",
                   optimizer=optimizer)
    predicted = analyze(spec).peak_allocated_bytes
    measured = measure_cpu_peak(spec)
    assert abs(predicted - measured) <= 0.001 * measured, (predicted, measured)


def test_cpu_prediction_foreach_optimizer():
    spec = RunSpec(str(FIXTURES / "tiny-gpt2.json"), batch=2, seq=16, device="cpu", precision="fp32",
                   optimizer_impl="foreach")
    predicted = analyze(spec).peak_allocated_bytes
    measured = measure_cpu_peak(spec)
    assert abs(predicted - measured) <= 0.001 * measured, (predicted, measured)
