"""The search machinery `fit`, `sweep` and `levers` share: sizes from a few exact traces, and the searches over them.

Within one model and run, the recording at batch B (or sequence S) has the same ops and storages at every size;
only each storage's bytes change, as a polynomial of low degree (linear in B, at most quadratic in S). So:

- `Curve`: each storage's bytes as a polynomial of the size, from exact traces at equally spaced nodes (Newton's
  forward differences in integers), evaluated exactly at any size;
- `aligned`: whether two exact traces record the same structure (the condition for a `Curve` through them);
- `same_bytes`: whether interpolated bytes are an exact trace's (the check of a `Curve` at a further node);
- `largest`: the largest size in [1, limit] that fits (galloping, then bisection);
- `fewest_ranks`: the smallest power of two of GPUs in [smallest, MAX_RANKS] that fits (bisection);
- `TraceSession`: the config resolved and the precision resolved once (`resolve_precision`), then exact traces of
  sized variants of the run, cached per spec, the heap refrozen after each;
- `compared_bytes`, `within`, `basis_text`: the verdict against a budget (peak reserved when there is one, else
  peak allocated), and its wording;
- `evaluate`: one exact trace's `FitPoint` against a budget, on a CUDA target by the allocator replay under it
  (`fit`'s verdict, and the one that picks a pipeline's failing stage).

The tracer and the tables are imported when a session traces, not with this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable, Iterator

if TYPE_CHECKING:
    from .spec import RunSpec

SEQ_STEP = 64  # the sequence nodes are SEQ_STEP * (1, 2, 3, 4), smaller when the model is shorter
MAX_RANKS = 1024  # the largest FSDP world size `fit` and the `fsdp` lever try


class Curve:
    """Each storage's bytes as a polynomial of the size, from exact traces at equally spaced nodes (Newton's
    forward differences in integers): `degree` + 1 nodes determine it, the others check it.

    `nodes`: the sizes traced (batch or sequence), equally spaced, at least `degree` + 1 of them; `tables`: their
    exact traces (`tables.StepTables`, in the order of `nodes`, `aligned` with each other); the first is the base
    whose storage table `rows_at` returns with other bytes. Bytes are ints (int64 numpy arrays)."""

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
        """The base table with each storage's bytes at size x (shapes are the base trace's: not reported), or
        None when the bytes are not polynomial there (`bytes_at`)."""
        sizes = self.bytes_at(x)
        if sizes is None:
            return None
        return tuple(r if r.nbytes == n else replace(r, nbytes=n) for r, n in zip(self.base.table, sizes.tolist()))


def same_bytes(sizes, tables) -> bool:
    """Whether interpolated `sizes` (`Curve.bytes_at`; None: not polynomial) are the bytes of the exact trace
    `tables` (`tables.StepTables`), storage by storage."""
    return sizes is not None and sizes.tolist() == [r.nbytes for r in tables.table]


def aligned(a, b) -> bool:
    """Whether two exact traces (`tables.StepTables`) record the same structure: the same ops (names, phases,
    reads, allocations, frees) and the same storages (all but their bytes and shapes)."""
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


def largest(fits: Callable[[int], bool], start: int, limit: int) -> int:
    """The largest x in [1, limit] with fits(x) (assumed monotone), 0 when none: from `start`, galloping up, then
    bisection."""
    if limit < 1:
        return 0
    start = min(start, limit)
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


def _compared(allocated: int, reserved: int | None) -> int:
    return reserved if reserved is not None else allocated


def compared_bytes(peaks) -> int:
    """The bytes a budget is compared with, as the fit verdict compares the device's capacity: `peaks`' peak
    reserved (the caching-allocator model, CUDA target) when it has one, else its peak allocated. `peaks`: anything
    with `peak_allocated_bytes` and `peak_reserved_bytes` (a MemoryReport, a `tables.Outcome`)."""
    return _compared(peaks.peak_allocated_bytes, peaks.peak_reserved_bytes)


def within(allocated: int, reserved: int | None, budget: int) -> bool:
    """The verdict: whether the compared bytes (`reserved` when known, else `allocated`) are at most `budget`."""
    return _compared(allocated, reserved) <= budget


def fits_budget(peaks, budget: int) -> bool:
    """The verdict of `peaks` (as in `compared_bytes`) against `budget`."""
    return within(peaks.peak_allocated_bytes, peaks.peak_reserved_bytes, budget)


def basis_text(peaks) -> str:
    """The wording of what `compared_bytes(peaks)` compares."""
    return "peak reserved" if peaks.peak_reserved_bytes is not None else "peak allocated"


@dataclass(frozen=True, slots=True)
class FitPoint:
    """The peak at one size (`x`: batch or sequence; a rank count, ZeRO stage, pipeline depth or stage), exact
    (traced) or interpolated; `fits` by the verdict (`evaluate`)."""

    x: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int | None  # the unbounded replay's (CUDA target)
    fits: bool
    exact: bool
    # the replay under the budget (CUDA target, when the allocated bytes fit): its peak reserved bytes and the cache
    # releases (cudaMalloc retries) its steady step needs
    reserved_at_capacity: int | None = None
    alloc_retries: int | None = None


def evaluate(tables, x: int, cuda: bool, budget: int, exact: bool, rows: tuple | None = None) -> FitPoint:
    """The point at size `x` of an exact trace `tables` (`tables.StepTables`), over `rows` (its storage table with
    other sizes, interpolated) when given: peak allocated (on a CUDA target the allocator replay's); on a CUDA target
    the unbounded replay's peak reserved and, when the allocated bytes fit `budget`, the replay under `budget`
    (`pressure.replay_at_capacity`), whose verdict is the point's; on the CPU target peak allocated at most `budget`.
    The one verdict of `fit` (every axis), of a pipeline's stages (pp_stages.py `failing_stage`) and so of the
    stage a --pp report shows. Bytes are ints."""
    from .analysis.pressure import replay_at_capacity

    steady = tables.timeline(rows)
    allocated = steady.peak_bytes
    if not cuda:
        return FitPoint(x, allocated, None, within(allocated, None, budget), exact)
    first = tables.timeline(rows, 0)
    unbounded = tables.replay(rows)
    if allocated > budget:  # certain failure: the replay could not hold even the live bytes
        return FitPoint(x, unbounded.peak_allocated_bytes, unbounded.peak_reserved_bytes, False, exact)
    v = replay_at_capacity(first, steady, budget, tables.alloc_conf, unbounded)
    # peak allocated as memory_allocated() counts it (unsplit block remainders included): the unbounded replay's,
    # as the report's
    return FitPoint(x, unbounded.peak_allocated_bytes, unbounded.peak_reserved_bytes, v.fits, exact,
                    v.peak_reserved_bytes, v.alloc_retries)


def resolve_precision(spec: RunSpec, resolved) -> tuple[RunSpec, str]:
    """(`spec` with its precision resolved, where it came from): --precision, the config's `stored` dtype, a local
    checkpoint's dtype, or the default (`tracer/checkpoint_headers.py::precision_for`). `resolved`: the
    `tracer.loading.ResolvedConfig` of `spec.model`. The one place the run's precision is written into its spec."""
    from .tracer.checkpoint_headers import precision_for

    precision, source = precision_for(spec, resolved)
    return replace(spec, precision=precision), source


@dataclass(frozen=True, slots=True)
class Trace:
    """One exact trace: its `tables.StepTables` and the number of layers in the model's checkpointable stack. A
    --pp stage that is not the one reported keeps only its `digest` (`pp_stages.StageDigest`: its figures, its
    lever outcome and its verdict), `tables` None: a 70B pipeline's eight stage tables held at once were most of
    the run's memory."""

    tables: object
    num_layers: int
    digest: object = None


@dataclass(slots=True)
class TraceSession:
    """Exact traces of sized variants of one run. `spec`: the run with its precision resolved
    (`resolve_precision`); `resolved`: its resolved config; `say`: progress; `heap`: the open
    `FrozenHeap`, refrozen after each trace. `traces`: the exact traces kept, by spec; `found`: outcomes
    read from the lever disk cache instead of traced (`levers.LeverDiskCache`), by spec."""

    spec: RunSpec
    resolved: object
    say: Callable[[str], None]
    heap: object
    precision_source: str = ""
    traces: dict = field(default_factory=dict)
    found: dict = field(default_factory=dict)

    @classmethod
    def start(cls, spec: RunSpec, say: Callable[[str], None], heap) -> "TraceSession":
        """Resolve `spec.model`'s config (before torch is imported) and the run's precision. Raises ModelLoadError."""
        from .tracer.loading import resolve_config

        resolved = resolve_config(spec.model)
        spec, source = resolve_precision(spec, resolved)
        return cls(spec, resolved, say, heap, source)

    def load(self, spec: RunSpec):
        """The `tracer.building.LoadedModel` of `spec` built on meta (not kept)."""
        from .tracer.building import load_model

        return load_model(spec, self.resolved)

    def record(self, spec: RunSpec, loaded, progress: Callable[[str], None] | None = None):
        """The `tables.StepTables` of `spec`'s step traced on `loaded` (not kept, the heap not refrozen)."""
        from .tables import step_tables

        return step_tables(spec, loaded, progress=progress)

    def fresh(self, spec: RunSpec) -> Trace:
        """`spec` built and traced now (not kept); the heap refrozen after, also when the trace raises."""
        try:
            loaded = self.load(spec)
            return Trace(self.record(spec, loaded), loaded.num_layers)
        finally:
            self.heap.refreeze()

    def trace(self, spec: RunSpec, message: str | None = None) -> Trace:
        """The exact trace of `spec`, made once (saying `message` then) and kept in `traces`."""
        if spec not in self.traces:
            if message:
                self.say(message)
            self.traces[spec] = self.fresh(spec)
        return self.traces[spec]

    def outcomes(self, cuda: bool) -> dict:
        """{spec: `tables.Outcome`} of the traces kept and the outcomes found, for a lever search to start from."""
        from .tables import outcome

        made = {s: outcome(t.tables, t.num_layers, cuda) if t.tables is not None else t.digest.outcome
                for s, t in self.traces.items()}
        return {**made, **self.found}


class FrozenHeap:
    """While open, the objects that existed at `__enter__` and at each `refreeze()` are moved out of the cyclic
    garbage collector's reach (`gc.freeze`); on exit they are put back (`gc.unfreeze`). When the caller had frozen
    objects itself it does nothing, so the collector's state is left as it was.

    A trace makes and drops hundreds of thousands of small objects, so the collector runs full (generation 2)
    collections, each walking every object torch and transformers hold (~0.3 s for Llama-2-7b's analysis). Frozen,
    those are not walked; the objects the trace makes are collected as before (some storages are held by
    reference cycles, e.g. selective checkpointing's caches, and die when the collector runs, as in the real
    step: pausing the collector instead kept them alive and over-predicted those runs by up to 11%)."""

    def __enter__(self):
        import gc

        self.owner = gc.get_freeze_count() == 0
        self.refreeze()
        return self

    def refreeze(self) -> None:
        """Freeze what exists now as well (call after torch and transformers have been imported)."""
        import gc

        if self.owner:
            gc.freeze()

    def __exit__(self, *exc) -> None:
        import gc

        if self.owner:
            gc.unfreeze()


@contextmanager
def frozen_session(spec: "RunSpec", say: Callable[[str], None]) -> Iterator[TraceSession]:
    """The `TraceSession` of `spec` (`TraceSession.start`) with the heap frozen while it is open (`FrozenHeap`):
    what `pipeline.trace_session`, `fit` and `sweep` open. Raises what `TraceSession.start` raises."""
    with FrozenHeap() as heap:
        yield TraceSession.start(spec, say, heap)
