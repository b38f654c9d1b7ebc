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
lowest peak among the plans traced, and by how much it misses, and no snippet to apply.

The budget is compared on the basis of the fit verdict (`report/summary.py`): for a CUDA target the peak
reserved bytes of the caching-allocator model (what must fit on the device), for the CPU the peak allocated
bytes. `plan['basis']` names it.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable

from .report.sections import CheckpointingPlan, PlanCandidate
from .search import basis_text, compared_bytes, fits_budget
from .spec import Checkpointing, RunSpec


def plan_checkpointing(spec: RunSpec, analyze_one: Callable, say: Callable[[str], None]):
    """The MemoryReport of the chosen plan, with `checkpointing['plan']` describing the search (bytes compared
    with `spec.memory_budget_bytes` by `search.compared_bytes`). When no plan fits, the floor's report with an empty
    snippet."""
    from .summaries import checkpointing_summary
    from .tracer.checkpointing import paste_snippet

    budget = spec.memory_budget_bytes
    seen: dict[str, object] = {}

    def evaluate(policy: str):
        if policy not in seen:
            say(f"auto: trying checkpointing {policy}")
            seen[policy] = analyze_one(replace(spec, checkpointing=policy, memory_budget_bytes=None), say)
        return seen[policy]

    def fits(policy: str) -> bool:
        return fits_budget(evaluate(policy), budget)

    search_checkpointing(evaluate("none").run.num_layers or 0, fits, evaluate)
    candidates = [(p, r) for p, r in seen.items() if fits_budget(r, budget)]
    if candidates:
        policy, chosen = min(candidates, key=lambda pr: (pr[1].recompute_flops, compared_bytes(pr[1])))
        verdict = f"fits the budget with {policy}"
    else:
        policy, chosen = min(seen.items(), key=lambda pr: (compared_bytes(pr[1]), pr[1].recompute_flops))
        verdict = (f"no plan fits; the floor is {policy}, whose peak is in the {chosen.peak_phase} phase "
                   f"({chosen.peak_op})")
    # nothing to apply when no plan fits: the floor is information, not advice
    snippet = paste_snippet(Checkpointing.parse(policy)) if candidates else ""
    plan = CheckpointingPlan(
        budget_bytes=budget, fits=bool(candidates), chosen=policy, verdict=verdict,
        basis=basis_text(chosen), over_budget_bytes=max(0, compared_bytes(chosen) - budget),
        algorithm="binary search over transformers' every_n_layers, plus selective and layers; every candidate traced",
        evaluated=tuple(PlanCandidate(policy=p, peak_allocated_bytes=r.peak_allocated_bytes,
                                      peak_reserved_bytes=r.peak_reserved_bytes, compared_bytes=compared_bytes(r),
                                      recompute_flops=r.recompute_flops, recompute_overhead=r.recompute_overhead)
                        for p, r in seen.items()))
    summary = checkpointing_summary(chosen, seen["none"], snippet, plan)
    return replace(chosen, checkpointing=summary)


def search_checkpointing(num_layers: int, fits: Callable[[str], bool], evaluate: Callable[[str], object]) -> None:
    """Evaluate the candidate plans for a stack of `num_layers` layers that the search needs, by `evaluate(policy)`
    (which caches): none; when none does not fit, selective and layers; when layers fits, a binary search over
    transformers' every_n_layers for the smallest number of checkpointed layers that fits (`fits(policy)`).
    Shared by `--checkpointing auto` and the checkpointing lever (`vramtrace.levers`)."""
    L = num_layers
    if fits("none") or not L:
        return
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
