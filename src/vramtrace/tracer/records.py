"""Plain records of one recorded step: ops and storages, as the dispatch-level recorder writes them.

Torch-free, so that layer replication (`replication.py`) and tests can work on hand-built records.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class RecStorage:
    """One storage. `op_index` -1: alive at step start (parameter, buffer, input, optimizer state).
    `nbytes` is the storage's size in bytes (int); `device` is 'meta' (the target) or 'cpu' (host tensors)."""

    sid: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    device: str
    op_index: int
    op: str
    module: str
    phase: str
    category: str | None = None  # set for pre-existing storages, gradients, optimizer state
    name: str = ""
    saved: bool = False  # saved for backward by autograd (an activation)


@dataclass(slots=True)
class RecOp:
    """One aten op as it ran. `ins`: storage ids of its tensor arguments (flattened, in order); `outs`: storages
    it allocated; `frees`: storages eager freed right after it; `lead`: how many tensors its first argument
    holds (a foreach op's first list; 1 for a tensor, 0 otherwise); `flops`: its FLOPs by
    `torch.utils.flop_counter`'s formulas (0 for ops it has none for); `recompute`: it re-runs a checkpointed
    forward in the backward."""

    index: int
    name: str
    phase: str
    module: str
    ins: tuple[int, ...]
    outs: tuple[int, ...]
    frees: tuple[int, ...] = ()
    lead: int = 0
    flops: int = 0
    recompute: bool = False
