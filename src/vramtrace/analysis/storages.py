"""The storage table: one row per storage of the recorded step, from the tracer's raw records. Pure data.

For each storage: its category, its last use (the last op reading or writing it) and the op after which eager
frees it under the chosen training loop. The trace releases the model's outputs as the trainer loop does and
records where the other loops would release them (`tracer/records.py::MicroMarks`); a storage the loop holds
(`held_as`) dies at the later of where it was freed and where its loop releases it:

- trainer: where it was freed (the output object dies when the loss is taken);
- function: at the end of the micro-step's `train_step` (`body_end`);
- script: `outputs` when the next micro-step's forward has returned, `loss` when the next loss is taken; the
  last micro-step's are held past the recording.

Holding a reference can only delay a free, so this is exact for the loop's code (tests compare it with real runs
of each loop and with the script loop traced as written).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Protocol

from .categories import Category

LOOPS = ("trainer", "function", "script")


@dataclass(frozen=True, slots=True, kw_only=True)
class StorageInfo:
    """One storage. `op_index` -1: alive at step start. `free_after`: index of the last op completed when eager
    frees it, None if it outlives the recording. `last_use`: last op reading or writing it (-1: none). `free_rank`:
    its place among the storages freed after the same op, in the order they died (0: first)."""

    sid: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    device: str  # 'meta' (the target device) or 'cpu' (host tensors such as optimizer step counters)
    category: Category
    op_index: int
    op: str
    module: str
    phase: str
    name: str
    free_after: int | None
    last_use: int
    free_rank: int = 0


class _Op(Protocol):
    index: int
    phase: str
    step: int
    reads: tuple[int, ...]
    allocates: tuple[int, ...]
    frees: tuple[int, ...]


class _Marks(Protocol):
    micro: int
    forward_returned: int
    loss_taken: int
    body_end: int


def release_point(held_as: str, micro: int, loop: str, marks: dict[int, _Marks]) -> int | None:
    """The op index after which `loop` drops its reference to micro-step `micro`'s `held_as` ('outputs', 'loss', or
    'graph': a leaf of the loss's autograd graph that is not a parameter, or its gradient, which the loss keeps);
    -1 for the trainer loop (no reference past the trace's own); None: held past the recording. Raises ValueError
    for an unknown loop."""
    if loop == "trainer":
        return -1
    if loop == "function":
        return marks[micro].body_end
    if loop == "script":
        nxt = marks.get(micro + 1)
        if nxt is None:
            return None
        return nxt.forward_returned if held_as == "outputs" else nxt.loss_taken
    raise ValueError(f"unknown loop {loop!r}; choose one of: {', '.join(LOOPS)}")


def storage_table(ops: Iterable[_Op], storages: Iterable, marks: Iterable[_Marks] = (),
                  loop: str = "trainer") -> tuple[StorageInfo, ...]:
    """The StorageInfo rows of `storages` (raw records with `tracer/records.py::RecStorage`'s fields, `sid` ==
    position) over `ops` (`index` == position) for
    `loop`. Categories: the recorded one (parameter, gradient, optimizer state, input, autocast weights, KV
    cache); else activation (saved by autograd, or born in a forward and kept into a backward); else outputs
    (held by the loop); else kept_across_steps (born in one step, alive in the next); else temporary."""
    ops = list(ops)
    by_micro = {m.micro: m for m in marks}
    last_use: dict[int, int] = {}
    free_after: dict[int, int] = {}
    free_rank: dict[int, int] = {}
    for o in ops:
        for sid in o.reads:
            last_use[sid] = o.index
        for sid in o.allocates:
            last_use[sid] = o.index
        for rank, sid in enumerate(o.frees):
            free_after[sid], free_rank[sid] = o.index, rank
    rows = []
    for s in storages:
        free = free_after.get(s.sid)
        if s.held_as and free is not None and s.op_index >= 0:
            point = release_point(s.held_as, s.held_micro, loop, by_micro)
            free = None if point is None else max(free, point)
        cat = s.category
        if cat is None:
            died = ops[free] if free is not None else None
            kept = s.phase == "forward" and died is not None and died.phase == "backward"
            if s.saved or kept:
                cat = Category.ACTIVATION
            elif s.held_as in ("outputs", "loss"):
                cat = Category.OUTPUTS
            elif s.op_index >= 0 and (died is None or died.step > ops[s.op_index].step):
                cat = Category.KEPT
            else:
                cat = Category.TEMPORARY
        rows.append(StorageInfo(
            sid=s.sid, nbytes=s.nbytes, dtype=s.dtype, shape=s.shape, device=s.device, category=Category(cat),
            op_index=s.op_index, op=s.op, module=s.module, phase=s.phase if s.op_index >= 0 else "start",
            name=s.name, free_after=free, last_use=last_use.get(s.sid, -1),
            free_rank=free_rank.get(s.sid, 0) if free == free_after.get(s.sid) else 0))
    return tuple(rows)


def loop_peaks(steady, ops, storages: Iterable, marks: Iterable[_Marks], loop: str, counted_devices,
               block_bytes: int = 1) -> dict[str, int]:
    """The steady-state peak bytes of every loop in `LOOPS`, from `steady` (the Timeline of `loop`'s table): only
    the storages a loop holds change their lifetimes, so each other loop's curve is `steady`'s plus the moved
    lifetimes (`liveness.peak_with`)."""
    from .liveness import interval, peak_with, round_block

    ops = list(ops)
    by_micro = {m.micro: m for m in marks}
    free_after = {sid: o.index for o in ops for sid in o.frees}
    first_op, last_op = steady.steps[0], steady.steps[-1]
    held = [s for s in storages if s.held_as and s.op_index >= 0 and s.device in counted_devices
            and round_block(s.nbytes, block_bytes) > 0]

    def span(s, which: str):
        free = free_after.get(s.sid)
        if free is not None:
            point = release_point(s.held_as, s.held_micro, which, by_micro)
            free = None if point is None else max(free, point)
        return interval(s.op_index, free, first_op, last_op)

    out = {}
    for other in LOOPS:
        changes = [(round_block(s.nbytes, block_bytes), span(s, loop), span(s, other)) for s in held]
        out[other] = steady.peak_bytes if other == loop else peak_with(steady, changes)
    return out
