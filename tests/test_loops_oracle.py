"""The step the user runs (issue 12) against real CPU runs of the same literal code (tests/oracle.py, public APIs
only): each loop with gradient accumulation, clipping, checkpointing, zero_grad(set_to_none=False), fp16 with
GradScaler, a --step function with an auxiliary loss and an EMA copy, and the script loop given as a --step file,
which must trace to the byte what --loop script derives."""

import json

import pytest

from conftest import FIXTURES
from oracle import measure_cpu_peak
from tolerance import assert_within
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
    assert_within(predicted, measured, TOL)


def test_script_loop_as_a_step_file_traces_as_derived():
    base = dict(batch=2, seq=48, device="cpu", precision="fp32")
    derived = analyze(RunSpec(GPT2, loop="script", **base))
    literal = analyze(RunSpec(GPT2, step=str(STEPS / "script_loop.py") + ":train_step", **base))
    assert literal.peak_allocated_bytes == derived.peak_allocated_bytes
    # the script loop keeps the previous logits alive into the next forward: above the trainer loop here
    assert derived.run.loop_peaks["script"] == derived.peak_allocated_bytes > derived.run.loop_peaks["trainer"]


def test_gradient_accumulation_reports_the_micro_step_and_the_effective_batch():
    r = analyze(RunSpec(GPT2, batch=2, seq=48, device="cpu", precision="fp32", grad_accum=3))
    assert r.run.effective_batch == 6 and 0 <= r.peak_micro_step < 3
    # micro-steps 2..N run with the accumulated gradients alive
    assert r.peak_micro_step > 0


def _deeper_llama(tmp_path) -> str:
    """tiny-llama-gqa with 6 wider layers and a small vocabulary: its peak is at the end of the forward, with the
    KV cache live (as Llama-2-7b's at batch 4 x 2048)."""
    config = json.loads((FIXTURES / "tiny-llama-gqa.json").read_text())
    config.update(num_hidden_layers=6, hidden_size=128, intermediate_size=256, num_key_value_heads=4, vocab_size=256)
    path = tmp_path / "deeper-llama.json"
    path.write_text(json.dumps(config))
    return str(path)


def _measured_in_a_fresh_process(model: str, **spec) -> int:
    """`measure_cpu_peak` of RunSpec(model, **spec) in a fresh interpreter, where a user's script runs. Once, under
    `.ci/run`'s two xdist workers, this real bf16-mixed run measured 2,218,580 B less in a worker that had run other
    tests first (about the autocast weight casts' 2,031,616 B) than in a fresh process and in this file run alone
    (20,145,532 B, the prediction). Not reproduced since: the same measurement after each of 38 test files (this one,
    all that sort before it but test_fresh_install, test_import_graph and test_liveness_unit, and 10 after), run in
    four sequential processes (`pytest -p` a probe plugin), gave 20,145,532 B every time, as did runs with 1, 2 and 4
    threads and with Python's gc disabled or collecting at every allocation; in 23 of those files no test left
    autocast nesting, autocast cache or dtype, default dtype, grad mode, oneDNN or matmul precision flags, dispatch
    or function modes, or a process group changed (a fingerprint of them compared after every test). A fresh
    process keeps the test's truth independent of what else a worker ran."""
    import os
    import subprocess
    import sys

    code = (f"import sys; sys.path.insert(0, {str(FIXTURES.parent.parent / 'tests')!r}); "
            "from oracle import measure_cpu_peak; from vramtrace import RunSpec; "
            f"print(measure_cpu_peak(RunSpec({model!r}, **{spec!r})))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout.split()[-1])


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp32"])
def test_use_cache_false_peak_is_a_real_run(tmp_path, precision):
    """A training forward with the config's use_cache on builds a KV cache (its own category). When the cache is
    live at the peak the report gives the peak of the same step with --use-cache false, and a real run with the
    cache off measures it: in bf16-mixed the saving is the fp32 cache (autocast's cat promotes it); in fp32 SDPA
    saves the cache's tensors for the backward, so without it the same bytes are saved and it saves nothing."""
    from vramtrace.render.terminal import kv_cache_note
    from vramtrace.units import format_bytes

    model = _deeper_llama(tmp_path)
    base = dict(batch=2, seq=64, device="cpu", precision=precision)
    r = analyze(RunSpec(model, **base))
    assert r.breakdown_at_peak["kv_cache"] > 0
    off = r.run.use_cache_false_peak_bytes
    measured = _measured_in_a_fresh_process(model, use_cache=False, **base)
    assert_within(off, measured, TOL)
    saved = r.peak_allocated_bytes - off
    assert (saved > 0) if precision == "bf16-mixed" else (saved == 0)
    assert f"--use-cache false peaks at {format_bytes(off)} (saves " in kv_cache_note(r)
    quiet = analyze(RunSpec(model, use_cache=False, **base))
    assert quiet.peak_allocated_bytes == off
    assert quiet.run.use_cache_false_peak_bytes is None and kv_cache_note(quiet) == ""
    # --compile's eager comparison is the same step, not traced again without the cache: nothing shows that figure
    from vramtrace.pipeline import analyze_eager

    eager = analyze_eager(RunSpec(model, compile=True, **base))
    assert eager.peak_allocated_bytes == r.peak_allocated_bytes and eager.run.use_cache_false_peak_bytes is None


def test_no_use_cache_line_when_the_cache_is_not_live_at_the_peak():
    """tiny-llama-gqa in bf16-mixed with eager attention peaks in the backward, after the trainer loop released
    the cache, and no cache storage is saved for the backward (eager attention's `repeat_kv` copies are): no line.
    With SDPA and transformers >= 5.24 the bf16 value cache is itself the tensor SDPA saves (5.24 keeps the values'
    own dtype in `DynamicLayer.lazy_initialization`; 5.23 cast them to the keys' fp32), so it is live there."""
    from vramtrace.render.terminal import kv_cache_note

    r = analyze(RunSpec(LLAMA, batch=2, seq=48, device="cpu", precision="bf16-mixed", attn_implementation="eager"))
    assert r.peak_phase == "backward" and r.breakdown_at_peak.get("kv_cache", 0) == 0
    assert r.run.use_cache_false_peak_bytes is None and kv_cache_note(r) == ""
