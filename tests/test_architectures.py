"""A sample of benchmarks/coverage.py's tiny architectures (vision, CLIP, seq2seq, DeBERTa) against real CPU
runs; the whole table is docs/coverage.md."""

import importlib.util
import json
from pathlib import Path

import pytest

from oracle import measure_cpu_peak
from tolerance import assert_within
from vramtrace import RunSpec, analyze

_spec = importlib.util.spec_from_file_location(
    "coverage_bench", Path(__file__).resolve().parent.parent / "benchmarks" / "coverage.py")
coverage = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(coverage)


@pytest.mark.parametrize("arch,mode", [("vit", "train"), ("resnet", "train"), ("clip", "train"),
                                       ("t5", "inference"), ("bart", "train"), ("deberta-v2", "train")])
def test_architecture_matches_real_cpu_step(arch, mode, tmp_path):
    path = tmp_path / f"{arch}.json"
    path.write_text(json.dumps(coverage.CONFIGS[arch]))
    spec = RunSpec(str(path), batch=2, seq=32, mode=mode, device="cpu", precision="fp32", image_size=32)
    report = analyze(spec)
    measured = measure_cpu_peak(spec)
    assert_within(report.peak_allocated_bytes, measured, 0.01)
    assert not report.unresolved
    if arch in ("vit", "resnet", "clip"):
        assert report.run.image_size == (32, 32)
