"""`--compile --device cpu` against real compiled CPU training steps (issue 17's done-when matrix).

Reproduce: HF_HUB_OFFLINE=1 python benchmarks/bench_compile_accuracy.py [--quick]
(about 45 s per case on 2 cores: Inductor's real C++ compile of each case, and vramtrace's trace.)

Cases: tiny GPT-2, Llama-GQA, BERT (fixtures/configs, batch 8 × seq 128) and the custom ConvNet
(fixtures/custom/convnet.py, batch 8 × 3 × 32 × 32), fp32 and bf16-mixed, without and with activation checkpointing
(transformers' per-layer checkpointing, `modules:blocks.*` for the ConvNet), AdamW, the trainer loop.
Real: tests/oracle.py (public APIs only: `torch.compile(model)`, the literal loop, the profiler's allocator events;
a first step outside the profiler compiles); predicted: `vramtrace.analyze(RunSpec(..., compile=True))`. Prints a
markdown table with the eager prediction beside it, and the time each took.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from oracle import measure_cpu_peak  # noqa: E402

from vramtrace import RunSpec, analyze  # noqa: E402

CONVNET = f"{ROOT}/fixtures/custom/convnet.py:ConvNet"


def cases(quick: bool):
    models = [("tiny-gpt2", "layers"), ("tiny-llama-gqa", "layers"), ("tiny-bert", "layers"),
              ("convnet", "modules:blocks.*")]
    for name, ckpt in models[:2] if quick else models:
        for precision in ("fp32", "bf16-mixed"):
            for checkpointing in ("none", ckpt):
                if name == "convnet":
                    spec = dict(model=CONVNET, batch=8, seq=None, inputs=("x=float32[B,3,32,32]",))
                else:
                    spec = dict(model=str(ROOT / "fixtures" / "configs" / f"{name}.json"), batch=8, seq=128)
                yield name, dict(spec, device="cpu", precision=precision, checkpointing=checkpointing)


def main() -> None:
    quick = "--quick" in sys.argv
    print("| model | precision | checkpointing | real compiled | --compile | error | eager prediction | trace s "
          "| real s |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for name, kw in cases(quick):
        t = time.time()
        predicted = analyze(RunSpec(**kw, compile=True), levers=False).peak_allocated_bytes
        trace_s = time.time() - t
        eager = analyze(RunSpec(**kw), levers=False).peak_allocated_bytes
        t = time.time()
        real = measure_cpu_peak(RunSpec(**kw, compile=True))
        real_s = time.time() - t
        print(f"| {name} | {kw['precision']} | {kw['checkpointing']} | {real:,} | {predicted:,} | "
              f"{(predicted - real) / real:+.3%} | {eager:,} | {trace_s:.1f} | {real_s:.1f} |", flush=True)


if __name__ == "__main__":
    main()
