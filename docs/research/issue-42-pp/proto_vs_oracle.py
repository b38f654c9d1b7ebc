"""The one-process prototype (static_pp.py) against the real gloo run of tests/pp_oracle.py, on more cases.

Usage (repository root): python docs/research/issue-42-pp/proto_vs_oracle.py CONFIG SCHEDULE PP M [SPLIT|-]
    [PRECISION] [--mode meta|cpu]
Prints one row per stage: real peak, prototype peak, the difference, and where each peak falls.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2] / "tests"))
import pp_oracle  # noqa: E402

_spec = importlib.util.spec_from_file_location("static_pp", HERE / "static_pp.py")
static_pp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(static_pp)


def main(argv):
    p = argparse.ArgumentParser()
    p.add_argument("config")
    p.add_argument("schedule")
    p.add_argument("pp", type=int)
    p.add_argument("m", type=int)
    p.add_argument("split", nargs="?", default="-")
    p.add_argument("precision", nargs="?", default="fp32")
    p.add_argument("--mode", default="meta")
    p.add_argument("--virtual-stages", type=int, default=None)
    p.add_argument("--batch", type=int, default=None, help="default: 2 rows per micro-batch")
    p.add_argument("--seq", type=int, default=32)
    a = p.parse_args(argv)
    batch = a.batch or 2 * a.m
    split = None if a.split == "-" else [int(x) for x in a.split.split(",")]
    real = pp_oracle.measure_pp_peaks(a.config, pp=a.pp, schedule=a.schedule, split=split, micro_batches=a.m,
                                      batch=batch, seq=a.seq, precision=a.precision,
                                      virtual_stages=a.virtual_stages)
    cfg = json.loads(Path(a.config).read_text())
    layers = cfg.get("num_hidden_layers", cfg.get("n_layer"))
    args = argparse.Namespace(pp=a.pp, schedule=a.schedule, micro_batches=a.m, layers=layers, batch=batch,
                              seq=a.seq, mode=a.mode, config=a.config, precision=a.precision,
                              virtual_stages=a.virtual_stages or 1,
                              split=split or pp_oracle.even_split(layers, a.pp * (a.virtual_stages or 1)))
    args.split_list = args.split
    for k, r in enumerate(real):
        s = static_pp.predict_stage(args, k)
        d = s["peak"] - r["peak_bytes"]
        print(f"| {Path(a.config).stem} | {a.precision} | {a.schedule} | {a.pp} | {a.m} | "
              f"{','.join(map(str, args.split))} | {k} | {r['at_step_start']} | {r['peak_bytes']} | {r['at']} | "
              f"{s['peak']} | {s['where']} | {d:+d} B ({100 * d / r['peak_bytes']:+.3f}%) |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
