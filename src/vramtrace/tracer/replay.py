"""The steady step's forward and backward, replayed from the first step's record instead of traced again.

With `zero_grad(set_to_none=True)` and no GradScaler, micro-step m of the steady step runs the same forward and
backward as micro-step m of the first step: the same ops on the same parameters and inputs, every gradient
made afresh. The trace records the first step, then for the steady step copies those ops and storages (new
storage ids, births and frees shifted to the new op indices) and gives each parameter a fresh meta `.grad`
adopted as the copy of its recorded gradient, so that the optimizer step that follows runs on real tensors and
its reads and frees land on the copies. That halves the cost of recording a two-step training trace.

A micro-step is replayed only when its record shows it is self-contained (`replayable`): everything it reads
or frees existed before the first step or was made by an earlier micro-step of the same step, and everything it
made and left alive is a parameter's gradient. Anything else (a module that caches a tensor on its first call,
a storage the first step frees that the steady step would not find) makes the trace run the micro-step for
real. `tests/test_replay.py` checks that replayed and fully traced recordings are identical.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import _disable_current_modes

from .recorder import StepRecorder
from .records import RecOp


@dataclass(frozen=True, slots=True)
class GradRecord:
    """One parameter's `.grad` after a micro-step's backward: its storage id, and its layout to remake it."""

    param: torch.nn.Parameter
    sid: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True, slots=True)
class MicroRecord:
    """Where one micro-step's forward and backward lie in the recording: ops [op_start, op_end), storages
    registered [sid_start, sid_end), its release marks (absolute op indices), its micro-step count over the
    recording, and the gradients it left."""

    op_start: int
    op_end: int
    sid_start: int
    sid_end: int
    forward_returned: int
    loss_taken: int
    micro_count: int
    grads: tuple[GradRecord, ...]


def capture(rec: StepRecorder, params: list[torch.nn.Parameter], op_start: int, sid_start: int,
            marks: dict[str, int], micro_count: int) -> MicroRecord | None:
    """The record of the micro-step whose backward just returned, or None when a gradient's storage is unknown."""
    grads = []
    for p in params:
        g = p.grad
        if g is None:
            continue
        sid = rec.live_sid(g)
        if sid is None:
            return None
        grads.append(GradRecord(p, sid, tuple(g.shape), tuple(g.stride()), g.dtype))
    return MicroRecord(op_start, len(rec.ops), sid_start, len(rec.storages), marks["forward_returned"],
                       marks["loss_taken"], micro_count, tuple(grads))


def replayable(rec: StepRecorder, r: MicroRecord, first_sid: int, step_map: dict[int, int]) -> bool:
    """Whether micro-step record `r` can stand for the same micro-step of a later step: each storage it reads or
    frees was registered before the first step (sid < `first_sid`, and then not freed) or is in `step_map`
    (made by an earlier micro-step of the same step, already replayed); each storage it made and left alive
    is one of its gradients."""
    grad_sids = {g.sid for g in r.grads}
    for s in range(r.sid_start, r.sid_end):
        f = rec.free_after.get(s)
        if (f is None or f >= r.op_end) and s not in grad_sids:
            return False  # made and kept (a cache, a buffer made on the first call): the later step would not
    for g in grad_sids:
        if not (r.sid_start <= g < r.sid_end or g in step_map):
            return False
    freed_here = {s for s, f in rec.free_after.items() if r.op_start <= f < r.op_end}
    for s in freed_here:
        if not (r.sid_start <= s < r.sid_end or s in step_map):
            return False
    for i in range(r.op_start, r.op_end):
        for s in rec.ops[i].ins:
            if not (s < first_sid or r.sid_start <= s < r.sid_end or s in step_map):
                return False
    return True


def replay(rec: StepRecorder, r: MicroRecord, step: int, micro: int, micro_count: int,
           step_map: dict[int, int]) -> dict[str, int]:
    """Append copies of `r`'s ops and storages to `rec` as step `step`, micro-step `micro` (`micro_count` over
    the recording), extend `step_map` (recorded sid -> its copy), and give each parameter the fresh meta
    `.grad` that stands for its copied gradient. Returns the copy's release marks. Call `replayable` first."""
    shift = len(rec.ops) - r.op_start
    smap = {s: len(rec.storages) + (s - r.sid_start) for s in range(r.sid_start, r.sid_end)}
    for s in range(r.sid_start, r.sid_end):
        old = rec.storages[s]
        held = micro_count if old.held_micro == r.micro_count else old.held_micro
        rec.storages.append(old.copy(smap[s], old.name, old.module, old.op_index + shift, held))
    freed_earlier = []  # copies made by an earlier micro-step of this step and freed here (out-of-place sums)
    for s, f in list(rec.free_after.items()):
        if r.op_start <= f < r.op_end:
            if s in smap:
                rec.free_after[smap[s]] = f + shift
            else:
                rec.free_after[step_map[s]] = f + shift
                freed_earlier.append(step_map[s])
    step_map.update(smap)

    def m(s: int) -> int:
        return step_map.get(s, s)

    for i in range(r.op_start, r.op_end):
        o = rec.ops[i]
        rec.ops.append(RecOp(i + shift, o.name, o.phase, o.module, tuple(m(s) for s in o.ins),
                             tuple(m(s) for s in o.outs), (), o.lead, o.flops, o.recompute, step, micro))
    freed = set(freed_earlier)
    for g in r.grads:
        sid = step_map[g.sid]
        cur = g.param.grad
        if cur is not None:
            if rec.live_sid(cur) == sid:
                continue  # accumulated in place into the gradient the earlier micro-step left
            if rec.live_sid(cur) in freed:
                rec.forget(cur)  # its free is written above, where the record frees it
        with torch._C.DisableTorchFunction(), _disable_current_modes():
            t = torch.empty_strided(g.shape, g.stride, dtype=g.dtype, device="meta")
        rec.adopt(t, sid)
        g.param.grad = t
    return {"forward_returned": r.forward_returned + shift, "loss_taken": r.loss_taken + shift}
