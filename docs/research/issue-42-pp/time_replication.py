"""Time replication (prototype, issue 42): a pipeline stage's records for M micro-batches rebuilt from a trace of
M' < M, the way `replication.py` rebuilds L layers from 4.

A stage's step (tracer/pipelining.py `pipeline_step`) is a prefix (the schedule chunking its inputs; in the first
step the receive buffers, one per micro-batch: torch/distributed/pipelining/stage.py `_RecvInfo`), a sequence of
micro-step blocks (`F<i>`, `B<i>`, each with the loop ops after it up to the next micro-step: the p2p waits that
free held sends, the last stage's loss), and a suffix (the waits after the last backward, `_update_losses`,
`perform_reduce_grad`'s `scale_grads`, the last stage's `merge_chunks` of every output, the optimizer step).
The block sequence is the schedule's (`block_sequence`: torch/distributed/pipelining/schedules.py
`ScheduleGPipe._step_microbatches` all forwards then all backwards; `Schedule1F1B._step_microbatches` w = min(M,
P - k) warm-up forwards, then (B_i, F_{i+w}) pairs, then w cool-down backwards). Since 1F1B needs M >= P, w = P - k
does not depend on M: only the steady pairs (and GPipe's middle forwards and backwards) repeat.

Per kind (F or B) the blocks of micro-batches < `head` are kept, the `tail` last are kept (shifted to the end), the
block of micro-batch `head` is the template, repeated (references shifted) for every middle micro-batch, and the
block of `head` + 1 is the check: it must equal the template shifted by one micro-batch, op for op, every reference
relative to its block's micro-batch (`NotPeriodic` otherwise). A storage born in a block belongs to that block's
micro-batch (its key: step, kind, op offset in the block, slot); a storage named after a micro-batch (a receive
buffer) belongs to it by name; the rest are global (parameters, `.grad` made in B0 and accumulated into by every
later backward, optimizer state, `scale_grads`'s workspaces). An op outside the blocks that refers to several
micro-batches (the last stage's `merge_chunks` cat, the frees of the M losses, GPipe's wait of every forward send)
gets micro-batch 1's entries once per middle micro-batch and micro-batch 2's none (`replication._Rebuild.refs_kept`).

Pure data in, pure data out: no torch here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from vramtrace.tracer.records import RecOp, RecStorage
from vramtrace.tracer.replication import NotPeriodic

_MICRO_NAME = re.compile(r"micro-batch (\d+)")
_MICRO_LABEL = re.compile(r"^([FB])(\d+)$")
_CAT = "aten.cat.default"
INPUT_CATEGORY = "input"  # analysis/categories.py Category.INPUT (records keep the value: no torch-side import)
STAGE_INPUTS = ("input_ids", "labels")  # the batch a stage's step is given (pipelining.py `record_stage`)
GLOBAL_T, GLOBAL_C = 1, 2  # the template and check micro-batch of ops outside the blocks


@dataclass(frozen=True, slots=True)
class KindPlan:
    """Blocks of one kind: micro-batches < `head` kept, `head` the template, `head` + 1 the check, the last
    `tail` kept (shifted to the end of the M)."""

    head: int
    tail: int


@dataclass(frozen=True, slots=True)
class TimePlan:
    """How to rebuild M = `micro_batches` from a trace of `traced` micro-batches, for stage `stage` of `stages`."""

    schedule: str  # 'gpipe' or '1f1b'
    stages: int
    stage: int
    micro_batches: int
    traced: int
    forward: KindPlan
    backward: KindPlan

    def kind(self, kind: str) -> KindPlan:
        return self.forward if kind == "F" else self.backward

    def source(self, kind: str, x: int) -> tuple[int, int]:
        """(traced micro-batch whose block of `kind` stands for target micro-batch `x`, shift x - it)."""
        kp, d = self.kind(kind), self.micro_batches - self.traced
        # every traced micro-batch after the check is kept at the end (`kp.tail` of them, or more when the trace
        # needs more micro-batches: Schedule1F1B's M >= P)
        y = x if x < kp.head else x - d if x >= kp.head + 2 + d else kp.head
        return y, x - y

    def global_targets(self, y: int) -> list[int]:
        """The target micro-batches a traced micro-batch's entries stand for in ops outside the blocks."""
        d = self.micro_batches - self.traced
        if y == GLOBAL_C:
            return []
        if y == GLOBAL_T:
            return list(range(GLOBAL_T, GLOBAL_C + 1 + d))
        return [y] if y < GLOBAL_T else [y + d]


def time_plan(schedule: str, stages: int, stage: int, micro_batches: int) -> TimePlan | None:
    """The plan of stage `stage` of `stages` under `schedule` for M = `micro_batches`: the smallest trace with a
    template and a check block of each kind; None when that is not fewer micro-batches than M."""
    if schedule == "gpipe":
        f = b = KindPlan(1, 1)  # F0 (first), F_{M-1} (then every send is waited), B0 (makes .grad), B_{M-1}
    elif schedule == "1f1b":
        w = stages - stage  # min(M, P - k) with M >= P (Schedule1F1B.__init__ refuses M < P)
        # the warm-up forwards kept; the backwards up to B_{w-2} kept (B0 makes `.grad`; F_{w-2}'s output is held by
        # the warm-up's last `send_work` until the loop after the steady phase reassigns it, freed in B_{M-w}'s
        # block, not in B_{w-2}'s), and the w cool-down backwards
        f, b = KindPlan(w, 1), KindPlan(max(1, w - 1), w)
    else:
        return None
    traced = max(f.head + 2 + f.tail, b.head + 2 + b.tail, GLOBAL_C + 2, stages if schedule == "1f1b" else 1)
    if traced >= micro_batches:
        return None
    return TimePlan(schedule, stages, stage, micro_batches, traced, f, b)


def block_sequence(schedule: str, stages: int, stage: int, m: int) -> list[tuple[str, int]]:
    """The micro-steps of one step in order (torch/distributed/pipelining/schedules.py, see the module doc)."""
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    w = min(m, stages - stage)
    seq = [("F", i) for i in range(w)]
    for i in range(m - w):
        seq += [("B", i), ("F", i + w)]
    return seq + [("B", i) for i in range(m - w, m)]


@dataclass(slots=True)
class _Segment:
    step: int
    start: int  # op index, inclusive
    stop: int  # exclusive
    block: tuple[str, int] | None  # (kind, micro-batch), None for a step's prefix or suffix
    labels: list  # (offset from start, label, in flight)


def _segments(ops: list[RecOp], labels: list) -> list[_Segment]:
    """The steps' prefixes, blocks and suffixes, in op order, each with its label entries."""
    steps: dict[int, list[int]] = {}
    for o in ops:
        steps.setdefault(o.step, []).append(o.index)
    segs: list[_Segment] = []
    for step, idxs in sorted(steps.items()):
        lo, hi = idxs[0], idxs[-1] + 1
        entries = [(i, e) for i, e in enumerate(labels) if lo <= e[0] < hi]
        micro = [(i, e) for i, e in entries if _MICRO_LABEL.match(e[1])]
        if not micro:
            raise NotPeriodic(f"step {step} runs no micro-step")
        after = [e[0] for i, e in entries if i > micro[-1][0] and not _MICRO_LABEL.match(e[1])]
        bounds = [e[0] for _, e in micro] + [after[0] if after else hi]
        segs.append(_Segment(step, lo, bounds[0], None, []))
        for (_, e), a, b in zip(micro, bounds, bounds[1:]):
            m = _MICRO_LABEL.match(e[1])
            segs.append(_Segment(step, a, b, (m.group(1), int(m.group(2))), []))
        segs.append(_Segment(step, bounds[-1], hi, None, []))
    for start, label, flight in labels:  # any other entry on a boundary closes the segment before it
        if _MICRO_LABEL.match(label):
            seg = next(s for s in segs if s.block is not None and s.start == start)
        else:
            seg = [s for s in segs if s.start < start][-1]
        seg.labels.append((start - seg.start, label, flight))
    return segs


class _Owners:
    """Which micro-batch owns each storage: (micro-batch, key) or None (global)."""

    def __init__(self, plan: TimePlan, ops: list[RecOp], storages: list[RecStorage], segs: list[_Segment]):
        self.plan, self.ops, self.storages, self.segs = plan, ops, storages, segs
        self.births: list[list[int]] = [[] for _ in ops]
        for st in storages:
            if st.op_index >= 0:
                self.births[st.op_index].append(st.sid)
        self.seg_of = [0] * len(ops)
        for n, seg in enumerate(segs):
            for k in range(seg.start, seg.stop):
                self.seg_of[k] = n
        self.owner: list[tuple[int, tuple] | None] = [None] * len(storages)
        for seg in segs:
            if seg.block is not None:
                for k in range(seg.start, seg.stop):
                    for j, s in enumerate(self.births[k]):
                        self.owner[s] = (seg.block[1], (seg.step, seg.block[0], k - seg.start, j))
        for st in storages:
            m = _MICRO_NAME.search(st.name)
            if m:
                self.owner[st.sid] = (int(m.group(1)), ("named", _MICRO_NAME.sub("micro-batch *", st.name)))
        self._globalise()
        self.by_key = {own: s for s, own in enumerate(self.owner) if own is not None}

    def _globalise(self) -> None:
        """A storage that the blocks of more than two micro-batches use is global (a `.grad` made by B0 and added
        into by every later backward); one born in a template or check block then breaks the period."""
        users: dict[int, set[int]] = {}
        for o in self.ops:
            block = self.segs[self.seg_of[o.index]].block
            if block is not None:
                for s in (*o.ins, *o.frees):
                    users.setdefault(s, set()).add(block[1])
        for s, micros in users.items():
            if self.owner[s] is not None and len(micros | {self.owner[s][0]}) > 2:
                if self.owner[s][1][0] != "named":
                    seg = self.segs[self.seg_of[self.storages[s].op_index]]
                    if seg.block[1] - self.plan.kind(seg.block[0]).head in (0, 1):
                        raise NotPeriodic(f"{self.storages[s].name or self.storages[s].op} of the template "
                                          f"{seg.block[0]}{seg.block[1]} is used by micro-batches {sorted(micros)}")
                self.owner[s] = None

    def micros(self, o: RecOp) -> set[int]:
        return {self.owner[s][0] for s in (*o.ins, *o.outs, *o.frees) if self.owner[s] is not None}


def _sig_storage(st: RecStorage) -> tuple:
    return (st.nbytes, st.dtype, st.shape, st.device, st.op, st.phase, st.category, st.saved,
            _MICRO_NAME.sub("micro-batch *", st.name), st.module)


def _check(owners: _Owners) -> None:
    """The check block of each kind and step equals its template shifted by one micro-batch. Raises NotPeriodic."""
    owner, ops, storages = owners.owner, owners.ops, owners.storages
    blocks = {(s.step, s.block): s for s in owners.segs if s.block is not None}

    def sig(o: RecOp, m: int) -> tuple:
        def rel(s: int):
            return ("g", s) if owner[s] is None else (owner[s][0] - m, owner[s][1])
        return (o.name, o.phase, o.module, o.lead, o.flops, o.recompute,
                *(tuple(map(rel, g)) for g in (o.ins, o.outs, o.frees, owners.births[o.index])))

    for (step, (kind, x)), seg in blocks.items():
        if x != owners.plan.kind(kind).head:
            continue
        chk = blocks.get((step, (kind, x + 1)))
        if chk is None or chk.stop - chk.start != seg.stop - seg.start:
            raise NotPeriodic(f"{kind}{x} and {kind}{x + 1} of step {step} run different numbers of ops")
        for k in range(seg.stop - seg.start):
            a, b = ops[seg.start + k], ops[chk.start + k]
            if sig(a, x) != sig(b, x + 1):
                raise NotPeriodic(f"{kind}{x} and {kind}{x + 1} of step {step} differ at op {k} ({a.name}: "
                                  f"{sig(a, x)[6:]} vs {sig(b, x + 1)[6:]})")
    for (m, key), s in owners.by_key.items():
        t = owners.plan.kind(key[1]).head if key[0] != "named" else GLOBAL_T
        if m == t:
            s2 = owners.by_key.get((t + 1, key))
            if s2 is None or _sig_storage(storages[s]) != _sig_storage(storages[s2]):
                raise NotPeriodic(f"micro-batch {t + 1} has no storage like {storages[s].name or storages[s].op}")


class _Rebuild:
    """The target's records: storages numbered in order of first appearance, ops and label entries in the
    schedule's order for M micro-batches."""

    def __init__(self, owners: _Owners):
        self.o, self.plan = owners, owners.plan
        self.d = self.plan.micro_batches - self.plan.traced
        self.ids: dict[tuple, int] = {}
        self.new_storages: list[RecStorage] = []
        self.new_ops: list[RecOp] = []
        self.new_labels: list[tuple[int, str, tuple[int, ...]]] = []
        self.born: set[int] = set()
        self.every = set(range(self.plan.traced))  # an op referring to every micro-batch is spread
        self.flight: set[int] = set()  # micro-batches whose forward began and whose backward has not ended

    def sid(self, it: tuple) -> int:
        """The new id of ('g', traced sid) or (target micro-batch, key)."""
        nid = self.ids.get(it)
        if nid is None:
            if it[0] == "g":
                st, x = self.o.storages[it[1]], None
            else:
                x, key = it
                y = (self.plan.source(key[1], x)[0] if key[0] != "named"
                     else x if x < GLOBAL_T else GLOBAL_T if x < GLOBAL_C + 1 + self.d else x - self.d)
                s = self.o.by_key.get((y, key))
                if s is None:
                    raise NotPeriodic(f"micro-batch {y} has no storage {key}")
                st = self.o.storages[s]
            nid = self.ids[it] = len(self.new_storages)
            name = st.name if x is None else _MICRO_NAME.sub(f"micro-batch {x}", st.name)
            self.new_storages.append(st.copy(nid, name, st.module, st.op_index, st.held_micro))
            if st.op_index < 0 and st.category == INPUT_CATEGORY and st.name in STAGE_INPUTS:  # M micro-batches of rows
                new, p = self.new_storages[-1], self.plan
                if st.nbytes % p.traced or st.shape[0] % p.traced:
                    raise NotPeriodic(f"the input {st.name} is not {p.traced} micro-batches")
                new.nbytes, new.shape = st.nbytes // p.traced * p.micro_batches, (
                    st.shape[0] // p.traced * p.micro_batches, *st.shape[1:])
        return nid

    def shifted(self, d: int):
        owner = self.o.owner
        return lambda sids: [self.sid(("g", s)) if owner[s] is None else self.sid((owner[s][0] + d, owner[s][1]))
                             for s in sids]

    def kept_refs(self, d: int):
        """References of a kept block moved by `d` micro-batches: to a kept head micro-batch's storages as they are
        (the last steady backward frees a warm-up forward's output, whatever M), to the others shifted."""
        owner, p = self.o.owner, self.plan

        def move(s: int) -> int:
            if owner[s] is None:
                return self.sid(("g", s))
            z, key = owner[s]
            head = GLOBAL_T if key[0] == "named" else p.kind(key[1]).head
            return self.sid((z if z < head else z + d, key))
        return lambda sids: [move(s) for s in sids]

    def spread(self, sids) -> list[int]:
        owner, out = self.o.owner, []
        for s in sids:
            if owner[s] is None:
                out.append(self.sid(("g", s)))
            else:
                out += [self.sid((x, owner[s][1])) for x in self.plan.global_targets(owner[s][0])]
        return out

    def emit(self, o: RecOp, refs) -> None:
        idx = len(self.new_ops)
        self.new_ops.append(RecOp(idx, o.name, o.phase, o.module, tuple(refs(o.ins)), tuple(refs(o.outs)),
                                  tuple(refs(o.frees)), o.lead, o.flops, o.recompute, o.step, o.micro))
        if o.name == _CAT and len(o.outs) == 1 and self.o.births[o.index] == list(o.outs):
            self._scale_cat(o, self.new_ops[-1])
        for nid in refs(self.o.births[o.index]):
            if nid in self.born:
                raise NotPeriodic(f"storage {self.new_storages[nid].name or nid} is born twice")
            self.born.add(nid)
            self.new_storages[nid].op_index, self.new_storages[nid].phase = idx, str(o.phase)

    def _scale_cat(self, o: RecOp, new: RecOp) -> None:
        """The last stage's `merge_chunks` (torch/distributed/pipelining/microbatch.py: `torch.cat` of every
        micro-batch's output): its output grows with the inputs it is given (dim 0, the rows)."""
        st = self.o.storages
        old_in = sum(st[s].nbytes for s in o.ins)
        if old_in != st[o.outs[0]].nbytes or len(new.ins) == len(o.ins):
            return
        out = self.new_storages[new.outs[0]]
        out.nbytes = sum(self.new_storages[s].nbytes for s in new.ins)
        out.shape = (out.shape[0] * out.nbytes // old_in, *out.shape[1:])

    def segment(self, seg: _Segment, target: tuple[str, int] | None = None) -> None:
        start = len(self.new_ops)
        if target is None:  # a prefix or suffix: per-micro-batch ops swept, several micro-batches spread
            chunks = self._chunking(seg)
            for k in range(seg.start, seg.stop):
                o = self.o.ops[k]
                micros = self.o.micros(o)
                if k in chunks:
                    if chunks[k]:
                        for _ in range(self.plan.micro_batches):
                            self.emit(o, self.shifted(0))
                elif len(micros) == 1:
                    y = micros.pop()
                    for x in self.plan.global_targets(y):
                        self.emit(o, self.shifted(x - y))
                else:
                    self.emit(o, self.spread if micros == self.every else self.kept_refs(self.d))
        else:
            d = target[1] - seg.block[1]
            kept = seg.block[1] != self.plan.kind(target[0]).head
            for k in range(seg.start, seg.stop):
                o = self.o.ops[k]
                if self.o.micros(o) == self.every:  # GPipe's wait of every forward send
                    if not kept:
                        raise NotPeriodic(f"an op of the template {target[0]}{seg.block[1]} spans micro-batches")
                    self.emit(o, self.spread)
                else:
                    self.emit(o, self.kept_refs(d) if kept else self.shifted(d))
        for off, label, _flight in seg.labels:  # a backward's micro-batch is in flight until its loop ops
            micro_step = target is not None and _MICRO_LABEL.match(label)
            if micro_step:
                label = f"{target[0]}{target[1]}"
                self.flight.add(target[1])
            self.new_labels.append((start + off, label, tuple(sorted(self.flight))))
            if micro_step and target[0] == "B":
                self.flight.discard(target[1])

    def _chunking(self, seg: _Segment) -> dict[int, bool]:
        """The views that chunk a global input into the micro-batches (`PipelineScheduleSingle.step`'s
        `_split_inputs`: `traced` slices of one storage, no bytes): op index -> whether it is the first of its run
        (emitted M times), the rest not emitted."""
        ops, m, found = self.o.ops, self.plan.traced, {}
        k = seg.start
        while k < seg.stop:
            o = ops[k]
            run = 1
            while (k + run < seg.stop and not o.outs and not o.frees and not self.o.micros(o)
                   and (ops[k + run].name, ops[k + run].ins, ops[k + run].outs, ops[k + run].frees)
                   == (o.name, o.ins, o.outs, o.frees)):
                run += 1
            if run == m:
                found.update({k + j: j == 0 for j in range(m)})
            k += run
        return found

    def run(self) -> None:
        for st in self.o.storages:
            if st.op_index < 0:
                self.sid(("g", st.sid))
        p = self.plan
        want = block_sequence(p.schedule, p.stages, p.stage, p.micro_batches)
        for step in sorted({s.step for s in self.o.segs}):
            segs = [s for s in self.o.segs if s.step == step]
            blocks = {s.block: s for s in segs if s.block is not None}
            if [s.block for s in segs[1:-1]] != block_sequence(p.schedule, p.stages, p.stage, p.traced):
                raise NotPeriodic(f"step {step} does not run the {p.schedule} schedule's micro-steps")
            self.segment(segs[0])
            for kind, x in want:
                self.segment(blocks[(kind, p.source(kind, x)[0])], (kind, x))
            self.segment(segs[-1])


def replicate_micro_batches(plan: TimePlan, ops: list[RecOp], storages: list[RecStorage], labels: list
                            ) -> tuple[list[RecOp], list[RecStorage], list[tuple[int, str, tuple[int, ...]]]]:
    """The records (ops, storages, `StageTrace.labels`) of the stage's step with `plan.micro_batches` micro-batches
    from those traced with `plan.traced`. Needs `ops[i].index == i` and `storages[s].sid == s`. Raises NotPeriodic
    (then trace every micro-batch)."""
    owners = _Owners(plan, ops, storages, _segments(ops, labels))
    _check(owners)
    r = _Rebuild(owners)
    r.run()
    return r.new_ops, r.new_storages, r.new_labels
