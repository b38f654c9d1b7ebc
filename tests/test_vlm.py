"""Vision-language models (Qwen2-VL, Qwen2.5-VL, Gemma-3): images fed as their processors feed them, the step traced
on meta against the same step run for real on the CPU (tests/oracle.py `vlm_batch`: public APIs only, the inputs
laid out by hand from the processors' source), and the options' errors."""

from __future__ import annotations

import json

import pytest

from conftest import FIXTURES
from oracle import measure_cpu_peak
from tolerance import assert_within
from vramtrace import RunSpec, analyze
from vramtrace.cli import main
from vramtrace.errors import UsageError

QWEN2_VL = str(FIXTURES / "tiny-qwen2-vl.json")
QWEN2_5_VL = str(FIXTURES / "tiny-qwen2.5-vl.json")
GEMMA3 = str(FIXTURES / "tiny-gemma3-vlm.json")  # vision_use_head false, as Gemma-3's checkpoints


def _spec(model, mode, **kw):
    args = {"batch": 2, "seq": 64, "mode": mode, "device": "cpu", "precision": "fp32", "image_size": 56,
            **({"new_tokens": 6} if mode == "generate" else {}), **kw}
    return RunSpec(model, **args)


@pytest.mark.parametrize("mode", ["train", "inference", "generate"])
@pytest.mark.parametrize("model", [QWEN2_VL, QWEN2_5_VL, GEMMA3], ids=lambda p: p.rsplit("/", 1)[-1][:-5])
def test_vlm_step_matches_a_real_cpu_step(model, mode):
    spec = _spec(model, mode, **({"image_size": None} if model == GEMMA3 else {}))
    report = analyze(spec)
    real = measure_cpu_peak(spec)
    assert_within(report.peak_allocated_bytes, real, 0.001)
    assert not report.unresolved
    assert report.run.image_size == (56, 56) and report.run.images == 1


def test_two_images_per_sample_match_a_real_cpu_step():
    spec = _spec(QWEN2_VL, "train", images=2)
    report = analyze(spec)
    real = measure_cpu_peak(spec)
    assert_within(report.peak_allocated_bytes, real, 0.001)
    assert report.run.images == 2


def test_the_vision_tower_is_measured():
    """More image pixels, more memory: the vision tower runs on the images (it did not when only input_ids were
    fed), and the image tokens stay within --seq."""
    small = analyze(_spec(QWEN2_VL, "inference")).peak_allocated_bytes
    large = analyze(_spec(QWEN2_VL, "inference", image_size=112)).peak_allocated_bytes
    assert large > small


@pytest.mark.parametrize("kwargs,message", [
    (dict(model=QWEN2_VL, image_size=224), "take 66 tokens per sample"),  # 64 image tokens + 2, > --seq 64
    (dict(model=QWEN2_VL, images=20), "more than --seq 64"),
    (dict(model=GEMMA3, image_size=112), "resizes every image to its vision tower's image_size, 56"),
    (dict(model=str(FIXTURES / "tiny-gpt2.json"), images=2, image_size=None), "--images applies to vision-language"),
])
def test_bad_image_options_are_usage_errors(kwargs, message):
    model = kwargs.pop("model")
    with pytest.raises(UsageError, match=message):
        analyze(_spec(model, "train", **kwargs))


def test_the_cli_reports_images_and_refuses_what_does_not_fit(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main([QWEN2_VL, "--batch", "1", "--seq", "64", "--mode", "inference", "--device", "cpu", "--image-size",
                 "56", "--images", "2", "--json", str(out)]) == 0
    run = json.loads(out.read_text())["run"]
    assert run["images"] == 2 and run["image_size"] == [56, 56]
    assert "2 images 56×56" in capsys.readouterr().out
    assert main([QWEN2_VL, "--seq", "8", "--device", "cpu", "--image-size", "56", "--images", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("Error: 2 56×56 images") and "Traceback" not in err


def test_training_builds_no_kv_cache_error_for_a_vlm():
    """The use_cache lever traces the step again with use_cache false: a VLM's use_cache is in its text config."""
    report = analyze(_spec(QWEN2_VL, "train", use_cache=False))
    assert report.run.use_cache is False


def test_the_language_models_layers_are_replicated_as_traced_in_full(tmp_path):
    """A VLM's layer count is in its text config: 4 of 5 layers traced, the rest rebuilt, equal to every layer
    traced."""
    cfg = json.loads((FIXTURES / "tiny-qwen2-vl.json").read_text())
    cfg["text_config"]["num_hidden_layers"] = 5
    path = tmp_path / "qwen2-vl-5l.json"
    path.write_text(json.dumps(cfg))
    shallow = analyze(_spec(str(path), "train"))
    full = analyze(_spec(str(path), "train", replicate_layers=False))
    assert shallow.run.trace.startswith("traced 4 of 5 layers")
    assert shallow.peak_allocated_bytes == full.peak_allocated_bytes
