"""Storage liveness over the step's ops: eager (where eager frees) and graph-optimal (last-use freeing).

Step semantics: the timeline has one step per recorded aten op of the selected phases. A storage is live at
step i when birth <= i <= death. Its birth is the op that allocated it (0 if it existed at step start);
its death is the last op completed before it was freed (the end if it outlives the step). The live bytes at
step i are what the allocator holds while op i runs: everything not yet freed plus op i's outputs.

Byte rounding: `block_bytes` rounds each storage up to the allocator's block; for CUDA 512 B, mirroring
`c10/cuda/CUDACachingAllocator.cpp::round_size` (kMinBlockSize = 512). 0-byte storages allocate nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Protocol

from .categories import PERSISTENT, Category

CUDA_MIN_BLOCK_BYTES = 512  # c10/cuda/CUDACachingAllocator.cpp: kMinBlockSize


def round_block(nbytes: int, block_bytes: int) -> int:
    """Round a request up to the allocator block size (`round_size` in CUDACachingAllocator.cpp)."""
    if nbytes <= 0:
        return 0
    if block_bytes <= 1:
        return nbytes
    return -(-nbytes // block_bytes) * block_bytes


class _Op(Protocol):
    index: int
    phase: str
    step: int


class _Storage(Protocol):
    sid: int
    nbytes: int
    device: str
    category: Category
    op_index: int
    free_after: int | None
    last_use: int


@dataclass(frozen=True, slots=True)
class Lifetime:
    sid: int
    bytes: int  # after block rounding
    birth: int  # timeline step
    death: int  # timeline step, inclusive
    category: Category
    outlives_step: bool = False  # not freed before the step ends (parameters, optimizer state, ...)
    at_start: bool = False  # alive before the first op (not allocated by it)
    free_rank: int = 0  # its place among the storages freed after the same op (storages.StorageInfo.free_rank)


@dataclass(frozen=True, slots=True)
class Timeline:
    """Per-storage lifetimes and the live-bytes curve over `steps` (op indices of the recording, in order)."""

    steps: tuple[int, ...]
    phases: tuple[str, ...]  # phase of each step
    lifetimes: tuple[Lifetime, ...]
    live_bytes: tuple[int, ...]  # while step i runs
    after_bytes: tuple[int, ...]  # after step i's frees (storages that outlive the step stay counted)
    start_bytes: int  # alive before the first op
    peak_bytes: int
    peak_step: int


def interval(op_index: int, free_after: int | None, first_op: int, last_op: int) -> tuple[int, int] | None:
    """(birth, death) positions on the timeline of ops `first_op..last_op` of a storage born at `op_index` (-1: at
    the recording's start) and freed after op `free_after` (None: never), or None when it is not alive during it."""
    if op_index > last_op:
        return None
    if op_index >= first_op:
        birth = op_index - first_op
    elif free_after is None or free_after >= first_op:
        birth = 0
    else:
        return None
    death = last_op - first_op if free_after is None or free_after >= last_op else free_after - first_op
    return birth, death


def peak_with(tl: Timeline, changes: Iterable[tuple[int, tuple[int, int] | None, tuple[int, int] | None]]) -> int:
    """The peak of `tl`'s live bytes after moving some storages' lifetimes: `changes` holds (bytes, old (birth,
    death) or None, new (birth, death) or None) in `tl`'s positions."""
    diff = [0] * (len(tl.live_bytes) + 1)
    for b, old, new in changes:
        if old is not None:
            diff[old[0]] -= b
            diff[old[1] + 1] += b
        if new is not None:
            diff[new[0]] += b
            diff[new[1] + 1] -= b
    acc, peak = 0, 0
    for i, live in enumerate(tl.live_bytes):
        acc += diff[i]
        peak = max(peak, live + acc)
    return peak


def build_timeline(ops: Iterable[_Op], storages: Iterable[_Storage], step: int,
                   counted_devices: tuple[str, ...], block_bytes: int = 1, graph_optimal: bool = False) -> Timeline:
    """Lifetimes of the storages over the ops of recorded step `step` (0: the first step, 1: the steady state).

    A storage born before the step is on the timeline from its start if it is freed within the step or later
    (the optimizer state of the first step, gradients kept by zero_grad(set_to_none=False), the previous outputs
    the script loop holds). With `graph_optimal`, non-persistent storages die at their last use instead of
    where eager frees them. Raises ValueError when the recording has no op of that step.
    """
    ops = list(ops)
    steps = [o.index for o in ops if o.step == step]
    if not steps:
        raise ValueError(f"no ops in step {step}")
    first_op, last_op = steps[0], steps[-1]
    n = len(steps)
    end = n - 1

    def to_pos(k: int | None) -> int:
        if k is None or k >= last_op:
            return end
        return k - first_op if k >= first_op else -1

    lifetimes: list[Lifetime] = []
    start = 0
    for s in storages:
        if s.device not in counted_devices:
            continue
        b = round_block(s.nbytes, block_bytes)
        if b == 0:
            continue
        span = interval(s.op_index, s.free_after, first_op, last_op)
        if span is None:
            continue
        birth, death = span
        existed = s.op_index < first_op
        if graph_optimal and s.category not in PERSISTENT:
            death = min(death, max(to_pos(s.last_use), birth))
        start += b if existed else 0
        outlives = (s.free_after is None or s.free_after > last_op) and death == end
        lifetimes.append(Lifetime(s.sid, b, birth, death, s.category, outlives, existed, getattr(s, "free_rank", 0)))

    diff = [0] * (n + 1)
    diff_after = [0] * (n + 1)
    for lt in lifetimes:
        diff[lt.birth] += lt.bytes
        diff[lt.death + 1] -= lt.bytes
        diff_after[lt.birth] += lt.bytes
        if not lt.outlives_step:
            diff_after[lt.death] -= lt.bytes
    live, after = [], []
    acc = acc_a = 0
    for i in range(n):
        acc += diff[i]
        acc_a += diff_after[i]
        live.append(acc)
        after.append(acc_a)
    peak = max(live)
    names: dict = {}  # str() of an enum member is slow, and a generation has a million ops
    phases = tuple(names.get(p) or names.setdefault(p, str(p)) for p in (ops[i].phase for i in steps))
    return Timeline(tuple(steps), phases, tuple(lifetimes), tuple(live),
                    tuple(after), start, peak, live.index(peak))
