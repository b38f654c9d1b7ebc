"""torch.nn's own attention modules against real CPU runs: nn.MultiheadAttention and nn.TransformerEncoderLayer,
training (`F.multi_head_attention_forward`, SDPA inside) and eval (their fast path), fp32 and bf16-mixed."""

from pathlib import Path

import pytest

from oracle import measure_cpu_peak
from tolerance import assert_within
from vramtrace import RunSpec, analyze

ATTENTION = Path(__file__).resolve().parent.parent / "fixtures" / "custom" / "attention.py"


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
@pytest.mark.parametrize("mode", ["train", "inference"])
@pytest.mark.parametrize("module", ["MHA", "Encoder"])
def test_torch_attention_modules_match_real_cpu_step(module, mode, precision):
    spec = RunSpec(f"{ATTENTION}:{module}", batch=2, seq=256, inputs=("x=float32[B,S,64]",), device="cpu",
                   precision=precision, mode=mode)
    report = analyze(spec)
    measured = measure_cpu_peak(spec)
    assert_within(report.peak_allocated_bytes, measured, 0.001)
    if mode == "train":  # the SDPA call inside F.multi_head_attention_forward is seen and sent to a backend
        assert sum(report.model.sdpa_backends.values()) == 1


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_wide_attention_whose_peak_is_a_gradient_accumulation(precision):
    # the backward adds the q/k/v gradients of the packed in-projection into one buffer at the peak; the real
    # engine adds in place (a trace under a dispatch mode would not: +3.2% before the recorder decided it)
    spec = RunSpec(f"{ATTENTION}:WideMHA", batch=2, seq=512, inputs=("x=float32[B,S,256]",), device="cpu",
                   precision=precision)
    predicted, measured = analyze(spec).peak_allocated_bytes, measure_cpu_peak(spec)
    assert_within(predicted, measured, 0.001)


def test_multihead_attention_on_cuda_takes_a_fused_sdpa_backend():
    # the math path would materialise the (B, heads, S, S) scores: 2 x 4 x 2048^2 x 4 B = 128 MiB
    spec = RunSpec(f"{ATTENTION}:MHA", batch=2, seq=2048, inputs=("x=float32[B,S,64]",), precision="bf16-mixed")
    report = analyze(spec)
    assert report.model.sdpa_backends == {"flash": 1}
    assert report.peak_allocated_bytes - report.breakdown_at_peak["cublas_workspace"] < 32 << 20


def test_cuda_fast_path_is_listed_as_unresolved():
    spec = RunSpec(f"{ATTENTION}:MHA", batch=2, seq=128, inputs=("x=float32[B,S,64]",), precision="fp32",
                   mode="inference")
    report = analyze(spec)
    assert any("_native_multi_head_attention" in u for u in report.unresolved)
