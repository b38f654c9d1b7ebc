"""Per-stage peaks of pipeline-parallel steps (`--pp`): vramtrace's prediction against the same step run for real
by P gloo processes (tests/pp_oracle.py `measure_pp_peaks`: torch.distributed.pipelining, public APIs only).

Reproduce: python benchmarks/pp_accuracy.py [--quick] [--only SUBSTRING]   (CPU only, sets HF_HUB_OFFLINE=1)
The grid: tiny-llama-gqa and tiny-gpt2 (fixtures/configs) with 4 decoder layers, batch 8 x seq 32 per pipeline step,
AdamW per stage; GPipe and 1F1B; P = 2 (2,2), 3 (2,1,1), 3 (3,0,1: a middle stage of 0 layers), 4 (1,1,1,1);
M = 4 micro-batches; fp32 and bf16-mixed (autocast inside each stage's forward); plus 1F1B with M = 8 for P = 2, 3, 4;
plus stages of more than 4 layers, which vramtrace traces with 4 and rebuilds (layer replication): P = 2 (7,6) and
P = 3 (6,5,5), both schedules, both precisions, both models (the model has the split's layers); plus three cases with
each decoder layer of every stage checkpointed (`CHECKPOINTED`: `--checkpointing modules:layers.*`, the lever under
--pp, against stages that run each layer under non-reentrant torch.utils.checkpoint, `measure_pp_peaks(...,
checkpointing=True)`; `--only ckpt` runs only those).
`--quick`: the eight cases of tests/test_pipelining.py. Columns: the real stage's peak and the micro-step at it, the
prediction (`analyze(RunSpec(..., pp=P, pp_schedule=S, micro_batches=M, pp_split=split)).run.pp.stage_peaks[k]`)
and its micro-step, and the error (predicted - real); "ckpt" marks a checkpointed case. A case vramtrace refuses
prints its one-line error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

SPLITS = {2: [(2, 2)], 3: [(2, 1, 1), (3, 0, 1)], 4: [(1, 1, 1, 1)]}
QUICK = [("tiny-llama-gqa", "gpipe", (2, 2), 4, "fp32"), ("tiny-llama-gqa", "1f1b", (3, 0, 1), 4, "fp32"),
         ("tiny-llama-gqa", "1f1b", (1, 1, 1, 1), 4, "bf16-mixed"), ("tiny-llama-gqa", "1f1b", (2, 2), 8, "fp32"),
         ("tiny-gpt2", "1f1b", (3, 1), 4, "fp32"), ("tiny-gpt2", "gpipe", (1, 2, 1), 4, "bf16-mixed"),
         ("tiny-llama-gqa", "1f1b", (7, 6), 4, "bf16-mixed"), ("tiny-gpt2", "gpipe", (6, 2), 4, "bf16-mixed")]
REPLICATED = [(7, 6), (6, 5, 5)]  # stages of more than 4 layers: traced with 4, the rest rebuilt
# each decoder layer of every stage checkpointed: (model, schedule, split, M, precision, True); larger than the
# suite's one case (tests/test_pipelining.py: Llama 1F1B (1,1) M = 2 fp32): 4 layers under both schedules and both
# models, and stages of 7 and 6 layers (every layer traced: vramtrace does not replicate under modules:)
CHECKPOINTED = [("tiny-llama-gqa", "1f1b", (2, 2), 4, "bf16-mixed", True),
                ("tiny-gpt2", "gpipe", (2, 1, 1), 4, "fp32", True),
                ("tiny-llama-gqa", "1f1b", (7, 6), 8, "fp32", True)]


def grid() -> list[tuple]:
    cases = []
    for model in ("tiny-llama-gqa", "tiny-gpt2"):
        for precision in ("fp32", "bf16-mixed"):
            for schedule in ("gpipe", "1f1b"):
                for pp, splits in SPLITS.items():
                    cases += [(model, schedule, split, 4, precision) for split in splits]
        cases += [(model, "1f1b", SPLITS[pp][0], 8, "fp32") for pp in (2, 3, 4)]
        cases += [(model, schedule, split, 4, precision) for precision in ("fp32", "bf16-mixed")
                  for schedule in ("gpipe", "1f1b") for split in REPLICATED]
    return cases + CHECKPOINTED


def config_with_layers(tmp: str, model: str, layers: int) -> str:
    cfg = json.loads((ROOT / "fixtures" / "configs" / f"{model}.json").read_text())
    cfg["n_layer" if "n_layer" in cfg else "num_hidden_layers"] = layers
    path = Path(tmp, f"{model}-{layers}l.json")
    path.write_text(json.dumps(cfg))
    return str(path)


def rows(path: str, model: str, schedule: str, split: tuple, m: int, precision: str, batch: int, seq: int,
         checkpointing: bool = False):
    from pp_oracle import measure_pp_peaks
    from vramtrace import RunSpec, analyze
    from vramtrace.errors import VramtraceError
    from vramtrace.levers import PP_CHECKPOINTING

    pp = len(split)
    real = measure_pp_peaks(path, pp=pp, schedule=schedule, split=split, micro_batches=m, batch=batch, seq=seq,
                            precision=precision, checkpointing=checkpointing)
    head = (f"| {model} | {precision}{' ckpt' if checkpointing else ''} | {schedule} | {pp} | "
            f"{','.join(map(str, split))} | {m} |")
    try:
        report = analyze(RunSpec(path, batch=batch, seq=seq, device="cpu", precision=precision, pp=pp,
                                 pp_schedule=schedule, micro_batches=m, pp_split=split,
                                 checkpointing=PP_CHECKPOINTING if checkpointing else "none"))
        peaks = report.run.pp.stage_peaks
    except VramtraceError as e:
        return [f"{head} {k} | {r['peak_bytes']:,} | {r['at']} | Error: {str(e).splitlines()[0]} | | |"
                for k, r in enumerate(real)]
    out = []
    for k, r in enumerate(real):
        d = peaks[k].peak_bytes - r["peak_bytes"]
        out.append(f"{head} {k} | {r['peak_bytes']:,} | {r['at']} | {peaks[k].peak_bytes:,} | {peaks[k].at} | "
                   f"{d:+,} B ({100 * d / r['peak_bytes']:+.3f}%) |")
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="only the eight cases of tests/test_pipelining.py")
    p.add_argument("--only", default=None, help="only the cases whose row head contains this text")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=32)
    args = p.parse_args(argv)
    print("| model | precision | schedule | P | split | M | stage | real peak (B) | real at | predicted (B) | "
          "predicted at | error |")
    print("|---|---|---|---:|---|---:|---:|---:|---|---:|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for model, schedule, split, m, precision, *ckpt in (QUICK if args.quick else grid()):
            checkpointing = bool(ckpt and ckpt[0])
            text = f"{model} {precision} {schedule} {len(split)} {split} {m}{' ckpt' if checkpointing else ''}"
            if args.only and args.only not in text:
                continue
            path = config_with_layers(tmp, model, sum(split))
            for row in rows(path, model, schedule, split, m, precision, args.batch, args.seq, checkpointing):
                print(row, flush=True)


if __name__ == "__main__":
    main()
