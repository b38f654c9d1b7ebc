"""`vramtrace validate`: predicted vs measured on the local device, refusal before allocating, CUDA when lent."""

import json

import pytest

from conftest import FIXTURES, run_cli
from vramtrace import RunSpec
from vramtrace import validate as validate_mod
from vramtrace.errors import UsageError


def cli(capsys, *args):
    """`vramtrace validate ...` in this process."""
    return run_cli(capsys, "validate", *args)


@pytest.mark.parametrize("config", ["tiny-gpt2", "tiny-llama-gqa", "tiny-bert"])
def test_validate_on_the_cpu_agrees_within_1pct(capsys, config):
    p = cli(capsys, str(FIXTURES / f"{config}.json"), "--batch", "2", "--seq", "32", "--device", "cpu", "--json", "-",
            "-q")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["device"] == "cpu" and out["measured_peak_allocated_bytes"] > 0
    assert abs(out["allocated_error"]) <= 0.01, out


def test_validate_measures_the_plan_auto_chose(capsys):
    p = cli(capsys, str(FIXTURES / "tiny-llama-gqa.json"), "--batch", "4", "--seq", "96", "--device", "cpu",
            "--precision", "fp32", "--checkpointing", "auto", "--memory-budget", "5MiB", "--json", "-", "-q")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["run"]["checkpointing"] != "none" and abs(out["allocated_error"]) <= 0.001, out
    assert out["measured_peak_allocated_bytes"] <= 5 << 20


def test_validate_refuses_before_allocating_when_the_prediction_does_not_fit(monkeypatch):
    monkeypatch.setattr(validate_mod, "free_bytes", lambda device: 1024)
    monkeypatch.setattr(validate_mod, "measure_step", lambda *a, **k: pytest.fail("allocated despite the refusal"))
    spec = RunSpec(str(FIXTURES / "tiny-gpt2.json"), batch=2, seq=16, device="cpu")
    with pytest.raises(UsageError, match="smaller"):
        validate_mod.validate(spec)


def test_validate_cuda_without_a_gpu_is_a_clear_error(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    p = cli(capsys, str(FIXTURES / "tiny-gpt2.json"), "--batch", "1", "--seq", "8")
    assert p.returncode == 2 and p.stderr.strip().splitlines()[-1].startswith("Error: validate --device cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["tiny-gpt2", "tiny-llama-gqa", "tiny-bert"])
def test_validate_on_cuda(config):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    out = validate_mod.validate(RunSpec(str(FIXTURES / f"{config}.json"), batch=2, seq=64))
    assert abs(out["allocated_error"]) <= 0.01, out
