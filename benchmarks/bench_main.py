"""Print the wall and CPU time of the main job, with and without the levers, next to the import floor.

Reproduce: python benchmarks/bench_main.py [MODEL] [--batch 4] [--seq 2048] [--repeat 5] [--trace-every-layer]
           [--warm]
Goals: issue 2, <= 10 s and <= 2 GiB RSS on a 2-core machine for meta-llama/Llama-2-7b, batch 4, seq 2048; issue
38, the default run (levers searched) <= 1.5 x the `--no-levers` run, and `--no-levers` <= 1.0 s of own work above
the import floor.

Three commands alternate, run after run, so that a noisy machine affects all alike; medians are printed:
- default: `vramtrace MODEL --batch B --seq S --json -` (Llama-2-7b at batch 4 does not fit an H100: the levers
  are searched and traced);
- no levers: the same with `--no-levers`;
- import floor: a process that only imports torch and transformers and the model class, as any
  transformers-based tool must; the difference is vramtrace's own work (trace, liveness, report).
Wall time is the child's; CPU time is its user + sys (getrusage of the children), which another process's load on
the machine changes less than the wall time. The load average (1 min) before and after is printed: a figure
taken under load is not a figure of the code. The lever outcome cache (`VRAMTRACE_LEVER_CACHE`,
`vramtrace.levers.LeverDiskCache`) is off for every run unless --warm (then it is filled by a first run that is
not counted, and every default run finds its levers there).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

FLOOR = ("import torch, transformers, torch._meta_registrations\n"
         "from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM\n")


def _timed(cmd: list[str], env: dict) -> tuple[float, float]:
    """(wall seconds, user + sys CPU seconds) of one run of `cmd`; exits with its stderr when it fails."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0:
        sys.exit(p.stderr)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def _line(name: str, runs: list[tuple[float, float]]) -> tuple[float, float]:
    walls, cpus = [w for w, _ in runs], [c for _, c in runs]
    wall, cpu = statistics.median(walls), statistics.median(cpus)
    print(f"{name:<13}: {wall:6.2f} s wall (min {min(walls):.2f}, max {max(walls):.2f}), {cpu:6.2f} s user+sys "
          f"(median of {len(runs)})")
    return wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="meta-llama/Llama-2-7b")
    ap.add_argument("--batch", default="4")
    ap.add_argument("--seq", default="2048")
    ap.add_argument("--trace-every-layer", action="store_true")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--warm", action="store_true", help="the lever outcome cache on (filled by an uncounted run)")
    a = ap.parse_args()
    cmd = [sys.executable, "-m", "vramtrace.cli", a.model, "--batch", a.batch, "--seq", a.seq, "--json", "-"]
    if a.trace_every_layer:
        cmd.append("--trace-every-layer")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cache_dir = tempfile.TemporaryDirectory(prefix="vramtrace-bench-")
    env["VRAMTRACE_LEVER_CACHE"] = cache_dir.name if a.warm else "off"
    if a.warm:
        _timed(cmd, env)
    load_before = os.getloadavg()[0]
    runs: dict[str, list] = {"default": [], "no levers": [], "import floor": []}
    for _ in range(a.repeat):
        runs["default"].append(_timed(cmd, env))
        runs["no levers"].append(_timed(cmd + ["--no-levers"], env))
        runs["import floor"].append(_timed([sys.executable, "-c", FLOOR], env))
    rss_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    prefix = "" if a.warm else "VRAMTRACE_LEVER_CACHE=off "
    print(f"command      : {prefix}python -m vramtrace.cli {' '.join(cmd[3:])} [--no-levers]")
    print(f"reproduce    : python benchmarks/bench_main.py {' '.join(sys.argv[1:])}".rstrip())
    print(f"machine      : {os.cpu_count()} cores, load average {load_before:.2f} before, "
          f"{os.getloadavg()[0]:.2f} after; lever cache {'warm' if a.warm else 'off'}")
    default, no_levers, floor = (_line(name, r) for name, r in runs.items())
    print(f"levers cost  : {default[0] / no_levers[0]:.2f} x the --no-levers wall time "
          f"({default[1] / no_levers[1]:.2f} x its CPU time); goal <= 1.5 x")
    print(f"own work     : {no_levers[0] - floor[0]:.2f} s wall, {no_levers[1] - floor[1]:.2f} s CPU with "
          "--no-levers above the import floor; goal <= 1.0 s")
    print(f"peak RSS     : {rss_kib / 2**20:.2f} GiB (the largest child)")
    cache_dir.cleanup()


if __name__ == "__main__":
    main()
