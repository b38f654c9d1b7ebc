"""Print, for one model, the predicted peak and recompute overhead of each checkpointing policy.

Reproduce: python benchmarks/bench_checkpointing.py [MODEL] [--batch 4] [--seq 2048] [--budget 60GiB]
Default: meta-llama/Llama-2-7b, batch 4, seq 2048, bf16-mixed, AdamW (foreach), H100 target; the policies
none, layers, every:4, selective, and auto with a 60 GiB budget (issue 3). The recompute overhead is the
recompute FLOPs over the step's forward + backward FLOPs (torch.utils.flop_counter formulas).
"""

from __future__ import annotations

import argparse
import time

from vramtrace import RunSpec, analyze
from vramtrace.units import format_bytes, parse_bytes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="meta-llama/Llama-2-7b")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--budget", default="60GiB")
    a = ap.parse_args()
    print(f"{a.model}, batch {a.batch}, seq {a.seq}, bf16-mixed, AdamW, H100-80GB target")
    print(f"{'policy':<12} {'peak allocated':>15} {'activations':>12} {'recompute':>10} {'time':>7}  note")
    for policy in ("none", "layers", "every:4", "selective", "auto"):
        budget = parse_bytes(a.budget) if policy == "auto" else None
        t0 = time.perf_counter()
        r = analyze(RunSpec(a.model, batch=a.batch, seq=a.seq, checkpointing=policy, memory_budget_bytes=budget))
        dt = time.perf_counter() - t0
        ck = r.checkpointing
        overhead = 0.0 if ck is None else ck.recompute_overhead
        plan = None if ck is None else ck.plan
        note = r.run.trace
        if policy == "auto" and plan is not None:
            over = f", over by {format_bytes(plan.over_budget_bytes)}" if not plan.fits else ""
            note = plan.verdict + over
        name = f"auto {a.budget}" if policy == "auto" else policy
        print(f"{name:<12} {format_bytes(r.peak_allocated_bytes):>15} {format_bytes(r.activation_bytes):>12} "
              f"{100 * overhead:>9.1f}% {dt:>6.1f}s  {note}")


if __name__ == "__main__":
    main()
