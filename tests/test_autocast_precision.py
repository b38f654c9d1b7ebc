"""`--precision bf16-autocast|fp16-autocast`: the weights in bf16/fp16 as `from_pretrained(dtype=...)` loads them
and the step under `torch.autocast(dtype)`, what HF Trainer with bf16=True/fp16=True runs on a model loaded in that
dtype (accelerate's `autocast`; fp16 with the Trainer's GradScaler), against the same step run for real on the CPU
(tests/oracle.py: the model built in bf16, `torch.autocast("cpu", torch.bfloat16)` around forward and loss)."""

from __future__ import annotations

import pytest

from conftest import FIXTURES
from oracle import measure_cpu_peak
from tolerance import assert_within
from vramtrace import RunSpec, analyze
from vramtrace.errors import UsageError

GPT2 = str(FIXTURES / "tiny-gpt2.json")
LLAMA = str(FIXTURES / "tiny-llama-gqa.json")


@pytest.mark.parametrize("model,kw", [
    (LLAMA, {"precision": "bf16-autocast"}),  # full fine-tune: bf16 parameters, gradients and AdamW states
    (GPT2, {"precision": "bf16-autocast"}),
    (LLAMA, {"precision": "bf16-autocast", "lora_rank": 8}),  # peft's fp32 adapters (autocast_adapter_dtype)
    (GPT2, {"precision": "bf16-autocast", "lora_rank": 8, "checkpointing": "layers"}),
    (LLAMA, {"precision": "fp16-autocast", "lora_rank": 8}),  # the GradScaler on the fp32 adapters' gradients
], ids=["llama-full", "gpt2-full", "llama-lora", "gpt2-lora-ckpt", "llama-lora-fp16"])
def test_autocast_precision_matches_a_real_cpu_run(model, kw):
    spec = RunSpec(model, batch=2, seq=16, device="cpu", **kw)
    measured = measure_cpu_peak(spec)
    report = analyze(spec)
    assert_within(report.peak_allocated_bytes, measured, 0.001)


def test_bf16_autocast_keeps_bf16_weights_and_autocasts_in_bf16():
    """The weights (and, full fine-tune, the gradients) are bf16, unlike bf16-mixed's fp32 master weights:
    the parameter bytes are half of bf16-mixed's."""
    auto = analyze(RunSpec(LLAMA, batch=1, seq=8, device="cpu", precision="bf16-autocast"))
    mixed = analyze(RunSpec(LLAMA, batch=1, seq=8, device="cpu", precision="bf16-mixed"))
    assert auto.model.param_dtype == "bfloat16" and auto.model.compute_dtype == "bfloat16"
    assert mixed.model.param_dtype == "float32"
    assert auto.breakdown_at_peak["parameter"] * 2 == mixed.breakdown_at_peak["parameter"]


def test_autocast_precision_with_fsdp_is_refused_in_one_line():
    with pytest.raises(UsageError, match="bf16-autocast"):
        RunSpec(LLAMA, batch=1, seq=8, precision="bf16-autocast", fsdp=2)


def test_fp16_autocast_full_fine_tune_is_refused_as_the_grad_scaler_refuses_it():
    """torch's GradScaler raises "Attempting to unscale FP16 gradients" on fp16 trainable parameters (the real
    step fails the same way): one line naming the way out, not a traced failure."""
    import torch

    model = torch.nn.Linear(4, 4).half()
    scaler = torch.amp.GradScaler("cpu")
    opt = torch.optim.SGD(model.parameters())
    scaler.scale(model(torch.ones(1, 4, dtype=torch.float16)).float().sum()).backward()
    with pytest.raises(ValueError, match="FP16 gradients"):
        scaler.step(opt)
    with pytest.raises(UsageError, match="fp16-mixed"):
        analyze(RunSpec(LLAMA, batch=1, seq=8, device="cpu", precision="fp16-autocast"))
