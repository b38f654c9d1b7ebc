"""Print predicted vs measured (CPU profiler allocator) peaks for the tiny fixtures, as markdown tables.

Reproduce: python benchmarks/accuracy_cpu.py
Tables: precisions and modes (batch 2, seq 32); activation checkpointing policies (batch 4, seq 64, the real
run applies the same policy); layer replication (6 layers: 4 traced, all 6 rebuilt).
"""

from __future__ import annotations

import itertools
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from conftest import deep_config  # noqa: E402
from oracle import measure_cpu_peak  # noqa: E402

from vramtrace import RunSpec, analyze  # noqa: E402


def _row(label: str, spec: RunSpec) -> None:
    pred = analyze(spec).peak_allocated_bytes
    meas = measure_cpu_peak(spec)
    print(f"| {label} | {pred:,} | {meas:,} | {100 * (pred - meas) / meas:+.3f}% |", flush=True)


def main() -> None:
    fixture = lambda name: str(ROOT / "fixtures" / "configs" / f"{name}.json")  # noqa: E731
    print("| config | mode | precision | predicted bytes | measured bytes | error |")
    print("|---|---|---|---:|---:|---:|")
    cases = itertools.product(["tiny-gpt2", "tiny-llama-gqa", "tiny-bert"],
                              [("train", "fp32"), ("train", "bf16-mixed"), ("train", "bf16"),
                               ("inference", "fp32"), ("inference", "bf16")])
    for cfg, (mode, prec) in cases:
        _row(f"{cfg} | {mode} | {prec}", RunSpec(fixture(cfg), batch=2, seq=32, device="cpu", precision=prec,
                                                  mode=mode))
    tmp = Path(tempfile.mkdtemp())
    print("\n| config | checkpointing | precision | predicted bytes | measured bytes | error |")
    print("|---|---|---|---:|---:|---:|")
    for cfg, policy, prec in [(c, p, pr) for c in ("tiny-gpt2", "tiny-llama-gqa", "tiny-bert")
                              for p in ("none", "layers", "selective") for pr in ("fp32", "bf16-mixed")]:
        _row(f"{cfg} | {policy} | {prec}", RunSpec(fixture(cfg), batch=4, seq=64, device="cpu", precision=prec,
                                                   checkpointing=policy))
    for policy in ("every:2", "nth:2"):
        _row(f"tiny-llama-gqa, 4 layers | {policy} | fp32", RunSpec(
            deep_config(tmp, "tiny-llama-gqa", 4), batch=4, seq=64, device="cpu", precision="fp32",
            checkpointing=policy))
    print("\n| config (6 layers, 4 traced) | checkpointing | predicted bytes | measured bytes | error |")
    print("|---|---|---:|---:|---:|")
    for cfg in ("tiny-gpt2", "tiny-llama-gqa", "tiny-bert"):
        for policy in ("none", "layers"):
            _row(f"{cfg} | {policy}", RunSpec(deep_config(tmp, cfg, 6), batch=4, seq=64, device="cpu",
                                              precision="fp32", checkpointing=policy))


if __name__ == "__main__":
    main()
