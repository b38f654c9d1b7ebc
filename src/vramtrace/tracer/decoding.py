"""Decode-step rebuild: trace the first few decode steps of a generation, then rebuild the records of the rest.

A greedy `model.generate()` of N tokens runs the prefill (micro-step 0 of the recording) and N-1 decode steps
(micro-steps 1..N-1), each the same code over one new token. Tracing 512 decode steps costs 512 times one step
for records that differ only in the length the KV cache has reached. So the tracer stops the generation after
`traced` decode steps (`feature_bridges.generating(..., stop_after=...)`: the stop check answers "finished"
early, so the last traced step runs the loop's exit as the real last step does, while `max_new_tokens` still sizes
everything that depends on it, a StaticCache's `max_cache_len` included) and this module rebuilds the records of
the whole generation:

- With K the last traced micro-step, micro-steps K-3, K-2 and K-1 are the pattern: op for op and storage for
  storage the same records (op name, phase, module; a storage's dtype, device, category, name, whether saved),
  every reference either to a storage born in the same micro-step, or d <= `MAX_BACK` micro-steps earlier, at
  the same place, or to the same fixed storage (a parameter, the prefill's static cache), and sizes (bytes,
  each shape dimension, FLOPs) affine in the step: at K-1 minus at K-2 equals at K-2 minus at K-3. The KV cache
  grows by one token per step (DynamicCache's `torch.cat`; the attention scores and masks by one column); a
  StaticCache does not grow at all. Anything else raises `NotPeriodic` and the caller traces every step.
- Micro-steps K..N-2 are copies of micro-step K-1 with sizes extrapolated; the last traced micro-step (the
  loop's exit: a prefix of a regular step's ops) becomes micro-step N-1, its sizes extrapolated by the slope of
  the regular step's records at the same place, and its references to earlier steps resolved to the copies.
- A storage a pattern step makes must die within `MAX_BACK` steps or never: a storage that lives from one
  decode step to the end would need every copy kept, which the pattern cannot say.

Sizes are piecewise affine only where a sliding-window cache layer stops growing (transformers'
`DynamicSlidingWindowLayer.update` keeps the last `sliding_window - 1` tokens): `decode_steps_to_trace` moves the
pattern past that step. Pure data in, pure data out: no torch here.
"""

from __future__ import annotations

from .records import RecOp, RecStorage
from .replication import NotPeriodic

PATTERN = 3  # the pattern's micro-steps: two give the slope, the third is the check
MAX_BACK = 3  # how many steps back a decode step may refer to a storage by its place
FIRST_PATTERN_STEP = 2  # decode step 1 reads the prefill's cache: its references differ from later steps'
TRACED_DECODE_STEPS = FIRST_PATTERN_STEP + PATTERN + 1  # ... + the last traced step (the loop's exit)
WINDOW_MARGIN = 2  # decode steps on each side of the step where a sliding window fills, kept out of the pattern


def decode_steps_to_trace(new_tokens: int, prompt: int, windows: tuple[int, ...]) -> int | None:
    """How many decode steps to trace for a generation of `new_tokens` tokens after a prompt of `prompt` tokens,
    whose cache has sliding-window layers of `windows` tokens (transformers' `sliding_window`), or None: trace
    them all (the rebuild would save nothing). The decode step k (1..N-1) finds prompt + k - 1 tokens in the
    cache; a window layer's storages stop growing at k = window - prompt, so the pattern starts after that step
    when the generation reaches it."""
    traced = TRACED_DECODE_STEPS
    for w in windows:
        kink = w - prompt
        if -WINDOW_MARGIN <= kink and kink - WINDOW_MARGIN <= new_tokens - 1:
            traced = max(traced, kink + WINDOW_MARGIN + PATTERN + 1)
    return traced if traced < new_tokens - 2 else None


def _groups(ops: list[RecOp]) -> dict[int, range]:
    """{micro-step: its ops' index range}; raises NotPeriodic when a micro-step's ops are not contiguous."""
    spans: dict[int, list[int]] = {}
    for o in ops:
        spans.setdefault(o.micro, []).append(o.index)
    out = {}
    for m, idx in spans.items():
        if idx[-1] - idx[0] + 1 != len(idx) or any(ops[i].step != 0 for i in idx):
            raise NotPeriodic(f"decode step {m}'s ops are not one contiguous run of the first step")
        out[m] = range(idx[0], idx[-1] + 1)
    return out


class _Places:
    """Where each storage was born: (micro-step, its place among that step's births), -1 for storages born
    before any op (parameters, buffers, inputs)."""

    def __init__(self, ops: list[RecOp], storages: list[RecStorage]):
        self.micro = [ops[s.op_index].micro if s.op_index >= 0 else -1 for s in storages]
        self.born: dict[int, list[int]] = {}
        self.place = [0] * len(storages)
        for s in storages:
            if s.op_index >= 0:
                b = self.born.setdefault(self.micro[s.sid], [])
                self.place[s.sid] = len(b)
                b.append(s.sid)

    def ref(self, sid: int, m: int) -> tuple:
        """A reference from micro-step `m` to `sid`: ('own', place), ('back', d, place) or ('fixed', sid)."""
        bm = self.micro[sid]
        if bm == m:
            return ("own", self.place[sid])
        if bm >= 1 and m - bm <= MAX_BACK:
            return ("back", m - bm, self.place[sid])
        return ("fixed", sid)


def _op_shape(o: RecOp, places: _Places, m: int) -> tuple:
    return (o.name, o.phase, o.module, o.lead, o.recompute, tuple(places.ref(s, m) for s in o.ins),
            tuple(places.ref(s, m) for s in o.outs), tuple(places.ref(s, m) for s in o.frees))


def _storage_kind(s: RecStorage, m: int) -> tuple:
    held = s.held_micro - m if s.held_micro >= 0 else None
    return (s.dtype, len(s.shape), s.device, s.op, s.module, s.phase, s.category, s.name, s.saved, s.held_as, held)


def _sizes(s: RecStorage) -> tuple[int, ...]:
    return (s.nbytes, *s.shape)


def rebuild_decode_steps(ops: list[RecOp], storages: list[RecStorage], new_tokens: int
                         ) -> tuple[list[RecOp], list[RecStorage], int]:
    """The records of a generation of `new_tokens` tokens from those of one stopped after K < N-1 decode steps
    (micro-steps 0..K, see the module docstring). Needs `ops[i].index == i` and `storages[s].sid == s`; returns
    new lists numbered the same way, and how many decode steps were copied (not traced). Raises NotPeriodic."""
    groups = _groups(ops)
    last = max(groups)
    pattern = list(range(last - PATTERN, last))
    if pattern[0] < FIRST_PATTERN_STEP:
        raise NotPeriodic(f"only {last} decode steps traced")
    copies = new_tokens - 1 - last
    if copies <= 0:
        return ops, storages, 0
    places = _Places(ops, storages)
    template = pattern[-1]
    t_ops, t_born = [ops[i] for i in groups[template]], places.born.get(template, [])
    f_ops, f_born = [ops[i] for i in groups[last]], places.born.get(last, [])
    slope, flop_slope = _check_pattern(ops, storages, groups, places, pattern)
    _check_last_step(storages, places, (t_ops, t_born, template), (f_ops, f_born, last), slope)
    # 3. rebuild: everything before the last traced step, the copies, then the last step as step N-1
    out = _Copies(ops, storages, places, groups[last].start, last, new_tokens, len(t_born))
    t_code, f_code = out.encoded(t_ops, template), out.encoded(f_ops, last)
    fixed_sids = list(out.fixed)
    for j in range(last, new_tokens - 1):
        out.emit(t_ops, t_born, t_code, j, template, fixed_sids, slope, flop_slope)
    out.emit(f_ops, f_born, f_code, new_tokens - 1, last, fixed_sids, slope, flop_slope)
    return out.ops, out.storages, copies


def _check_pattern(ops: list[RecOp], storages: list[RecStorage], groups: dict[int, range], places: _Places,
                   pattern: list[int]) -> tuple[list[list[int]], list[int]]:
    """1. The pattern's steps: the same records, references in the same places, sizes affine in the step, and
    each storage dying the same number of steps later. Returns (per storage of a step, its sizes' growth per
    step; per op, its FLOPs' growth per step). Raises NotPeriodic."""
    template = pattern[-1]
    t_ops = [ops[i] for i in groups[template]]
    t_born = places.born.get(template, [])
    for m in pattern[:-1]:
        m_ops = [ops[i] for i in groups[m]]
        if len(m_ops) != len(t_ops) or any(_op_shape(a, places, m) != _op_shape(b, places, template)
                                           for a, b in zip(m_ops, t_ops)):
            raise NotPeriodic(f"decode steps {m} and {template} run different ops")
        m_born = places.born.get(m, [])
        if len(m_born) != len(t_born) or any(_storage_kind(storages[a], m) != _storage_kind(storages[b], template)
                                             for a, b in zip(m_born, t_born)):
            raise NotPeriodic(f"decode steps {m} and {template} make different storages")
    a, b, c = ([storages[s] for s in places.born.get(m, [])] for m in pattern)
    slope = []
    for x, y, z in zip(a, b, c):
        d1 = [q - p for p, q in zip(_sizes(x), _sizes(y))]
        d2 = [q - p for p, q in zip(_sizes(y), _sizes(z))]
        if d1 != d2:
            raise NotPeriodic(f"storage {z.name or z.op} of the decode steps does not grow by the same bytes each step")
        slope.append(d2)
    fa, fb, fc = ([ops[i].flops for i in groups[m]] for m in pattern)
    flop_slope = [z - y for y, z in zip(fb, fc)]
    if any(y - x != d for x, y, d in zip(fa, fb, flop_slope)):
        raise NotPeriodic("an op's FLOPs do not grow by the same count each decode step")
    deaths: dict[int, int] = {}  # storage -> the micro-step of the op that frees it
    for o in ops:
        for s in o.frees:
            deaths[s] = o.micro
    fates = [[deaths[s] - m if s in deaths else None for s in places.born.get(m, [])] for m in pattern]
    if any(f != fates[-1] for f in fates) or any(f is not None and f > MAX_BACK for f in fates[-1]):
        raise NotPeriodic(f"a storage of the decode steps does not die the same number of steps later, within "
                          f"{MAX_BACK}, in steps {pattern[0]}..{template}")
    return slope, flop_slope


def _check_last_step(storages: list[RecStorage], places: _Places, template: tuple[list[RecOp], list[int], int],
                     last: tuple[list[RecOp], list[int], int], slope: list[list[int]]) -> None:
    """2. The last traced step (its ops, births and micro-step, as `template`'s) is a regular step cut short
    (the loop's exit), its sizes one slope past the template. Raises NotPeriodic."""
    (t_ops, t_born, t_micro), (f_ops, f_born, f_micro) = template, last
    if len(f_ops) > len(t_ops) or any(x.name != y.name or x.module != y.module for x, y in zip(f_ops, t_ops)):
        raise NotPeriodic("the last decode step is not a regular step cut short")
    if len(f_born) > len(t_born) or any(
            _storage_kind(storages[x], f_micro) != _storage_kind(storages[y], t_micro)
            or [q - p for p, q in zip(_sizes(storages[y]), _sizes(storages[x]))] != d
            for x, y, d in zip(f_born, t_born, slope)):
        raise NotPeriodic("the last decode step's storages are not a regular step's one step later")


class _Copies:
    """The rebuilt records (`ops`, `storages`): those before the last traced step `last` (its first op
    `first_last_op`), then each step `emit` adds. A reference is encoded once per source step as a place in the
    lookup list of each copy: [own births (`n` slots), births 1..MAX_BACK steps back (n slots each), the fixed
    storages]."""

    def __init__(self, ops: list[RecOp], storages: list[RecStorage], places: _Places, first_last_op: int, last: int,
                 new_tokens: int, n: int):
        self.src_storages, self.places, self.n = storages, places, n
        self.new_sid: dict[int, int] = {}
        self.storages: list[RecStorage] = []
        for s in storages:
            if places.micro[s.sid] != last:
                self.new_sid[s.sid] = len(self.storages)
                # a storage the last step's outputs reach (a StaticCache's tensors) is reached by step N-1's
                held = new_tokens - 1 if s.held_micro == last else s.held_micro
                self.storages.append(s.copy(len(self.storages), s.name, s.module, s.op_index, held))
        new_sid = self.new_sid
        self.ops: list[RecOp] = [RecOp(o.index, o.name, o.phase, o.module, tuple(new_sid[s] for s in o.ins),
                                       tuple(new_sid[s] for s in o.outs), tuple(new_sid[s] for s in o.frees), o.lead,
                                       o.flops, o.recompute, o.step, o.micro) for o in ops[:first_last_op]]
        self.born_at: dict[int, list[int]] = {m: [new_sid[s] for s in sids] for m, sids in places.born.items()
                                              if m != last}
        self.fixed: dict[int, int] = {}

    def encode(self, sid: int, src_micro: int) -> int:
        ref = self.places.ref(sid, src_micro)
        if ref[0] == "own":
            return ref[1]
        if ref[0] == "back":
            return ref[1] * self.n + ref[2]
        return (MAX_BACK + 1) * self.n + self.fixed.setdefault(self.new_sid[ref[1]], len(self.fixed))

    def encoded(self, src_ops: list[RecOp], src_micro: int) -> list[tuple[tuple[int, ...], ...]]:
        return [tuple(tuple(self.encode(x, src_micro) for x in refs) for refs in (o.ins, o.outs, o.frees))
                for o in src_ops]

    def emit(self, src_ops: list[RecOp], src_born: list[int], code: list, j: int, src_micro: int,
             fixed_sids: list[int], slope: list[list[int]], flop_slope: list[int]) -> None:
        """Step `j` as a copy of step `src_micro` (its ops, births and encoded references), sizes and FLOPs
        shifted by the slopes. Raises NotPeriodic when a size would fall below 0."""
        own: list[int] = []
        op_base, first_op = len(self.ops), src_ops[0].index
        shift = j - src_micro
        for k, sid in enumerate(src_born):
            s = self.src_storages[sid]
            size = [v + shift * d for v, d in zip(_sizes(s), slope[k])]
            if any(v < 0 for v in size):
                raise NotPeriodic(f"storage {s.name or s.op} would shrink below 0 bytes")
            new = RecStorage(len(self.storages), size[0], s.dtype, tuple(size[1:]), s.device,
                             op_base + (s.op_index - first_op), s.op, s.module, s.phase, s.category, s.name,
                             s.saved, s.held_as, s.held_micro + shift if s.held_micro >= 0 else -1)
            own.append(new.sid)
            self.storages.append(new)
        self.born_at[j] = own
        lut = own + [-1] * (self.n - len(own))  # the last step makes fewer storages; none refers past its own
        for d in range(1, MAX_BACK + 1):  # steps j-1..j-3 are pattern steps or copies: n births each
            lut += self.born_at[j - d]
        lut += fixed_sids
        at = lut.__getitem__
        for k, o in enumerate(src_ops):
            ins, outs, frees = code[k]
            self.ops.append(RecOp(op_base + k, o.name, o.phase, o.module, tuple(map(at, ins)), tuple(map(at, outs)),
                                  tuple(map(at, frees)), o.lead, o.flops + shift * flop_slope[k], o.recompute,
                                  o.step, j))
