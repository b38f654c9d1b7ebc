"""Print the end-to-end time and peak RSS of the main job, next to the import floor of torch + transformers.

Reproduce: python benchmarks/bench_main.py [MODEL] [--batch 4] [--seq 2048] [--trace-every-layer] [--repeat 3]
Goal (issue 2): <= 10 s and <= 2 GiB RSS on a 2-core machine for meta-llama/Llama-2-7b, batch 4, seq 2048.
By default 4 layers are traced and the repeated one replicated; --trace-every-layer times the full trace.

The import floor is a process that only imports torch and transformers and the model class, as any
transformers-based tool must; the difference is vramtrace's own work (trace, liveness, report). Runs alternate
between the two so that a noisy machine affects both alike; medians are printed.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import time

FLOOR = ("import torch, transformers, torch._meta_registrations\n"
         "from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM\n")


def _timed(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        sys.exit(p.stderr)
    return wall


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="meta-llama/Llama-2-7b")
    ap.add_argument("--batch", default="4")
    ap.add_argument("--seq", default="2048")
    ap.add_argument("--trace-every-layer", action="store_true")
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    cmd = [sys.executable, "-m", "vramtrace.cli", a.model, "--batch", a.batch, "--seq", a.seq, "--json", "-"]
    if a.trace_every_layer:
        cmd.append("--trace-every-layer")
    walls, floors = [], []
    for _ in range(a.repeat):
        walls.append(_timed(cmd))
        rss_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        floors.append(_timed([sys.executable, "-c", FLOOR]))
    wall, floor = statistics.median(walls), statistics.median(floors)
    print(f"command      : {' '.join(cmd[2:])}")
    print(f"end-to-end   : {wall:.1f} s median of {a.repeat} (min {min(walls):.1f} s, max {max(walls):.1f} s)")
    print(f"import floor : {floor:.1f} s median (torch + transformers + the model class, nothing else)")
    print(f"own work     : {wall - floor:.1f} s (end-to-end minus the import floor)")
    print(f"peak RSS     : {rss_kib / 2**20:.2f} GiB")


if __name__ == "__main__":
    main()
