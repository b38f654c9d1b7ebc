"""Per-rank peaks of sharded steps: vramtrace's prediction against the same step run for real by N gloo processes.

Reproduce: python benchmarks/bench_sharding_oracle.py   (CPU only, sets HF_HUB_OFFLINE=1; about 3 minutes)
Cases: tiny-gpt2 and tiny-llama-gqa (fixtures/configs), batch 2 x seq 16 per rank, AdamW:
- FSDP2 over 2 and 3 ranks, fp32 and bf16-mixed, reshard_after_forward true and false (every rank);
- FSDP2 over 2 ranks with checkpointing layers, grad_accum 2, clip_grad_norm 1.0, the script loop, fp16-mixed, bf16;
- DDP over 2 ranks, fp32 and bf16-mixed;
- transformers' tensor parallelism over 2 ranks (tiny-llama-gqa and tiny-mistral-sw: GPT-2 has no TP plan), fp32,
  bf16-mixed and bf16 training, bf16 inference and generation (4 new tokens; Mistral with a static cache);
- FSDP2 over 2 ranks with `--tp 1` (no TP: transformers applies no plan to one rank);
- transformers' own FSDP plan (`--fsdp-plan transformers`), 2 ranks and a 2 × 2 mesh with TP, fp32 and bf16-mixed.
Columns: the real per-rank peaks (tests/oracle.py `measure_cpu_peak_ranks`: the storages alive before the warm-up
plus torch.profiler's allocator events, maximised over the measured step), vramtrace's per-rank predictions
(`analyze(RunSpec(..., device="cpu", fsdp=N, rank=r))`; DDP: one prediction for every rank), and the error in %.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def main() -> None:
    from oracle import measure_cpu_peak_ranks
    from vramtrace import RunSpec, analyze

    configs = ROOT / "fixtures" / "configs"
    cases = []
    for model in ("tiny-gpt2", "tiny-llama-gqa"):
        for precision in ("fp32", "bf16-mixed"):
            for reshard in (True, False):
                for world in (2, 3):
                    cases.append((model, {"precision": precision, "fsdp": world, "reshard_after_forward": reshard}))
    for model, extra in [("tiny-llama-gqa", {"checkpointing": "layers"}), ("tiny-llama-gqa", {"grad_accum": 2}),
                         ("tiny-gpt2", {"clip_grad_norm": 1.0}), ("tiny-llama-gqa", {"loop": "script"}),
                         ("tiny-gpt2", {"precision": "fp16-mixed"}), ("tiny-llama-gqa", {"precision": "bf16"})]:
        cases.append((model, {"precision": "fp32", "fsdp": 2, **extra}))
    for model in ("tiny-gpt2", "tiny-llama-gqa"):
        for precision in ("fp32", "bf16-mixed"):
            cases.append((model, {"precision": precision, "ddp": 2}))
    for model in ("tiny-llama-gqa", "tiny-mistral-sw"):
        for precision in ("fp32", "bf16-mixed", "bf16"):
            cases.append((model, {"precision": precision, "tp": 2}))
    cases += [("tiny-llama-gqa", {"precision": "bf16", "tp": 2, "mode": "inference"}),
              ("tiny-llama-gqa", {"precision": "bf16", "tp": 2, "mode": "generate", "new_tokens": 4}),
              ("tiny-mistral-sw", {"precision": "bf16", "tp": 2, "mode": "generate", "new_tokens": 6,
                                   "cache": "static"}),
              ("tiny-gpt2", {"precision": "fp32", "fsdp": 2, "tp": 1})]
    for extra in ({}, {"tp": 2}):
        for precision in ("fp32", "bf16-mixed"):
            cases.append(("tiny-llama-gqa", {"precision": precision, "fsdp": 2, "fsdp_plan": "transformers", **extra}))
    print("| model | options | real per rank | predicted per rank | error % |")
    print("|---|---|---|---|---|")
    for model, kw in cases:
        path = str(configs / f"{model}.json")
        real = measure_cpu_peak_ranks(RunSpec(path, batch=2, seq=16, device="cpu", **kw))
        if "fsdp" in kw or "tp" in kw:
            pred = [analyze(RunSpec(path, batch=2, seq=16, device="cpu", rank=r, **kw)).peak_allocated_bytes
                    for r in range(len(real))]
        else:
            pred = [analyze(RunSpec(path, batch=2, seq=16, device="cpu", **kw)).peak_allocated_bytes] * len(real)
        errors = ", ".join(f"{100 * (p - r) / r:+.3f}" for p, r in zip(pred, real))
        options = " ".join(f"{k}={v}" for k, v in kw.items())
        print(f"| {model} | {options} | {', '.join(f'{r:,}' for r in real)} | {', '.join(f'{p:,}' for p in pred)} "
              f"| {errors} |", flush=True)


if __name__ == "__main__":
    main()
