"""`vramtrace fit`: the largest batch (or sequence) that fits, found on per-storage interpolation between exact
traces and checked by exact traces, against analyze() at every point and a real CPU run at the answer."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from conftest import FIXTURES
from seam import step_tables
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


# --- the verdict under pressure: the allocator replayed with the device's capacity (issue 39, item 4) ---------------

def _timeline(*lifetimes):
    """A hand-made timeline of one graph step per lifetime's birth (what `ReplaySchedule` reads: the lifetimes and
    the number of steps)."""
    from vramtrace.analysis.liveness import Timeline

    steps = tuple(range(max(lt.death for lt in lifetimes) + 1))
    return Timeline(steps, ("forward",) * len(steps), tuple(lifetimes), (0,) * len(steps), (0,) * len(steps), 0, 0, 0)


def _steps():
    """A 10 MiB parameter from the start; the first step makes and frees a 60 MiB temporary, the steady step a
    70 MiB one. All requests are multiples of 2 MiB above 10 MiB, so each new segment is the request itself
    (CUDACachingAllocator.cpp get_allocation_size)."""
    from vramtrace.analysis.categories import Category
    from vramtrace.analysis.liveness import Lifetime

    param = Lifetime(1, 10 * MiB, 0, 0, Category.PARAMETER, outlives_step=True, at_start=True)
    first = _timeline(param, Lifetime(2, 60 * MiB, 0, 0, Category.ACTIVATION))
    steady = _timeline(param, Lifetime(3, 70 * MiB, 0, 0, Category.ACTIVATION))
    return first, steady


MiB = 2**20


def test_a_step_over_the_capacity_unbounded_fits_by_releasing_the_cache():
    """By hand: the first step reserves 10 + 60 MiB. In the steady step no cached block holds 70 MiB, so without a
    capacity a third segment makes 140 MiB reserved: over a 85 MiB device. With 85 MiB, cudaMalloc(70 MiB) fails
    (70 + 70 > 85), `release_cached_blocks` frees the whole free 60 MiB segment (the parameter's stays), and the
    retry succeeds: 10 + 70 = 80 MiB reserved, 5 MiB headroom, one cache release per step. With 75 MiB the retry
    fails too (80 > 75): out of memory in the steady step."""
    from vramtrace.analysis.allocator import replay_steps
    from vramtrace.analysis.pressure import replay_at_capacity

    first, steady = _steps()
    unbounded = replay_steps(first, steady)
    assert unbounded.peak_reserved_bytes == 140 * MiB and unbounded.alloc_retries == 0
    v = replay_at_capacity(first, steady, 85 * MiB, unbounded=unbounded)
    assert v.fits and v.peak_reserved_bytes == 80 * MiB and v.headroom_bytes == 5 * MiB
    assert (v.alloc_retries, v.first_step_alloc_retries) == (1, 0)
    assert v.peak_allocated_bytes == 80 * MiB
    oom = replay_at_capacity(first, steady, 75 * MiB)
    assert not oom.fits and oom.estimate.oom_step == "steady" and oom.estimate.oom_sid == 3
    # the old criterion, unbounded reserved at most the capacity, would have refused 85 MiB
    assert unbounded.peak_reserved_bytes > 85 * MiB


def test_the_main_verdict_replays_a_tiny_model_under_its_capacity():
    """tiny-llama-gqa at batch 128: the least capacity its replay fits in, found by bisection on the replay (it
    fails below the peak allocated, fits at the unbounded peak reserved), is below the unbounded peak reserved: the
    report says it fits there, by releasing the cache, where the old criterion (unbounded reserved <= capacity)
    said over; one byte less and the report names the allocation that runs out of memory."""
    from vramtrace.analysis.pressure import replay_at_capacity

    spec = RunSpec(LLAMA, batch=128, seq=32, cuda_context_bytes=0)
    t = step_tables(spec)
    first, steady = t.timeline(step=0), t.timeline()
    unbounded = analyze(spec, levers=False).peak_reserved_bytes
    lo, hi = steady.peak_bytes - 1, unbounded
    assert not replay_at_capacity(first, steady, lo).fits and replay_at_capacity(first, steady, hi).fits
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if replay_at_capacity(first, steady, mid).fits else (mid, hi)
    assert hi < unbounded
    r = analyze(RunSpec(LLAMA, batch=128, seq=32, cuda_context_bytes=0, gpu_memory_bytes=hi), levers=False)
    assert r.fit.fits and r.fit.alloc_retries + r.fit.first_step_alloc_retries >= 1
    assert r.fit.peak_reserved_bytes_at_capacity <= hi and r.fit.headroom_bytes == \
        hi - r.fit.peak_reserved_bytes_at_capacity
    below = analyze(RunSpec(LLAMA, batch=128, seq=32, cuda_context_bytes=0, gpu_memory_bytes=hi - 1), levers=False)
    assert not below.fit.fits and below.fit.oom.startswith("CUDA out of memory")


def test_cuda_context_by_gpu_family_and_cuda_version():
    from vramtrace.analysis.device import cuda_context_default, default_cuda_major

    # issue 39's H100 (sm90, CUDA 13.0): 663-769 MiB measured; the default is the largest
    h100 = cuda_context_default(90, 13)
    assert h100.nbytes == 769 * MiB and "measured" in h100.source
    for sm, cuda in ((80, 12), (86, 13), (89, 13), (100, 13), (120, 13), (70, 12), (90, 12)):
        found = cuda_context_default(sm, cuda)
        # no training-step figure is published for these: never below the largest known (the H100's)
        assert found.nbytes >= h100.nbytes and "assumed" in found.source, (sm, cuda)
    assert default_cuda_major(90) == 13 and default_cuda_major(75) == 13 and default_cuda_major(70) == 12
    with pytest.raises(UsageError, match="--cuda-version 12"):
        cuda_context_default(70, 13)  # torch's CUDA 13 wheels have no sm70 kernels
    with pytest.raises(UsageError, match="12, 13"):
        cuda_context_default(90, 11)
    assert RunSpec(GPT2, batch=1, seq=8, gpu="V100-16GB").cuda_major == 12
    with pytest.raises(UsageError, match="--cuda-version 12"):
        RunSpec(GPT2, batch=1, seq=8, gpu="V100-16GB", cuda_version=13)
    with pytest.raises(UsageError, match="cuda_version"):  # the API's words: the field
        RunSpec(GPT2, batch=1, seq=8, device="cpu", cuda_version=13)
    given = RunSpec(GPT2, batch=1, seq=8, cuda_version=12, cuda_context_bytes=600 * MiB).cuda_context_figure
    assert given.nbytes == 600 * MiB and given.source == "--cuda-context"


def test_the_report_says_which_cuda_context_it_assumed(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main([GPT2, "--batch", "1", "--seq", "8", "--gpu", "A100-80GB", "--cuda-version", "12", "--no-levers",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    run = json.loads(out.read_text())["run"]
    assert run["cuda_version"] == 12 and run["cuda_context_bytes"] == 769 * MiB
    assert run["cuda_context_source"].startswith("default for A100-80GB (sm80) with CUDA 12: assumed")
    assert "CUDA context 769.00 MiB: default for A100-80GB (sm80) with CUDA 12" in " ".join(text.split())


# --- the evidence's fit boundary (real H100 run, tests/fixtures/gpu_evidence/fit_boundary.json) ----------------

@pytest.fixture(scope="module")
def evidence_fit(tmp_path_factory):
    """`vramtrace fit` on the evidence's config (Llama-2-7b dims, 4 layers, bf16-mixed AdamW, seq 2048) on H100-80GB
    with the measured CUDA context; and the evidence's figures."""
    from importlib import resources

    truth = json.loads((Path(__file__).parent / "fixtures" / "gpu_evidence" / "fit_boundary.json").read_text())
    config = json.loads((resources.files("vramtrace.tracer") / "configs" / "llama-2-7b.json").read_text())
    path = tmp_path_factory.mktemp("evidence") / "llama-2-7b-4-layers.json"
    path.write_text(json.dumps({**config, "num_hidden_layers": 4}))
    spec = RunSpec(str(path), batch=1, seq=2048, precision="bf16-mixed", gpu="H100-80GB",
                   cuda_context_bytes=truth["cuda_context_bytes"])
    assert spec.capacity[1] == truth["mem_get_info_total_bytes"]
    return fit(spec, "batch", levers=False), truth


def test_the_evidence_boundary_24_runs_out_of_memory_in_the_replay(evidence_fit):
    """Batch 24 failed with CUDA OOM on the H100: its replay under the measured capacity runs out of memory, and no
    larger batch fits. The old criterion's answer, 21, ran with room to spare: the answer is now above it. The
    replay's peak allocated at 22 is the real one to 512 B (peak allocated counts unsplit block remainders)."""
    result, truth = evidence_fit
    assert result.budget_bytes == truth["mem_get_info_total_bytes"] - truth["cuda_context_bytes"]
    assert result.best.fits
    assert result.allocated_bound >= 24  # allocated alone does not reject 24: the replay must
    points = {p.x: p for p in result.curve}
    assert 24 not in points or not points[24].fits
    ran = truth["ran"][str(result.best.x)]
    assert result.best.reserved_at_capacity <= result.budget_bytes
    assert abs(result.best.peak_allocated_bytes - ran["peak_allocated_bytes"]) <= 512


def test_the_evidence_boundary_answer_is_23_with_the_real_runs_reserved(evidence_fit):
    """Batch 23 ran on the H100 and 24 did not: the answer is 23, and its replay under the measured capacity
    reserves what the real run reserved (max_memory_reserved()) within one small-pool segment (2 MiB): the traced
    request order (frees in the order the step dropped them, autocast's casts last argument first) is the real
    one; where cudaMalloc put each segment is not known, and best fit breaks ties by address."""
    result, truth = evidence_fit
    assert result.best.x == 23
    assert abs(result.best.reserved_at_capacity - truth["ran"]["23"]["peak_reserved_bytes"]) <= 2 * 2**20
