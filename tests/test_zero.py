"""`--zero 1|2|3 --dp N`: DeepSpeed's own ZeRO engine traced on one fake rank, against the same step run for real by
2 DeepSpeed processes over gloo on the CPU (tests/zero_oracle.py, which imports nothing from vramtrace), rank by
rank, within 0.5% (issue 42's done-when). Six real cases cover the axes between them: ZeRO-1, 2, 3 and 3 with CPU
optimizer offload; fp32 and bf16; DeepSpeed's default `reduce_bucket_size` (5e8 elements: a 2 GB fp32 / 1 GB bf16
bucket) and 1e6; tiny Llama (GQA) and tiny GPT-2. The whole grid is benchmarks/zero_accuracy.py.

Needs deepspeed (`pip install 'vramtrace[deepspeed]'`), else skipped; DeepSpeed runs on its CPU accelerator."""

from __future__ import annotations

import functools
import json
import os

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed picks its accelerator when it is imported
pytest.importorskip("deepspeed")

from conftest import FIXTURES  # noqa: E402
from tolerance import assert_within  # noqa: E402
from vramtrace import RunSpec, analyze  # noqa: E402
from zero_oracle import measure_zero_peaks, zero_ds_config  # noqa: E402

LLAMA = FIXTURES / "tiny-llama-gqa.json"
GPT2 = FIXTURES / "tiny-gpt2.json"
BATCH, SEQ, DP = 2, 32, 2

# (model, stage, precision, reduce_bucket_size, offload_optimizer): every axis of the done-when at least once
CASES = [
    (LLAMA, 1, "fp32", 10**6, None),
    (GPT2, 2, "bf16", 10**6, None),
    (LLAMA, 2, "bf16", None, None),  # the 1 GB bf16 bucket allocated in every backward
    (LLAMA, 3, "fp32", 10**6, None),  # peak at gloo's reduce-scatter clone of the gradient bucket
    (GPT2, 3, "fp32", None, None),  # the 2 GB bucket ZeRO-3 keeps from initialize
    (LLAMA, 3, "bf16", 10**6, "cpu"),
]


def _id(case) -> str:
    model, stage, precision, bucket, offload = case
    return (f"{model.stem.removeprefix('tiny-')}-zero{stage}{'+offload' if offload else ''}-{precision}-"
            f"{'default' if bucket is None else '1e6'}")


@functools.lru_cache(maxsize=None)
def _real(case) -> tuple[dict, ...]:
    """The real 2-process run of the case (each rank's start, increase and peak), once per test session."""
    model, stage, precision, bucket, offload = case
    return tuple(measure_zero_peaks(model, stage=stage, dp=DP, precision=precision, batch=BATCH, seq=SEQ,
                                    reduce_bucket_size=bucket, offload_optimizer=offload))


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_zero_matches_real_deepspeed_ranks(case, tmp_path):
    """The predicted peak equals each rank's real peak within 0.5% (the ranks are one class: one trace); vramtrace
    reads the same ds_config (`--deepspeed FILE`) the real run used."""
    model, stage, precision, bucket, offload = case
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps(zero_ds_config(stage=stage, dp=DP, precision=precision, batch=BATCH,
                                                reduce_bucket_size=bucket, offload_optimizer=offload)))
    spec = RunSpec(str(model), batch=BATCH, seq=SEQ, device="cpu", precision=precision, zero=stage, dp=DP,
                   offload_optimizer=offload, deepspeed_config=str(config))
    report = analyze(spec)  # every distinct rank class traced (one here: DeepSpeed pads every partition alike)
    assert report.run.zero.rank_peaks is None or len(report.run.zero.rank_peaks) == 1
    for real in _real(case):
        assert_within(report.peak_allocated_bytes, real["peak"], 0.005, _id(case), real)


def test_oracle_zero1_start_is_the_model_states():
    """The oracle's own check: what the real ZeRO-1 fp32 rank holds between steps is DeepSpeed's documented model
    states, counted from the parameter count alone: the flat bit16 parameters (fp32 here, 4 bytes each), this
    rank's fp32 master partition (4 bytes x 1/dp) and AdamW's exp_avg and exp_avg_sq of it (8 bytes x 1/dp); plus
    the model's buffers (rotary `inv_freq` and `original_inv_freq`), the step's input_ids (int64; the labels are
    the same tensor), AdamW's `step` (a 0-dim fp32 tensor per param group: one flat partition) and the gradient
    norm the engine keeps (`_global_grad_norm`, 0-dim fp32)."""
    import torch
    import transformers

    config = json.loads(LLAMA.read_text())
    config = transformers.AutoConfig.for_model(config.pop("model_type"), **config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in model.parameters())
    assert params % (2 * DP) == 0  # no partition padding in this model: every rank holds the same
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    expected = 4 * params + (4 + 8) * params // DP + buffers + BATCH * SEQ * 8 + 4 + 4
    for real in _real(CASES[0]):
        assert real["start"] == expected, (real, expected)
