"""Print the end-to-end time of `vramtrace fit` next to one analysis of the same run at the answer.

Reproduce: python benchmarks/bench_fit.py [MODEL] [--seq 2048] [--repeat 3] [-- extra run options]
Goal (issue 13): the max-batch search costs <= 2x one analysis end to end. The default run is Llama-2-7b at seq
2048 with LoRA r=16 and checkpointing of every layer on the H100 preset (answer: batch 25); the plain Llama-2-7b
run does not fit even at batch 1 and is timed as well. Both commands run with --no-levers (the levers of a run that
does not fit are a search of their own). Runs alternate; medians are printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _timed(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(p.stderr)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="meta-llama/Llama-2-7b")
    ap.add_argument("--seq", default="2048")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("extra", nargs="*", default=["--lora-rank", "16", "--checkpointing", "layers"])
    a = ap.parse_args()
    cli = [sys.executable, "-m", "vramtrace.cli"]
    for extra in (a.extra, []):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "fit.json"
            fit_cmd = [*cli, "fit", a.model, "--seq", a.seq, *extra, "--no-levers", "-q", "--json", str(out)]
            fits, analyses = [], []
            for _ in range(a.repeat):
                fits.append(_timed(fit_cmd))
                result = json.loads(out.read_text())
                batch = (result["best"] or result["next"])["x"]
                analyses.append(_timed([*cli, a.model, "--seq", a.seq, "--batch", str(batch), *extra, "--no-levers", "-q",
                                        "--json", str(Path(tmp) / "one.json")]))
        f, one = statistics.median(fits), statistics.median(analyses)
        answer = f"batch {result['best']['x']}" if result["best"] else "nothing fits"
        print(f"fit {a.model} --seq {a.seq} {' '.join(extra)}: {answer}, {result['traces']} exact traces; "
              f"{result['method']}")
        print(f"  fit {f:.1f} s, one analysis at batch {batch} {one:.1f} s (medians of {a.repeat}): "
              f"ratio {f / one:.2f}")


if __name__ == "__main__":
    main()
