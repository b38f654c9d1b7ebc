"""`CpuWorkspaceProbe` (CPU target): what a CPU kernel allocates and frees inside one op, for every op but views
(oneDNN's matmul scratchpads and reorders, flash-attention buffers, im2col buffers, upcast copies), measured on this
machine's kernels at its thread count; large ops at reduced sizes and extrapolated (`REDUCTION_RULES`,
`SCRATCHPAD_QUERIES`, `NOT_EXTRAPOLATED`); gloo's collective temporaries (`GLOO_TEMPORARY`); the ops' FLOPs
(`op_flops`). The meta kernels allocate only the outputs.
"""

from __future__ import annotations

import contextlib
import math
import sys
from fractions import Fraction
from typing import Any, Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.flop_counter import flop_registry, shape_wrapper

from .op_rules import op_set, op_table
from .probe_cache import PROBED, Probed, disk_cache
from .profiling import available_host_bytes, cpu_zeros_like, run_profiled, unique_storage_bytes

# What a CPU kernel raises on stand-ins it does not accept (the meta kernel's layouts are not the CPU kernel's)
KERNEL_ERRORS = (RuntimeError, ValueError, TypeError, IndexError, NotImplementedError)

# Tensors above this many bytes make an op worth running at reduced sizes (`CpuWorkspaceProbe`): a Llama-2-7b
# matmul at batch 4 x 2048 (8192 x 4096 by 4096 x 11008, fp32: 480 MiB) takes seconds on two cores.
REDUCE_ABOVE_BYTES = 256 << 20
# So do more FLOPs than this (torch.utils.flop_counter's formula for the op, where it has one): a bf16 matmul on a
# CPU whose oneDNN ISA is below avx512_core (at::native's cpublas fallback; an AVX2 machine) runs at about 0.5
# GFLOP/s, so Llama-2-7b's 8192 x 4096 by 4096 x 4096 bf16 matmul (160 MiB of tensors, 275 GFLOP) would take nine
# minutes at full size.
REDUCE_ABOVE_FLOPS = 10**9
# A run at reduced sizes beyond the three smallest is made while its tensors stay within this many bytes
# (`CpuWorkspaceProbe._extrapolated`): more points on the line, at a bounded cost.
REDUCED_RUN_BYTES = 16 << 20


# The CPU target's collectives are gloo's (torch.distributed's CPU backend), and two of them allocate a temporary
# for the duration of the collective (torch/csrc/distributed/c10d/ProcessGroupGloo.cpp): `_reduce_scatter_base`
# (`reduce_scatter_tensor_coalesced`) clones the whole input, all-reduces the clone in place and copies this rank's
# chunk out; `_allgather_base` gathers into a temporary of the output's size, then copies it into the output. NCCL
# (a CUDA target) reduces and gathers in place. Op -> the argument (0: output, 1: input) whose bytes it holds.
# Every per-op table here is keyed by the op's overload (`op_rules.op_table`), looked up with the dispatched `func`.
GLOO_TEMPORARY = op_table("GLOO_TEMPORARY", {"c10d._reduce_scatter_base_.default": 1,
                                             "c10d._allgather_base_.default": 0})


class CpuWorkspaceProbe:
    """Bytes a CPU kernel allocates and frees inside one op (its workspace), beyond its new outputs.

    Measured, not modelled, for every op that computes (all but views): the op is run once on real CPU
    tensors of the same sizes, strides and dtypes (zeros), in this process (same thread count, same oneDNN ISA),
    under torch.profiler's allocator events (`profile_memory=True`); the workspace is the peak of the running
    allocation sum inside the op minus the bytes of the output storages it allocated (an in-place op's output
    is its input: not subtracted). Cached per signature (op, shapes, strides, dtypes, other arguments, thread
    count) for the whole process (`PROBED`), and on disk for the next process (`ProbeDiskCache`; `--compile`'s
    eager comparison runs in a second process on a machine with two cores or more, `second_process.py`).

    What this catches, found on real runs (issue 11): oneDNN's user scratchpad of bf16 matmuls
    (`aten/src/ATen/native/mkldnn/Matmul.cpp` sends bf16 mm/addmm/bmm/baddbmm to `ideep::matmul_forward` when
    oneDNN's ISA is at least avx512_core; its size depends on the kernel, the strides and the thread count),
    the CPU flash attention's per-thread buffers (`aten/src/ATen/native/cpu/FlashAttentionKernel.cpp`),
    upcast copies of mixed-dtype pointwise ops, oneDNN reorders and im2col buffers of convolutions
    (`aten/src/ATen/native/mkldnn/Conv.cpp`, `ConvolutionMM2d.cpp`). An op failing on zeros is listed in
    `failures` (reported as unresolved), never counted as 0 silently.

    A large op (its tensors over `reduce_above` bytes, or its FLOPs over `reduce_above_flops`: a 7B model's
    matmuls take seconds to minutes each on two cores) is run at reduced sizes instead (`_extrapolated`: its large
    dimensions cut in every tensor, each keeping its dimension order), and the workspace, if exactly affine over
    the runs, is extrapolated to the full size (listed in `extrapolated`); otherwise the op runs at full size. One
    too large to run here at full size (over half the available memory) that cannot be extrapolated is a failure.
    An op whose blocking steps with its sizes has a rule of its own that keeps its block sizes
    (`REDUCTION_RULES`: the CPU flash attention), a library that states its workspace (`SCRATCHPAD_QUERIES`:
    oneDNN's matmuls), or runs at full size (`NOT_EXTRAPOLATED`: convolutions).
    """

    def __init__(self, limit_bytes: int | None = None, autocast_dtype: Callable[[], torch.dtype | None] = lambda: None,
                 reduce_above: int | None = None, reduce_above_flops: int | None = None):
        # the dtype of the (emulated) CPU autocast active where the op runs: the probe runs under the real one,
        # since a kernel outside autocast's op lists (e.g. `_transformer_encoder_layer_fwd`) calls ops that
        # autocast casts (`_native_multi_head_attention`); for the ops autocast already handled it is a no-op
        self.autocast_dtype = autocast_dtype
        self.failures: dict[str, str] = {}  # op -> why its workspace could not be measured (counted as 0)
        self.notes: dict[str, str] = {}  # op -> where the CPU kernel's outputs differ from the meta kernel's
        self.limit_bytes = available_host_bytes() // 2 if limit_bytes is None else limit_bytes
        self.reduce_above = REDUCE_ABOVE_BYTES if reduce_above is None else reduce_above
        self.reduce_above_flops = REDUCE_ABOVE_FLOPS if reduce_above_flops is None else reduce_above_flops
        self.extrapolated: dict[str, str] = {}  # op -> the sizes its workspace was extrapolated over

    @staticmethod
    def _key(x):
        if isinstance(x, torch.Tensor):
            # not requires_grad: the op runs under no_grad on fresh zeros, so an eager op and a compiled graph's
            # extern kernel on the same layouts are one run
            return ("T", tuple(x.shape), x.stride(), x.storage_offset(), x.dtype)
        if isinstance(x, (list, tuple)):
            return tuple(CpuWorkspaceProbe._key(v) for v in x)
        return x

    @staticmethod
    def probed(func) -> bool:
        """Whether `func` is probed: every op but views (their output is an input's storage)."""
        return not getattr(func, "is_view", False)

    def __call__(self, func, args, kwargs, out):
        """(workspace bytes, output) of `func(*args, **kwargs)` (meta tensors) on this machine's CPU. `out` is the
        meta kernel's output; where the CPU kernel's new outputs have another dtype or shape (CPU
        `native_layer_norm` returns a bf16 input's mean and rstd in bf16, the meta kernel in fp32; a kernel that
        autocast casts inside, such as `_transformer_encoder_layer_fwd`), the returned output is `out` with
        those leaves replaced by meta tensors laid out as the CPU kernel's, since they are what the real step
        holds (listed in `notes`)."""
        if not self.probed(func) or not _has_meta((args, kwargs, out)):
            # an op on host tensors only (a vision-language model's image grid, tracer/vlm.py) ran for real: its
            # outputs hold the values the model reads, and are not relaid by a run on zeros
            return 0, out
        local = dtensor_local_op(func, args, kwargs, out)
        if local is not None:
            return self(func, *local)[0], out
        gloo = GLOO_TEMPORARY.get(func)
        if gloo is not None:  # a collective: the fake backend runs no kernel to probe
            t = args[gloo]
            return t.numel() * t.element_size(), out
        if func.namespace in ("c10d", "_c10d_functional"):  # the other collectives: nothing the fake backend runs
            return 0, out  # is gloo's, and a collective run here would wait in c10d's work registry for ever
        autocast = self.autocast_dtype()
        # the memory limit enters as whether it applies: each probe reads the memory available when it starts
        over = _tensor_bytes((args, kwargs, out)) > self.limit_bytes
        key = (str(func), self._key(args), self._key(tuple(sorted(kwargs.items()))), autocast,
               torch.get_num_threads(), over, self.reduce_above, self.reduce_above_flops)
        if key not in PROBED:
            found = disk_cache().get(key)
            if found is None:
                found = self._probe(func, args, kwargs, out, autocast)
                disk_cache().put(key, found)
            PROBED[key] = found
        ws, layouts, failure, note, extrapolated = PROBED[key]
        for found, record in ((failure, self.failures), (note, self.notes), (extrapolated, self.extrapolated)):
            if found is not None:
                record[str(func)] = found
        if layouts:
            leaves, spec = torch.utils._pytree.tree_flatten(out)
            for i, shape, stride, dtype in layouts:
                leaves[i] = torch.empty_strided(shape, stride, dtype=dtype, device=leaves[i].device)
            out = torch.utils._pytree.tree_unflatten(leaves, spec)
        return ws, out

    def _probe(self, func, args, kwargs, out, autocast) -> Probed:
        """What one op's run (or runs at reduced sizes) on this CPU found."""
        tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        size = _tensor_bytes(tensors)
        if size > self.reduce_above or op_flops(func, args, kwargs, out) > self.reduce_above_flops:
            reduced = self._extrapolated(func, args, kwargs, out, autocast, tensors)
            if reduced is not None:
                return Probed(reduced[0], (), extrapolated=reduced[1])
        if size > self.limit_bytes:
            return Probed(0, (), failure=f"its tensors ({size >> 20} MiB) exceed half of this machine's available "
                                         "memory")
        try:
            workspace, cpu_out = self._on_zeros(func, args, kwargs, autocast)
        except KERNEL_ERRORS as e:  # the meta kernel's outputs differ from the CPU kernel's expectations
            return Probed(0, (), failure=str(e).splitlines()[0] if str(e) else type(e).__name__)
        meta_leaves = torch.utils._pytree.tree_leaves(out)
        cpu_leaves = torch.utils._pytree.tree_leaves(cpu_out)
        ins = _storages(args, kwargs)  # meta inputs: an output among them is in place, never relaid
        layouts = []
        if len(meta_leaves) == len(cpu_leaves):
            for i, (m, c) in enumerate(zip(meta_leaves, cpu_leaves)):
                if (isinstance(m, torch.Tensor) and isinstance(c, torch.Tensor)
                        and StorageWeakRef(m.untyped_storage()) not in ins
                        and (m.dtype != c.dtype or m.shape != c.shape)):
                    layouts.append((i, tuple(c.shape), c.stride(), c.dtype))
        note = None
        if layouts:
            note = ("the CPU kernel's outputs are laid out otherwise than the meta kernel's ("
                                     + ", ".join(f"{str(c.dtype).removeprefix('torch.')}{list(c.shape)} for "
                                                 f"{str(meta_leaves[i].dtype).removeprefix('torch.')}"
                                                 f"{list(meta_leaves[i].shape)}" for i, *_ in layouts
                                                 for c in [cpu_leaves[i]])
                                     + "); the trace holds the CPU's")
        return Probed(workspace, tuple(layouts), note=note)

    def _extrapolated(self, func, args, kwargs, out, autocast, tensors: list[torch.Tensor]) -> tuple[int, str] | None:
        """(the workspace of `func` at full size from runs at reduced sizes (class docstring), how it was cut), or
        None: no dimension to reduce, a run failed, the outputs differ from the meta kernel's beyond the reduction,
        or the workspaces are not exactly affine in the reduction's measure.

        Generic cut: every large dimension (a multiple of 8, 1024 or more) is cut at once to 1/k of its size
        (measure: 1/k, the fraction kept), for k from the largest power of two that divides them all and keeps
        128 or more of the smallest (above the small-size paths of the CPU kernels) down to 2: the three smallest
        runs always, a larger one while it is cheap (`_affordable`). Every run must lie on one
        line. At 1024 the cuts are 1/8, 1/4, 1/2 (a matmul then costs 14% of its full run); for Llama-2-7b's
        matmuls (4096 and more) 1/32, 1/16, 1/8: a bf16 matmul on a CPU below avx512_core runs at about
        0.5 GFLOP/s (this AVX2 machine), so its 1/2 run alone would take minutes. A step between the largest run and
        full size is not seen. A kernel whose blocking changes with the sizes is not affine over the runs and runs
        at full size, unless an op rule (`REDUCTION_RULES`) knows where its blocking is constant.

        Before the line: an op whose workspace a library states (`SCRATCHPAD_QUERIES`: oneDNN's matmul scratchpad)
        takes the library's answer at full size when its answers at the reduced sizes equal every measured run (one
        of them not 0). oneDNN's bf16 matmul scratchpads on an AVX-512-BF16 CPU step with the sizes: a line through
        three runs can be exactly affine and wrong at full size, both ways (`onednn.py`; (1024, 4096) @ (4096,
        1024): 657,024 B on the line, 3,442,432 B booked)."""
        if func in NOT_EXTRAPOLATED:
            return None
        rule = REDUCTION_RULES.get(func)
        points = rule(args, kwargs) if rule is not None else None
        if points is not None:
            how = rule.__doc__.splitlines()[0]
        else:
            dims = sorted({d for t in tensors for d in t.shape if d >= 1024 and d % 8 == 0})
            if not dims:
                return None
            k = 8
            while all(d % (2 * k) == 0 for d in dims) and dims[0] // (2 * k) >= 128:
                k *= 2
            cuts = []
            while k >= 2 and (len(cuts) < 3 or self._affordable(func, args, kwargs, out, {d: d // k for d in dims})):
                cuts.append(({d: d // k for d in dims}, Fraction(1, k)))
                k //= 2
            points = (cuts, Fraction(1))
            how = f"sizes {', '.join(map(str, dims))} cut to {', '.join(str(x) for _, x in cuts)}"
        cuts, full = points
        query = SCRATCHPAD_QUERIES.get(func)
        found, answered = [], query is not None
        for sizes, x in cuts:
            reduced = tuple(at_reduced_sizes(tree, sizes) for tree in (args, kwargs, out))
            w = self._reduced_run(func, *reduced, autocast)
            if w is None:
                return None
            found.append((x, w))
            answered = answered and query(*reduced) == w
        if answered and any(w for _, w in found):
            at_full = query(args, kwargs, out)
            if at_full is not None:
                return at_full, f"{how}: oneDNN's matmul scratchpad at each, asked of oneDNN at full size"
        (x0, w0), (x1, w1) = found[:2]
        slope = Fraction(w1 - w0, 1) / (x1 - x0)
        if slope < 0 or any(w != w0 + slope * (x - x0) for x, w in found[2:]):
            return None
        workspace = w0 + slope * (full - x0)
        if workspace.denominator != 1:
            return None
        return int(workspace), f"{how}: affine"

    def _affordable(self, func, args, kwargs, out, sizes: dict[int, int]) -> bool:
        """Whether a run beyond the three smallest, with dimensions cut as `sizes` says, is cheap enough: its tensors
        within `REDUCED_RUN_BYTES` and its FLOPs within `reduce_above_flops` (Llama-2-7b's bf16 8192 x 4096 by
        4096 x 4096 matmul at 1/4, 4.3 GFLOP, takes 4.3 s on this AVX2 machine)."""
        if _reduced_bytes((args, kwargs, out), sizes) > REDUCED_RUN_BYTES:
            return False
        r_args, r_kwargs, r_out = (at_reduced_sizes(tree, sizes) for tree in (args, kwargs, out))
        return r_args is not None and op_flops(func, r_args, r_kwargs, r_out) <= self.reduce_above_flops

    def _reduced_run(self, func, r_args, r_kwargs, r_out, autocast) -> int | None:
        """The workspace of one run of `func` on its arguments cut to reduced sizes (`at_reduced_sizes`: meta, None where a
        tensor could not be cut), or None (not cut, it failed, or its outputs are not the reduced meta outputs)."""
        if any(x is None for x in (r_args, r_kwargs, r_out)):
            return None
        try:
            workspace, cpu_out = self._on_zeros(func, r_args, r_kwargs, autocast)
        except KERNEL_ERRORS:
            return None

        def layouts(tree):
            return [(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else None
                    for t in torch.utils._pytree.tree_leaves(tree)]

        if layouts(r_out) != layouts(cpu_out):  # a CPU kernel's own output layout (`notes`): a full-size run says
            return None
        return workspace

    def _on_zeros(self, func, args, kwargs, autocast) -> tuple[int, Any]:
        """(workspace bytes, CPU output) of one run of `func` on CPU zeros standing for the meta `args` and
        `kwargs`: the in-op allocation peak less the new output storages. Raises KERNEL_ERRORS."""
        cpu_args, cpu_kwargs = cpu_zeros_like(args), cpu_zeros_like(kwargs)
        peak, cpu_out = self._measure(func, cpu_args, cpu_kwargs, autocast)
        return max(peak - _new_output_bytes(cpu_out, _storages(cpu_args, cpu_kwargs)), 0), cpu_out

    @staticmethod
    def _measure(func, args, kwargs, autocast: torch.dtype | None):
        """(in-op allocation peak in bytes, the output) of one real run of the op."""
        rng = torch.default_generator.get_state()  # a random op on the stand-ins must not move the caller's RNG
        try:
            with torch.no_grad(), torch.autocast("cpu", dtype=autocast) if autocast else contextlib.nullcontext():
                out, peak = run_profiled(lambda: func(*args, **kwargs))
        finally:
            torch.default_generator.set_state(rng)
        return peak, out


def dtensor_local_op(func, args, kwargs, out) -> tuple | None:
    """(args, kwargs, out) of the local op a DTensor op runs on each rank: every DTensor replaced by its local tensor
    (torch.distributed.tensor's dispatch runs `func` on the local shards, torch/distributed/tensor/_dispatch.py
    `OpDispatcher.dispatch`), when `func` on the local tensors (meta) gives outputs shaped as the DTensor outputs'
    local tensors. None: no DTensor among the arguments, or the op redistributes its inputs first (its local
    inputs are not the shards the trace holds), and then the op is probed as given. A DTensor's `shape` is the
    global one: probed as given, a TP rank's weight-gradient matmul ran at the full size of the weight (FSDP x TP
    on tiny Llama, bf16: oneDNN's scratchpad of a (176, 32)^T @ (32, 64) mm, 61,568 B at one thread, where the
    rank runs (88, 32)^T @ (32, 64), 33,408 B)."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    cls = getattr(dtensor, "DTensor", None)
    if cls is None or not any(isinstance(t, cls) for t in torch.utils._pytree.tree_leaves((args, kwargs))):
        return None

    def local(tree):
        return torch.utils._pytree.tree_map(lambda t: t._local_tensor if isinstance(t, cls) else t, tree)

    l_args, l_kwargs, l_out = local(args), local(kwargs), local(out)
    if any(t.device.type != "meta" for t in torch.utils._pytree.tree_leaves((l_args, l_kwargs, l_out))
           if isinstance(t, torch.Tensor)):
        return None

    def stand_in(tree):  # the op may write its arguments: run it on stand-ins laid out as the local tensors
        return torch.utils._pytree.tree_map(
            lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
            if isinstance(t, torch.Tensor) else t, tree)

    try:
        with torch.no_grad():
            ran = func(*stand_in(l_args), **stand_in(l_kwargs))
    except KERNEL_ERRORS:
        return None

    def shapes(tree):
        return [(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else None
                for t in torch.utils._pytree.tree_leaves(tree)]

    return (l_args, l_kwargs, l_out) if shapes(ran) == shapes(l_out) else None


# the code of a formula wrapped by torch/utils/flop_counter.py `shape_wrapper` (every registered one but those
# registered with get_raw=True), which calls it with each tensor replaced by its shape
_SHAPE_FORMULA = shape_wrapper(lambda *a, **k: 0).__code__
_FLOPS: dict[tuple, int] = {}  # (op, `_shape_key` of its arguments and output) -> its FLOPs
_FLOPS_KEPT = 100_000  # entries at most (a long-running `vramtrace serve` sees ever new shapes): emptied when full
_FLOP_SCALARS = frozenset({int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
                           torch.memory_format})


def op_flops(func, args, kwargs, out) -> int:
    """FLOPs of one op by torch.utils.flop_counter's formula for it (`flop_registry`), 0 where it has none. A
    formula that sees only shapes (`shape_wrapper`) gives the same FLOPs for the same op, shapes and other
    arguments: kept per `_shape_key` (a layer's matmuls recur in every layer and micro-batch)."""
    flop_rule = flop_registry.get(func.overloadpacket)
    if flop_rule is None:
        return 0
    key = [func]
    if flop_rule.__code__ is not _SHAPE_FORMULA or not _shape_key((args, kwargs, out), key):
        return int(flop_rule(*args, **kwargs, out_val=out))
    key = tuple(key)
    flops = _FLOPS.get(key)
    if flops is None:
        if len(_FLOPS) >= _FLOPS_KEPT:
            _FLOPS.clear()
        flops = _FLOPS[key] = int(flop_rule(*args, **kwargs, out_val=out))
    return flops


def _shape_key(tree, key: list) -> bool:
    """Append what `shape_wrapper` passes a formula of `tree` to `key`: each tensor's shape (ints only), each
    scalar by (type, value), each tuple, list or dict by its type, length (and keys) and items; False when an item
    cannot be keyed (a SymInt, a tensor subclass's odd shape, any other object)."""
    kind = type(tree)
    if isinstance(tree, torch.Tensor):
        shape = tuple(tree.shape)
        if not all(type(d) is int for d in shape):
            return False
        key.append(shape)
        return True
    if kind in _FLOP_SCALARS:
        if kind is float and tree != tree:  # NaN: never equal to itself, so never found again
            return False
        key.append((kind, tree))
        return True
    if kind is dict:
        key.append((dict, tuple(tree)))
        tree = tree.values()
    elif kind in (tuple, list, torch.Size):
        key.append((kind, len(tree)))
    else:
        return False
    return all(_shape_key(x, key) for x in tree)


def at_reduced_sizes(tree, sizes: dict[int, int]):
    """`tree` (an op's arguments or outputs, meta tensors) with every tensor dimension whose size is a key of
    `sizes`, and every such int in a list of sizes, cut to its value; each tensor keeps its dimension order (its
    strides are those of a dense tensor laid out in the original order; broadcast dimensions keep stride 0). None
    when a tensor is not dense in its order (a slice, an overlapping view): its reduced strides would be a guess."""
    def tensor(t: torch.Tensor):
        shape = [sizes.get(d, d) for d in t.shape]
        order = sorted(range(t.dim()), key=lambda i: (t.stride(i), -i))  # innermost first
        expect, new_expect, stride = 1, 1, [0] * t.dim()
        for i in order:
            if t.stride(i) == 0 or t.shape[i] == 1:
                stride[i] = 0 if t.stride(i) == 0 else new_expect
                continue
            if t.stride(i) != expect:
                return None
            stride[i] = new_expect
            expect *= t.shape[i]
            new_expect *= shape[i]
        return torch.empty_strided(shape, stride, dtype=t.dtype, device="meta")

    def is_sizes(x) -> bool:
        return isinstance(x, (list, tuple)) and bool(x) and all(type(v) is int for v in x)

    bad = []

    def leaf(x):
        if isinstance(x, torch.Tensor):
            r = tensor(x)
            if r is None:
                bad.append(x)
            return r
        if is_sizes(x):
            return type(x)(sizes.get(v, v) for v in x)
        return x

    out = torch.utils._pytree.tree_map(leaf, tree, is_leaf=is_sizes)
    return None if bad else out


def _has_meta(tree) -> bool:
    """Whether any tensor of `tree` is on the meta device."""
    return any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in torch.utils._pytree.tree_leaves(tree))


def _tensor_bytes(tree) -> int:
    """Bytes of the storages of the tensors in `tree`, each tensor's storage counted once per tensor."""
    return sum(t.untyped_storage().nbytes() for t in torch.utils._pytree.tree_leaves(tree)
               if isinstance(t, torch.Tensor))


def _reduced_bytes(tree, sizes: dict[int, int]) -> int:
    """Bytes of the tensors in `tree` (meta), laid out densely, with their dimensions cut as `sizes` says."""
    total = 0
    for t in torch.utils._pytree.tree_leaves(tree):
        if isinstance(t, torch.Tensor):
            total += t.element_size() * math.prod(sizes.get(d, d) for d in t.shape)
    return total


def _storages(*trees) -> set[StorageWeakRef]:
    """The storages (`StorageWeakRef`, torch/multiprocessing/reductions.py, as `recorder.storage_key`) of the
    tensors in `trees`."""
    return {StorageWeakRef(t.untyped_storage()) for t in torch.utils._pytree.tree_leaves(trees) if isinstance(t, torch.Tensor)}


def _new_output_bytes(out, ins: set[StorageWeakRef]) -> int:
    """Bytes of the storages of `out` that are not among the input storages `ins` (an in-place op's output is
    its input: not new)."""
    return unique_storage_bytes(t for t in torch.utils._pytree.tree_leaves(out)
                                if isinstance(t, torch.Tensor) and StorageWeakRef(t.untyped_storage()) not in ins)


def _flash_attention_points(args, kwargs):
    """batch to 2 or less, heads to 2 and 4, tokens to 768 and 1024: one block size

    The CPU flash attention (`aten/src/ATen/native/cpu/FlashAttentionKernel.cpp`, `cpu_flash_attention` and
    `cpu_flash_attention_backward`) allocates per-thread buffers sized by its block sizes only: the query block is
    256 tokens from 768 query tokens up (`flash_attention_kernel_impl` and `flash_attention_backward_kernel_impl`
    pick 32, 64 or 256 at 192 and 768 tokens), the key block min(512, key tokens). What else it allocates (a copy
    of a tensor the kernel wants in another layout) grows with batch × heads × tokens. So for a self-attention of
    1024 tokens or more, the runs keep 768 or more tokens (the same block sizes) and cut the batch, the heads and
    the tokens; the measure is batch × heads × tokens, and the three runs must be exactly affine in it. No
    dimension is cut to 1: a tensor with a dimension of 1 is contiguous in more layouts, and the kernel's copy
    into its layout then does not happen (measured: none at 1 × 1 × 768 × 64 fp32, 196,608 B more at 1 × 2).
    Returns (((sizes, measure), ...), full measure), or None: not a self-attention of 1024 or more tokens and 4 or
    more heads with distinct sizes."""
    backward = len(args) > 5
    q, k, v = args[1:4] if backward else args[:3]
    if not (isinstance(q, torch.Tensor) and q.dim() == 4 and q.shape == k.shape == v.shape):
        return None
    batch, heads, tokens, head_dim = q.shape
    if tokens < 1024 or heads < 4 or len({batch, heads, tokens, head_dim}) < 4:
        return None  # a size shared by two dimensions would be cut in both
    b = min(batch, 2)
    cuts = [({batch: b, heads: h, tokens: t}, b * h * t) for h, t in ((2, 768), (4, 768), (2, 1024))]
    return cuts, batch * heads * tokens


def _onednn_matmul(args, kwargs, out) -> int | None:
    """oneDNN's scratchpad (`onednn.matmul_scratchpad_bytes`) for `mm` / `bmm` (the two matrices) and `addmm` /
    `baddbmm` (bias or `self`, then the two matrices: ATen copies `self` into the output and has oneDNN add the
    product to it, aten/src/ATen/native/mkldnn/Matmul.cpp `mkldnn_matmul`, a `sum` post-op for beta != 0, whose
    scratchpad is the plain matmul's: checked against the profiler on 16 layouts, `tests/test_onednn.py`, and per
    op against its reduced runs, as every answer). None with other arguments (alpha, beta)."""
    from .onednn import matmul_scratchpad_bytes

    return None if kwargs or len(args) not in (2, 3) else matmul_scratchpad_bytes(args[-2], args[-1], out)


# Ops whose workspace a library can state without running them (`CpuWorkspaceProbe._extrapolated`): op -> (args,
# kwargs, out) -> bytes or None. An answer is taken for a large op only where it equals the measured workspace of
# every run at reduced sizes, so an op that does not reach that library here (ATen's own bf16 gemm on a CPU below
# avx512_core, MKL's fp32 sgemm: 0 bytes measured) keeps the measured line.
SCRATCHPAD_QUERIES = op_table("SCRATCHPAD_QUERIES",
                              {f"aten.{op}.default": _onednn_matmul for op in ("mm", "bmm", "addmm", "baddbmm")})

# Ops run at full size however large (`CpuWorkspaceProbe._extrapolated`): oneDNN's convolutions pick their
# blocking and reorders from the channel counts, and a line through runs at reduced channels can be exactly affine
# and wrong. Measured: a 1x1 convolution of 32 x 1024 x 7 x 7 to 2048 channels (ResNet-50's last stage), cut
# to 1/8, 1/4, 1/2: 12,845,056 B on the line, 14,811,136 B at full size in fp32 (on an AVX-512 CPU and under
# ONEDNN_MAX_CPU_ISA=AVX2 alike), 6,422,528 against 7,807,104 B in bf16 on AVX-512-BF16.
NOT_EXTRAPOLATED = op_set("NOT_EXTRAPOLATED", ("aten.convolution.default", "aten.convolution_backward.default"))

# Ops whose large runs are cut by a rule of their own (`CpuWorkspaceProbe._extrapolated`): op -> the rule.
REDUCTION_RULES = op_table("REDUCTION_RULES", {
    "aten._scaled_dot_product_flash_attention_for_cpu.default": _flash_attention_points,
    "aten._scaled_dot_product_flash_attention_for_cpu_backward.default": _flash_attention_points,
})
