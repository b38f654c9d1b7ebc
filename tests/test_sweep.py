"""`vramtrace fit --sweep`: every point of the grid, interpolated or traced, equals analyze() there to the byte; where
the storages are not polynomial in the sizes (the CPU target), every point is traced and the result says so."""

from __future__ import annotations

import json

import pytest

from conftest import FIXTURES
from vramtrace import RunSpec, analyze
from vramtrace.cli import main
from vramtrace.errors import UsageError
from vramtrace.sweep import parse_grid, sweep

LLAMA = str(FIXTURES / "tiny-llama-gqa.json")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_every_point_equals_analyze(device):
    capacity = (80 if device == "cuda" else 10) * 2**20  # the CUDA target holds 64 MiB of cuBLAS workspaces
    spec = RunSpec(LLAMA, batch=1, seq=None, device=device, gpu_memory_bytes=capacity, cuda_context_bytes=(
        0 if device == "cuda" else None))
    grid = ((1, 2, 5, 7), (40, 100, 250)) if device == "cuda" else ((1, 7), (40, 250))  # the CPU's: all traced
    result = sweep(spec, *grid)
    if device == "cuda":
        assert result.method.startswith("interpolated"), result.method
        assert any(not p.exact for p in result.points)
    else:  # the CPU's flash attention picks its block sizes by sequence length: not polynomial, every point traced
        assert result.method.startswith("every point traced"), result.method
    for p in result.points:
        r = analyze(RunSpec(LLAMA, batch=p.batch, seq=p.seq, device=device), levers=False)
        assert p.peak_allocated_bytes == r.peak_allocated_bytes, p
        if p.peak_reserved_bytes is not None:
            assert p.peak_reserved_bytes == r.peak_reserved_bytes, p
        compared = r.peak_reserved_bytes if device == "cuda" else r.peak_allocated_bytes
        assert p.fits == (compared <= result.budget_bytes), p
    assert {p.fits for p in result.points} == {True, False}


def test_grid_parsing_and_cli(tmp_path, capsys):
    assert parse_grid("4,1,2 x 512,128") == ((1, 2, 4), (128, 512))
    for bad in ("1,2", "x512", "1,a x 4", "0x16"):
        with pytest.raises(UsageError, match="--sweep"):
            parse_grid(bad)
    out = tmp_path / "sweep.json"
    assert main(["fit", LLAMA, "--sweep", "1,2x32,64", "--device", "cpu", "--json", str(out), "-q"]) == 0
    d = json.loads(out.read_text())
    assert d["budget_bytes"] is None and len(d["points"]) == 4 and all(p["fits"] is None for p in d["points"])
    assert main(["fit", LLAMA, "--sweep", "1x32", "--seq", "64"]) == 2
    assert "drop --batch and --seq" in capsys.readouterr().err
