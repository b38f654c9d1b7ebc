"""Layer replication: trace a model with 4 of its L identical layers, then rebuild the records of all L.

A decoder or encoder stack repeats one layer L times. Its step is periodic: the forward runs layer 0, 1, ...,
L-1; the backward runs them in reverse; the optimizer walks the parameters layer by layer (or, foreach, in
lists ordered by layer). Tracing L = 32 layers op by op costs 8x what 4 layers cost, for records that differ
only in their layer index. So the tracer runs a copy of the model with 4 layers and this module rebuilds the
records of the full model:

- Layers 0 and 3 of the trace become layers 0 and L-1; layer 1 is the template of the middle layers 1..L-2.
  Layer 2 is the check: its records must equal layer 1's, shifted by one layer, op for op and storage for
  storage (name, phase, module, sizes, and every reference relative to its own layer). Anything that is not
  periodic raises `NotPeriodic`, and the caller traces every layer instead.
- Each phase is split into sweeps over the layers (ascending in the forward, descending in the backward). In a
  sweep, the unit of layer i is the span of ops from its first op to the next layer's first op, so ops between
  two layers that belong to neither (an optimizer's step counter) repeat with the unit.
- A storage belongs to a layer (it was born in that layer's unit, or it is one of that layer's parameters or
  buffers, or it is the per-layer output of a foreach op) or is global (the embedding output, the rotary
  tables, the loss). A middle layer F refers to its neighbours' storages (its input comes from layer F-1; in
  the backward, its output gradient from layer F+1), so a reference is kept as (layer offset, key) and
  resolved for each F.
- A global op whose storage lists span layers (a foreach op over every parameter, the frees at the end of an
  autocast region) gets layer 1's entries once per middle layer; layer 2's entries were the check.
- A compiled step (`--compile`) keeps its first two layers as traced (`LayerPlan.head` = 2: 5 layers traced,
  layer 2 the template, layer 3 the check): Inductor's memory planning hands each layer's dying buffers to the
  next layer's, so the first layer, with no earlier layer's buffers to take, allocates what the others reuse, and
  the second layer's references into it are unlike the third's into the second.

Pure data in, pure data out: no torch here.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Iterable

from .records import ALLOCATION_OP, REUSE_OP, RecOp, RecStorage

TRACED_LAYERS = 4  # layers 0 and 3 are the boundary layers, 1 the template, 2 the check (`LayerPlan.head` = 1)
_ANY_LAYER = "\0L\0"


class NotPeriodic(Exception):
    """The recorded step is not periodic over the layers; trace every layer instead. str(e) says why."""


@dataclass(frozen=True, slots=True)
class LayerPlan:
    """Where the repeated layers are: `prefix` is the qualified name of their ModuleList (e.g. 'model.layers'),
    `num_layers` is L of the full model; the traced model has `traced` = `head` + 3 of them: `head` leading layers
    kept as traced (1: the first layer; a compiled graph's second layer still differs from the third, since the
    first has no earlier layer's buffers for Inductor's memory planning to reuse), the template layer `head`, the
    check layer `head` + 1 and the last layer."""

    prefix: str
    num_layers: int
    head: int = 1

    @property
    def traced(self) -> int:
        return self.head + 3

    @property
    def template(self) -> int:
        return self.head

    @property
    def check(self) -> int:
        return self.head + 1

    def layer_of(self, path: str) -> int | None:
        """The traced layer index of a module path, parameter name or state name, or None (global)."""
        m = self._re().match(path)
        return int(m.group(1)) if m else None

    def rename(self, path: str, mapping: dict[int, int]) -> str:
        """Replace the traced layer index in `path` by its index in the full model."""
        m = self._re().match(path)
        if not m:
            return path
        i = int(m.group(1))
        return f"{path[:m.start(1)]}{mapping.get(i, i)}{path[m.end(1):]}"

    def _re(self) -> re.Pattern:
        return _layer_pattern(self.prefix)

    def weight(self, traced_layer: int | None) -> int:
        """How many layers of the full model a traced layer's records stand for."""
        if traced_layer is None or traced_layer < self.head or traced_layer == self.traced - 1:
            return 1
        return self.num_layers - self.head - 1 if traced_layer == self.template else 0


@functools.lru_cache(maxsize=8)
def _layer_pattern(prefix: str) -> re.Pattern:
    return re.compile(rf"^{re.escape(prefix)}\.(\d+)(?=[.:]|$)")


@dataclass(frozen=True, slots=True)
class _Unit:
    layer: int
    start: int  # op index, inclusive
    stop: int  # op index, exclusive
    tag: tuple  # (phase, sweep number)


def _sweeps(phase: str, idxs: list[int], owner_layer: list[int | None], multi: list[bool], group: tuple = (),
            traced: int = TRACED_LAYERS) -> list[_Unit]:
    """The units of every sweep over the layers among the ops `idxs` of one phase. Raises NotPeriodic.

    A sweep visits layers 0, 1, .., `traced` - 1 (the forward, an optimizer's loop) or back (the backward). Runs of
    two neighbouring layers may interleave (the backward of layer i+1 can still be running when a checkpointed
    layer i starts its recompute), so the unit of layer i runs from its first op to the first op of the next
    layer in the sweep; the last layer's unit ends at the sweep's last layer op.
    """
    last = traced - 1
    runs: list[list[int]] = []  # [layer, first op, last op]
    for k in idxs:
        layer = owner_layer[k]
        if layer is None:
            continue
        if runs and runs[-1][0] == layer:
            runs[-1][2] = k
        else:
            runs.append([layer, k, k])
    sweeps: list[list[list[int]]] = []
    for run in runs:
        cur = sweeps[-1] if sweeps else None
        if cur is not None:
            step = 1 if cur[0][0] == 0 else -1
            front = max(r[0] for r in cur) if step == 1 else min(r[0] for r in cur)
            done = front == (last if step == 1 else 0)
            # a neighbour's run may continue after the front moved on, also past the sweep's last layer (a
            # compiled backward graph interleaves a checkpointed layer's recompute with the backward of the layer
            # after it); a new sweep starts at the first or the last layer
            if run[0] in (front, front + step) or (run[0] == front - step and not (done and run[0] in (0, last))):
                cur.append(run)
                continue
            if not done:
                raise NotPeriodic(f"the {phase} phase visits layer {run[0]} after layer {front}")
        if run[0] not in (0, last):
            raise NotPeriodic(f"a sweep of the {phase} phase starts at layer {run[0]}")
        sweeps.append([run])
    units: list[_Unit] = []
    for n, sweep in enumerate(sweeps):
        order = [sweep[0][0]] + [r[0] for a, r in zip(sweep, sweep[1:]) if r[0] not in [x[0] for x in sweep[:sweep.index(r)]]]
        if sorted(order) != list(range(traced)):
            raise NotPeriodic(f"a sweep of the {phase} phase visits the layers {order}")
        first = {layer: min(r[1] for r in sweep if r[0] == layer) for layer in order}
        end = max(r[2] for r in sweep)
        tag = (phase, *group, n)
        for j, layer in enumerate(order):
            stop = first[order[j + 1]] if j + 1 < len(order) else end + 1
            units.append(_Unit(layer, first[layer], stop, tag))
            if any(multi[k] for k in range(first[layer], stop)):
                raise NotPeriodic(f"an op spanning several layers runs inside layer {layer}'s {phase}")
    return units


def _user_layer(plan: LayerPlan, ops: list[RecOp], born: list[int], uses: dict[int, list[int]]) -> int | None:
    """The layer a creation op of the backward outside every layer's modules (no inputs) runs for: the one layer
    whose ops, alone, read or free the storages it made, or None. The autograd.Function that runs a compiled backward
    (AOTAutograd's CompiledFunction, torch/_functorch/_aot_autograd/runtime_wrappers.py) materializes a zero
    gradient for each output no loss depends on (torch/autograd/function.py `set_materialize_grads`, default
    True), all of them before the backward graph runs: with transformers' KV cache on, two per layer (the keys
    and values the cache keeps), each read only by its layer's backward."""
    layers = {plan.layer_of(ops[u].module) for s in born for u in uses.get(s, ())}
    return layers.pop() if born and len(layers) == 1 and all(uses.get(s) for s in born) else None


def _is_foreach(o: RecOp) -> bool:
    return o.name.startswith("aten._foreach_")


def _own_births(plan: LayerPlan, o: RecOp, born: list[int], unit: tuple[_Unit, tuple[str, str, int]] | None,
                storages: list[RecStorage], owner: list[tuple[int, tuple] | None]) -> None:
    """Set the owners of the storages op `o` allocated: the layer in its name (a gradient, an optimizer state:
    an optimizer may create the next parameter's step counter in this layer's unit), else its unit's layer, or
    for a foreach op outside the units, the layer of the first list's matching input. Raises NotPeriodic."""
    # a name recurs in every step and micro-step (a gradient, an autocast copy): the key says which, and in which
    # sweep of the phase: a pipeline stage's forwards of M micro-batches are M sweeps of one phase, each making
    # its own autocast copies of the weights, alive until that micro-batch's backward
    when = unit[0].tag if unit is not None else (o.step, o.micro, str(o.phase))
    for s in born:
        layer = plan.layer_of(storages[s].name)
        if layer is not None:
            owner[s] = (layer, ("named", *when, plan.rename(storages[s].name, {layer: -1})))
    if unit is not None:
        u, off = unit
        for slot, s in enumerate(born):
            if owner[s] is None:
                owner[s] = (u.layer, (u.tag, off, slot))
        return
    born = [s for s in born if owner[s] is None]
    layers = {owner[s][0] for s in o.ins if owner[s] is not None}
    if not born or not layers:
        return
    if _is_foreach(o) and o.lead >= len(born) and born == list(o.outs):
        for slot, s in enumerate(o.outs):
            src = owner[o.ins[slot]]
            owner[s] = None if src is None else (src[0], ("list", o.index, src[1]))
    elif plan.template in layers and plan.check in layers and not _stacks_its_inputs(o, born, storages):
        raise NotPeriodic(f"{o.name} allocates storages from every layer's storages")


# ops that allocate one storage of one element per tensor of their input list (clip_grad_norm_'s
# `torch.stack(norms)` over every parameter's norm, torch/nn/utils/clip_grad.py `_get_total_norm`): global, with
# its size scaled to the full model's list. Recorded names (`RecOp.name`): this module works on torch-free records,
# so the set stays names; tests/test_op_rules.py checks that each names an op overload.
_STACKS = frozenset({"aten.stack.default", "aten.cat.default"})


def _stacks_its_inputs(o: RecOp, born: list[int], storages: list[RecStorage]) -> bool:
    if o.name not in _STACKS or len(born) != 1 or not o.ins:
        return False
    s = storages[born[0]]
    return len(s.shape) == 1 and s.shape[0] == len(o.ins) and all(
        storages[i].nbytes * len(o.ins) == s.nbytes for i in o.ins)


def canonical_frees(ops: list[RecOp], storages: list[RecStorage]) -> list[RecOp]:
    """`ops` with the frees of interchangeable storages reassigned first born, first freed.

    Storages are interchangeable when no op reads them (a compiled graph's buffers: `compiled.run_program`
    allocates and frees them, the kernels that read them are not recorded) and their records agree in everything
    but their birth (bytes, dtype, shape, device, op, module, phase, category, name, saved, held_as, micro-step).
    Inductor's memory planning draws each reused buffer from a pool that carries over from one layer to the next,
    so which of two such buffers dies first can alternate between layers while the bytes alive at every op do
    not. Freeing, at each free, the earliest born of the interchangeable storages alive keeps every op's bytes
    and makes the records periodic again for `replicate_layers`. Needs `ops[i].index == i` and
    `storages[s].sid == s`; returns new ops (storages are unchanged)."""
    read = {s for o in ops for s in o.ins}
    group: dict[int, tuple] = {}
    for st in storages:
        if st.op_index >= 0 and st.sid not in read:
            group[st.sid] = (st.nbytes, st.dtype, st.shape, st.device, st.op, st.module, st.phase, st.category,
                             st.name, st.saved, st.held_as, st.held_micro, ops[st.op_index].step,
                             ops[st.op_index].micro)
    born: dict[int, list[int]] = {}
    for st in storages:
        if st.sid in group:
            born.setdefault(st.op_index, []).append(st.sid)
    alive: dict[tuple, list[int]] = {}  # group -> the records of its storages alive, in birth order
    record: dict[int, int] = {}  # a storage (its sid in `storages`) -> the record it is now, and back:
    storage: dict[int, int] = {}  # a free swaps the records of two storages alive
    out = []
    for o in ops:
        for sid in sorted(born.get(o.index, ())):
            alive.setdefault(group[sid], []).append(sid)
            record[sid] = storage[sid] = sid
        frees = []
        for sid in o.frees:
            g = group.get(sid)
            if g is None or sid not in record:
                frees.append(sid)
                continue
            first, mine = alive[g].pop(0), record.pop(sid)
            if first != mine:  # the storage holding the first record takes this one's
                other = storage[first]
                record[other], storage[mine] = mine, other
            del storage[first]
            frees.append(first)
        out.append(o if tuple(frees) == o.frees else RecOp(o.index, o.name, o.phase, o.module, o.ins, o.outs,
                                                            tuple(frees), o.lead, o.flops, o.recompute, o.step,
                                                            o.micro))
    return out


def replicate_layers(plan: LayerPlan, ops: list[RecOp], storages: list[RecStorage]
                     ) -> tuple[list[RecOp], list[RecStorage], list[int]]:
    """The records of the full model (`plan.num_layers` layers) from those of the traced `plan.traced`-layer model.

    Needs `ops[i].index == i` and `storages[s].sid == s`. Returns new lists, numbered the same way; storages keep
    their category and are renamed to their layer in the full model (name and module path). A storage's birth
    (`op_index`) is the op it was first seen at. The third list maps each traced op index to the index of its
    last copy in the rebuilt ops (a check layer's op: the last rebuilt op before it). Raises NotPeriodic.
    """
    if plan.num_layers <= plan.traced:
        raise NotPeriodic(f"the model has only {plan.num_layers} layers")
    births: list[list[int]] = [[] for _ in ops]
    for s in storages:
        if s.op_index >= 0:
            births[s.op_index].append(s.sid)
    owners = _Ownership(plan, ops, storages, births)
    by_key: dict[tuple[int, tuple], int] = {own: s for s, own in enumerate(owners.owner) if own is not None}
    _check_periodic(owners, by_key)
    return _Rebuild(owners, by_key).run()


class _Ownership:
    """1. Phase by phase: which layer each op runs for (by module path in the forward and backward, by the
    storages it reads elsewhere: the optimizer step; `multi`: it reads several layers' storages, a foreach op),
    the sweeps and `units`, then every storage's `owner`: (traced layer, key) or None (global)."""

    def __init__(self, plan: LayerPlan, ops: list[RecOp], storages: list[RecStorage], births: list[list[int]]):
        self.plan, self.ops, self.storages, self.births = plan, ops, storages, births
        self.owner: list[tuple[int, tuple] | None] = [None] * len(storages)
        for s in storages:
            layer = plan.layer_of(s.name) if s.op_index < 0 else None
            if layer is not None:
                self.owner[s.sid] = (layer, ("pre", plan.rename(s.name, {layer: -1})))
        self.uses: dict[int, list[int]] = {}  # storage -> the ops that read or free it
        for o in ops:
            for s in (*o.ins, *o.frees):
                self.uses.setdefault(s, []).append(o.index)
        self.owner_layer: list[int | None] = [None] * len(ops)
        self.multi = [False] * len(ops)
        self.units: list[_Unit] = []
        # op index -> (unit, (op name, module relative to the unit's layer, how many such ops precede it in the
        # unit)): a storage's key, which survives a boundary layer running fewer ops of other kinds (the first
        # layer's backward has no all-gather of a layer before it to prefetch, under FSDP2)
        self.unit_of: dict[int, tuple[_Unit, tuple[str, str, int]]] = {}
        self.relative: dict[tuple[str, int], str] = {}  # (module path, layer) -> `_relative`
        phases: dict[tuple, list[int]] = {}
        for o in ops:  # each micro-step's phases are swept separately
            phases.setdefault((o.step, o.micro, o.phase), []).append(o.index)
        for group, idxs in phases.items():
            self.units += self._settle(group, idxs)
        self._share_boundary_chains()

    def _share_boundary_chains(self) -> None:
        """Make global a storage of a kept boundary layer (the first `head` or the last) that ops two or more layers
        away use: one storage serves every layer. The backward's residual-stream gradient is one: autograd
        accumulates a gradient into the buffer it arrived in when nothing else holds that buffer
        (torch/csrc/autograd/input_buffer.cpp `InputBuffer::accumulate`, in place while its use count is 1), so the
        sum made in the last layer (its incoming gradient is held elsewhere: a pipeline stage's received gradient)
        is added into by every layer below it. The template and the check layer then refer to the same storage,
        which the periodicity check requires; a storage only one of them uses still fails it."""
        kept = set(range(self.plan.head)) | {self.plan.traced - 1}
        for s, own in enumerate(self.owner):
            if own is None or own[0] not in kept:
                continue
            users = {self.owner_layer[u] for u in self.uses.get(s, ())} - {None}
            if any(abs(layer - own[0]) > 1 for layer in users):
                self.owner[s] = None

    def _settle(self, group: tuple, idxs: list[int]) -> list[_Unit]:
        """The units of one phase of one micro-step. Ownership feeds back into the tags (an op reading a step
        counter born in a layer's unit belongs to that layer), so repeat until the units settle."""
        phase = group[2]
        phase_units: list[_Unit] = []
        for _ in range(4):
            previous = phase_units
            self._tag(phase, idxs)
            phase_units = _sweeps(phase, idxs, self.owner_layer, self.multi, group, self.plan.traced)
            for k in idxs:
                for s in self.births[k]:
                    self.owner[s] = None
                self.unit_of.pop(k, None)
            self._key(phase_units)
            for k in idxs:
                _own_births(self.plan, self.ops[k], self.births[k], self.unit_of.get(k), self.storages, self.owner)
            if phase_units == previous:
                return phase_units
        raise NotPeriodic(f"the layers of the {phase} phase do not settle")

    def _tag(self, phase: str, idxs: list[int]) -> None:
        """Each op's layer (`owner_layer`) and whether it reads several layers' storages (`multi`)."""
        born_layer: dict[int, int | None] = {}
        for k in idxs:
            o = self.ops[k]
            if phase in ("forward", "backward") or (phase == "step" and o.module != "optimizer"):
                self.owner_layer[k] = self.plan.layer_of(o.module)
                if self.owner_layer[k] is None and not o.ins and phase == "backward":
                    self.owner_layer[k] = _user_layer(self.plan, self.ops, self.births[k], self.uses)
            else:
                seen = {self.owner[s][0] if self.owner[s] is not None else born_layer.get(s) for s in o.ins} - {None}
                self.owner_layer[k] = next(iter(seen)) if len(seen) == 1 else None
                self.multi[k] = len(seen) > 1
            for s in self.births[k]:
                born_layer[s] = self.owner_layer[k]

    def _relative(self, module: str, layer: int) -> str:
        """`module` with layer `layer`'s index as -1; memoized (a module path recurs in every unit, and `_settle`
        keys each phase up to four times)."""
        out = self.relative.get((module, layer))
        if out is None:
            out = self.relative[module, layer] = self.plan.rename(module, {layer: -1})
        return out

    def _key(self, phase_units: list[_Unit]) -> None:
        """`unit_of` for the ops of `phase_units`."""
        for u in phase_units:
            seen: dict[tuple[str, str], int] = {}
            for k in range(u.start, u.stop):
                # a compiled graph's buffer that reuses a dying one's storage is keyed as the allocation it
                # is in the first layer, which has no earlier layer's buffers to reuse
                name = ALLOCATION_OP if self.ops[k].name == REUSE_OP else self.ops[k].name
                what = (name, self._relative(self.ops[k].module, u.layer))
                self.unit_of[k] = (u, (*what, seen.get(what, 0)))
                seen[what] = seen.get(what, 0) + 1


def _tensor_sig(s: RecStorage) -> tuple:
    """What makes two storages the same tensor: bytes, dtype, shape, device and the op that made it."""
    return s.nbytes, s.dtype, s.shape, s.device, s.op


def _sig_storage(plan: LayerPlan, s: RecStorage, layer: int) -> tuple:
    """What a storage of traced layer `layer` must share with its twin in the next layer."""
    return (*_tensor_sig(s), s.phase, s.category, s.saved, s.op_index < 0,
            plan.rename(s.name, {layer: -1, layer + 1: -2, layer - 1: -3}), plan.rename(s.module, {layer: -1}))


def _sig_op(owners: _Ownership, o: RecOp, layer: int) -> tuple:
    """What an op of traced layer `layer` must share with its twin in the next layer: every reference relative
    to its own layer."""
    plan, owner, storages = owners.plan, owners.owner, owners.storages

    def rel(s: int):
        own = owner[s]
        if own is None:
            return ("global", s)
        if abs(own[0] - layer) > 1:
            raise NotPeriodic(f"layer {layer} uses a storage of layer {own[0]} ({storages[s].name or storages[s].op})")
        return (own[0] - layer, own[1])

    return (o.name, o.phase, o.lead, o.flops, o.recompute,
            plan.rename(o.module, {layer: -1, layer + 1: -2, layer - 1: -3}),
            *(tuple(rel(s) for s in group) for group in (o.ins, o.outs, o.frees, owners.births[o.index])))


def _check_periodic(owners: _Ownership, by_key: dict[tuple[int, tuple], int]) -> None:
    """3. The check: the check layer's records equal the template's, shifted by one layer. Raises NotPeriodic."""
    plan, ops, storages = owners.plan, owners.ops, owners.storages
    T, C = plan.template, plan.check
    check = {u.tag: u for u in owners.units if u.layer == C}
    for u1 in (u for u in owners.units if u.layer == T):
        u2 = check[u1.tag]
        if u1.stop - u1.start != u2.stop - u2.start:
            raise NotPeriodic(f"layers {T} and {C} run {u1.stop - u1.start} and {u2.stop - u2.start} ops in "
                              f"{u1.tag[0]}")
        for k in range(u1.stop - u1.start):
            if _sig_op(owners, ops[u1.start + k], T) != _sig_op(owners, ops[u2.start + k], C):
                raise NotPeriodic(f"layers {T} and {C} differ at {ops[u1.start + k].name} in {u1.tag[0]}")
    n_owned = [0] * plan.traced
    for (layer, key), s in by_key.items():
        n_owned[layer] += 1
        if layer == T:
            s2 = by_key.get((C, key))
            if s2 is None or _sig_storage(plan, storages[s], T) != _sig_storage(plan, storages[s2], C):
                raise NotPeriodic(f"layer {C} has no storage like layer {T}'s {storages[s].name or storages[s].op}")
    if n_owned[T] != n_owned[C]:
        raise NotPeriodic(f"layers {T} and {C} own different numbers of storages")


class _Rebuild:
    """4. The full model's records, storages numbered in order of appearance; 5. their births."""

    def __init__(self, owners: _Ownership, by_key: dict[tuple[int, tuple], int]):
        self.owners, self.by_key = owners, by_key
        plan = self.plan = owners.plan
        self.ops, self.storages, self.births, self.owner = owners.ops, owners.storages, owners.births, owners.owner
        self.L, self.T, self.C, self.head, self.last = (plan.num_layers, plan.template, plan.check, plan.head,
                                                        plan.traced - 1)
        self.kept = {**{i: i for i in range(self.T + 1)}, self.C: self.L - 2, self.last: self.L - 1}
        self.new_storages: list[RecStorage] = []
        self.ids: dict[tuple, int] = {}
        self.module_names: dict[tuple, str] = {}  # module paths repeat: rename each (path, layers) once
        self.template_ids: dict[int, dict[int, int]] = {}  # final layer -> traced sid -> new id: each resolved once
        self.new_ops: list[RecOp] = []
        self.new_births: list[list[int]] = []
        self.new_index = [-1] * len(self.ops)
        # whether each traced op's births are its outputs, in order (most ops': `emit` reuses their new ids)
        self.born_outs = [tuple(b) == o.outs for o, b in zip(self.ops, self.births)]
        self.alike: set[int] = set()  # boundary layers' traced sids found alike their template twin (`item`)

    def run(self) -> tuple[list[RecOp], list[RecStorage], list[int]]:
        self._pre()
        self._emit_ops()
        for o, born in zip(self.new_ops, self.new_births):
            for s in born:
                self.new_storages[s].op_index = o.index
                self.new_storages[s].phase = str(o.phase)
        new_index = self.new_index
        for k in range(len(new_index)):
            if new_index[k] < 0:
                new_index[k] = new_index[k - 1] if k else -1
        return self.new_ops, self.new_storages, new_index

    def item(self, final: int, key: tuple) -> tuple[int, int]:
        """(traced sid, final layer) of the storage `key` of layer `final` of the full model."""
        T, last, storages = self.T, self.last, self.storages
        traced = final if final < self.head else last if final == self.L - 1 else T
        s = self.by_key.get((traced, key))
        if s is None:
            raise NotPeriodic(f"layer {traced} has no storage for {key}")
        # a boundary layer's storage may be used differently (the last layer's output is saved by the head),
        # but it must be the same tensor as the template's (the layers before the one before the template may
        # own other storages: `LayerPlan.head`); checked once per storage (a boundary op's lists repeat it)
        if traced in (T - 1, last) and (T, key) in self.by_key and s not in self.alike:
            if _tensor_sig(storages[s]) != _tensor_sig(storages[self.by_key[(T, key)]]):
                raise NotPeriodic(f"layer {traced}'s {storages[s].name or storages[s].op} is unlike layer {T}'s")
            self.alike.add(s)
        return s, final

    def module_renamed(self, path: str, names: dict[int, int]) -> str:
        key = (path, *names.items())
        out = self.module_names.get(key)
        if out is None:
            out = self.module_names[key] = self.plan.rename(path, names)
        return out

    def sid_of(self, it: tuple) -> int:
        """The new id of `it`: ('global', sid) or (traced sid, final layer)."""
        nid = self.ids.get(it)
        if nid is None:
            nid = self.ids[it] = len(self.new_storages)
            if it[0] == "global":
                s, names = self.storages[it[1]], self.kept
            else:
                s, layer = self.storages[it[0]], self.owner[it[0]][0]
                names = {layer: it[1], layer + 1: it[1] + 1, layer - 1: it[1] - 1}
            self.new_storages.append(s.copy(nid, self.plan.rename(s.name, names) if s.name else "",
                                            self.module_renamed(s.module, names), s.op_index, s.held_micro))
        return nid

    def refs_template(self, sids: Iterable[int], final: int) -> list[int]:
        """The new ids of a template op's storages in the full model's layer `final`."""
        ids_f = self.template_ids.get(final)
        if ids_f is None:
            ids_f = self.template_ids[final] = {}
        try:  # most are resolved already: a unit's ops refer to its own storages again and again
            return [ids_f[s] for s in sids]
        except KeyError:
            pass
        out = []
        for s in sids:
            nid = ids_f.get(s)
            if nid is None:
                own = self.owner[s]
                nid = ids_f[s] = (self.sid_of(("global", s)) if own is None
                                  else self.sid_of(self.item(final + own[0] - self.T, own[1])))
            out.append(nid)
        return out

    def refs_kept(self, sids: Iterable[int]) -> list[int]:
        """The new ids of a kept op's storages (a global op's lists spanning layers: the template's entries once
        per middle layer, the check layer's none)."""
        sids = list(sids)
        T, C, owner = self.T, self.C, self.owner
        layers = {owner[s][0] for s in sids if owner[s] is not None}
        spread = T in layers and C in layers  # a list over every layer: the template's entries once per middle layer
        out = []
        for s in sids:
            own = owner[s]
            if own is None:
                out.append(self.sid_of(("global", s)))
            elif spread and own[0] == T:
                out.extend(self.sid_of(self.item(f, own[1])) for f in range(self.head, self.L - 1))
            elif not (spread and own[0] == C):
                out.append(self.sid_of(self.item(self.kept[own[0]], own[1])))
        return out

    def _pre(self) -> None:
        """The storages alive at step start (parameters, buffers, inputs), in the full model's order."""
        owner, T = self.owner, self.T
        pre = [s.sid for s in self.storages if s.op_index < 0]
        pre_middle = [s for s in pre if owner[s] is not None and owner[s][0] == T]
        for s in pre:
            own = owner[s]
            if own is not None and own[0] in (T, self.C):
                if s == pre_middle[0]:
                    for f in range(self.head, self.L - 1):
                        self.refs_template(pre_middle, f)
                continue
            self.refs_kept([s])

    def emit(self, o: RecOp, module: str, refs) -> None:
        self.new_index[o.index] = len(self.new_ops)
        ins = tuple(refs(o.ins))
        outs = tuple(refs(o.outs))
        self.new_ops.append(RecOp(len(self.new_ops), o.name, o.phase, module, ins, outs,
                                  tuple(refs(o.frees)) if o.frees else (), o.lead, o.flops, o.recompute, o.step,
                                  o.micro))
        born = list(outs) if self.born_outs[o.index] else refs(self.births[o.index])
        if len(ins) != len(o.ins) and _stacks_its_inputs(o, self.births[o.index], self.storages):
            out = self.new_storages[born[0]]  # one element per tensor of the full model's list
            out.nbytes, out.shape = out.nbytes // len(o.ins) * len(ins), (len(ins),)
        self.new_births.append(born)

    def _emit_ops(self) -> None:
        """Every op: a kept layer's or a global op once, the template's units once per middle layer (in the
        order its sweep runs them), the check layer's none."""
        ops, T, C, head, L = self.ops, self.T, self.C, self.head, self.L
        units, unit_of = self.owners.units, self.owners.unit_of
        k = 0
        while k < len(ops):
            hit = unit_of.get(k)
            if hit is None or hit[0].layer != T:
                if hit is None or hit[0].layer != C:
                    self.emit(ops[k], self.module_renamed(ops[k].module, self.kept), self.refs_kept)
                k += 1
                continue
            u = hit[0]
            descending = any(v.tag == u.tag and v.layer == 0 and v.start > u.start for v in units)
            for f in (range(L - 2, head - 1, -1) if descending else range(head, L - 1)):
                names = {T - 1: f - 1, T: f, C: f + 1}

                def refs(sids, f=f):
                    return self.refs_template(sids, f)

                for t in range(u.start, u.stop):
                    self.emit(ops[t], self.module_renamed(ops[t].module, names), refs)
            k = u.stop
