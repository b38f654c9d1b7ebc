"""Plain records of one recorded step: ops and storages, as the dispatch-level recorder writes them.

Torch-free, so that layer replication (`replication.py`) and tests can work on hand-built records.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


# The pseudo-op of a compiled graph's buffer that takes over a dying buffer's storage (Inductor's `# reuse` lines;
# recorder.py `StepRecorder.storage_reused`): a birth that an allocation (`ALLOCATION_OP`) makes elsewhere.
REUSE_OP = "inductor.reuse"
ALLOCATION_OP = "aten.empty_strided.default"  # how a compiled graph's buffers are allocated (compiled.run_program)
# the storage name of a zero gradient that the autograd.Function running a compiled backward materializes for an
# output no loss depends on (compiled_step.CompiledStepRecorder)
ZERO_GRADIENT_NAME = "AOTAutograd zero gradient of a graph output"  # its first word labels it in the by-layer table


class Phase(str, enum.Enum):
    """The part of the step an op runs in (`tracer/step.py` runs them in this order)."""

    FORWARD = "forward"  # the model's forward and the loss (under autocast for a mixed precision)
    BACKWARD = "backward"  # loss.backward() (the scaled loss under a GradScaler)
    CLIP = "clip_grad_norm"  # GradScaler.unscale_ and torch.nn.utils.clip_grad_norm_
    OPTIMIZER = "optimizer"  # optimizer.step() (through GradScaler.step) and GradScaler.update()
    ZERO_GRAD = "zero_grad"
    STEP = "step"  # a user step function's own code outside the phases above (an EMA update, logging)

    def __str__(self) -> str:
        return self.value


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
    # the loop's own reference: 'outputs' (reachable from the model's output object) or 'loss', and the
    # micro-step (counted over the whole recording) whose variable it is; '' when the loop holds none
    held_as: str = ""
    held_micro: int = -1

    def copy(self, sid: int, name: str, module: str, op_index: int, held_micro: int) -> RecStorage:
        """This record as storage `sid` with the given name, module, birth and loop micro-step (what layer
        replication and step replay change; `dataclasses.replace` is several times slower on 10^4 records)."""
        return RecStorage(sid, self.nbytes, self.dtype, self.shape, self.device, op_index, self.op, module,
                          self.phase, self.category, name, self.saved, self.held_as, held_micro)


@dataclass(slots=True)
class RecOp:
    """One aten op as it ran. `ins`: storage ids of its tensor arguments (flattened, in order); `outs`: storages
    it allocated; `frees`: storages eager freed right after it; `lead`: how many tensors its first argument
    holds (a foreach op's first list; 1 for a tensor, 0 otherwise); `flops`: its FLOPs by
    `torch.utils.flop_counter`'s formulas (0 for ops it has none for); `recompute`: it re-runs a checkpointed
    forward in the backward; `step`: which step of the recording (0: the first, 1: the steady state); `micro`:
    its micro-step within that step (gradient accumulation)."""

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
    step: int = 0
    micro: int = 0


@dataclass(frozen=True, slots=True)
class OpInfo:
    """One op of the finished recording (`RecOp` after layer replication), frozen: `reads` are the storage ids
    of its tensor arguments, `allocates` the storages it allocated, `frees` those eager freed right after it."""

    index: int
    name: str  # aten overload, e.g. 'aten.mm.default'
    phase: Phase
    module: str  # qualified module path ('' for the root), 'optimizer' in the optimizer step
    reads: tuple[int, ...] = ()
    allocates: tuple[int, ...] = ()
    flops: int = 0  # torch.utils.flop_counter's count for the op (0 where it has no formula)
    recompute: bool = False  # a checkpointed forward op re-run in the backward
    step: int = 0
    micro: int = 0
    frees: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class MicroMarks:
    """Where one micro-step's loop variables could be released, as op indices (the last op completed at that
    moment): `forward_returned` (the model returned `outputs`), `loss_taken` (the loss was computed from it),
    `body_end` (a `train_step` function for this micro-batch returns: after the backward, or after the optimizer
    step on the last micro-step). `micro` counts micro-steps over the whole recording."""

    step: int
    micro: int
    forward_returned: int
    loss_taken: int
    body_end: int
