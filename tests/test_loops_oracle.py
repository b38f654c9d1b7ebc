"""The step the user runs (issue 12) against real CPU runs of the same literal code (tests/oracle.py, public APIs
only): each loop with gradient accumulation, clipping, checkpointing, zero_grad(set_to_none=False), fp16 with
GradScaler, a --step function with an auxiliary loss and an EMA copy, and the script loop given as a --step file,
which must trace to the byte what --loop script derives."""

import pytest

from conftest import FIXTURES
from oracle import measure_cpu_peak
from vramtrace import RunSpec, analyze

TOL = 1e-4  # 0.01%
GPT2, LLAMA, BERT = (str(FIXTURES / f"{c}.json") for c in ("tiny-gpt2", "tiny-llama-gqa", "tiny-bert"))
STEPS = FIXTURES.parent / "steps"

CASES = [
    (GPT2, "fp32", dict(loop="trainer")),
    (GPT2, "fp32", dict(loop="function", grad_accum=4)),
    (GPT2, "fp32", dict(loop="script", grad_accum=4)),
    (GPT2, "fp32", dict(loop="script", clip_grad_norm=1.0)),
    (GPT2, "fp32", dict(loop="function", checkpointing="layers")),
    (GPT2, "fp32", dict(loop="script", zero_grad="zeros", grad_accum=2)),
    (LLAMA, "bf16-mixed", dict(loop="script")),
    (LLAMA, "bf16-mixed", dict(loop="trainer", grad_accum=4, clip_grad_norm=1.0)),
    (LLAMA, "bf16-mixed", dict(loop="function", checkpointing="layers", use_cache=False)),
    (BERT, "bf16-mixed", dict(loop="script", grad_accum=2)),
    (BERT, "bf16-mixed", dict(loop="function", clip_grad_norm=1.0)),
    (GPT2, "fp16-mixed", dict(loop="trainer")),
    (LLAMA, "fp16-mixed", dict(loop="script", clip_grad_norm=1.0, grad_accum=2)),
    (GPT2, "fp32", dict(step=str(STEPS / "aux_ema.py") + ":train_step")),
]


@pytest.mark.parametrize(("model", "precision", "extra"), CASES,
                         ids=lambda v: v.rsplit("/", 1)[-1] if isinstance(v, str) else str(v))
def test_loop_matches_real_cpu_run(model, precision, extra):
    spec = RunSpec(model, batch=2, seq=48, device="cpu", precision=precision, **extra)
    predicted = analyze(spec).peak_allocated_bytes
    measured = measure_cpu_peak(spec)
    assert abs(predicted - measured) <= TOL * measured, (predicted, measured)


def test_script_loop_as_a_step_file_traces_as_derived():
    base = dict(batch=2, seq=48, device="cpu", precision="fp32")
    derived = analyze(RunSpec(GPT2, loop="script", **base))
    literal = analyze(RunSpec(GPT2, step=str(STEPS / "script_loop.py") + ":train_step", **base))
    assert literal.peak_allocated_bytes == derived.peak_allocated_bytes
    # the script loop keeps the previous logits alive into the next forward: above the trainer loop here
    assert derived.run["loop_peaks"]["script"] == derived.peak_allocated_bytes > derived.run["loop_peaks"]["trainer"]


def test_gradient_accumulation_reports_the_micro_step_and_the_effective_batch():
    r = analyze(RunSpec(GPT2, batch=2, seq=48, device="cpu", precision="fp32", grad_accum=3))
    assert r.run["effective_batch"] == 6 and 0 <= r.peak_micro_step < 3
    # micro-steps 2..N run with the accumulated gradients alive
    assert r.peak_micro_step > 0
