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

"Fits" is the verdict of the main report: on a CUDA target the peak reserved by the caching-allocator model
(cuBLAS workspaces included) plus the CUDA context, on the CPU target the peak allocated, at most
`capacity × (1 - headroom)`; `budget_bytes` is that less the CUDA context, compared with the reserved bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from .errors import UsageError
from .spec import Device, RunSpec

BATCH_NODES = (2, 3, 4)  # not 1: at batch 1 some reshapes are views, at 2 and more copies
SEQ_STEP = 64  # the sequence nodes are SEQ_STEP * (1, 2, 3, 4), smaller when the model is shorter
MAX_BATCH = 1 << 20  # the search's upper end for the batch axis


@dataclass(frozen=True, slots=True)
class FitPoint:
    """The peak at one size (`x`: batch or sequence), exact (traced) or interpolated; `fits` by the verdict."""

    x: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int | None
    fits: bool
    exact: bool


@dataclass(frozen=True, slots=True)
class FitResult:
    """The answer of `fit`. `axis` 'batch' or 'seq', `fixed` the other size; `best` the largest size that fits
    (None: not even the smallest), `next` the size one past it (None when `best` is the axis's limit);
    `budget_bytes` = capacity × (1 - headroom) - the CUDA context; `method` says how the answer was found;
    `traces` counts the exact traces it took."""

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
    levers: dict | None = None  # nothing fits: what makes the smallest size fit (vramtrace.levers.find_levers)

    def to_dict(self) -> dict:
        def point(p: FitPoint | None):
            return None if p is None else {"x": p.x, "peak_allocated_bytes": p.peak_allocated_bytes,
                                           "peak_reserved_bytes": p.peak_reserved_bytes, "fits": p.fits,
                                           "exact": p.exact}
        return {"axis": self.axis, "fixed": self.fixed, "limit": self.limit, "capacity_bytes": self.capacity_bytes,
                "budget_bytes": self.budget_bytes, "basis": self.basis, "best": point(self.best),
                "next": point(self.next), "curve": [point(p) for p in self.curve], "method": self.method,
                "traces": self.traces, "levers": self.levers}


class _Curve:
    """Each storage's bytes as a polynomial of the size, from exact traces at equally spaced nodes (Newton's
    forward differences in integers): `degree` + 1 nodes determine it, the others check it."""

    def __init__(self, nodes: tuple[int, ...], tables: list, degree: int):
        import numpy as np

        self.base = tables[0]
        self.x0, self.h, self.degree = nodes[0], nodes[1] - nodes[0], degree
        row = np.array([[r.nbytes for r in t.table] for t in tables[:degree + 1]], dtype=np.int64)
        diffs = []  # (Δ^0, ..., Δ^degree) of each storage's bytes at the first degree + 1 nodes
        for _ in range(degree + 1):
            diffs.append(row[0])
            row = row[1:] - row[:-1]
        self.diffs = np.stack(diffs, axis=1)  # (storages, degree + 1)
        self._bound = [int(v) for v in np.abs(self.diffs).max(axis=0, initial=0)]

    def bytes_at(self, x: int):
        """Every storage's bytes at size x (an int64 numpy array in the base table's order), or None when one of
        them is not an integer there (not polynomial).

        y(x) = Σ_k Δ^k y0 · Π_{j<k} (x - x0 - j·h) / (h^k · k!), all over the common denominator
        D = h^degree · degree!, so that the sum is exact in integers (in int64 when it cannot overflow, else in
        Python's ints)."""
        import numpy as np

        deg, h = self.degree, self.h
        factorials = [1]
        for k in range(1, deg + 1):
            factorials.append(factorials[-1] * k)
        denominator = h ** deg * factorials[deg]
        terms, prod = [], 1
        for k in range(deg + 1):
            terms.append(prod * h ** (deg - k) * (factorials[deg] // factorials[k]))
            prod *= x - self.x0 - k * h
        if sum(b * abs(t) for b, t in zip(self._bound, terms)) < 1 << 62:
            n = self.diffs @ np.array(terms, dtype=np.int64)
        else:
            n = np.array([sum(int(d) * t for d, t in zip(row, terms)) for row in self.diffs.tolist()], dtype=object)
        if (n % denominator).any():
            return None
        return (n // denominator).astype(np.int64)

    def rows_at(self, x: int):
        """The base table with each storage's bytes at size x (shapes are the base trace's: not reported)."""
        sizes = self.bytes_at(x)
        if sizes is None:
            return None
        return tuple(r if r.nbytes == n else replace(r, nbytes=n) for r, n in zip(self.base.table, sizes.tolist()))


def _equal(sizes, tables) -> bool:
    """Whether interpolated `sizes` (None: not polynomial) are the bytes of the exact trace `tables`."""
    return sizes is not None and sizes.tolist() == [r.nbytes for r in tables.table]


def _aligned(a, b) -> bool:
    """Whether two exact traces record the same structure: the same ops (names, phases, reads, allocations,
    frees) and the same storages (all but their bytes and shapes)."""
    ta, tb = a.traced, b.traced
    if len(ta.ops) != len(tb.ops) or len(a.table) != len(b.table) or ta.steps != tb.steps:
        return False
    for x, y in zip(ta.ops, tb.ops):
        if (x.name, x.phase, x.reads, x.allocates, x.frees, x.step) != (y.name, y.phase, y.reads, y.allocates,
                                                                        y.frees, y.step):
            return False
    for r, s in zip(a.table, b.table):
        if (r.sid, r.dtype, r.device, r.category, r.op_index, r.op, r.free_after, r.last_use) != (
                s.sid, s.dtype, s.device, s.category, s.op_index, s.op, s.free_after, s.last_use):
            return False
    return True


def fit(spec: RunSpec, axis: str, capacity_bytes: int | None = None, headroom: float = 0.0,
        progress: Callable[[str], None] | None = None, levers: bool = True) -> FitResult:
    """The largest batch (`axis` 'batch', at `spec.seq`) or the longest sequence (`axis` 'seq', at
    `spec.batch`), or the fewest FSDP2 ranks (`axis` 'fsdp', at both: `_fit_ranks`), whose step fits in
    `capacity_bytes` (default: `spec.capacity`) less `headroom` (a fraction in
    [0, 1)). When not even the smallest size fits and `levers` is true, the result's `levers` says what makes it
    fit (`vramtrace.levers`). Raises UsageError (bad axis, capacity or headroom; the CPU target without a
    capacity), and what `analyze` raises."""
    from . import _FrozenHeap

    say = progress or (lambda _m: None)
    if axis not in ("batch", "seq", "fsdp"):
        raise UsageError(f"fit searches 'batch', 'seq' or 'fsdp', got {axis!r}")
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
    with _FrozenHeap() as heap:
        return _fit(spec, axis, capacity_bytes, budget, cuda, say, heap, levers)


def _fit(spec: RunSpec, axis: str, capacity: int, budget: int, cuda: bool, say, heap, levers: bool) -> FitResult:
    from .tables import step_tables
    from .tracer.building import load_model
    from .tracer.checkpoint_headers import precision_for
    from .tracer.loading import resolve_config

    resolved = resolve_config(spec.model)
    spec = replace(spec, precision=precision_for(spec, resolved)[0])
    if axis == "fsdp":
        return _fit_ranks(spec, resolved, capacity, budget, cuda, say, heap)
    exact: dict[int, FitPoint] = {}
    tables: dict[int, object] = {}
    num_layers: dict[int, int] = {}
    limit = MAX_BATCH

    def sized(x: int) -> RunSpec:
        return replace(spec, batch=x) if axis == "batch" else replace(spec, seq=x)

    def trace(x: int) -> FitPoint:
        if x not in exact:
            say(f"exact trace at {axis} {x}")
            loaded = load_model(sized(x), resolved)
            t = step_tables(sized(x), loaded)
            heap.refreeze()
            num_layers[x] = loaded.num_layers
            alloc, reserved = t.peaks(cuda=cuda)
            tables[x] = t
            exact[x] = FitPoint(x, alloc, reserved, (reserved if cuda else alloc) <= budget, True)
        return exact[x]

    if axis == "seq":
        model = load_model(sized(SEQ_STEP), resolved)  # the model's longest sequence bounds the search
        limit = getattr(getattr(model.model, "config", None), "max_position_embeddings", None) or 1 << 20
        h = min(SEQ_STEP, max(1, limit // 4))
        nodes, degree = (h, 2 * h, 3 * h, 4 * h), 2
    else:
        nodes, degree = BATCH_NODES, 1
    for x in nodes:
        trace(x)
    curve: _Curve | None = None
    why = ""
    if not all(_aligned(tables[nodes[0]], tables[x]) for x in nodes[1:]):
        why = f"the recordings at {axis} {', '.join(map(str, nodes))} differ in structure"
    else:
        curve = _Curve(nodes, [tables[x] for x in nodes], degree)
        for x in nodes[degree + 1:]:
            if not _equal(curve.bytes_at(x), tables[x]):
                why = f"a storage's bytes are not a degree-{degree} polynomial of the {axis} (checked at {x})"
                curve = None
                break
    rows_cache: dict[int, tuple] = {}
    allocated_cache: dict[int, int] = {}
    replay_cache: dict[int, tuple[int, int | None]] = {}

    def rows(x: int) -> tuple:
        if x not in rows_cache:
            r = curve.rows_at(x)
            if r is None:
                raise _NotPolynomial(x)
            rows_cache[x] = r
        return rows_cache[x]

    def traced_only(x: int, exact_only: bool) -> bool:
        # below the nodes (batch 1: size-1 dimensions make other views) and without a curve: traced
        return exact_only or curve is None or x in exact or x < nodes[0]

    def allocated(x: int, exact_only: bool = False) -> int:
        """The search's peak allocated: the liveness sum, on a CUDA target a lower bound of the replay's."""
        if traced_only(x, exact_only):
            return trace(x).peak_allocated_bytes
        if x not in allocated_cache:
            allocated_cache[x] = tables[nodes[0]].timeline(rows(x)).peak_bytes
        return allocated_cache[x]

    def replayed(x: int) -> tuple[int, int | None]:
        """(peak allocated, peak reserved) of an interpolated point on a CUDA target: the allocator replay's."""
        if x not in replay_cache:
            replay_cache[x] = tables[nodes[0]].peaks(rows(x), cuda=True)
        return replay_cache[x]

    def reserved(x: int, exact_only: bool = False) -> int | None:
        if not cuda:
            return None
        if traced_only(x, exact_only):
            return trace(x).peak_reserved_bytes
        return replayed(x)[1]

    def point(x: int, exact_only: bool = False) -> FitPoint:
        if traced_only(x, exact_only):
            return trace(x)
        a, r = replayed(x) if cuda else (allocated(x), None)  # as an exact point's (`StepTables.peaks`)
        return FitPoint(x, a, r, (r if cuda else a) <= budget, False)

    def largest(fits: Callable[[int], bool]) -> int:
        """The largest x in [1, limit] with fits(x) (peak allocated grows with the size), 0 when none: from the
        first node, galloping up, then bisection."""
        start = min(nodes[0], limit)
        if fits(start):
            lo, hi = start, start * 2
            while hi <= limit and fits(hi):
                lo, hi = hi, hi * 2
            hi = min(hi, limit + 1)
        else:
            lo, hi = 0, start
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo

    def best_size(exact_only: bool) -> int:
        """The largest size whose peak allocated fits (monotone, so bisected); on a CUDA target, then down from
        there to the largest whose peak reserved fits: the caching allocator's segments make reserved bytes
        non-monotone in the size, and no larger size can fit, since reserved >= allocated."""
        best = largest(lambda x: allocated(x, exact_only) <= budget)
        while cuda and best >= 1 and reserved(best, exact_only) > budget:
            best -= 1
        return best

    method = ""
    if curve is not None:
        try:
            best = best_size(False)
            checks = [x for x in (best, best + 1) if 1 <= x <= limit]
            for x in checks:
                interp = point(x) if x not in exact else None
                got = trace(x)
                if interp is not None and (interp.peak_allocated_bytes, interp.peak_reserved_bytes) != (
                        got.peak_allocated_bytes, got.peak_reserved_bytes):
                    why = (f"the interpolation disagrees with the exact trace at {axis} {x} "
                           f"({interp.peak_allocated_bytes:,} vs {got.peak_allocated_bytes:,} bytes allocated)")
                    break
            else:
                method = (f"interpolated from exact traces at {axis} {', '.join(map(str, nodes))} (degree {degree}); "
                          f"checked by exact traces at {', '.join(map(str, checks))}")
        except _NotPolynomial as e:
            why = f"a storage's bytes are not an integer at {axis} {e.x}: not polynomial"
    if not method:
        say(f"bisection by exact traces ({why})")
        best = best_size(True)
        method = f"bisection by exact traces ({why})"
    best_point = trace(best) if best >= 1 else None
    next_point = trace(best + 1) if best + 1 <= limit else None
    if method.startswith("interpolated"):  # the curve at the nodes, powers of two and around the answer
        shown = sorted({*nodes, *exact, *(x for x in _powers(best + 1) if x >= nodes[0]), best + 1} - {0})
        curve_points = tuple(point(x) for x in shown if x <= limit)
    else:
        curve_points = tuple(exact[x] for x in sorted(exact))
    basis = (f"peak reserved (caching-allocator model, cuBLAS workspaces included) + the CUDA context "
             f"({spec.cuda_context:,} bytes)" if cuda else "peak allocated (CPU target)")
    found = None
    if best_point is None and next_point is not None and levers:
        from .levers import Evaluator, find_levers
        from .tables import outcome

        ev = Evaluator(resolved, cuda, say, heap)
        ev.seed(sized(next_point.x), outcome(tables[next_point.x], num_layers[next_point.x], cuda))
        found = find_levers(sized(next_point.x), ev, budget)
    return FitResult(axis, spec.seq if axis == "batch" else spec.batch, limit, capacity, budget, basis, best_point,
                     next_point, curve_points, method, len(exact), found)


MAX_RANKS = 1024  # the largest FSDP world size `fit` tries


def fewest_ranks(fits: Callable[[int], bool], smallest: int = 1) -> int | None:
    """The smallest power of two N in [smallest, MAX_RANKS] with `fits(N)`, bisected (the per-rank peak falls
    with N), or None when even MAX_RANKS does not fit. `fits` is called on the bisection's points only."""
    sizes = [1 << k for k in range(smallest.bit_length() - 1, MAX_RANKS.bit_length())]
    lo, hi, best = 0, len(sizes) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        if fits(sizes[mid]):
            best, hi = sizes[mid], mid - 1
        else:
            lo = mid + 1
    return best


def _fit_ranks(spec: RunSpec, resolved, capacity: int, budget: int, cuda: bool, say, heap) -> FitResult:
    """The fewest GPUs, a power of two up to MAX_RANKS (1: no sharding), whose FSDP2 step (`--fsdp N`, the per-rank
    batch and sequence kept) fits: bisection by exact traces, the per-rank peak falling with N. Each N is traced
    at rank 0, whose shards are the largest (ceil(dim0 / N) rows of every parameter, `sharding.rank_classes`)."""
    from .tables import step_tables
    from .tracer.building import load_model

    exact: dict[int, FitPoint] = {}

    def trace(n: int) -> FitPoint:
        if n not in exact:
            say(f"exact trace at --fsdp {n}")
            sized = replace(spec, fsdp=n if n > 1 else None)
            t = step_tables(sized, load_model(sized, resolved))
            heap.refreeze()
            alloc, reserved = t.peaks(cuda=cuda)
            exact[n] = FitPoint(n, alloc, reserved, (reserved if cuda else alloc) <= budget, True)
        return exact[n]

    best = fewest_ranks(lambda n: trace(n).fits)
    below = None if best == 1 else (best // 2 if best else MAX_RANKS)
    basis = (f"peak reserved (caching-allocator model, cuBLAS workspaces included) + the CUDA context "
             f"({spec.cuda_context:,} bytes), rank 0" if cuda else "peak allocated (CPU target), rank 0")
    return FitResult("fsdp", spec.batch, MAX_RANKS, capacity, budget, basis,
                     trace(best) if best else None, trace(below) if below else None,
                     tuple(exact[n] for n in sorted(exact)),
                     "bisection over powers of two by exact traces (FSDP2 on each layer and the root)", len(exact))


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
