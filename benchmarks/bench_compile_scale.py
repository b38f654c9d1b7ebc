"""How long `--compile` takes on a 7B model, end to end, and where the time goes.

Reproduce: HF_HUB_OFFLINE=1 python benchmarks/bench_compile_scale.py [--quick]

Runs `vramtrace meta-llama/Llama-2-7b --batch 4 --seq 2048 --compile --device cpu --no-levers` (bf16-mixed, AdamW,
the trainer loop) as a subprocess, with the KV cache off (`--use-cache false`, as under checkpointing) and on
(transformers' default), each twice on a fresh CPU kernel probe cache (`VRAMTRACE_CPU_PROBE_CACHE`): a machine's
first run, which measures the CPU kernels, and a repeated run, which finds them on disk. It prints for each: wall
seconds, peak RSS, the trace note (whether the compiled step was traced on 5 layers with the middle layer
replicated, or on all 32), the predicted peak, and the ops whose CPU workspace was extrapolated from runs at
reduced sizes (tracer/probe.py `CpuWorkspaceProbe`). Before each run it prints the seconds a fixed pure-Python loop
takes: this machine's speed varies by up to 2x within minutes (0.50 to 0.95 s for this loop here), so timings
are comparable only at a similar figure.

`--quick` also runs the same with every CPU kernel probe answered 0 bytes (in process, the eager comparison in
this process too), which is the time of the tracer alone: dynamo, AOTAutograd, Inductor's lowering and code
generation, the recording and the replication.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time

CMD = ["vramtrace", "meta-llama/Llama-2-7b", "--batch", "4", "--seq", "2048", "--compile", "--device", "cpu",
       "--no-levers"]


def loop_seconds() -> float:
    """Seconds a fixed pure-Python loop takes: this machine's speed at the moment."""
    start, total = time.perf_counter(), 0
    for i in range(10_000_000):
        total += i * i
    return time.perf_counter() - start


def run(extra: list[str], probe_cache: str, which: str) -> None:
    speed = loop_seconds()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        start = time.perf_counter()
        proc = subprocess.run(CMD + extra + ["--json", out], capture_output=True, text=True,
                              env={**os.environ, "HF_HUB_OFFLINE": "1", "VRAMTRACE_CPU_PROBE_CACHE": probe_cache})
        wall = time.perf_counter() - start
        rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss >> 10
        if proc.returncode != 0:
            print(f"{' '.join(extra) or 'defaults'}: exit {proc.returncode}: {proc.stderr.strip()[-300:]}")
            return
        with open(out) as f:
            report = json.load(f)
    run_info = report["run"]
    print(f"{' '.join(extra) or 'defaults'}, {which} run: {wall:.1f} s (Python loop {speed:.2f} s before it), "
          f"max RSS so far {rss} MiB, peak "
          f"{report['peak_allocated_bytes']:,} B (eager {report['compiled']['peak_allocated_bytes_eager']:,} B)")
    print(f"  trace: {run_info['trace']}")
    print(f"  extrapolated: {run_info.get('cpu_kernels', {}).get('extrapolated_workspaces', '(none)')}")


def quick() -> None:
    """The tracer's own time: every probe answers 0 bytes."""
    import vramtrace
    from vramtrace import second_process
    from vramtrace.spec import RunSpec
    from vramtrace.tracer import probe

    probe.CpuWorkspaceProbe._probe = lambda self, func, args, kwargs, out, autocast: probe.Probed(0, ())
    second_process.cores = lambda: 1  # the eager comparison here too, under the stubbed probe
    for use_cache in (False, True):
        start = time.perf_counter()
        spec = RunSpec("meta-llama/Llama-2-7b", batch=4, seq=2048, device="cpu", compile=True, use_cache=use_cache)
        report = vramtrace.analyze(spec, levers=False)
        print(f"no probe, use_cache {use_cache}: {time.perf_counter() - start:.1f} s; {report.run.trace}")


if __name__ == "__main__":
    for extra in (["--use-cache", "false"], []):
        with tempfile.TemporaryDirectory() as cache:
            run(extra, cache, "first")
            run(extra, cache, "repeated")
    if "--quick" in sys.argv:
        quick()
