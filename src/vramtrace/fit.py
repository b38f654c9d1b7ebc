"""`vramtrace fit`: the largest micro-batch that fits at a sequence length, or the longest sequence at a batch.

Fast by construction. Within one model and run, the recording at batch B (or sequence S) has the same ops and
storages at every size; only each storage's bytes change, as a polynomial of low degree: linear in B, at most
quadratic in S (attention scores). So a few exact traces give every storage's bytes at any size:

- batch: exact traces at B = 2, 3, 4; each storage's bytes are the line through B = 2, 3, checked at B = 4
  (batch 1 is traced when the search gets there: a reshape that is a view at B = 1 copies at B >= 2);
- sequence: exact traces at S = h, 2h, 3h, 4h (h = 64, or less for short models); the parabola through the
  first three (Newton's forward differences, integer arithmetic), checked at the fourth.

A candidate's peak is then the same liveness analysis (and, on a CUDA target, the same caching-allocator replay)
over the recording's storage table with the interpolated sizes: exact as long as the recording's structure does
not change with the size. The answer is checked by two more exact traces, at the answer and one past it; when
either disagrees with the interpolation (a kernel whose choice or workspace changes with the shape), or the
traced structures differ, or a storage is not polynomial, the search falls back to bisection by exact traces and
says so. Every point of the curve is marked exact or interpolated.

"Fits" is the verdict of the main report. On a CUDA target: the caching-allocator replay of the first and steady
steps with `budget_bytes` for cudaMalloc (`capacity × (1 - headroom)` less the CUDA context) runs without an
out-of-memory, releasing its cache and retrying where cudaMalloc fails as PyTorch does (`analysis/pressure.py`);
peak allocated above the budget is a certain failure, checked first. On the CPU target: peak allocated at most the
budget. The search bisects the largest size whose peak allocated fits (monotone: `allocated_bound`, an upper
bound on the answer), then walks down from there to the largest size the replay fits (fragmentation makes the
replay's verdict not monotone in the size); each answer shows the replay's headroom and cache releases per step.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from .errors import UsageError
from .report.data import to_data
from .report.sections import LeversSummary
from .spec import Device, RunSpec
from .search import (MAX_RANKS, SEQ_STEP, Curve, FitPoint, TraceSession, aligned, evaluate, fewest_ranks,
                     frozen_session, largest, same_bytes)

BATCH_NODES = (2, 3, 4)  # not 1: at batch 1 some reshapes are views, at 2 and more copies
MAX_BATCH = 1 << 20  # the search's upper end for the batch axis
MAX_PIPELINE_STAGE_TRACES = 32  # `vramtrace fit --pp`: stage traces before the search stops (`_fit_depth`)


@dataclass(frozen=True, slots=True)
class FitResult:
    """The answer of `fit`. `axis` 'batch' or 'seq', `fixed` the other size (axes 'fsdp', 'zero' and 'pp': the
    batch, per rank or per pipeline step, with `limit` the largest rank count, stage or depth searched); `best` the
    largest size that fits (the smallest for 'fsdp', 'zero' and 'pp'; None: not even the smallest, or the largest),
    `next` the size one past it (None when `best` is the axis's limit);
    `budget_bytes` = capacity × (1 - headroom) - the CUDA context (what cudaMalloc may take); `method` says how
    the answer was found; `traces` counts the exact traces it took; `allocated_bound` the largest size whose peak
    allocated fits the budget (an upper bound on `best`; None for the FSDP axis); `cuda_context_bytes` and
    `cuda_context_source` the context assumed and why (0 and '' on the CPU target)."""

    axis: str
    fixed: int | None
    limit: int
    capacity_bytes: int
    budget_bytes: int
    basis: str
    best: FitPoint | None
    next: FitPoint | None
    curve: tuple[FitPoint, ...]
    method: str
    traces: int
    levers: LeversSummary | None = None  # nothing fits: what makes the smallest size fit (vramtrace.levers.find_levers)
    allocated_bound: int | None = None
    cuda_context_bytes: int = 0
    cuda_context_source: str = ""

    @property
    def headroom_bytes(self) -> int | None:
        """The budget the answer's replay never reserved (CUDA target), else the budget less its peak allocated."""
        if self.best is None:
            return None
        used = self.best.reserved_at_capacity
        return self.budget_bytes - (used if used is not None else self.best.peak_allocated_bytes)

    def to_dict(self) -> dict:
        def point(p: FitPoint | None):
            return None if p is None else {"x": p.x, "peak_allocated_bytes": p.peak_allocated_bytes,
                                           "peak_reserved_bytes": p.peak_reserved_bytes, "fits": p.fits,
                                           "exact": p.exact, "reserved_at_capacity_bytes": p.reserved_at_capacity,
                                           "alloc_retries": p.alloc_retries}
        return {"axis": self.axis, "fixed": self.fixed, "limit": self.limit, "capacity_bytes": self.capacity_bytes,
                "budget_bytes": self.budget_bytes, "cuda_context_bytes": self.cuda_context_bytes,
                "cuda_context_source": self.cuda_context_source, "basis": self.basis, "best": point(self.best),
                "next": point(self.next), "headroom_bytes": self.headroom_bytes,
                "allocated_bound": self.allocated_bound, "curve": [point(p) for p in self.curve],
                "method": self.method, "traces": self.traces, "levers": to_data(self.levers)}


def fit(spec: RunSpec, axis: str, capacity_bytes: int | None = None, headroom: float = 0.0,
        progress: Callable[[str], None] | None = None, levers: bool = True) -> FitResult:
    """The largest batch (`axis` 'batch', at `spec.seq`) or the longest sequence (`axis` 'seq', at
    `spec.batch`), or the fewest FSDP2 ranks (`axis` 'fsdp', at both: `_fit_ranks`), the smallest ZeRO stage
    (`axis` 'zero': `_fit_stage`) or pipeline depth (`axis` 'pp': `_fit_depth`), whose step fits in
    `capacity_bytes` (default: `spec.capacity`) less `headroom` (a fraction in
    [0, 1)). When not even the smallest size fits and `levers` is true, the result's `levers` says what makes it
    fit (`vramtrace.levers`). Raises UsageError (bad axis, capacity or headroom; the CPU target without a
    capacity), and what `analyze` raises."""
    say = progress or (lambda _m: None)
    if axis not in ("batch", "seq", "fsdp", "zero", "pp"):
        raise UsageError(f"fit searches 'batch', 'seq', 'fsdp', 'zero' or 'pp', got {axis!r}")
    if axis == "zero" and spec.zero is None:
        raise UsageError("fit's ZeRO axis searches the stage at the run's ranks: give --zero 1 --dp N")
    if axis == "pp" and spec.pp is None:
        raise UsageError("fit's pipeline axis searches the depth from the run's: give --pp P with --batch and --seq")
    if axis != "pp" and spec.pp is not None:
        raise UsageError(f"fit's {axis} axis does not search a pipeline (its traces would size stage 0 alone); with "
                         "--pp, fit searches the depth: give --batch and --seq")
    if axis == "pp" and spec.pp_split is not None:
        raise UsageError("fit --pp searches the pipeline depth, which --pp-split fixes (one layer count per "
                         "stage): drop --pp-split")
    if axis == "fsdp" and spec.world is not None:
        raise UsageError("fit with --batch and --seq searches the number of FSDP ranks itself; drop --fsdp/--ddp/--tp")
    if not 0 <= headroom < 1:
        raise UsageError(f"--headroom must be in [0%, 100%), got {headroom:.0%}")
    cuda = spec.device is Device.CUDA
    if capacity_bytes is None:
        if spec.capacity is None:
            raise UsageError("the CPU target has no device capacity: pass --gpu-memory (e.g. 16GiB)")
        capacity_bytes = spec.capacity[1]
    if capacity_bytes <= 0:
        raise UsageError(f"--gpu-memory must be positive, got {capacity_bytes} bytes")
    budget = int(capacity_bytes * (1 - headroom)) - spec.cuda_context
    if budget <= 0:
        raise UsageError(f"the capacity less --headroom leaves nothing beside the CUDA context "
                         f"({spec.cuda_context:,} bytes; --cuda-context sets it)")
    with frozen_session(spec, say) as session:
        return _fit(session, axis, capacity_bytes, budget, cuda, levers)


WALK = 16  # sizes the search walks down from the allocated bound before it bisects on the replay's verdict


class _Search:
    """The state of one `fit` search along `axis`: the exact traces made (`session.traces`, their points
    `exact`), the curve interpolating them (None: exact traces only) and the interpolated points computed."""

    def __init__(self, session: TraceSession, axis: str, cuda: bool, budget: int):
        self.session, self.spec, self.axis, self.cuda, self.budget = session, session.spec, axis, cuda, budget
        self.exact: dict[int, FitPoint] = {}
        self.curve: Curve | None = None
        self.nodes: tuple[int, ...] = ()
        self._points: dict[int, FitPoint] = {}
        self._allocated: dict[int, int] = {}

    def sized(self, x: int) -> RunSpec:
        return replace(self.spec, batch=x) if self.axis == "batch" else replace(self.spec, seq=x)

    def tables(self, x: int):
        """The StepTables of the exact trace at size `x` (traced when not yet)."""
        return self.session.trace(self.sized(x), f"exact trace at {self.axis} {x}").tables

    def trace(self, x: int) -> FitPoint:
        if x not in self.exact:
            self.exact[x] = evaluate(self.tables(x), x, self.cuda, self.budget, True)
        return self.exact[x]

    def traced_only(self, x: int, exact_only: bool) -> bool:
        # below the nodes (batch 1: size-1 dimensions make other views) and without a curve: traced
        return exact_only or self.curve is None or x in self.exact or x < self.nodes[0]

    def rows(self, x: int) -> tuple:
        r = self.curve.rows_at(x)
        if r is None:
            raise _NotPolynomial(x)
        return r

    def allocated(self, x: int, exact_only: bool = False) -> int:
        if self.traced_only(x, exact_only):
            return self.trace(x).peak_allocated_bytes
        if x not in self._allocated:
            self._allocated[x] = self.tables(self.nodes[0]).timeline(self.rows(x)).peak_bytes
        return self._allocated[x]

    def point(self, x: int, exact_only: bool = False) -> FitPoint:
        if self.traced_only(x, exact_only):
            return self.trace(x)
        if x not in self._points:
            self._points[x] = evaluate(self.tables(self.nodes[0]), x, self.cuda, self.budget, False, self.rows(x))
        return self._points[x]

    def best_size(self, limit: int, exact_only: bool) -> tuple[int, int]:
        """(the largest size that fits, the largest whose peak allocated fits the budget). The second is bisected
        (peak allocated grows with the size) and bounds the first; on a CUDA target the search walks down from
        it while the replay under the budget runs out of memory, then bisects below (WALK sizes on)."""
        bound = largest(lambda x: self.allocated(x, exact_only) <= self.budget, min(self.nodes[0], limit), limit)
        best, walked = bound, 0
        while self.cuda and best >= 1 and not self.point(best, exact_only).fits and walked < WALK:
            best, walked = best - 1, walked + 1
        if best >= 1 and not self.point(best, exact_only).fits:
            best = largest(lambda x: self.point(x, exact_only).fits, 1, best - 1)
        return best, bound


def _fit(session: TraceSession, axis: str, capacity: int, budget: int, cuda: bool, levers: bool) -> FitResult:
    if axis == "fsdp":
        return _fit_ranks(session, capacity, budget, cuda)
    if axis == "zero":
        return _fit_stage(session, capacity, budget, cuda)
    if axis == "pp":
        return _fit_depth(session, capacity, budget, cuda)
    s = _Search(session, axis, cuda, budget)
    spec = session.spec
    limit = MAX_BATCH
    if axis == "seq":
        model = session.load(s.sized(SEQ_STEP))  # the model's longest sequence bounds the search
        limit = getattr(getattr(model.model, "config", None), "max_position_embeddings", None) or 1 << 20
        h = min(SEQ_STEP, max(1, limit // 4))
        s.nodes, degree = (h, 2 * h, 3 * h, 4 * h), 2
    else:
        s.nodes, degree = BATCH_NODES, 1
    for x in s.nodes:
        s.trace(x)
    why = _make_curve(s, axis, degree)
    method, best, bound = "", 0, 0
    if s.curve is not None:
        try:
            best, bound = s.best_size(limit, False)
            checks = [x for x in (best, best + 1) if 1 <= x <= limit]
            why = _check(s, checks)
            if not why:
                method = (f"interpolated from exact traces at {axis} {', '.join(map(str, s.nodes))} (degree "
                          f"{degree}); checked by exact traces at {', '.join(map(str, checks))}")
        except _NotPolynomial as e:
            why = f"a storage's bytes are not an integer at {axis} {e.x}: not polynomial"
    if not method:
        session.say(f"bisection by exact traces ({why})")
        best, bound = s.best_size(limit, True)
        method = f"bisection by exact traces ({why})"
    return _result(s, spec, capacity, limit, best, bound, method, levers)


def _make_curve(s: _Search, axis: str, degree: int) -> str:
    """Set `s.curve` from the node traces when they share one structure and their sizes are polynomial of
    `degree`; else leave it None and say why."""
    nodes = s.nodes
    if not all(aligned(s.tables(nodes[0]), s.tables(x)) for x in nodes[1:]):
        return f"the recordings at {axis} {', '.join(map(str, nodes))} differ in structure"
    curve = Curve(nodes, [s.tables(x) for x in nodes], degree)
    for x in nodes[degree + 1:]:
        if not same_bytes(curve.bytes_at(x), s.tables(x)):
            return f"a storage's bytes are not a degree-{degree} polynomial of the {axis} (checked at {x})"
    s.curve = curve
    return ""


def _check(s: _Search, checks: list[int]) -> str:
    """'' when the interpolated points at `checks` equal exact traces there (peaks and verdict), else why not."""
    for x in checks:
        interp = s.point(x) if x not in s.exact else None
        got = s.trace(x)
        if interp is not None and replace(interp, exact=True) != got:
            return (f"the interpolation disagrees with the exact trace at {s.axis} {x} "
                    f"({interp.peak_allocated_bytes:,} vs {got.peak_allocated_bytes:,} bytes allocated)")
    return ""


def _result(s: _Search, spec: RunSpec, capacity: int, limit: int, best: int, bound: int, method: str,
            levers: bool) -> FitResult:
    """The FitResult of a finished search: the answer and the size past it traced, the curve shown (the nodes,
    the exact traces, powers of two and the sizes around the answer), the levers when nothing fits."""
    best_point = s.trace(best) if best >= 1 else None
    next_point = s.trace(best + 1) if best + 1 <= limit else None
    if method.startswith("interpolated"):
        shown = sorted({*s.nodes, *s.exact, *(x for x in _powers(best + 1) if x >= s.nodes[0]), best + 1} - {0})
        curve_points = tuple(s.point(x) for x in shown if x <= limit)
    else:
        curve_points = tuple(s.exact[x] for x in sorted(s.exact))
    found = None
    if best_point is None and next_point is not None and levers:
        from .levers import Evaluator, find_levers
        from .tables import outcome

        ev = Evaluator(s.session, s.cuda)
        made = s.session.trace(s.sized(next_point.x))
        ev.seed(s.sized(next_point.x), outcome(made.tables, made.num_layers, s.cuda))
        found = find_levers(s.sized(next_point.x), ev, s.budget)
    ctx = spec.cuda_context_figure if s.cuda else None
    return FitResult(s.axis, spec.seq if s.axis == "batch" else spec.batch, limit, capacity, s.budget,
                     _basis(spec, s.cuda), best_point, next_point, curve_points, method, len(s.exact), found,
                     bound, ctx.nbytes if ctx else 0, ctx.source if ctx else "")


def _basis(spec: RunSpec, cuda: bool, ranks: bool = False, stages: bool = False) -> str:
    """What "fits" means for `spec` (the text shown under the answer)."""
    rank = ", rank 0" if ranks else ", every pipeline stage" if stages else ""
    if not cuda:
        return f"peak allocated (CPU target){rank}"
    return (f"the caching-allocator replay (cuBLAS workspaces included) of the first and steady steps with the "
            f"budget for cudaMalloc, the capacity less the CUDA context ({spec.cuda_context:,} bytes), releasing the "
            f"cache and retrying as PyTorch does: no out-of-memory{rank}")


def _fit_ranks(session: TraceSession, capacity: int, budget: int, cuda: bool) -> FitResult:
    """The fewest GPUs, a power of two up to MAX_RANKS (1: no sharding), whose FSDP2 step (`--fsdp N`, the per-rank
    batch and sequence kept) fits: bisection by exact traces, the per-rank peak falling with N. Each N is traced
    at rank 0, whose shards are the largest (ceil(dim0 / N) rows of every parameter, `sharding.rank_classes`)."""
    spec = session.spec
    exact: dict[int, FitPoint] = {}

    def trace(n: int) -> FitPoint:
        if n not in exact:
            made = session.trace(replace(spec, fsdp=n if n > 1 else None), f"exact trace at --fsdp {n}")
            exact[n] = evaluate(made.tables, n, cuda, budget, True)
        return exact[n]

    best = fewest_ranks(lambda n: trace(n).fits)
    below = None if best == 1 else (best // 2 if best else MAX_RANKS)
    ctx = spec.cuda_context_figure if cuda else None
    return FitResult("fsdp", spec.batch, MAX_RANKS, capacity, budget, _basis(spec, cuda, ranks=True),
                     trace(best) if best else None, trace(below) if below else None,
                     tuple(exact[n] for n in sorted(exact)),
                     "bisection over powers of two by exact traces (FSDP2 on each layer and the root)", len(exact),
                     cuda_context_bytes=ctx.nbytes if ctx else 0, cuda_context_source=ctx.source if ctx else "")


def _fit_stage(session: TraceSession, capacity: int, budget: int, cuda: bool) -> FitResult:
    """The smallest DeepSpeed ZeRO stage, from the run's `--zero` up to 3, whose step fits at the run's `--dp`
    (the per-rank batch and sequence kept): each stage traced in order (DeepSpeed's engine, tracer/zero.py) until
    one fits. `best`: that stage, `next`: the stage below it that does not (None when the run's stage fits)."""
    spec = session.spec
    exact: dict[int, FitPoint] = {}
    best = None
    for stage in range(spec.zero, 4):
        made = session.trace(replace(spec, zero=stage), f"exact trace at --zero {stage}")
        exact[stage] = evaluate(made.tables, stage, cuda, budget, True)
        if exact[stage].fits:
            best = stage
            break
    if best is None:
        below = 3  # not even ZeRO-3 fits
    else:
        below = best - 1 if best > spec.zero else None
    ctx = spec.cuda_context_figure if cuda else None
    return FitResult("zero", spec.batch, 3, capacity, budget, _basis(spec, cuda, ranks=True),
                     exact[best] if best is not None else None, exact.get(below),
                     tuple(exact[n] for n in sorted(exact)),
                     f"each ZeRO stage from {spec.zero} traced in order at --dp {spec.dp} (DeepSpeed's engine)",
                     len(exact), cuda_context_bytes=ctx.nbytes if ctx else 0,
                     cuda_context_source=ctx.source if ctx else "")


def _fit_depth(session: TraceSession, capacity: int, budget: int, cuda: bool) -> FitResult:
    """The smallest pipeline depth P' >= the run's `--pp` P whose step fits (the batch and sequence kept): each
    depth traced exactly, every distinct stage (pp_stages.py `stage_traces`), in order P, P + 1, ... up to the
    decoder layer count, until one fits. Consecutive depths, not powers of two: a user picks any depth that divides
    their GPUs, and the largest stage's peak is not monotone in the depth (the split's remainder moves, the
    micro-batches follow the depth), so a bisection could pass the smallest depth that fits; it stops at the first
    that fits, so the traces are those of the depths below the answer, and before a depth whose stages would take
    the search past `MAX_PIPELINE_STAGE_TRACES` stage traces (under 1F1B every stage of a depth is traced: from
    --pp 4 to 32 layers would be 522). A depth is skipped where the run's options do not go together with it
    (`levers.pipeline_depth`: the batch not a multiple of the micro-batches, a schedule refusing them, more stages
    than layers).

    A depth fits when every stage does. Its FitPoint is its largest stage's, or, on a CUDA target where that one
    fits and another stage does not, the largest of those that do not (pp_stages.py `failing_stage`: the stage the
    report of the same spec shows). `--stage K` is dropped: the pipeline fits only when all its stages do, so every
    stage is sized. `best`: that depth, `next`: the valid depth below it (None when the run's P fits)."""
    from .levers import pipeline_depth
    from .pp_stages import stage_traces

    spec = session.spec
    exact: dict[int, FitPoint] = {}
    depths: list[int] = []
    skipped: list[int] = []
    best, layers, depth, traces, capped = None, None, spec.pp, 0, None
    v = spec.pp_virtual_stages or 1
    while layers is None or depth * v <= layers:
        on = replace(spec, stage=None) if layers is None else pipeline_depth(spec, depth, layers)
        if on is None:
            skipped.append(depth)
        elif layers is not None and traces + depth > MAX_PIPELINE_STAGE_TRACES:  # at most `depth` stages to trace
            capped = depth
            break
        else:
            session.say(f"exact trace at --pp {depth}")
            stages = stage_traces(session, on)
            traces += len(stages)
            layers = next(iter(stages.values())).num_layers
            exact[depth] = _worst_stage(stages, cuda, budget, depth)
            depths.append(depth)
            if exact[depth].fits:
                best = depth
                break
        depth += 1
    if best is None:
        below = depths[-1]  # not even the deepest fits
    else:
        below = depths[-2] if len(depths) > 1 else None
    m = "the micro-batches follow the depth (M = P')" if spec.micro_batches is None else (
        f"--micro-batches {spec.micro_batches} kept (1F1B: raised to the depth where it is below it)")
    method = (f"each pipeline depth from --pp {spec.pp} traced in order, every distinct stage (a depth fits when "
              f"its largest stage does{'; --stage dropped: every stage sized' if spec.stage is not None else ''}); "
              f"{spec.pp_schedule.value}, {m}, even split"
              + (f"; skipped --pp {', '.join(map(str, skipped))} (the batch {spec.batch} does not split into its "
                 "micro-batches, or the schedule refuses them)" if skipped else "")
              + (f"; stopped before --pp {capped}: its stages would take the search past "
                 f"{MAX_PIPELINE_STAGE_TRACES} stage traces" if capped else ""))
    ctx = spec.cuda_context_figure if cuda else None
    return FitResult("pp", spec.batch, (capped - 1) if capped else layers // v, capacity, budget,
                     _basis(spec, cuda, stages=True),
                     exact[best] if best is not None else None, exact.get(below),
                     tuple(exact[n] for n in sorted(exact)), method, traces,
                     cuda_context_bytes=ctx.nbytes if ctx else 0, cuda_context_source=ctx.source if ctx else "")


def _worst_stage(stages: dict, cuda: bool, budget: int, depth: int) -> FitPoint:
    """The FitPoint at `depth` of a pipeline's stage traces `stages` ({stage: search.Trace}): its failing stage's
    (pp_stages.py `failing_stage`, as the report of the same spec picks it, `trace_stages`): fits when every stage
    does; the bytes of its largest stage by the report's basis (`StepTables.peaks`), unless that one fits and
    another does not (the largest of those, then)."""
    from .pp_stages import failing_stage

    points = {k: evaluate(t.tables, depth, cuda, budget, True) for k, t in stages.items()}
    return points[failing_stage(points)]


def _powers(n: int) -> list[int]:
    """1, 2, 4, ... up to n: where the curve is shown."""
    out, x = [], 1
    while x <= n:
        out.append(x)
        x *= 2
    return out


class _NotPolynomial(Exception):
    def __init__(self, x: int):
        super().__init__(x)
        self.x = x
