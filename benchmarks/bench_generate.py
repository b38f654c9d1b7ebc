"""Print the end-to-end time of `vramtrace MODEL --mode generate` for a few new-token counts, next to the torch +
transformers import floor, to show how the cost grows with the decode steps.

Reproduce: python benchmarks/bench_generate.py [MODEL] [--new-tokens 4,16,128] [--seq 512] [--batch 4] [--repeat 1]
Goal (issue 15): `--new-tokens 512` on Llama-2-7b must not cost 512 traced decode steps (trace a few, rebuild the
rest, check, as layer replication does). The tracer traces 6 decode steps and rebuilds the rest
(`tracer/decoding.py`); what still grows with N is the analysis of the rebuilt ops (about 2,500 per decode step for
Llama-2-7b: timelines, the caching-allocator replay). Before the rebuild
(every step traced, commit d272b86) the same benchmark measured about 0.21 s per extra decode step.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from bench_fit import _timed  # this directory is on sys.path when run as a script


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="meta-llama/Llama-2-7b")
    ap.add_argument("--new-tokens", default="4,16,128")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=1)
    a = ap.parse_args()
    floor = statistics.median(_timed([sys.executable, "-c", "import torch, transformers"]) for _ in range(a.repeat))
    print(f"import floor {floor:.1f} s")
    first = None
    for n in (int(x) for x in a.new_tokens.split(",")):
        cmd = [sys.executable, "-m", "vramtrace.cli", a.model, "--mode", "generate", "--batch", str(a.batch),
               "--seq", str(a.seq), "--new-tokens", str(n), "-q", "--json", "-"]
        took = statistics.median(_timed(cmd) for _ in range(a.repeat))
        more = "" if first is None else f", {(took - first[1]) / (n - first[0]):.3f} s per extra decode step"
        first = first or (n, took)
        print(f"{a.model} batch {a.batch} prompt {a.seq} + {n} new tokens: {took:.1f} s "
              f"({took - floor:.1f} s beyond the floor{more})")


if __name__ == "__main__":
    main()
