"""Print predicted vs measured peaks of the step the user runs (issue 12), as markdown tables for docs/accuracy.md.

Reproduce: python benchmarks/accuracy_loops.py   (and ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 python
benchmarks/accuracy_loops.py)
Tables: each loop (trainer, function, script) × {plain, --grad-accum 4, --clip-grad-norm 1.0, --checkpointing
layers} on tiny GPT-2, Llama-GQA and BERT, fp32 and bf16-mixed (batch 2, seq 48); fp16-mixed with GradScaler;
optimizers (batch 1, seq 4: the optimizer step's own temporaries decide the peak); a --step file with an auxiliary
loss and an EMA copy. The truth is tests/oracle.py (public APIs only, the literal loop code, the CPU profiler's
allocator events). The first line names the CPU, the oneDNN ISA cap and the thread count the figures depend on.
`--quick` runs one row per table.
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from oracle import measure_cpu_peak  # noqa: E402

from vramtrace import RunSpec, analyze  # noqa: E402
from vramtrace.tracer.profiling import cpu_environment  # noqa: E402

CONFIGS = ("tiny-gpt2", "tiny-llama-gqa", "tiny-bert")
VARIANTS = {"plain": {}, "grad-accum 4": dict(grad_accum=4), "clip 1.0": dict(clip_grad_norm=1.0),
            "ckpt layers": dict(checkpointing="layers")}
worst = 0.0


def _fixture(name: str) -> str:
    return str(ROOT / "fixtures" / "configs" / f"{name}.json")


def _row(label: str, spec: RunSpec) -> None:
    global worst
    pred = analyze(spec).peak_allocated_bytes
    meas = measure_cpu_peak(spec)
    err = 100 * (pred - meas) / meas
    worst = max(worst, abs(err))
    print(f"| {label} | {pred:,} | {meas:,} | {err:+.4f}% |", flush=True)


def _head(*cols: str) -> None:
    print("\n| " + " | ".join(cols) + " | predicted bytes | measured bytes | error |")
    print("|" + "---|" * len(cols) + "---:|---:|---:|")


def main() -> None:
    quick = "--quick" in sys.argv
    t0 = time.perf_counter()
    env = cpu_environment()
    print(f"Measured on {env['cpu']} ({env['cpu_flags']}), oneDNN ISA {env['onednn_max_isa']}, ATen "
          f"{env['aten_capability']}, {env['threads']} threads, torch {env['torch']}")
    _head("config", "precision", "loop", "variant")
    cases = list(itertools.product(CONFIGS, ("fp32", "bf16-mixed"), ("trainer", "function", "script"), VARIANTS))
    for cfg, prec, loop, variant in cases[:1] if quick else cases:
        _row(f"{cfg} | {prec} | {loop} | {variant}", RunSpec(_fixture(cfg), batch=2, seq=48, device="cpu",
                                                             precision=prec, loop=loop, **VARIANTS[variant]))
    _head("config", "loop", "GradScaler step")
    for cfg, loop, extra in [("tiny-gpt2", "trainer", {}), ("tiny-llama-gqa", "script", dict(grad_accum=2)),
                             ("tiny-bert", "function", dict(clip_grad_norm=1.0))][:1 if quick else None]:
        label = ", ".join(f"{k.replace('_', '-')} {v}" for k, v in extra.items()) or "plain"
        _row(f"{cfg} | {loop} | fp16-mixed, {label}", RunSpec(_fixture(cfg), batch=2, seq=48, device="cpu",
                                                                precision="fp16-mixed", loop=loop, **extra))
    _head("config", "precision", "--optimizer", "--optimizer-impl")
    optimizers = [("adamw", "default"), ("adamw", "foreach"), ("adamw_torch_fused", "default"), ("adafactor", "default"),
                  ("torch-adafactor", "default"), ("torch-adafactor", "foreach"), ("rmsprop", "default"),
                  ("rmsprop", "foreach"), ("adagrad", "default"), ("adagrad", "fused"), ("sgd-nesterov", "foreach"),
                  ("sgd-momentum", "fused")]
    for cfg, prec, (opt, impl) in list(itertools.product(("tiny-gpt2", "tiny-llama-gqa"), ("fp32", "bf16-mixed"),
                                                         optimizers))[:1 if quick else None]:
        _row(f"{cfg} | {prec} | {opt} | {impl}", RunSpec(_fixture(cfg), batch=1, seq=4, device="cpu", precision=prec,
                                                         optimizer=opt, optimizer_impl=impl))
    _head("config", "precision", "--step")
    step = str(ROOT / "fixtures" / "steps" / "aux_ema.py") + ":train_step"
    for cfg, prec in list(itertools.product(("tiny-gpt2", "tiny-llama-gqa"), ("fp32", "bf16-mixed")))[:1 if quick else None]:
        _row(f"{cfg} | {prec} | `fixtures/steps/aux_ema.py:train_step` (auxiliary loss, EMA copy)",
             RunSpec(_fixture(cfg), batch=2, seq=48, device="cpu", precision=prec, step=step))
    print(f"\nLargest error: {worst:.4f}%; {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
