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
    # `--compile-mode max-autotune-no-cudagraphs` (the suite checks only that its Inductor options are set: the
    # autotuning compiles take minutes): in a training step the weights are graph inputs, not constants, so
    # Inductor's CPU GEMM template (torch/_inductor/utils.py `use_cpp_gemm_template`: a constant mat2) does not
    # apply, and the matmuls stay ATen's
    if not quick:
        yield "tiny-llama-gqa", dict(model=str(ROOT / "fixtures" / "configs" / "tiny-llama-gqa.json"), batch=2,
                                     seq=64, device="cpu", precision="bf16-mixed", checkpointing="none",
                                     use_cache=False, compile_mode="max-autotune-no-cudagraphs")


def main() -> None:
    quick = "--quick" in sys.argv
    print("| model | precision | checkpointing | real compiled | --compile | error | eager prediction | trace s "
          "| real s |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for name, kw in cases(quick):
        t = time.time()
        predicted = analyze(RunSpec(**kw, compile=True), levers=False).peak_allocated_bytes
        trace_s = time.time() - t
        eager_kw = {k: v for k, v in kw.items() if k != "compile_mode"}
        eager = analyze(RunSpec(**eager_kw), levers=False).peak_allocated_bytes
        t = time.time()
        real = measure_cpu_peak(RunSpec(**kw, compile=True))
        real_s = time.time() - t
        label = f"{name} {kw['compile_mode']}" if "compile_mode" in kw else name
        print(f"| {label} | {kw['precision']} | {kw['checkpointing']} | {real:,} | {predicted:,} | "
              f"{(predicted - real) / real:+.3%} | {eager:,} | {trace_s:.1f} | {real_s:.1f} |", flush=True)


if __name__ == "__main__":
    main()
