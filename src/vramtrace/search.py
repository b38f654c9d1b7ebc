"""The search machinery `fit`, `sweep` and `levers` share: sizes from a few exact traces, and the searches over them.

Within one model and run, the recording at batch B (or sequence S) has the same ops and storages at every size;
only each storage's bytes change, as a polynomial of low degree (linear in B, at most quadratic in S). So:

- `Curve`: each storage's bytes as a polynomial of the size, from exact traces at equally spaced nodes (Newton's
  forward differences in integers), evaluated exactly at any size;
- `aligned`: whether two exact traces record the same structure (the condition for a `Curve` through them);
- `same_bytes`: whether interpolated bytes are an exact trace's (the check of a `Curve` at a further node);
- `largest`: the largest size in [1, limit] that fits (galloping, then bisection);
- `fewest_ranks`: the smallest power of two of GPUs in [smallest, MAX_RANKS] that fits (bisection).

The traces themselves (`tables.StepTables`) are made by the callers; this module imports none of them.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

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
