"""Print predicted vs measured (CPU profiler allocator) peaks for the tiny fixtures, as a markdown table.

Reproduce: python benchmarks/accuracy_cpu.py
"""

from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from oracle import measure_cpu_peak  # noqa: E402

from vramtrace import RunSpec, analyze  # noqa: E402


def main() -> None:
    print("| config | mode | precision | predicted bytes | measured bytes | error |")
    print("|---|---|---|---:|---:|---:|")
    cases = itertools.product(["tiny-gpt2", "tiny-llama-gqa", "tiny-bert"],
                              [("train", "fp32"), ("train", "bf16-mixed"), ("train", "bf16"),
                               ("inference", "fp32"), ("inference", "bf16")])
    for cfg, (mode, prec) in cases:
        spec = RunSpec(str(ROOT / "fixtures" / "configs" / f"{cfg}.json"), batch=2, seq=32, device="cpu",
                       precision=prec, mode=mode)
        pred = analyze(spec).peak_allocated_bytes
        meas = measure_cpu_peak(spec)
        print(f"| {cfg} | {mode} | {prec} | {pred:,} | {meas:,} | {100 * (pred - meas) / meas:+.3f}% |")


if __name__ == "__main__":
    main()
