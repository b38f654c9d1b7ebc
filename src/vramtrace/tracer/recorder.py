"""Record one eager step at the dispatch level: every aten op, every storage, and where eager frees it.

The recorder is a TorchDispatchMode (below autograd, so it sees the ops that really run, forward and backward,
and the optimizer's). For every op output whose storage is new it registers the storage and a
`weakref.finalize` on the storage object: the finalizer fires exactly when the last reference to the storage
dies (Python locals, autograd saved tensors, optimizer temporaries), so frees land where eager frees them.
This is the technique of PyTorch's `test/inductor/test_mem_estimation.py` (FakeTensorMemoryProfilerMode).

Storages are keyed by a recorder-assigned id (`sid`); a live storage is found by the address of its StorageImpl
(`storage_key(t).cdata`), dropped when the storage dies; while it is listed, a `StorageWeakRef` on it keeps the
address from being reused (the one its free's `weakref.finalize` holds), so a storage made later at the same
address gets a new id.

An op with fresh outputs that ran before with the same arguments (by layout) gets outputs built from the layouts
its meta kernel gave then (`MetaResultCache`, keyed as FakeTensor's dispatch cache is): the repeated layers and
micro-steps of a trace run their Python meta kernels once.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import SUPPORTED_NODES, tree_flatten, tree_map

from ..errors import UnsupportedOpError
from .probe import op_flops
from .profiling import cpu_zeros_like
from .records import REUSE_OP, Phase, RecOp, RecStorage

FALLBACK_LIMIT_BYTES = 256 << 20  # inputs of an op without a meta kernel that the CPU fallback may run

_MODULE_KEY = "vramtrace_module"
RESIZE_OP = "storage.resize_"  # the pseudo-op of an in-place storage resize up (storage_resized)
MANAGED_DEVICE = "cuda_managed"  # the device of a storage outside the caching allocator (`managed`)
HOST_DEVICE = "host"  # the device of a storage in host memory on a CUDA target (FSDP2's CPU offload: `offload`)
_ADD = torch.ops.aten.add.Tensor
# A functional collective's output wrapped for autograd (torch/distributed/_functional_collectives.py
# `_wrap_tensor_autograd`: an AsyncCollectiveTensor around the input, no allocation; its fake kernel is `empty_like`).
# A name, compared only in the `_c10d_functional` namespace: that module defines the op when it loads, after this
# one (tests/test_op_rules.py checks the name resolves once it has)
_DEVICE_QUERY = torch.ops.prim.device.default  # `Tensor.device` of a subclass that dispatches it
_WRAP_COLLECTIVE = "_c10d_functional._wrap_tensor_autograd.default"
# references to an input-buffer gradient seen from the top of __torch_dispatch__ when the engine holds the last one
# (the buffer, the dispatcher's argument, the Python argument, the engine's own copy): see _accumulates_in_place;
# a private read declared as bridges.ACCUMULATION_USE_COUNTS, with the storage's count
ACCUMULATE_USE_COUNT = 4


# Set by `keeping_args`: recorders made meanwhile keep every op's arguments (`StepRecorder.op_args`), for a runnable
# FX graph of the step (fx_export.py); off by default, since the tracer's analyses need storages only
_KEEP_ARGS: contextvars.ContextVar[bool] = contextvars.ContextVar("vramtrace_keep_args", default=False)


@contextlib.contextmanager
def keeping_args():
    """Recorders created inside keep each op's arguments and outputs (`StepRecorder.op_args`)."""
    token = _KEEP_ARGS.set(True)
    try:
        yield
    finally:
        _KEEP_ARGS.reset(token)


@dataclass(frozen=True, slots=True)
class TensorArg:
    """A tensor among an op's recorded arguments or outputs: its storage (`sid`), and its view of it: sizes,
    strides and storage offset in elements of `dtype`. A pytree leaf (not a tuple)."""

    sid: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype


def tensor_leaves(tree) -> list[torch.Tensor]:
    """The tensors among `tree`'s leaves, in the order of `tree_flatten(tree)[0]` (torch/utils/_pytree.py), which
    the recorder's `ins`, `outs` and record numbering follow. Plain containers (exactly tuple, list or dict: a dict
    in its insertion order, as `_dict_flatten`) are walked here; any other pytree node (a namedtuple, a structseq,
    an OrderedDict, a class registered with `register_pytree_node`, any tuple subclass) is flattened by
    `tree_flatten` itself, in its place. An op's (args, kwargs) and outputs are plain containers: this skips the
    TreeSpec that `tree_flatten` builds for every node and the namedtuple check it makes for every leaf."""
    out: list[torch.Tensor] = []
    _collect_tensors(tree, out)
    return out


def _collect_tensors(tree, out: list[torch.Tensor]) -> None:
    kind = type(tree)
    if kind is tuple or kind is list:
        children = tree
    elif kind is dict:
        children = tree.values()
    elif kind in SUPPORTED_NODES or issubclass(kind, tuple):  # pytree's own node types, namedtuples: its order
        out.extend(t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor))
        return
    else:  # a leaf (pytree: a type not in SUPPORTED_NODES and not a namedtuple)
        if isinstance(tree, torch.Tensor):
            out.append(tree)
        return
    for x in children:
        kind = type(x)
        if kind is tuple or kind is list or kind is dict or kind in SUPPORTED_NODES or issubclass(kind, tuple):
            _collect_tensors(x, out)
        elif isinstance(x, torch.Tensor):
            out.append(x)


def storage_of(t: torch.Tensor) -> torch.UntypedStorage:
    """The storage that holds t's data: a DTensor's (FSDP2's sharded parameters, their gradients and optimizer
    states, TP's weights) is its local tensor's; the DTensor wrapper's own `untyped_storage()` is a storage of
    the global shape that holds nothing (torch/distributed/tensor/_api.py: a wrapper subclass)."""
    local = getattr(t, "_local_tensor", None)
    return (local if isinstance(local, torch.Tensor) else t).untyped_storage()


def storage_key(t: torch.Tensor) -> StorageWeakRef:
    """The key of t's storage (`storage_of`) while it is alive: a `StorageWeakRef` (torch/multiprocessing/
    reductions.py), equal for every tensor over the same StorageImpl, as torch's own FX passes key storages
    (analysis/graph_liveness.py too). It holds no reference to the data; the recorder drops it when the storage
    dies (its finalizer), so a StorageImpl made later at the same address is a new key's storage."""
    return StorageWeakRef(storage_of(t))


def _address(t: torch.Tensor) -> int:
    """The address of t's StorageImpl (`storage_of`): `storage_key(t).cdata` (both are the StorageImpl pointer,
    torch/csrc/StorageMethods.cpp `THPStorage_weakRef`, torch/csrc/Storage.cpp `THPStorage_get_cdata`), without
    the weak reference: an int key of the recorder's live storages. While a storage is listed, the StorageWeakRef
    its free's finalizer holds as an argument (`_watch`) keeps the address from being reused."""
    return storage_of(t)._cdata


# -- a cache of meta kernels' results ---------------------------------------------------------------------------
# The non-tensor arguments a cache key holds by (type, value): 1, 1.0 and True are equal and hash alike, but give
# outputs of other dtypes (torch/_subclasses/fake_tensor.py `_prep_args_for_hash` keys them the same way)
_KEY_SCALARS = frozenset({int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
                          torch.memory_format})
_KEY_SEQUENCES = frozenset({tuple, list, torch.Size})
_EXCLUDED_TAGS = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape, torch.Tag.inplace_view,
                  torch.Tag.nondeterministic_seeded)


def _cacheable_op(func) -> bool:
    """Whether the meta results of `func` may be cached (`MetaResultCache`): an aten or prims OpOverload whose
    schema has no alias annotation (no view, no in-place, no out=) and returns only tensors or lists of tensors, and
    none of the ops FakeTensor's own cache bypasses (torch/_subclasses/fake_tensor.py `_validate_cache_key`:
    data-dependent output, dynamic output shape, in-place view, `_unsafe_view`, the lift functions, non-builtin
    ops) nor a random op (`nondeterministic_seeded`)."""
    if not isinstance(func, torch._ops.OpOverload) or func.namespace not in ("aten", "prims"):
        return False
    schema = func._schema
    if (not schema.returns or any(a.alias_info is not None for a in schema.arguments)
            or func is torch.ops.aten._unsafe_view.default
            or func in (torch.ops.aten.lift.default, torch.ops.aten.lift_fresh.default,
                        torch.ops.aten.lift_fresh_copy.default)
            or any(tag in func.tags for tag in _EXCLUDED_TAGS)):
        return False
    for r in schema.returns:
        kind = r.type.getElementType() if isinstance(r.type, torch.ListType) else r.type
        if r.alias_info is not None or not isinstance(kind, torch.TensorType):
            return False
    return True


class MetaResultCache:
    """The outputs' layouts of the meta kernels an op ran with the same arguments before, to build its outputs
    without running its kernel again (most are Python decompositions, torch/_refs and torch/_prims_common, and
    cost far more than the recorder's own work on an op).

    What it holds, mirroring FakeTensor's dispatch cache (torch/_subclasses/fake_tensor.py `_cached_dispatch_impl`,
    `_cache_key`, `_prep_args_for_hash`, `_validate_cache_key`, `_validate_output_for_cache_entry`):
    - ops: `_cacheable_op` (FakeTensor's exclusions, and only ops with fresh outputs: no alias annotation).
    - calls: only where no other dispatch mode is below the recorder's (a FakeTensorMode would see the call and
      make its outputs; the recorder's own mode is off the stack while it handles an op).
    - key: the op; the default dtype and device, inference mode, grad mode and the CPU and CUDA autocast state
      (meta tensors have no autocast key: kept to be safe); each argument: a plain
      `torch.Tensor` on meta (exact type: no subclass, so no DTensor, FakeTensor or FunctionalTensor; strided, not
      nested, quantized, conjugated or negated) by its shape, strides, storage offset, dtype, storage bytes, requires_grad and
      whether it is an inference tensor; a scalar, dtype, device, layout, memory format or string by (type,
      value); a tuple, list or torch.Size by its type and items. Any other argument (a SymInt, a Generator, a
      subclass) makes the call uncached.
    - value: stored only when every output is a plain strided meta tensor, not a view, not requiring grad, held by
      nothing but itself (a use count of 1, and 2 on its storage: it and the storage object asked) and with a
      storage of its own (no input's, no other output's): its shape, strides, storage offset, dtype and storage
      bytes, and the outputs' nesting (a tensor, a tuple or a list).
    A hit builds each output as a new meta storage of the recorded bytes (`torch.UntypedStorage`) set to the
    recorded view (`aten.set_`): the same tensor as the kernel's for everything the recorder and autograd read."""

    def __init__(self):
        self._ops: dict[Any, bool] = {}  # op -> _cacheable_op(op)
        self._entries: dict[tuple, Any] = {}
        self.hits = 0
        self.misses = 0

    def __call__(self, func, args, kwargs):
        """func(*args, **kwargs): its kernel's outputs, or the outputs built from an earlier identical call's."""
        cacheable = self._ops.get(func)
        if cacheable is None:
            cacheable = self._ops[func] = _cacheable_op(func)
        if not cacheable or torch._C._len_torch_dispatch_stack():  # a mode below the recorder's sees every call
            return func(*args, **kwargs)
        key = _call_key(func, args, kwargs)
        if key is None:
            return func(*args, **kwargs)
        entry = self._entries.get(key)
        if entry is not None:
            self.hits += 1
            return _build(entry)
        out = func(*args, **kwargs)
        self.misses += 1
        entry = _entry(out, args, kwargs)
        if entry is not None:
            self._entries[key] = entry
        return out


def _call_key(func, args, kwargs) -> tuple | None:
    key = [func, torch.get_default_dtype(), torch._C._get_default_device(), torch.is_inference_mode_enabled(),
           torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),
           torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")]
    if not _key_items(args, key) or not _key_items(kwargs.values(), key):
        return None
    key.append(tuple(kwargs))
    return tuple(key)


def _key_items(items, key: list) -> bool:
    """Append the key of each of `items` to `key`; False when one cannot be keyed."""
    for x in items:
        kind = type(x)
        if kind is torch.Tensor:
            if (x.device.type != "meta" or x.layout is not torch.strided or x.is_nested or x.is_quantized
                    or x.is_conj() or x.is_neg()):
                return False
            key.append((tuple(x.shape), x.stride(), x.storage_offset(), x.dtype, x.untyped_storage().nbytes(),
                        x.requires_grad, x.is_inference()))
        elif kind in _KEY_SCALARS:
            key.append((kind, x))
        elif kind in _KEY_SEQUENCES:
            key.append((kind, len(x)))
            if not _key_items(x, key):
                return False
        else:
            return False
    return True


def _entry(out, args, kwargs):
    """The layouts of `out` to rebuild it from (`_build`), or None when an output is not a fresh plain tensor."""
    inputs = {t.untyped_storage()._cdata for t in tensor_leaves((args, kwargs))}
    seen: set[int] = set()

    def layout(x):
        kind = type(x)
        if kind is tuple or kind is list:
            parts = [layout(v) for v in x]
            return None if any(p is None for p in parts) else (kind, tuple(parts))
        if (kind is not torch.Tensor or x.device.type != "meta" or x.layout is not torch.strided or x._is_view()
                or x.requires_grad or x.is_conj() or x.is_neg() or x._use_count() != 1):
            return None
        st = x.untyped_storage()
        if st._cdata in inputs or st._cdata in seen or torch._C._storage_Use_Count(st._cdata) != 2:
            return None
        seen.add(st._cdata)
        return (torch.Tensor, (tuple(x.shape), x.stride(), x.storage_offset(), x.dtype, st.nbytes()))

    return layout(out)


def _build(entry):
    kind, what = entry
    if kind is not torch.Tensor:
        return kind(_build(e) for e in what)
    shape, stride, offset, dtype, nbytes = what
    t = torch.ops.aten.empty.memory_format([0], dtype=dtype, device="meta")
    torch.ops.aten.set_.source_Storage_storage_offset(t, torch.UntypedStorage(nbytes, device="meta"), offset, shape,
                                                      stride)
    return t


class StepRecorder(TorchDispatchMode):
    """Dispatch mode recording ops, storages and eager frees. Set `phase` (a `Phase`), `step` and `micro` between
    the parts of the step. Under `Phase.STEP` (a user's step function) the phase of each op is found as it runs:
    backward inside the autograd engine, optimizer inside `Optimizer.step` (`in_optimizer`, kept by the trace's
    optimizer hooks), forward inside the model's forward (`forward_depth`), else step."""

    cache_meta_results = True  # whether recorders made from now on have a `meta_cache`

    def __init__(self):
        super().__init__()
        self._phase = Phase.STEP
        self.step = 0
        self.micro = 0
        self.forward_depth = 0  # > 0 inside the model's own forward (tracer/hooks.py)
        self.in_optimizer = 0  # > 0 inside Optimizer.step
        self.ops: list[RecOp] = []
        self.storages: list[RecStorage] = []
        self.free_after: dict[int, int] = {}  # sid -> index of the last op completed when it was freed
        self._live: dict[int, int] = {}  # a live storage's address (`_address`, storage_key(t).cdata) -> sid
        self._op_names: dict[torch._ops.OpOverload, str] = {}  # op -> str(op)
        self._finalizers: list[weakref.finalize] = []
        self._lock = threading.Lock()
        self.module_stack: list[str] = []
        self.recomputing = 0  # > 0 while a checkpointed region's forward is re-run in the backward
        # (func, args, kwargs, meta out) -> (bytes the target's kernel allocates and frees inside the op, an int or a
        # tuple of blocks in allocation order, and the output laid out as the target's kernel lays it out)
        # (probe.CpuWorkspaceProbe; on a CUDA target cuda_reductions.cuda_workspace_hook)
        self.workspace: Callable[[Any, tuple, dict, Any], tuple[int | tuple[int, ...], Any]] | None = None
        self.strict = False  # an op without a meta kernel raises UnsupportedOpError (else: CPU fallback, listed)
        self.unresolved: list[str] = []
        self._finished_node = None  # the autograd node whose apply just finished: the engine accumulates its outputs
        # The per-op tables below are keyed by the op's overload (torch.ops.aten.mm.default: op_rules.op_table) and
        # looked up with the dispatched `func`.
        # op -> ('outputs', a keyword argument or 'workspace', category): storages an op makes or writes, or
        # the workspace it holds, that get a category when they have none (sharding.fsdp_op_categories)
        self.op_categories: dict[torch._ops.OpOverload, tuple[str, str]] = {}
        # (op, its first input's category) -> the category of the storages it makes (the int8 weight cast to
        # a float dtype: a dequantized weight, quantization.quantized_recording)
        self.derived_categories: dict[tuple[torch._ops.OpOverload, str], str] = {}
        # op -> its kernel for meta inputs, in place of the registered one (the int8 ops of bitsandbytes, whose
        # fake kernels need a FakeTensorMode for a data-dependent size: quantization.quantized_recording)
        self.meta_kernels: dict[torch._ops.OpOverload, Callable] = {}
        # op -> the order in which the target's kernel allocates its tensor outputs (indices into the flattened
        # outputs; the meta kernel's order where absent): the caching allocator's best fit depends on it
        # (kernels.CUDA_OUTPUT_ORDER)
        self.output_order: dict[torch._ops.OpOverload, tuple[int, ...]] = {}
        # FSDP2's CPU offload (`offload`): storages in host memory, the ops that make them; > 0 inside a host-to-device
        # copy (`device_copy`)
        self.offloading = False
        self._copying_to_device = 0
        self._resized_away: set[int] = set()  # records whose storage was resized (storage_resized): freed there
        self._resized_from: dict[StorageWeakRef, int] = {}  # storage_key -> its last record, while resized to 0
        # op index -> (args, kwargs, output) with every tensor a TensorArg, for the ops of `__torch_dispatch__`
        # (not the pseudo-ops), when made under `keeping_args`; else None
        self.op_args: dict[int, tuple] | None = {} if _KEEP_ARGS.get() else None
        self.pipeline = None  # --pp: the traced stage's micro-steps and buffers (tracer/pipelining.py StageTrace)
        # the meta kernels' results of earlier identical calls (None: every op runs its kernel)
        self.meta_cache: MetaResultCache | None = MetaResultCache() if self.cache_meta_results else None

    @property
    def phase(self) -> Phase:
        if self._phase is not Phase.STEP:
            return self._phase
        if torch._C._current_autograd_node() is not None:
            return Phase.BACKWARD
        if self.in_optimizer:
            return Phase.OPTIMIZER
        if self.forward_depth:
            return Phase.FORWARD
        return Phase.STEP

    @phase.setter
    def phase(self, value: Phase) -> None:
        self._phase = Phase(value)

    # -- storages ----------------------------------------------------------------------------------------
    def _on_free(self, key: StorageWeakRef, sid: int) -> None:
        with self._lock:
            if self._live.get(key.cdata) == sid:
                del self._live[key.cdata]
            if self._resized_from.get(key) == sid:
                del self._resized_from[key]
            if sid not in self._resized_away:
                self.free_after[sid] = len(self.ops) - 1

    def _retire(self, address: int) -> int | None:
        """End the record of the live storage at `address` (`_address`) after the last op, while the storage lives
        on as a new record (a resize, a reuse); its finalizer then frees the new record, not this one. Returns the
        record, or None."""
        old = self._live.pop(address, None)
        if old is not None:
            self.free_after[old] = len(self.ops) - 1
            self._resized_away.add(old)
        return old

    def storage_reused(self, t: torch.Tensor, module: str, op: str, shape: tuple[int, ...]) -> None:
        """t's live storage is taken over by a new buffer of a compiled graph (Inductor's `# reuse` line: memory
        planning or an in-place kernel hands a dying buffer's storage to the next buffer of the same size, with no
        free and no allocation in between). The storage's record so far dies after the last op and the new buffer
        is a new record of the same bytes and the new buffer's `shape`, born at a pseudo-op `REUSE_OP` of `module`
        with `op` (the op the buffer was lowered from): bytes live never differ from the real run's, and a buffer
        that one layer hands to the next is owned by each layer in turn, as layer replication needs."""
        if self._retire(_address(t)) is None:
            return
        index = len(self.ops)
        sid = self.storage_id(t, op_index=index, op=op or REUSE_OP)
        self.storages[sid].module = module or self.storages[sid].module
        self.storages[sid].shape = tuple(shape)
        self.ops.append(RecOp(index, REUSE_OP, self.phase, module or self.current_module(), (), (sid,), (), 0, 0,
                              False, self.step, self.micro))

    def storage_resized(self, t: torch.Tensor) -> None:
        """t's storage was resized in place (`UntypedStorage.resize_`, which the dispatcher does not see; FSDP2's
        `alloc_storage`/`free_storage` for its unsharded parameters, `bridges.FSDP_ON_META`). The CPU resize
        allocates the new size, copies and frees the old data (aten/src/ATen/native/Resize.cpp `resize_bytes_cpu`):
        the storage's record so far dies after the last op, and a size above 0 is a new record born at a pseudo-op
        `storage.resize_`, with the category and name of the storage's last record (also across a resize to 0)."""
        st = storage_of(t)
        key = StorageWeakRef(st)
        old = self._retire(key.cdata)
        if old is not None:
            self._resized_from[key] = old
        if st.nbytes() == 0:
            return
        index = len(self.ops)
        sid = self.storage_id(t, op_index=index, op=RESIZE_OP)
        old = self._resized_from.pop(key, None)
        if old is not None:
            self.storages[sid].category = self.storages[old].category
            self.storages[sid].name = self.storages[old].name
        self.ops.append(RecOp(index, RESIZE_OP, self.phase, self.current_module(), (), (sid,), (), 0, 0, False,
                              self.step, self.micro))

    def storage_id(self, t: torch.Tensor, *, op_index: int, op: str, category: str | None = None,
                   name: str = "") -> int:
        """The sid of t's storage, registering it (born at `op_index`) if it is new."""
        st = storage_of(t)
        sid = self._live.get(st._cdata)
        if sid is not None:
            return sid
        sid = len(self.storages)
        module = self.current_module() if op_index >= 0 else ""
        shape = tuple(getattr(t, "_local_tensor", t).shape)
        self.storages.append(RecStorage(sid, st.nbytes(), str(t.dtype).removeprefix("torch."), shape,
                                      t.device.type, op_index, op, module, str(self.phase), category, name))
        self._watch(st, sid)
        return sid

    def _watch(self, st: torch.UntypedStorage, sid: int) -> None:
        """Map the live storage `st` to record `sid` and record its free where its last reference dies."""
        key = StorageWeakRef(st)
        self._live[key.cdata] = sid
        self._finalizers.append(weakref.finalize(st, self._on_free, key, sid))

    def host_data(self, t: torch.Tensor) -> None:
        """A tensor made from host data (`torch.tensor(x, device=...)`, kernels.py `_HOST_DATA_FACTORIES`) whose
        storage no op recorded: record its allocation as the op `aten.lift_fresh` that the same call records on
        the CPU (on a CUDA device it is an allocation of the caching allocator and a host-to-device copy). A
        storage an op already recorded (the CPU path's own `aten.lift_fresh`) is left as it is."""
        if _address(t) in self._live:
            return
        index, name = len(self.ops), str(torch.ops.aten.lift_fresh.default)
        sid = self.storage_id(t, op_index=index, op=name)
        self.ops.append(RecOp(index, name, self.phase, self.current_module(), (), (sid,), (), 0, 0, False,
                              self.step, self.micro))

    def live_sid(self, t: torch.Tensor) -> int | None:
        """The sid of t's storage if it is registered and alive, else None."""
        return self._live.get(_address(t))

    def adopt(self, t: torch.Tensor, sid: int) -> None:
        """Make t's storage the live storage of the existing record `sid` (a storage whose birth was written by
        replaying an earlier record, `trace._TraceObserver.replay`): its free is then recorded where t's dies."""
        self._watch(storage_of(t), sid)

    def forget(self, t: torch.Tensor) -> None:
        """Stop watching t's storage: its record's free is written by the caller (a replayed record)."""
        self._live.pop(_address(t), None)

    def register_existing(self, t: torch.Tensor, category: str, name: str) -> int:
        """Register a tensor alive at step start (parameter, buffer, input, optimizer state)."""
        sid = self.storage_id(t, op_index=-1, op="", category=category, name=name)
        s = self.storages[sid]
        if s.category is None or s.op_index == -1:
            s.category, s.name = category, s.name or name
        return sid

    def hold(self, t: torch.Tensor, what: str, micro: int) -> None:
        """Mark t's storage as the loop's `what` ('outputs' or 'loss') of micro-step `micro` (analysis/storages.py
        derives each loop's release from it)."""
        sid = self._live.get(_address(t))
        if sid is not None and self.storages[sid].op_index >= 0:
            s = self.storages[sid]
            s.held_as, s.held_micro = what, micro

    def managed(self, t: torch.Tensor, category: str) -> None:
        """t's storage is memory outside the target's caching allocator (CUDA managed memory: a paged
        bitsandbytes optimizer's state): its record gets `category` and the device 'cuda_managed', which no
        target counts as allocated (trace.py `counted`)."""
        sid = self._live.get(_address(t))
        if sid is not None:
            self.storages[sid].category = category
            self.storages[sid].device = MANAGED_DEVICE

    def offload(self, t: torch.Tensor) -> None:
        """t's storage lives in host memory (FSDP2's CPU offload: a sharded parameter; an output a CUDA kernel makes
        on the host, kernels.py `on_host_output`): device 'host', which a CUDA target does not count. Once `offloading` is set, the recorder also puts in host memory what an op makes
        from host storages only (the optimizer step and its state, gradient accumulation, on the CPU), and the
        output of a copy to the CPU (`aten._to_copy` with device cpu: FSDP2's gradient offload)."""
        sid = self._live.get(_address(t))
        if sid is not None:
            self.storages[sid].device = HOST_DEVICE

    @contextlib.contextmanager
    def device_copy(self):
        """While open, what an op makes from host storages is on the device (a host-to-device copy)."""
        self._copying_to_device += 1
        try:
            yield
        finally:
            self._copying_to_device -= 1

    def _to_host(self, func, args, kwargs) -> bool:
        """Whether the op is a copy of a meta tensor to the CPU under `offloading` (its output is host memory)."""
        if not self.offloading or func is not torch.ops.aten._to_copy.default:
            return False
        device = kwargs.get("device")
        return device is not None and torch.device(device).type == "cpu" and args[0].device.type == "meta"

    def describe(self, t: torch.Tensor, module: str, op: str) -> None:
        """Give t's live storage the module and the op it belongs to (a compiled graph's buffer: both come from the
        FX node it was lowered from, not from the module stack and the allocating call); the op that allocated it
        gets the module too (layer replication reads an op's layer from its module)."""
        sid = self._live.get(_address(t))
        if sid is not None:
            s = self.storages[sid]
            s.module, s.op = module or s.module, op or s.op
            if module and 0 <= s.op_index < len(self.ops) and self.ops[s.op_index].outs == (sid,):
                self.ops[s.op_index].module = module

    def set_category(self, t: torch.Tensor, category: str, name: str = "") -> None:
        """Give t's storage `category` (a storage outside the allocator, `managed`, keeps its own) and a name."""
        sid = self._live.get(_address(t))
        if sid is not None:
            s = self.storages[sid]
            if s.device != MANAGED_DEVICE:
                s.category = category
            s.name = s.name or name

    def detach(self) -> None:
        """Stop listening for frees (call after the step; later deaths are not part of it), and write each op's
        `frees`."""
        self._finished_node = None  # no autograd node kept alive past the step
        for f in self._finalizers:
            f.detach()
        self._finalizers.clear()
        frees: dict[int, list[int]] = {}
        for sid, index in self.free_after.items():
            frees.setdefault(index, []).append(sid)
        for index, sids in frees.items():
            if index >= 0:  # in the order the storages died (the finalizers' order), as the allocator frees them
                self.ops[index].frees = tuple(sids)

    # -- module attribution ---------------------------------------------------------------------------------
    def current_module(self) -> str:
        phase = self.phase
        if phase is Phase.BACKWARD:
            if self.recomputing and self.module_stack:  # a checkpointed forward re-run in the backward
                return self.module_stack[-1]
            node = torch._C._current_autograd_node()
            if node is not None:
                return node.metadata.get(_MODULE_KEY, "")
            return ""
        if phase is Phase.OPTIMIZER:
            return "optimizer"
        if phase is Phase.ZERO_GRAD:
            return "optimizer.zero_grad"
        if phase is Phase.CLIP:
            return "clip_grad_norm"
        return self.module_stack[-1] if self.module_stack else ""

    # -- gradient accumulation ------------------------------------------------------------------------------------
    def watch_node(self, node) -> None:
        """Register a post-hook on autograd `node`: once it fires, the engine's next ops until another node runs
        are its `InputBuffer::accumulate` calls (torch/csrc/autograd/engine.cpp `evaluate_function`: call_function
        runs pre-hooks, apply, post-hooks; then each output is added to its consumer's input buffer)."""
        node.register_hook(self._node_finished)

    def backward_done(self) -> None:
        """The micro-step's `backward()` returned: drop the last finished autograd node (`_node_finished`). Kept,
        it would keep its graph alive into the next step: the leaves it reaches through AccumulateGrad (an
        embedding output that `enable_input_require_grads` made require grad, and its `.grad`), which a real loop
        frees with the loss's graph when the backward returns."""
        self._finished_node = None

    def _node_finished(self, grad_inputs, grad_outputs) -> None:
        self._finished_node = torch._C._current_autograd_node()

    def _accumulates_in_place(self, func, args, kwargs) -> bool:
        """Whether this op is the engine adding a second gradient into an input buffer (`old_var + var`) where the
        real engine, with no dispatch mode active, reuses `old_var`'s storage (`old_var.add_(var)`).

        torch/csrc/autograd/input_buffer.cpp `accumulate`: in place when GradMode is off and
        `can_accumulate_inplace(old_var)`: a plain dense tensor whose last reference and storage the buffer holds.
        Under any dispatch mode `at::isTensorSubclassLike` is true, so a traced step always takes `old_var + var`;
        the reference counts seen here carry the dispatch call's own references (calibrated by
        tests/test_recorder_accumulation.py against real runs without a mode): `ACCUMULATE_USE_COUNT` tensor
        references and 2 storage references (the buffer's tensor and the storage object made to ask)."""
        if func is not _ADD or kwargs or len(args) != 2 or self.phase is not Phase.BACKWARD or torch.is_grad_enabled():
            return False
        if self._finished_node is None or torch._C._current_autograd_node() is not self._finished_node:
            return False
        old, var = args
        if (not isinstance(old, torch.Tensor) or not isinstance(var, torch.Tensor) or old is var
                or old.layout is not torch.strided or old.shape != var.shape or old.dtype != var.dtype
                or not is_non_overlapping_and_dense_or_false(old)):
            return False
        return (old._use_count() == ACCUMULATE_USE_COUNT
                and torch._C._storage_Use_Count(old.untyped_storage()._cdata) == 2)

    # -- saved tensors ------------------------------------------------------------------------------------------
    def pack_hook(self, t: torch.Tensor) -> torch.Tensor:
        if self.phase is Phase.FORWARD:
            sid = self._live.get(_address(t))
            if sid is not None:
                self.storages[sid].saved = True
        return t

    # -- the dispatch hook -----------------------------------------------------------------------------------
    def _no_meta_kernel(self, func, args, kwargs, error: NotImplementedError):
        """An op without a meta kernel: under `strict` an UnsupportedOpError; else run the CPU kernel on zeros of
        the same sizes (inputs up to FALLBACK_LIMIT_BYTES) and give its outputs' sizes on meta, listed in
        `unresolved` (a data-dependent size may differ from the real data's)."""
        if not func._schema.returns:
            # an op that returns nothing writes its arguments in place and allocates no output (the fused
            # optimizers' `_fused_sgd_`, `_fused_adagrad_`: CPU and CUDA kernels, no meta kernel): nothing to run on
            # meta; a CPU target's kernel workspace is still measured (`workspace`)
            return None
        where = self.current_module() or "(root)"
        hint = f"an op has no meta kernel: {func} in module {where} ({str(error).splitlines()[0][:120]})"
        leaves = tensor_leaves((args, kwargs))
        size = sum(t.untyped_storage().nbytes() for t in leaves)
        if self.strict or size > FALLBACK_LIMIT_BYTES or any(t.device.type not in ("meta", "cpu") for t in leaves):
            raise UnsupportedOpError(f"{hint}; register one with torch.library.register_fake, or replace the op"
                                     + ("" if self.strict else f" (its inputs exceed the {FALLBACK_LIMIT_BYTES >> 20} "
                                                               "MiB CPU fallback)")) from None
        rng = torch.default_generator.get_state()  # a random op on the stand-ins must not move the caller's RNG
        try:
            out = func(*cpu_zeros_like(args), **cpu_zeros_like(kwargs))
        except Exception as e:
            raise UnsupportedOpError(f"{hint}; the CPU fallback failed too: {str(e).splitlines()[0][:120]}") from e
        finally:
            torch.default_generator.set_state(rng)
        self.unresolved.append(f"{func} in {where}: no meta kernel; output sized by the CPU kernel on zeros "
                               "(a data-dependent size may differ); --strict makes this an error")
        return tree_map(lambda x: torch.empty_strided(tuple(x.shape), x.stride(), dtype=x.dtype, device="meta")
                        if isinstance(x, torch.Tensor) else x, out)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "profiler":  # record_function markers: no storage in or out, not recorded (their
            return func(*args, **kwargs)  # number varies between layers, FSDP2's hooks open one per hook)
        if func is _DEVICE_QUERY:  # a subclass's `.device` (torch/_subclasses/fake_tensor.py makes FakeTensors with
            # `dispatch_device=True`): a metadata query, no kernel, no storage in or out; under ZeRO's FakeTensorMode
            # 60% of the ops dispatched (DeepSpeed reads devices per parameter), not recorded
            return func(*args, **kwargs)
        to_host = False
        try:
            if self._accumulates_in_place(func, args, kwargs):
                out = args[0].add_(args[1])  # the input buffer's storage is reused, as the real engine does
            elif func.namespace == "_c10d_functional" and str(func) == _WRAP_COLLECTIVE:
                out = torch.ops.aten.alias.default(args[0])  # the real op wraps its input; its fake kernel copies
            elif func in self.meta_kernels:
                out = self.meta_kernels[func](*args, **kwargs)
            elif to_host := self._to_host(func, args, kwargs):
                out = func(*args, **{**kwargs, "device": torch.device("meta"), "pin_memory": None})
            elif self.meta_cache is not None:
                out = self.meta_cache(func, args, kwargs)
            else:
                out = func(*args, **kwargs)
        except NotImplementedError as e:
            out = self._no_meta_kernel(func, args, kwargs, e)
        ws = 0
        if self.workspace is not None:  # may lay outputs out as the target's kernel does (kernels.py)
            ws, out = self.workspace(func, args, kwargs, out)
        index = len(self.ops)
        name = self._op_names.get(func)
        if name is None:
            name = self._op_names[func] = str(func)
        ins = [self.storage_id(t, op_index=index, op=name) for t in tensor_leaves((args, kwargs))]
        new = []
        n_before = len(self.storages)
        outs = tensor_leaves(out)
        order = self.output_order.get(func)
        if order is not None and sorted(order) == list(range(len(outs))):
            outs = [outs[i] for i in order]
        for t in outs:
            sid = self.storage_id(t, op_index=index, op=name)
            if sid >= n_before and sid not in new:
                new.append(sid)
        # storages born and freed within the op: what the kernel holds while it runs, one per block the hook
        # gives (an int, or a tuple in allocation order: a CUDA reduction's staging buffer and semaphores)
        for nbytes in ((ws,) if isinstance(ws, int) else ws):
            if nbytes <= 0:
                continue
            sid = len(self.storages)
            where, category = self.op_categories.get(func, ("", None))
            self.storages.append(RecStorage(sid, nbytes, "uint8", (nbytes,), "meta", index, name,
                                            self.current_module(), str(self.phase),
                                            category if where == "workspace" else None, "kernel workspace"))
            self.free_after[sid] = index
            new.append(sid)
        if self.offloading and new and (to_host or (not self._copying_to_device and ins and all(
                self.storages[i].device == HOST_DEVICE for i in ins))):
            for sid in new:
                self.storages[sid].device = HOST_DEVICE
        if self.derived_categories and ins and (func, self.storages[ins[0]].category) in self.derived_categories:
            for sid in new:
                if self.storages[sid].category is None:
                    self.storages[sid].category = self.derived_categories[func, self.storages[ins[0]].category]
        if func in self.op_categories and self.op_categories[func][0] != "workspace":
            where, category = self.op_categories[func]
            for t in tensor_leaves(out if where == "outputs" else kwargs.get(where)):
                if self.storages[self.storage_id(t, op_index=index, op=name)].category is None:
                    self.set_category(t, category)
        first = args[0] if args else None
        lead = len(first) if isinstance(first, (list, tuple)) else int(isinstance(first, torch.Tensor))
        flops = op_flops(func, args, kwargs, out)
        phase = self.phase
        if self.op_args is not None:
            def arg(t):
                if not isinstance(t, torch.Tensor):
                    return t
                return TensorArg(self.storage_id(t, op_index=index, op=name), tuple(t.shape), tuple(t.stride()),
                                 t.storage_offset(), t.dtype)

            self.op_args[index] = tree_map(arg, (args, kwargs, out))
        self.ops.append(RecOp(index, name, phase, self.current_module(), tuple(ins), tuple(new), (), lead,
                              flops, self.recomputing > 0 and phase is Phase.BACKWARD, self.step, self.micro))
        return out


def tag_autograd_nodes(outputs: Any, module_path: str, on_node: Callable[[Any], None] | None = None) -> None:
    """Tag the autograd nodes created inside a module's forward with its path (innermost module wins), and
    call `on_node(node)` once for each.

    Walks from the outputs' grad_fn towards the inputs and stops at nodes already tagged (by inner modules or
    earlier modules), so every node is visited once over the whole forward.
    """
    stack = [t.grad_fn for t in tree_flatten(outputs)[0] if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    while stack:
        node = stack.pop()
        meta = node.metadata
        if _MODULE_KEY in meta:
            continue
        meta[_MODULE_KEY] = module_path
        if on_node is not None:
            on_node(node)
        for nxt, _ in node.next_functions:
            if nxt is not None:
                stack.append(nxt)
