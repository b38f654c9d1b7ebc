"""`--checkpointing auto --memory-budget B`: the checkpointing plan that fits B with the least recompute.

The algorithm. The candidate plans are the ones a transformers user can apply with one call:

- none;
- `nth:N` for N = L..2: transformers' `every_n_layers=N` checkpoints c = ceil(L/N) of the L layers;
- `layers` (all L layers, c = L);
- `selective` (every layer, saving the matmul outputs).

Every candidate the planner looks at is traced and analysed exactly, so its peak and its recompute FLOPs
(torch.utils.flop_counter) are predictions of the same kind as the main job's, never estimates. Along the
`nth` family the peak falls and the recompute grows with c, so the planner binary-searches the smallest c that
fits (about log2 L traces, each checked), evaluates `selective` and `layers`, and returns the fitting plan with
the fewest recompute FLOPs. Because each answer is traced, a plan reported as fitting does fit; the search can
only miss a cheaper plan if the peak were not monotone in c. When nothing fits, the report gives the floor: the
lowest peak among the plans traced, and by how much it misses.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable

from .spec import Checkpointing, RunSpec


def plan_checkpointing(spec: RunSpec, analyze_one: Callable, say: Callable[[str], None]):
    """The MemoryReport of the chosen plan, with `checkpointing['plan']` describing the search."""
    from . import checkpointing_summary
    from .tracer.checkpointing import paste_snippet

    budget = spec.memory_budget_bytes
    seen: dict[str, object] = {}

    def evaluate(policy: str):
        if policy not in seen:
            say(f"auto: trying checkpointing {policy}")
            seen[policy] = analyze_one(replace(spec, checkpointing=policy), say)
        return seen[policy]

    def fits(policy: str) -> bool:
        return evaluate(policy).peak_allocated_bytes <= budget

    base = evaluate("none")
    L = base.run.get("num_layers") or 0
    if not fits("none") and L:
        evaluate("selective")
        if fits("layers") and L > 1:
            by_count = {}  # layers checkpointed -> N (every_n_layers)
            for n in range(L, 1, -1):
                by_count.setdefault(math.ceil(L / n), n)
            counts = sorted(by_count)
            lo, hi = 0, len(counts) - 1
            while lo <= hi:  # smallest count that fits
                mid = (lo + hi) // 2
                if fits(f"nth:{by_count[counts[mid]]}"):
                    hi = mid - 1
                else:
                    lo = mid + 1
    candidates = [(p, r) for p, r in seen.items() if r.peak_allocated_bytes <= budget]
    if candidates:
        policy, chosen = min(candidates, key=lambda pr: (pr[1].recompute_flops, pr[1].peak_allocated_bytes))
        verdict = f"fits the budget with {policy}"
    else:
        policy, chosen = min(seen.items(), key=lambda pr: (pr[1].peak_allocated_bytes, pr[1].recompute_flops))
        verdict = (f"no plan fits; the floor is {policy}, whose peak is in the {chosen.peak_phase} phase "
                   f"({chosen.peak_op})")
    summary = checkpointing_summary(chosen, base, paste_snippet(Checkpointing.parse(policy)))
    summary["plan"] = {
        "budget_bytes": budget, "fits": bool(candidates), "chosen": policy, "verdict": verdict,
        "over_budget_bytes": max(0, chosen.peak_allocated_bytes - budget),
        "algorithm": "binary search over transformers' every_n_layers, plus selective and layers; every candidate traced",
        "evaluated": [{"policy": p, "peak_allocated_bytes": r.peak_allocated_bytes,
                       "recompute_flops": r.recompute_flops,
                       "recompute_overhead": r.recompute_overhead}
                      for p, r in seen.items()],
    }
    return replace(chosen, checkpointing=summary)
