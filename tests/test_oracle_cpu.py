"""Predictions for --device cpu against real CPU runs (profiler allocator events), within 0.1%: the CPU kernels'
own buffers (oneDNN bf16 matmul scratchpads on AVX-512 CPUs, flash-attention buffers) are measured per op
signature on this CPU, so this holds under ONEDNN_MAX_CPU_ISA=AVX2 and without it (test_oracle_avx2.py)."""

import pytest

from conftest import FIXTURES
from oracle import measure_cpu_peak
from tolerance import assert_within
from vramtrace import RunSpec, analyze

CONFIGS = ["tiny-gpt2", "tiny-llama-gqa", "tiny-bert"]


@pytest.mark.parametrize("precision,mode", [("fp32", "train"), ("bf16-mixed", "train"), ("bf16", "train"),
                                            ("fp32", "inference"), ("bf16", "inference")])
@pytest.mark.parametrize("config", CONFIGS)
def test_cpu_prediction_matches_profiler(config, precision, mode):
    spec = RunSpec(str(FIXTURES / f"{config}.json"), batch=2, seq=32, device="cpu", precision=precision, mode=mode)
    predicted = analyze(spec).peak_allocated_bytes
    measured = measure_cpu_peak(spec)
    assert_within(predicted, measured, 0.001)


@pytest.mark.parametrize("optimizer", ["sgd-momentum", "adam", "none"])
def test_cpu_prediction_other_optimizers(optimizer):
    spec = RunSpec(str(FIXTURES / "tiny-llama-gqa.json"), batch=2, seq=16, device="cpu", precision="fp32",
                   optimizer=optimizer)
    predicted = analyze(spec).peak_allocated_bytes
    measured = measure_cpu_peak(spec)
    assert_within(predicted, measured, 0.001)


def test_cpu_prediction_foreach_optimizer():
    spec = RunSpec(str(FIXTURES / "tiny-gpt2.json"), batch=2, seq=16, device="cpu", precision="fp32",
                   optimizer_impl="foreach")
    predicted = analyze(spec).peak_allocated_bytes
    measured = measure_cpu_peak(spec)
    assert_within(predicted, measured, 0.001)


def test_cpu_kernel_output_layouts_replace_the_meta_kernels():
    # CPU native_layer_norm returns a bf16 input's mean and rstd in bf16 (the meta kernel: fp32, as CUDA does);
    # they are saved for backward, so the trace must hold the CPU's (BERT bf16 training was +0.1% before)
    spec = RunSpec(str(FIXTURES / "tiny-bert.json"), batch=2, seq=32, device="cpu", precision="bf16")
    report = analyze(spec)
    stats = [t for t in report.tensors if t.op == "aten.native_layer_norm.default" and list(t.shape) == [2, 32, 1]]
    assert stats and {t.dtype for t in stats} == {"bfloat16"}
    assert "native_layer_norm" in report.run.cpu_kernels.relaid_outputs
    cuda = analyze(RunSpec(str(FIXTURES / "tiny-bert.json"), batch=2, seq=32, precision="bf16"))
    assert {t.dtype for t in cuda.tensors if t.op == "aten.native_layer_norm.default"
            and list(t.shape) == [2, 32, 1]} == {"float32"}
