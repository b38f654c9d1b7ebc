"""Local safetensors checkpoints: headers only, parameter cross-check, stored dtype as the weight dtype."""

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from conftest import FIXTURES
from oracle import measure_cpu_peak
from tolerance import assert_within
from vramtrace import RunSpec, analyze
from vramtrace.cli import main
from vramtrace.tracer.checkpoint_headers import local_header


def _checkpoint(tmp_path, dtype=torch.bfloat16, shards=1):
    """tiny-llama-gqa's config plus its weights (random, `dtype`) in `shards` safetensors files."""
    from vramtrace.validate import real_model

    shutil.copy(FIXTURES / "tiny-llama-gqa.json", tmp_path / "config.json")
    model = real_model(RunSpec(str(FIXTURES / "tiny-llama-gqa.json"), batch=1, seq=4, precision="fp32")).model
    state = {k: v.to(dtype).contiguous() for k, v in model.state_dict().items()}
    names = sorted(state)
    if shards == 1:
        save_file(state, str(tmp_path / "model.safetensors"))
    else:
        weight_map = {}
        for i in range(shards):
            part = names[i::shards]
            fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            save_file({k: state[k] for k in part}, str(tmp_path / fname))
            weight_map.update({k: fname for k in part})
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return sum(v.numel() for v in state.values())


@pytest.mark.parametrize("shards", [1, 3])
def test_headers_counted_without_loading(tmp_path, shards):
    elements = _checkpoint(tmp_path, shards=shards)
    header = local_header(tmp_path)
    assert header.elements == elements and header.dtype == "bfloat16" and header.files == shards


def test_stored_dtype_is_the_weight_dtype_and_counts_match(tmp_path):
    _checkpoint(tmp_path, torch.bfloat16)
    spec = RunSpec(str(tmp_path), batch=2, seq=16, device="cpu", mode="inference")
    report = analyze(spec)
    assert report.run.precision == "bf16" and report.model.param_dtype == "bfloat16"
    assert report.model.checkpoint.matches is True
    fp32 = _checkpoint(tmp_path, torch.float32)
    assert fp32 == report.params
    report32 = analyze(spec)
    assert report32.run.precision == "fp32"
    measured = measure_cpu_peak(RunSpec(str(tmp_path), batch=2, seq=16, device="cpu", mode="inference",
                                        precision="fp32"))
    assert_within(report32.peak_allocated_bytes, measured, 0.01)
    # an explicit --precision wins over the stored dtype
    assert analyze(RunSpec(str(tmp_path), batch=2, seq=16, device="cpu", precision="bf16-mixed")).run.precision == "bf16-mixed"


def test_mismatch_is_reported(tmp_path, capsys):
    _checkpoint(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] = 192
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    report = analyze(RunSpec(str(tmp_path), batch=1, seq=8, device="cpu"))
    assert report.model.checkpoint.matches is False
    assert "MISMATCH" in report.model.checkpoint.note
    assert main([str(tmp_path), "--seq", "8", "--device", "cpu"]) == 0
    assert "MISMATCH" in capsys.readouterr().out


def test_broken_index_is_one_line_error(tmp_path, capsys):
    shutil.copy(FIXTURES / "tiny-llama-gqa.json", tmp_path / "config.json")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "missing.safetensors"}}))
    assert main([str(tmp_path), "--seq", "8"]) == 1
    err = capsys.readouterr().err
    assert "lacks: missing.safetensors" in err and err.count("\n") == 1
