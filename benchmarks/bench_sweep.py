"""Print the end-to-end time of a 100-point `vramtrace fit --sweep` next to the torch + transformers import floor.

Reproduce: python benchmarks/bench_sweep.py [MODEL ...] [--repeat 3]
Goal (issue 13): a 100-point batch × sequence sweep costs <= 5 s beyond the import floor (`python -c "import torch,
transformers"`). The grid is batches 1..10 × 10 sequence lengths up to the model's context (GPT-2: 128..1024,
Llama-2-7b: 256..2560), on the H100 preset. Runs alternate; medians are printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from bench_fit import _timed  # this directory is on sys.path when run as a script

GRIDS = {"gpt2": "1,2,3,4,5,6,7,8,9,10x128,200,256,300,384,512,600,700,800,1024",
         "meta-llama/Llama-2-7b": "1,2,3,4,5,6,7,8,9,10x256,512,768,1024,1280,1536,1792,2048,2304,2560"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="*", default=list(GRIDS))
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    floor_cmd = [sys.executable, "-c", "import torch, transformers"]
    for model in a.models:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "sweep.json"
            cmd = [sys.executable, "-m", "vramtrace.cli", "fit", model, "--sweep", GRIDS[model], "-q", "--json",
                   str(out)]
            floors, sweeps = [], []
            for _ in range(a.repeat):
                floors.append(_timed(floor_cmd))
                sweeps.append(_timed(cmd))
            result = json.loads(out.read_text())
        floor, took = statistics.median(floors), statistics.median(sweeps)
        exact = sum(p["exact"] for p in result["points"])
        print(f"sweep {model} {GRIDS[model]}: {len(result['points'])} points ({exact} traced), "
              f"{result['traces']} exact traces; {result['method']}")
        print(f"  sweep {took:.1f} s, import floor {floor:.1f} s (medians of {a.repeat}): {took - floor:.1f} s beyond "
              "the floor")


if __name__ == "__main__":
    main()
