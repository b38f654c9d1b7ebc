"""`vramtrace fit`: the largest batch (or sequence) that fits, found on per-storage interpolation between exact
traces and checked by exact traces, against analyze() at every point and a real CPU run at the answer."""

from __future__ import annotations

import json
import textwrap

import pytest

from conftest import FIXTURES
from oracle import measure_cpu_peak
from vramtrace import RunSpec, analyze
from vramtrace.cli import main
from vramtrace.errors import UsageError
from vramtrace.fit import fit

GPT2, LLAMA = (str(FIXTURES / f"{c}.json") for c in ("tiny-gpt2", "tiny-llama-gqa"))


def _verdict_bytes(report) -> int:
    return report.peak_reserved_bytes if report.peak_reserved_bytes is not None else report.peak_allocated_bytes


def _assert_curve_is_exact(spec: RunSpec, result) -> None:
    """Every point fit shows, interpolated or traced, equals analyze() at that size, to the byte."""
    for p in result.curve:
        sized = RunSpec(**{**_fields(spec), result.axis: p.x})
        r = analyze(sized)
        assert (p.peak_allocated_bytes, p.peak_reserved_bytes) == (r.peak_allocated_bytes, r.peak_reserved_bytes), p
        assert p.fits == (_verdict_bytes(r) <= result.budget_bytes)


def _fields(spec: RunSpec) -> dict:
    return {f: getattr(spec, f) for f in spec.__dataclass_fields__}


def test_max_batch_on_the_cpu_target_is_a_real_run():
    """Capacity between the exact peaks at batch 6 and 7: the answer is 6; a real CPU run at 6 fits, the
    prediction at 7 does not; the answer came from the interpolation and each point shown equals analyze().
    fp32: on an AVX-512-BF16 CPU, oneDNN's scratchpads of bf16 matmuls are not polynomial in the batch (one
    tiny-llama-gqa mm's: 255,744, 337,664 and 378,624 B at batch 2, 3, 4), and fit rightly bisects instead."""
    base = dict(seq=48, device="cpu", precision="fp32")
    p6, p7 = (analyze(RunSpec(LLAMA, batch=b, **base)).peak_allocated_bytes for b in (6, 7))
    capacity = (p6 + p7) // 2
    result = fit(RunSpec(LLAMA, batch=1, **base), "batch", capacity)
    assert result.best.x == 6 and result.next.x == 7 and not result.next.fits
    assert result.method.startswith("interpolated"), result.method
    assert measure_cpu_peak(RunSpec(LLAMA, batch=6, **base)) <= capacity
    assert result.next.peak_allocated_bytes > capacity
    _assert_curve_is_exact(RunSpec(LLAMA, batch=1, **base), result)


def test_max_batch_on_a_cuda_target_uses_reserved_bytes_and_headroom():
    """The verdict is on the caching allocator's reserved bytes, which are not monotone in the batch (segments):
    the answer is the largest batch whose reserved bytes fit, and no larger one fits."""
    spec = RunSpec(GPT2, batch=1, seq=64, cuda_context_bytes=0)
    result = fit(spec, "batch", 120 * 2**20, headroom=0.05)
    assert result.budget_bytes == int(120 * 2**20 * 0.95)
    assert result.best.fits and result.best.peak_reserved_bytes <= result.budget_bytes < result.next.peak_reserved_bytes
    assert any(not p.exact for p in result.curve)
    _assert_curve_is_exact(spec, result)
    # nothing from the answer up to where even the allocated bytes exceed the budget fits
    for b in range(result.best.x + 1, result.best.x + 4):
        assert _verdict_bytes(analyze(RunSpec(GPT2, batch=b, seq=64))) > result.budget_bytes


def test_longest_sequence_at_a_batch():
    spec = RunSpec(LLAMA, batch=2, seq=None, cuda_context_bytes=0)
    target = analyze(RunSpec(LLAMA, batch=2, seq=150))
    result = fit(spec, "seq", target.peak_reserved_bytes)
    assert result.method.startswith("interpolated") and "degree 2" in result.method
    assert result.best.x >= 150 and not result.next.fits
    _assert_curve_is_exact(spec, result)


def test_longest_sequence_is_capped_by_the_model():
    result = fit(RunSpec(GPT2, batch=1, seq=None), "seq", 80 * 2**30)
    assert result.best.x == result.limit == 128 and result.next is None  # tiny-gpt2's n_positions


def test_a_size_dependence_beyond_the_polynomial_falls_back_to_bisection(tmp_path):
    """A model whose storage is quadratic in the batch (a B x B matrix) fails the check at the third batch node:
    fit says so and bisects by exact traces, and its answer is still exact."""
    path = tmp_path / "gram.py"
    path.write_text(textwrap.dedent("""
        import torch
        from torch import nn

        class Gram(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(256, 256)

            def forward(self, x):
                h = self.lin(x)
                return h @ h.T  # (B, B)

        def example_inputs(batch, seq):
            return (torch.randn(batch, 256),)

        def loss(output, x):
            return output.pow(2).mean()
    """))
    spec = RunSpec(f"{path}:Gram", batch=1, seq=None, device="cpu")
    p20 = analyze(RunSpec(f"{path}:Gram", batch=20, seq=None, device="cpu")).peak_allocated_bytes
    result = fit(spec, "batch", p20)
    assert result.method.startswith("bisection by exact traces"), result.method
    assert "not a degree-1 polynomial" in result.method
    assert result.best.x == 20 and result.next.peak_allocated_bytes > p20
    assert all(p.exact for p in result.curve)


def test_fit_errors():
    with pytest.raises(UsageError, match="--gpu-memory"):
        fit(RunSpec(GPT2, batch=1, seq=8, device="cpu"), "batch")
    with pytest.raises(UsageError, match="headroom"):
        fit(RunSpec(GPT2, batch=1, seq=8), "batch", headroom=1.0)


def test_cli_fit_json_and_errors(tmp_path, capsys):
    out = tmp_path / "fit.json"
    assert main(["fit", GPT2, "--seq", "64", "--gpu-memory", "120MiB", "--cuda-context", "0B", "--headroom", "5%",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "Largest micro-batch that fits:" in text and "does not fit" in text
    d = json.loads(out.read_text())
    assert d["axis"] == "batch" and d["fixed"] == 64 and d["best"]["fits"] and not d["next"]["fits"]
    assert d["budget_bytes"] == int(120 * 2**20 * 0.95) and d["target"] == "a CUDA device"
    for args, needle in [
        (["fit", GPT2, "--seq", "64", "--batch", "2", "--fsdp", "2"], "drop --fsdp"),
        (["fit", GPT2, "--seq", "64", "--device", "cpu"], "pass --gpu-memory"),
        (["fit", GPT2, "--seq", "64", "--headroom", "120%"], "--headroom"),
        (["fit", GPT2, "--seq", "64", "--gpu-memory", "48"], "has no unit"),
        ([GPT2, "--seq", "64", "--headroom", "5%"], "applies to `vramtrace fit"),
    ]:
        assert main(args) == 2, args
        err = capsys.readouterr().err
        assert err.startswith("Error: ") and needle in err and err.count("\n") == 1, err


def test_fit_html_plots_the_curve(tmp_path):
    page = tmp_path / "fit.html"
    assert main(["fit", GPT2, "--seq", "64", "--gpu-memory", "120MiB", "--cuda-context", "0B", "--html", str(page),
                 "--json", str(tmp_path / "fit.json"), "-q"]) == 0
    html = page.read_text()
    d = json.loads((tmp_path / "fit.json").read_text())
    assert html.count("<circle") == len(d["curve"]) and 'class="budget"' in html
    assert html.count("<polyline") == 2  # reserved (compared) and allocated
    assert "<script" not in html and "http" not in html.replace("http-equiv", "")
    largest = f"Largest micro-batch that fits: {d['best']['x']}"
    assert largest in html
