"""DeepSpeed ZeRO per-rank peaks: vramtrace's prediction against the same step run for real by 2 DeepSpeed processes.

Reproduce (deepspeed installed: `pip install 'vramtrace[deepspeed]'`; CPU only; sets HF_HUB_OFFLINE=1 and
DS_ACCELERATOR=cpu; about a minute per case on a 2-core machine):

    python benchmarks/zero_accuracy.py [--real-only] [CASE ...]     # CASE e.g. llama-zero3-fp32-1e6

The grid: tiny-llama-gqa and tiny-gpt2 (fixtures/configs), batch 2 x seq 32 per rank, 2 ranks, AdamW
(`"torch_adam": true`); ZeRO-1, ZeRO-2, ZeRO-3 and ZeRO-3 with CPU optimizer offload; fp32 and bf16
(`bf16.enabled`); DeepSpeed's default `reduce_bucket_size` (5e8 elements) and 1e6: 32 cases.
Columns: the real per-rank start (bytes alive at the measured step's start) and peak (tests/zero_oracle.py
`measure_zero_peaks`), vramtrace's per-rank prediction (`analyze(RunSpec(..., device="cpu", zero=S, dp=2, rank=r,
deepspeed_config=<the same ds_config>))`), and the error in bytes and %. Prints a Markdown table (docs/accuracy.md,
"DeepSpeed ZeRO").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

MODELS = {"llama": "tiny-llama-gqa", "gpt2": "tiny-gpt2"}
BATCH, SEQ, DP = 2, 32, 2


def cases() -> list[tuple[str, int, str, int | None, str | None]]:
    return [(model, stage, precision, bucket, offload)
            for model in MODELS for stage, offload in ((1, None), (2, None), (3, None), (3, "cpu"))
            for precision in ("fp32", "bf16") for bucket in (None, 10**6)]


def name(case) -> str:
    model, stage, precision, bucket, offload = case
    return f"{model}-zero{stage}{'+offload' if offload else ''}-{precision}-{'default' if bucket is None else '1e6'}"


def predict(case, rank: int, directory: str) -> int:
    from vramtrace import RunSpec, analyze
    from zero_oracle import zero_ds_config

    model, stage, precision, bucket, offload = case
    config = Path(directory, f"{name(case)}.json")
    config.write_text(json.dumps(zero_ds_config(stage=stage, dp=DP, precision=precision, batch=BATCH,
                                                reduce_bucket_size=bucket, offload_optimizer=offload)))
    spec = RunSpec(str(ROOT / "fixtures" / "configs" / f"{MODELS[model]}.json"), batch=BATCH, seq=SEQ, device="cpu",
                   precision=precision, zero=stage, dp=DP, rank=rank, offload_optimizer=offload,
                   deepspeed_config=str(config))
    return analyze(spec).peak_allocated_bytes


def main() -> None:
    from zero_oracle import measure_zero_peaks

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cases", nargs="*", help="case names (default: all 32)")
    ap.add_argument("--real-only", action="store_true", help="only the real runs (no vramtrace prediction)")
    args = ap.parse_args()
    print("| case | rank | real start | real peak | predicted peak | error |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases():
            if args.cases and name(case) not in args.cases:
                continue
            model, stage, precision, bucket, offload = case
            real = measure_zero_peaks(ROOT / "fixtures" / "configs" / f"{MODELS[model]}.json", stage=stage, dp=DP,
                                      precision=precision, batch=BATCH, seq=SEQ, reduce_bucket_size=bucket,
                                      offload_optimizer=offload)
            for r in real:
                predicted = None if args.real_only else predict(case, r["rank"], tmp)
                diff = None if predicted is None else predicted - r["peak"]
                error = "" if diff is None else f"{diff:+,} B ({diff / r['peak']:+.4%})"
                shown = "" if predicted is None else f"{predicted:,}"
                print(f"| {name(case)} | {r['rank']} | {r['start']:,} | {r['peak']:,} | {shown} | {error} |",
                      flush=True)


if __name__ == "__main__":
    main()
