"""A REAL multi-process gloo CPU run of torch.distributed.pipelining on a tiny HF Llama, measured per rank.

Usage (from the repository root; one process per stage, one thread each):
    python docs/research/issue-42-pp/real_pp.py --pp 2 --schedule gpipe --micro-batches 4 [--split 2,2]
        [--layers 4] [--batch 8] [--seq 32] [--json out.json]

The run itself is tests/pp_oracle.py `measure_pp_peaks` (the test suite's oracle, grown from this script; its
docstring describes the cut, the loss, the loop and the measurement): fixtures/configs/tiny-llama-gqa.json with
num_hidden_layers = --layers, built by AutoModelForCausalLM.from_config (seed 0, sdpa, fp32) on every rank and cut
by hand (stage 0 = embed_tokens + its layers, middle = its layers, last = its layers + norm + lm_head, rotary on
every stage), `model.loss_function` as the schedule's loss_fn, an AdamW per stage, `schedule.step(...)`, `del
out`, `opt.step()`, `opt.zero_grad()`; two warm-up steps then the measured one; per rank the bytes of the storages
alive before the first step + the running sum of the profiler's [memory] events, maximised over the measured step,
the micro-step at the peak (record_function ranges F<i> / B<i> / opt), and the lost-free check ("lost": the
storages alive at the end minus start + all events; "steady": the measured step's net).
The JSONs in results/ were written by this script before the run moved into tests/pp_oracle.py; it gives the same
bytes for every one of them.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests"))
import pp_oracle  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--schedule", choices=("gpipe", "1f1b"), default="gpipe")
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--split", default=None, help="decoder layers per stage, e.g. 3,0,1")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    split = [int(x) for x in args.split.split(",")] if args.split else pp_oracle.even_split(args.layers, args.pp)
    cfg = json.loads((ROOT / "fixtures/configs/tiny-llama-gqa.json").read_text())
    cfg["num_hidden_layers"] = args.layers
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp, "tiny-llama-gqa.json")
        config.write_text(json.dumps(cfg))
        rows = pp_oracle.measure_pp_peaks(config, pp=args.pp, schedule=args.schedule, split=split,
                                          micro_batches=args.micro_batches, batch=args.batch, seq=args.seq)
    stages = [{"rank": r["stage"], "at_step_start": r["at_step_start"], "peak": r["peak_bytes"], "where": r["at"],
               "lost": r["lost"], "steady": r["steady"], "params": r["params_bytes"],
               "recv_buffers": r["recv_buffer_bytes"]} for r in rows]
    case = {"schedule": args.schedule, "pp": args.pp, "split": split, "M": args.micro_batches,
            "batch": args.batch, "seq": args.seq, "layers": args.layers, "stages": stages}
    for r in stages:
        print(f"{args.schedule} pp={args.pp} split={split} stage {r['rank']}: peak {r['peak']} "
              f"(at step start {r['at_step_start']}, params {r['params']}, recv buffers {r['recv_buffers']}) "
              f"at {r['where']}; lost {r['lost']} steady {r['steady']}")
    if args.json:
        Path(args.json).write_text(json.dumps(case, indent=1))
    return case


if __name__ == "__main__":
    main(sys.argv[1:])
