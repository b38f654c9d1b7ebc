"""The device beyond the tensors: cuBLAS workspaces, the CUDA context, PYTORCH_CUDA_ALLOC_CONF, the GPU presets and
the verdict replayed with the device's capacity."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import FIXTURES
from vramtrace import RunSpec, analyze
from vramtrace.analysis.allocator import CachingAllocatorModel, ExpandableSegmentsModel
from vramtrace.analysis.device import AllocConf, cublas_workspace_bytes
from vramtrace.cli import main
from vramtrace.errors import UsageError
from vramtrace.fit import fit
from vramtrace.gpus import parse_gpu

MiB = 2**20
LLAMA = str(FIXTURES / "tiny-llama-gqa.json")
ROOT = Path(__file__).resolve().parent.parent


def test_cublas_workspace_sizes():
    # 8,519,680 B: what pytorch#95668 measured left allocated after one nn.Linear forward on an A10G (sm86)
    assert cublas_workspace_bytes(86) == cublas_workspace_bytes(80) == cublas_workspace_bytes(75) == 8_519_680
    assert cublas_workspace_bytes(90) == cublas_workspace_bytes(100) == cublas_workspace_bytes(120) == 32 * MiB


@pytest.mark.parametrize("gpu,each", [("H100", 32 * MiB), ("A100-80GB", 8_519_680)])
def test_a_training_step_holds_the_forward_and_the_backward_threads_workspaces(gpu, each):
    r = analyze(RunSpec(LLAMA, batch=2, seq=32, gpu=gpu))
    rows = [t for t in r.tensors if t.category == "cublas_workspace"]
    assert sorted(t.name for t in rows) == ["cuBLAS workspace (backward thread)", "cuBLAS workspace (forward thread)"]
    assert all(t.bytes == each and t.birth == 0 and t.death == r.num_steps - 1 for t in rows)
    assert r.breakdown_at_peak["cublas_workspace"] == 2 * each
    inference = analyze(RunSpec(LLAMA, batch=2, seq=32, gpu=gpu, mode="inference"))
    assert inference.breakdown_at_peak["cublas_workspace"] == each  # one thread
    cpu = analyze(RunSpec(LLAMA, batch=2, seq=32, device="cpu"))
    assert "cublas_workspace" not in {t.category for t in cpu.tensors}


def test_device_total_is_reserved_plus_the_cuda_context():
    r = analyze(RunSpec(LLAMA, batch=2, seq=32, cuda_context_bytes=300 * MiB))
    f = r.fit
    assert f.cuda_context_bytes == 300 * MiB
    assert f.device_total_bytes == r.peak_reserved_bytes + 300 * MiB
    assert f.headroom_bytes == f.capacity_bytes - f.device_total_bytes and f.fits
    default = analyze(RunSpec(LLAMA, batch=2, seq=32), levers=False)
    # issue 39's H100 (sm90, CUDA 13.0, driver 580): 663-769 MiB measured across 20 processes; the default takes the
    # largest, and the report says where it comes from
    assert default.fit.cuda_context_bytes == default.run.cuda_context_bytes == 769 * MiB
    assert default.run.cuda_version == 13 and "measured" in default.run.cuda_context_source


def test_the_verdict_names_the_allocation_that_fails():
    base = analyze(RunSpec(LLAMA, batch=2, seq=32, cuda_context_bytes=0), levers=False)
    capacity = base.peak_allocated_bytes // 2
    r = analyze(RunSpec(LLAMA, batch=2, seq=32, cuda_context_bytes=0, gpu_memory_bytes=capacity), levers=False)
    assert not r.fit.fits
    oom = r.fit.oom
    assert oom.startswith("CUDA out of memory. Tried to allocate ") and "of the first step" in oom, oom
    named = {t.name or t.module for t in r.tensors}
    assert any(n and n in oom for n in named), oom


def test_fit_leaves_the_cuda_context_out_of_the_budget():
    spec = RunSpec(LLAMA, batch=1, seq=32, cuda_context_bytes=100 * MiB)
    result = fit(spec, "batch", 400 * MiB)
    assert result.budget_bytes == 300 * MiB
    # the allocator replayed with the 300 MiB left for cudaMalloc: the answer's replay stays under it
    assert result.best.fits and result.best.reserved_at_capacity <= 300 * MiB and not result.next.fits
    with pytest.raises(UsageError, match="CUDA context"):
        fit(spec, "batch", 100 * MiB)


def test_alloc_conf_parsing():
    c = AllocConf.parse("expandable_segments:True, max_split_size_mb:512")
    assert c.expandable_segments and c.max_split_size == 512 * MiB
    assert str(c) == "expandable_segments:True,max_split_size_mb:512"
    assert AllocConf.parse("") == AllocConf()
    for bad, needle in [("expandable_segments:yes", "bad --alloc-conf entry"), ("max_split_size_mb:8", "> 20"),
                        ("roundup_power2_divisions:4", "not modelled"), ("expandable_segments", "bad")]:
        with pytest.raises(UsageError, match=needle):
            AllocConf.parse(bad)
    with pytest.raises(UsageError, match="CUDA device"):
        RunSpec(LLAMA, batch=1, seq=8, device="cpu", alloc_conf="expandable_segments:True")


def test_expandable_segments_map_pages_after_the_free_tail():
    a = ExpandableSegmentsModel()
    a.malloc("a", 3 * MiB)  # one 20 MiB page of the large pool
    assert (a.reserved_bytes, a.allocated_bytes, a.num_segments) == (20 * MiB, 3 * MiB, 1)
    a.malloc("b", 18 * MiB)  # 17 MiB free at the tail: 1 MiB missing, one more page
    assert (a.reserved_bytes, a.allocated_bytes, a.num_segments) == (40 * MiB, 21 * MiB, 1)
    a.malloc("s", 100)  # the small pool: a 2 MiB page
    assert a.reserved_bytes == 42 * MiB
    a.free("a")
    a.free("b")
    a.malloc("c", 39 * MiB)  # everything merged back into one free block: no new page
    assert a.reserved_bytes == 42 * MiB and a.peak_reserved_bytes == 42 * MiB


def test_expandable_segments_avoid_the_fragmentation_of_fixed_segments():
    """A 12 MiB block freed, then 14 MiB asked for: the default allocator's 12 MiB segment is too small, so it
    reserves a second one; the expandable segment grows in place."""
    default, expandable = CachingAllocatorModel(), ExpandableSegmentsModel()
    for a in (default, expandable):
        a.malloc("x", 12 * MiB)
        a.free("x")
        a.malloc("y", 14 * MiB)
    assert default.reserved_bytes == 26 * MiB
    assert expandable.reserved_bytes == 20 * MiB


def test_expandable_segments_end_to_end_never_reserve_less_than_allocated():
    r = analyze(RunSpec(LLAMA, batch=2, seq=32, alloc_conf="expandable_segments:True"))
    plain = analyze(RunSpec(LLAMA, batch=2, seq=32))
    assert r.peak_allocated_bytes == plain.peak_allocated_bytes
    assert r.peak_allocated_bytes <= r.peak_reserved_bytes
    assert "expandable_segments:True" in r.allocator.model


def test_the_h100_preset_is_what_a_real_h100_reported():
    # torch.cuda.mem_get_info()'s total on the H100 80GB HBM3 of the recorded GPU run (benchmarks/gpu_check.py
    # --real-only --record): the capacity a fit answers against is the device's, not a figure from a spec sheet
    record = json.loads((ROOT / "benchmarks" / "gpu_evidence" / "h100-2026-11-26-gpu_check.json").read_text())
    assert "H100 80GB" in record["device_name"]
    assert parse_gpu("h100").memory_bytes == record["total"]


def test_gpu_presets_and_the_bf16_warning(capsys):
    assert parse_gpu("h100").name == "H100-80GB" and parse_gpu("4090").name == "RTX4090"
    assert parse_gpu("t4").sm == 75  # Tesla T4: compute capability 7.5 (CUDA C++ Programming Guide)
    with pytest.raises(UsageError, match="--gpu-memory"):
        parse_gpu("A800")
    t4 = analyze(RunSpec(LLAMA, batch=1, seq=16, gpu="T4"))
    assert any("no native bf16" in w for w in t4.run.warnings)
    assert not analyze(RunSpec(LLAMA, batch=1, seq=16, gpu="T4", precision="fp16-mixed")).run.warnings
    assert not analyze(RunSpec(LLAMA, batch=1, seq=16, gpu="A10")).run.warnings
    assert main([LLAMA, "--batch", "1", "--seq", "16", "--alloc-conf", "garbage_collection_threshold:2"]) == 2
    assert "bad --alloc-conf entry" in capsys.readouterr().err
