"""Optimizers as people choose them (issue 12): torch's fused, foreach and for-loop implementations, RMSprop,
Adagrad (state made in __init__), SGD with Nesterov momentum, torch's and transformers' Adafactor, HF Trainer's
`optim` names; each against the real CPU step of tests/oracle.py (public APIs only). Batch 1 × seq 4, so that
the optimizer's own temporaries decide the peak where the implementation has any."""

import pytest

from conftest import FIXTURES
from oracle import measure_cpu_peak
from tolerance import assert_within
from vramtrace import RunSpec, analyze
from vramtrace.cli import main
from vramtrace.errors import UsageError

GPT2, LLAMA = (str(FIXTURES / f"{c}.json") for c in ("tiny-gpt2", "tiny-llama-gqa"))
TOL = 1e-4  # 0.01%

CASES = [
    (GPT2, "fp32", dict(optimizer="adamw_torch_fused")),  # HF Trainer's default optim: AdamW(fused=True)
    (GPT2, "fp32", dict(optimizer="adamw", optimizer_impl="foreach")),
    (LLAMA, "bf16-mixed", dict(optimizer="adafactor")),  # transformers' Adafactor as HF Trainer builds it
    (GPT2, "fp32", dict(optimizer="torch-adafactor", optimizer_impl="foreach")),
    (GPT2, "bf16-mixed", dict(optimizer="torch-adafactor")),
    (LLAMA, "fp32", dict(optimizer="rmsprop", optimizer_impl="foreach")),
    (GPT2, "fp32", dict(optimizer="adagrad")),
    (GPT2, "fp16-mixed", dict(optimizer="adagrad", optimizer_impl="fused", clip_grad_norm=1.0)),
    (LLAMA, "fp32", dict(optimizer="sgd-nesterov", optimizer_impl="foreach")),
    (GPT2, "fp16-mixed", dict(optimizer="adamw", optimizer_impl="fused")),  # fused step under GradScaler
]


@pytest.mark.parametrize(("model", "precision", "extra"), CASES,
                         ids=lambda v: v.rsplit("/", 1)[-1] if isinstance(v, str) else str(v))
def test_optimizer_matches_real_cpu_run(model, precision, extra):
    spec = RunSpec(model, batch=1, seq=4, device="cpu", precision=precision, **extra)
    predicted = analyze(spec).peak_allocated_bytes
    measured = measure_cpu_peak(spec)
    assert_within(predicted, measured, TOL)


def test_state_made_in_init_is_counted_from_the_start():
    """Adagrad makes its `sum` state in __init__: alive before the first step, one per trainable parameter."""
    r = analyze(RunSpec(GPT2, batch=1, seq=4, device="cpu", precision="fp32", optimizer="adagrad"))
    params = sum(t.bytes for t in r.tensors if t.category == "parameter")
    state = [t for t in r.tensors if t.category == "optimizer_state" and t.name.endswith(":sum")]
    assert state and all(t.phase == "start" and t.birth == 0 for t in state)
    assert sum(t.bytes for t in state) == params


def test_fused_has_no_foreach_temporaries_on_a_cuda_target():
    """On CUDA torch's default is foreach, whose `_foreach_sqrt` etc. allocate a parameter-sized list; the fused
    kernel updates in place: the optimizer phase peaks lower."""
    base = dict(batch=1, seq=4, precision="fp32")
    foreach = analyze(RunSpec(GPT2, **base))
    fused = analyze(RunSpec(GPT2, optimizer="adamw_torch_fused", **base))
    assert foreach.run.optimizer_impl == "default" and fused.run.optimizer_impl == "fused"
    assert fused.peak_allocated_bytes < foreach.peak_allocated_bytes
    assert foreach.peak_phase == "optimizer"


@pytest.mark.parametrize(("kwargs", "needle"), [
    (dict(optimizer="rmsprop", optimizer_impl="fused"), "rmsprop has no fused implementation"),
    (dict(optimizer="adafactor", optimizer_impl="foreach"), "adafactor has no foreach implementation"),
    (dict(optimizer="adamw_torch_fused", optimizer_impl="foreach"), "drop optimizer_impl foreach"),
    (dict(optimizer="galore_adamw_8bit"), "unsupported optimizer 'galore_adamw_8bit' .an HF Trainer optim name"),
    (dict(optimizer="adamw-8bit", optimizer_impl="fused"), "adamw-8bit has no fused implementation"),
    (dict(optimizer="lamb"), "unsupported optimizer 'lamb'; choose one of: adamw"),
])
def test_optimizer_options_refused_in_one_line(kwargs, needle):
    with pytest.raises(UsageError, match=needle):
        RunSpec(GPT2, batch=1, seq=4, **kwargs)


def test_hf_trainer_names_are_aliases():
    assert RunSpec(GPT2, batch=1, seq=4, optimizer="paged_adamw_8bit").optimizer.value == "paged-adamw-8bit"
    assert RunSpec(GPT2, batch=1, seq=4, optimizer="adamw_bnb_8bit").optimizer.value == "adamw-8bit"
    assert RunSpec(GPT2, batch=1, seq=4, optimizer="paged_ademamix_8bit").optimizer.value == "paged-ademamix-8bit"
    assert RunSpec(GPT2, batch=1, seq=4, optimizer="rmsprop_bnb_32bit").optimizer.value == "rmsprop-bnb"
    spec = RunSpec(GPT2, batch=1, seq=4, optimizer="adamw_torch_fused")
    assert (spec.optimizer.value, spec.optimizer_impl.value) == ("adamw", "fused")
    assert RunSpec(GPT2, batch=1, seq=4, optimizer="adamw_torch").optimizer_impl.value == "default"


def test_cli_bad_optimizer_is_a_usage_error(capsys):
    assert main([GPT2, "--seq", "4", "--optimizer", "rmsprop", "--optimizer-impl", "fused"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("Error: --optimizer rmsprop has no fused implementation") and len(err.splitlines()) == 1
