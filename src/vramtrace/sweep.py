"""`vramtrace fit MODEL --sweep B1,B2,..xS1,S2,..`: the peak at every (batch, sequence) of a grid.

The same construction as `fit` (`vramtrace/fit.py`), in two sizes at once. Exact traces at batch 2, 3 and sequence
h, 2h, 3h (h = 64, or less for short models) give each storage's bytes as a parabola in the sequence at batch 2
and at batch 3 (`search.Curve`); between them it is linear in the batch. Checked by an exact trace at (4, 4h). A grid
point's peak allocated is the liveness sum of the interpolated bytes (block-rounded) over the recording's
lifetimes, vectorised with numpy in int64 (exact: no float). Batch 1 has its own recording (a reshape that is a
view at batch 1 copies at 2 and more), so its own parabola from exact traces at batch 1 and the same sequences,
checked at 4h (else traced at each sequence). On a CUDA target the caching-allocator model is replayed
at the points whose allocated bytes fit (where allocated does not, reserved cannot). When the structures differ
or a storage is not polynomial, every point is traced exactly, and the result says so.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from .errors import UsageError
from .search import SEQ_STEP, Curve, TraceSession, aligned, frozen_session, same_bytes, within
from .spec import Device, RunSpec

MAX_POINTS = 10_000


@dataclass(frozen=True, slots=True)
class SweepPoint:
    batch: int
    seq: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int | None  # CUDA target, where the allocated bytes fit (else None)
    fits: bool | None  # None: no capacity to check against
    exact: bool


@dataclass(frozen=True, slots=True)
class SweepResult:
    batches: tuple[int, ...]
    seqs: tuple[int, ...]
    budget_bytes: int | None
    points: tuple[SweepPoint, ...]
    method: str
    traces: int

    def to_dict(self) -> dict:
        return {"batches": list(self.batches), "seqs": list(self.seqs), "budget_bytes": self.budget_bytes,
                "method": self.method, "traces": self.traces,
                "points": [{f: getattr(p, f) for f in p.__dataclass_fields__} for p in self.points]}


def parse_grid(text: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """'1,2,4x512,1024' -> ((1, 2, 4), (512, 1024)). Raises UsageError."""
    left, sep, right = text.replace(" ", "").lower().partition("x")
    try:
        batches = tuple(sorted({int(b) for b in left.split(",") if b}))
        seqs = tuple(sorted({int(s) for s in right.split(",") if s}))
    except ValueError:
        batches = seqs = ()
    if not sep or not batches or not seqs or min(batches) < 1 or min(seqs) < 1:
        raise UsageError(f"bad --sweep {text!r}; write batches x sequences, e.g. 1,2,4,8x512,1024,2048")
    if len(batches) * len(seqs) > MAX_POINTS:
        raise UsageError(f"--sweep {text!r} has {len(batches) * len(seqs):,} points; at most {MAX_POINTS:,}")
    return batches, seqs


def sweep(spec: RunSpec, batches: tuple[int, ...], seqs: tuple[int, ...], headroom: float = 0.0,
          progress: Callable[[str], None] | None = None) -> SweepResult:
    """The peak of `spec` at every (batch, seq) of `batches` × `seqs`, checked against `spec.capacity` less
    `headroom` and the CUDA context when there is one. Raises UsageError, and what `analyze` raises."""
    say = progress or (lambda _m: None)
    budget = None
    if spec.capacity is not None:
        budget = int(spec.capacity[1] * (1 - headroom)) - spec.cuda_context
    with frozen_session(spec, say) as session:
        return _sweep(_Grid(session, budget), batches, seqs)


class _Grid:
    """The state of one sweep: the session of its exact traces, the budget (None: no capacity), the curves by batch
    (2 and 3: the parabolas in the sequence the other batches interpolate between; 1: batch 1's own) and each
    recording's lifetimes as arrays (`peak_of`)."""

    def __init__(self, session: TraceSession, budget: int | None):
        self.session, self.spec, self.budget = session, session.spec, budget
        self.cuda = self.spec.device is Device.CUDA
        self.exact: dict[tuple[int, int], object] = {}
        self.curves: dict[int, Curve] = {}
        self.structure: dict[int, tuple] = {}  # 1 (batch 1's recording) or 2 (the others'): lifetimes as arrays
        self.ones_base: tuple[int, int] | None = None  # the trace whose recording batch 1's sizes are of
        self.base: tuple[int, int] | None = None  # the others'

    def trace(self, b: int, s: int):
        if (b, s) not in self.exact:
            sized = replace(self.spec, batch=b, seq=s)
            self.exact[(b, s)] = self.session.trace(sized, f"exact trace at batch {b}, seq {s}").tables
        return self.exact[(b, s)]

    def verdict(self, alloc: int, reserved: int | None) -> bool | None:
        return None if self.budget is None else within(alloc, reserved, self.budget)

    def exact_point(self, b: int, s: int) -> SweepPoint:
        alloc, reserved = self.trace(b, s).peaks(cuda=self.cuda)
        return SweepPoint(b, s, alloc, reserved, self.verdict(alloc, reserved), True)

    def interpolated(self, b: int, s: int):
        if b == 1:
            return self.curves[1].bytes_at(s) if 1 in self.curves else None
        y2, y3 = self.curves[2].bytes_at(s), self.curves[3].bytes_at(s)
        return None if y2 is None or y3 is None else y2 + (b - 2) * (y3 - y2)

    def point(self, b: int, s: int, sizes) -> SweepPoint:
        """The interpolated point at (b, s) whose storages' bytes are `sizes`. On a CUDA target where the
        allocated bytes do not fit, reserved is unknown (None) and the verdict False (reserved cannot fit)."""
        alloc, reserved = self.peak_of(b, sizes)
        return SweepPoint(b, s, alloc, reserved, self.verdict(alloc, reserved), False)

    def _arrays(self, key: int) -> tuple:
        import numpy as np

        from .analysis.allocator import ReplaySchedule

        t = self.exact[self.ones_base if key == 1 else self.base]
        unit = tuple(replace(r, nbytes=1) for r in t.table)  # every storage on the timelines, even at 0 bytes
        first, steady = t.timeline(unit, 0), t.timeline(unit)
        index = {r.sid: i for i, r in enumerate(t.table)}
        schedule = ReplaySchedule.of(first, steady) if self.cuda else None
        return (np.array([index[lt.sid] for lt in steady.lifetimes], dtype=np.int64),
                np.array([lt.birth for lt in steady.lifetimes], dtype=np.int64),
                np.array([lt.death for lt in steady.lifetimes], dtype=np.int64), len(steady.steps),
                t.block, schedule, schedule and np.array([index[sid] for sid in schedule.sids], dtype=np.int64))

    def peak_of(self, b: int, sizes) -> tuple[int, int | None]:
        """(peak allocated, peak reserved on a CUDA target when the allocated bytes fit, else None) of the
        recording of batch b with `sizes` as its storages' bytes: the liveness sum of `StepTables.peaks`
        vectorised, and the same allocator replay (`ReplaySchedule`) without rebuilding the timelines; on a CUDA
        target when they fit, peak allocated is the replay's (unsplit block remainders included)."""
        import numpy as np

        key = 1 if b == 1 else 2
        if key not in self.structure:
            self.structure[key] = self._arrays(key)
        rows, births, deaths, n, block, schedule, replay_rows = self.structure[key]
        if block > 1:  # liveness.round_block, vectorised
            sizes = np.where(sizes > 0, -(-sizes // block) * block, 0)
        nbytes = sizes[rows]
        diff = np.zeros(n + 1, dtype=np.int64)
        np.add.at(diff, births, nbytes)
        np.add.at(diff, deaths + 1, -nbytes)
        alloc = int(np.cumsum(diff)[:-1].max())
        if not self.cuda or (self.budget is not None and alloc > self.budget):
            return alloc, None
        est = schedule.replay(sizes[replay_rows].tolist(), conf=self.exact[self.base].alloc_conf)
        return est.peak_allocated_bytes, est.peak_reserved_bytes  # as `StepTables.peaks` on a CUDA target


def _curves(g: _Grid, batches, s_nodes: tuple[int, ...], h: int) -> str:
    """Trace the nodes (batch 2, 3 × `s_nodes`, and (4, 4h)) and set `g.curves` (batch 1's too when it is swept
    and its own parabola checks at 4h); '' when the grid can be interpolated, else why not."""
    nodes = [(b, s) for b in (2, 3) for s in s_nodes] + [(4, 4 * h)]
    for b, s in nodes:
        g.trace(b, s)
    g.base = nodes[0]
    base = g.exact[g.base]
    if not all(aligned(base, g.exact[n]) for n in nodes[1:]):
        return "the recordings at the nodes differ in structure"
    g.curves = {b: Curve(s_nodes, [g.exact[(b, s)] for s in s_nodes], 2) for b in (2, 3)}
    if 1 in batches:  # batch 1 has its own structure: its own parabola in the sequence
        ones = [g.trace(1, s) for s in (*s_nodes, 4 * h)]
        g.ones_base = (1, s_nodes[0])
        if all(aligned(ones[0], t) for t in ones[1:]):
            curve = Curve(s_nodes, ones[:3], 2)
            if same_bytes(curve.bytes_at(4 * h), ones[3]):
                g.curves[1] = curve
    if not same_bytes(g.interpolated(4, 4 * h), g.exact[(4, 4 * h)]):
        return "a storage's bytes are not linear in the batch and quadratic in the sequence (checked at (4, 4h))"
    return ""


def _sweep(g: _Grid, batches, seqs) -> SweepResult:
    model = g.session.load(replace(g.spec, seq=SEQ_STEP))
    limit = getattr(getattr(model.model, "config", None), "max_position_embeddings", None) or 1 << 20
    if max(seqs) > limit:
        raise UsageError(f"--sweep sequence {max(seqs)} is past the model's max_position_embeddings ({limit})")
    h = min(SEQ_STEP, max(1, limit // 4))
    s_nodes = (h, 2 * h, 3 * h)
    why = _curves(g, batches, s_nodes, h)
    points = []
    for b in batches:
        for s in seqs:
            sizes = None if why or (b, s) in g.exact else g.interpolated(b, s)
            points.append(g.exact_point(b, s) if sizes is None else g.point(b, s, sizes))
    ones = ("; batch 1 from its own traces at the same sequences, checked at " + str(4 * h) if 1 in g.curves
            else "; batch 1 traced at each sequence" if 1 in batches else "")
    method = (f"every point traced ({why})" if why else
              f"interpolated from exact traces at batch 2, 3 × seq {', '.join(map(str, s_nodes))}, checked at "
              f"(4, {4 * h}){ones}")
    return SweepResult(tuple(batches), tuple(seqs), g.budget, tuple(points), method, len(g.exact))
