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
    outlives_step: bool = False  # never freed during the recording (parameters, optimizer state, ...)
    at_start: bool = False  # alive before the first op (not allocated by it)


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


def build_timeline(ops: Iterable[_Op], storages: Iterable[_Storage], phases: tuple[str, ...],
                   counted_devices: tuple[str, ...], block_bytes: int = 1, graph_optimal: bool = False,
                   preexisting_categories: frozenset[Category] = frozenset({Category.OPTIMIZER_STATE})) -> Timeline:
    """Lifetimes of the storages over the ops whose phase is in `phases`.

    A storage born in an excluded phase is kept only if its category is in `preexisting_categories` and it
    outlives the recording (the optimizer state created by the first step exists at the start of a steady-state
    step). With `graph_optimal`, non-persistent storages die at their last use instead of where eager frees them.
    """
    ops = list(ops)
    steps = [o.index for o in ops if o.phase in phases]
    if not steps:
        raise ValueError(f"no ops in phases {phases}")
    n_all = (ops[-1].index + 1) if ops else 0
    pos: dict[int, int] = {idx: i for i, idx in enumerate(steps)}
    # last_le[k]: timeline position of the last included op with index <= k (-1 if none)
    last_le = [-1] * n_all
    cur = -1
    for k in range(n_all):
        if k in pos:
            cur = pos[k]
        last_le[k] = cur
    n = len(steps)
    end = n - 1

    def to_pos(k: int | None) -> int:
        if k is None or k >= n_all:
            return end
        return last_le[k] if k >= 0 else -1

    lifetimes: list[Lifetime] = []
    start = 0
    for s in storages:
        if s.device not in counted_devices:
            continue
        b = round_block(s.nbytes, block_bytes)
        if b == 0:
            continue
        existed = s.op_index not in pos
        if not existed:
            birth = pos[s.op_index]
        elif s.op_index < 0 or (s.category in preexisting_categories and s.free_after is None):
            birth = 0
        else:
            continue
        death = to_pos(s.free_after)
        if graph_optimal and s.category not in PERSISTENT:
            death = min(death, max(to_pos(s.last_use), birth))
        if death < birth:  # existed at start, freed before any included op ran
            continue
        start += b if existed else 0
        lifetimes.append(Lifetime(s.sid, b, birth, death, s.category, s.free_after is None and death == end, existed))

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
    return Timeline(tuple(steps), tuple(o.phase for o in ops if o.phase in phases), tuple(lifetimes), tuple(live),
                    tuple(after), start, peak, live.index(peak))
