"""Print the end-to-end time and peak RSS of the main job.

Reproduce: python benchmarks/bench_main.py [MODEL] [--batch 4] [--seq 2048]
Goal (issue 2): <= 10 s and <= 2 GiB RSS on a 2-core machine for meta-llama/Llama-2-7b, batch 4, seq 2048.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="meta-llama/Llama-2-7b")
    ap.add_argument("--batch", default="4")
    ap.add_argument("--seq", default="2048")
    a = ap.parse_args()
    cmd = [sys.executable, "-m", "vramtrace.cli", a.model, "--batch", a.batch, "--seq", a.seq, "--json", "-"]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        sys.exit(p.stderr)
    rss_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import vramtrace.tracer.trace, transformers.models.llama"], check=True)
    imports = time.perf_counter() - t0
    print(f"command      : {' '.join(cmd[2:])}")
    print(f"end-to-end   : {wall:.1f} s (of which imports ~{imports:.1f} s)")
    print(f"peak RSS     : {rss_kib / 2**20:.2f} GiB")


if __name__ == "__main__":
    main()
