"""The aten ops that reach `gpu_reduce_kernel` on a CUDA target, and what their launches allocate beyond the output.

The rule itself (staging buffer, semaphores, accumulation buffer) is `analysis/cuda_reduce.py`; this module reads an
op's meta arguments into the iterator and kernel template arguments it needs. Kernel template arguments (torch
2.13, aten/src/ATen/native/cuda/):

* sum (`ReduceSumProdKernel.cu` `sum_functor`): arg_t float for half/bfloat16 inputs (`reduce_dispatch`), else the
  input's type; vt0 4, input_vec_size 8 for 16-bit inputs, else 4. prod (`prod_functor`): same arg_t, vt0 4.
* mean (`ReduceMomentsKernel.cu` `mean_kernel_impl`, `MeanOps`): arg_t float for half/bfloat16, else the input's.
* linalg_vector_norm / norm (`ReduceNormKernel.cu` `norm_kernel_cuda_impl`): arg_t the input's real accumulation
  type (float for half/bfloat16).
* amax/amin (`ReduceMaxValuesKernel.cu`, `ReduceMinValuesKernel.cu`): arg_t the input's type.
* max/min with indices (`ReduceMinMaxKernel.cu`, `MaxOps`): arg_t thrust::pair<scalar_t, int64_t> (16 B); max()
  and min() of all values (`ReduceAllOps.cpp`, max_all_stub) run the amax/amin kernel;
  argmax/argmin (`ReduceArgMaxKernel.cu`, `ArgMaxOps`): pair<acc_t, int64_t> (16 B), output int64.
* var/std/var_mean/std_mean (`ReduceMomentsKernel.cu` `std_var_kernel_impl`): `WelfordData<acc_t, int32_t>` (mean,
  m2, n, nf: 16 B for a float accumulator, 32 B for double), vt0 2 ("reducing unrolling factor to 2 for welford
  kernel").
* any/all (`ReduceLogicKernel.cu`): arg_t the input's type, output bool.
* logsumexp (`ReduceOps.cpp` `logsumexp_out_impl`, one recorded op whose meta kernel allocates only its output):
  amax(self, dims, keepdim=True), then `(self - maxes).exp_()` summed into the result: the maxes and the exp
  temporary are held with the sum's staging buffer.

An input of another dtype than the reduction computes in is cast first (`ReduceOpsUtils.h` `make_reduction` /
`make_reduction_from_out_ty`: `self.to(in_dtype)`, except a half/bfloat16 input into a float output on CUDA): that
copy is a transient block of the op too.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..analysis.cuda_reduce import ReduceDevice, ReduceKernel, make_iter, reduction_blocks

_SUM_LIKE = {"sum", "mean", "prod", "nansum"}
_NORMS = {"linalg_vector_norm", "norm"}
_VALUES = {"amax", "amin"}
_INDEXED = {"max", "min"}
_ARG = {"argmax", "argmin"}
_MOMENTS = {"var", "std", "var_mean", "std_mean"}
_LOGIC = {"any", "all"}
REDUCTION_OPS = _SUM_LIKE | _NORMS | _VALUES | _INDEXED | _ARG | _MOMENTS | _LOGIC | {"logsumexp"}


def _acc_bytes(dtype: torch.dtype) -> int:
    """at::acc_type<scalar_t, /*is_cuda=*/true> in bytes: float for half/bfloat16, the real accumulator of a complex
    type as a complex, else the type itself."""
    if dtype in (torch.float16, torch.bfloat16):
        return 4
    if dtype is torch.complex32:
        return 8
    return dtype.itemsize


def _named(func, args, kwargs) -> dict:
    return {a.name: v for a, v in zip(func._schema.arguments, args)} | kwargs


def _reduced_dims(ndim: int, dim) -> tuple[int, ...]:
    """The wrapped reduced dimensions; None or [] means all (`make_dim_mask`)."""
    if dim is None:
        return tuple(range(ndim))
    dims = [dim] if isinstance(dim, int) else list(dim)
    if not dims:
        return tuple(range(ndim))
    return tuple(sorted({d % ndim if ndim else 0 for d in dims}))


def _iterator(x: torch.Tensor, dims: tuple[int, ...], out: torch.Tensor, in_bytes: int, offset_bytes: int):
    """`make_iter` for `x` (shape, strides) reduced over `dims` into `out` (keepdim or not)."""
    keep = out.dim() == x.dim()
    out_strides, j = [], 0
    for d in range(x.dim()):
        if d in dims:
            out_strides.append(0)
            j += keep
        else:
            out_strides.append(out.stride(j) if out.dim() else 0)
            j += 1
    return make_iter(tuple(x.shape), tuple(x.stride()), tuple(out_strides), in_bytes, out.element_size(),
                     offset_bytes)


def _kernel(family: str, x_dtype: torch.dtype, out_dtype: torch.dtype) -> ReduceKernel:
    scalar = x_dtype.itemsize
    max_threads = 256 if x_dtype is torch.complex128 else 512
    same16 = x_dtype == out_dtype and x_dtype in (torch.float16, torch.bfloat16, torch.complex32)
    if family in _SUM_LIKE or family in _NORMS:
        ivs = 8 if family == "sum" and scalar == 2 else 4
        return ReduceKernel(_acc_bytes(x_dtype), scalar, out_dtype.itemsize, 4, ivs, max_threads, not same16)
    if family in _INDEXED or family in _ARG:
        return ReduceKernel(16, scalar, out_dtype.itemsize, 4, 4, max_threads, False)
    if family in _MOMENTS:
        welford = 16 if _acc_bytes(x_dtype) <= 4 else 32
        return ReduceKernel(welford, scalar, out_dtype.itemsize, 2, 2, max_threads, False)
    return ReduceKernel(scalar, scalar, out_dtype.itemsize, 4, 4, max_threads, not same16)  # amax/amin, any/all


def _in_dtype(family: str, x: torch.Tensor, out: torch.Tensor, named: dict) -> torch.dtype:
    """The dtype the iterator reads: the input's, or the output's where `make_reduction_from_out_ty` casts
    (sum/mean/prod into another dtype, but a half/bfloat16 input into a float output), `dtype=` for a norm."""
    if family in _SUM_LIKE and x.dtype != out.dtype:
        if x.dtype in (torch.float16, torch.bfloat16) and out.dtype is torch.float32:
            return x.dtype
        return out.dtype
    if family in _NORMS and named.get("dtype") is not None:
        return named["dtype"]
    return x.dtype


def reduction_workspace(func, args, kwargs, out, device: ReduceDevice) -> tuple[int, ...]:
    """The blocks (bytes, in allocation order) a CUDA reduction op holds while it runs beyond its outputs; () for
    any other op, an empty input, or a reduction that stays within thread blocks."""
    schema = getattr(func, "_schema", None)  # OpOverloads only
    if schema is None or func.namespace != "aten":
        return ()
    family = schema.name.split("::")[-1]
    if family not in REDUCTION_OPS or not args or not isinstance(args[0], torch.Tensor):
        return ()
    if family in _INDEXED:  # max.other / min.other are elementwise; max() / min() reduce all values as amax does
        if func._overloadname not in ("dim", "default"):  # (ReduceAllOps.cpp `max`: max_all_stub)
            return ()
        family = family if func._overloadname == "dim" else "a" + family
    x = args[0]
    outs = [t for t in torch.utils._pytree.tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    if not outs or x.numel() == 0 or x.is_complex() and family in _INDEXED | _ARG:
        return ()
    named = _named(func, args, kwargs)
    dims = _reduced_dims(x.dim(), named.get("dim"))
    result = outs[0]
    blocks: list[int] = []
    if family == "logsumexp":  # maxes (keepdim), the exp temporary, then the sum's buffers over it
        maxes = x.numel() // max(1, _numel(x, dims)) * x.element_size()
        blocks += [maxes, x.numel() * x.element_size()]
        x_contig = torch.empty(tuple(x.shape), dtype=x.dtype, device="meta")
        return tuple(blocks) + reduction_blocks(_iterator(x_contig, dims, result, x.element_size(), 0),
                                                _kernel("sum", x.dtype, result.dtype), device)
    in_dtype = _in_dtype(family, x, result, named)
    offset = x.storage_offset() * x.element_size()
    if in_dtype != x.dtype:  # the cast copy, contiguous
        blocks.append(x.numel() * in_dtype.itemsize)
        x, offset = torch.empty(tuple(x.shape), dtype=in_dtype, device="meta"), 0
    it = _iterator(x, dims, result, in_dtype.itemsize, offset)
    found = reduction_blocks(it, _kernel(family, in_dtype, result.dtype), device)
    return tuple(blocks) + found if found else tuple(blocks)


def _numel(x: torch.Tensor, dims: tuple[int, ...]) -> int:
    n = 1
    for d in dims:
        n *= x.shape[d]
    return n


def cuda_workspace_hook(device: ReduceDevice, other: Callable | None = None) -> Callable:
    """The recorder's `workspace` hook on a CUDA target: (blocks, out) with the reduction's blocks
    (`reduction_workspace`) and, when `other` is given (bitsandbytes' kernels, quantization.cuda_workspace), its
    bytes as one more block."""

    def hook(func, args, kwargs, out):
        blocks = reduction_workspace(func, args, kwargs, out, device)
        if other is not None:
            ws, out = other(func, args, kwargs, out)
            if ws:
                blocks += (ws,)
        return blocks, out

    return hook
