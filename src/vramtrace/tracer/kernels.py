"""Device kernel policy: make a meta-device run follow the kernels the *target* device would run.

On the meta device PyTorch takes CPU-like composite paths and has no autocast. This TorchFunctionMode sits
above autograd (so that what it changes is what autograd records and saves) and applies, for the target:

* SDPA backend choice. CUDA mirrors `aten/src/ATen/native/transformers/cuda/sdp_utils.cpp`
  (`select_sdp_backend`: flash, then memory-efficient, then math). CPU asks the real CPU dispatcher
  (`torch._fused_sdp_choice`, i.e. `sdp_utils_cpp.cpp::select_sdp_backend_cpp`) with tiny stand-in tensors.
* Dropout: CUDA's `at::dropout` takes the fused `native_dropout` (bool mask saved) when
  `is_fused_kernel_acceptable` (`aten/src/ATen/native/Dropout.cpp`); CPU and meta take `_dropout_impl`
  (a noise tensor of the input's dtype). The meta device already follows the CPU path.
* Autocast (mixed precision): per-op cast policies mirrored from `aten/src/ATen/autocast_mode.cpp`
  (CUDA and CPU lists), including the weight-cast cache that lives until the autocast region exits.

`CpuWorkspaceProbe` (CPU target) measures what a CPU kernel allocates and frees inside one op, for every op
but views: oneDNN's matmul scratchpads and reorders, flash-attention buffers, im2col buffers, upcast copies.
They depend on the local CPU's ISA and thread count; the meta kernels allocate only the outputs.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import json
import math
import os
import sys
from fractions import Fraction
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import flop_registry

from .. import bridges
from ..spec import Device


class CastPolicy(str, enum.Enum):
    LOWER = "lower_precision_fp"
    FP32 = "fp32"
    FP32_SET_OPT_DTYPE = "fp32_set_opt_dtype"
    PROMOTE = "promote"


def _ops(policy: CastPolicy, names: str) -> dict[str, CastPolicy]:
    return {n: policy for n in names.split()}


# aten/src/ATen/autocast_mode.cpp, TORCH_LIBRARY_IMPL(_, AutocastCUDA, m) and the AT_FORALL_* lists of autocast_mode.h.
CUDA_AUTOCAST: dict[str, CastPolicy] = {
    **_ops(CastPolicy.LOWER, """_convolution conv1d conv2d conv3d conv_tbc conv_transpose1d conv_transpose2d
        conv_transpose3d convolution prelu addmm addmv addr matmul einsum mm mv linalg_vecdot linear addbmm baddbmm
        bmm chain_matmul linalg_multi_dot lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell
        scaled_dot_product_attention"""),
    **_ops(CastPolicy.FP32, """acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow
        softplus layer_norm group_norm rms_norm frobenius_norm nuclear_norm cosine_similarity poisson_nll_loss
        cosine_embedding_loss nll_loss nll_loss2d hinge_embedding_loss kl_div l1_loss smooth_l1_loss huber_loss
        mse_loss margin_ranking_loss multilabel_margin_loss soft_margin_loss triplet_margin_loss multi_margin_loss
        binary_cross_entropy_with_logits dist pdist cdist renorm logsumexp"""),
    **_ops(CastPolicy.FP32_SET_OPT_DTYPE, "prod softmax log_softmax cumprod cumsum linalg_vector_norm linalg_matrix_norm sum"),
    **_ops(CastPolicy.PROMOTE, "addcdiv addcmul atan2 bilinear cross dot grid_sampler index_put scatter_add tensordot stack cat index_copy"),
}

# Same file, TORCH_LIBRARY_IMPL(_, AutocastCPU, m).
CPU_AUTOCAST: dict[str, CastPolicy] = {
    **_ops(CastPolicy.LOWER, """conv1d conv2d conv3d bmm mm linalg_vecdot baddbmm addmm addbmm linear _convolution
        matmul conv_tbc conv_transpose1d conv_transpose2d conv_transpose3d prelu scaled_dot_product_attention
        _native_multi_head_attention"""),
    **_ops(CastPolicy.FP32, """avg_pool3d binary_cross_entropy grid_sampler polar prod quantile nanquantile stft cdist
        trace view_as_complex cholesky cholesky_inverse cholesky_solve inverse lu_solve orgqr ormqr pinverse max_pool3d
        max_unpool2d max_unpool3d adaptive_avg_pool3d reflection_pad1d reflection_pad2d replication_pad1d
        replication_pad2d replication_pad3d mse_loss cosine_embedding_loss nll_loss nll_loss2d hinge_embedding_loss
        poisson_nll_loss smooth_l1_loss cross_entropy l1_loss huber_loss margin_ranking_loss soft_margin_loss
        triplet_margin_loss multi_margin_loss ctc_loss kl_div multilabel_margin_loss binary_cross_entropy_with_logits"""),
    **_ops(CastPolicy.PROMOTE, "stack cat index_copy"),
}

# CompositeImplicitAutograd ops that the CPU list above does not name but whose decomposition calls ops it casts
# to the lower precision (aten/src/ATen/native/Linear.cpp: einsum's `sumproduct_pair` and tensordot reach `bmm`/`mm`,
# `inner` reaches tensordot; LinearAlgebra.cpp: linalg_multi_dot and chain_matmul reach `mm`). Autocast acts at
# every dispatcher call, including the calls made inside a composite kernel, so the real op computes in the lower
# precision (checked: each returns bf16 from fp32 inputs under `torch.autocast("cpu", torch.bfloat16)`); this
# mode sees the composite's Python call only, so it casts the floating operands at the composite's boundary,
# uncached (the cast operands inside are views, not leaves: `cached_cast` never caches them). The bytes saved
# for backward are the same (bmm/mm save the cast operands); a transient differs when the composite's reshape
# copies an operand: the real run copies it in fp32 and then casts it, this one casts and then copies.
CPU_AUTOCAST_COMPOSITE = frozenset("einsum tensordot inner linalg_multi_dot chain_matmul".split())

_SDP_MATH, _SDP_FLASH, _SDP_EFFICIENT = 0, 1, 2  # at::SDPBackend (sdp_utils_cpp.h)

# The order in which a CUDA kernel allocates its outputs where it is not the meta kernel's (StepRecorder.output_order):
# aten/src/ATen/native/cuda/Dropout.cu `dropout_cuda` makes the bool mask, then the output (`mask = at::empty_like`,
# then `ret = at::empty_like`); the H100 snapshots of issue 39 show each dropout's mask allocated first.
CUDA_OUTPUT_ORDER: dict[str, tuple[int, ...]] = {"aten.native_dropout.default": (1, 0)}


def _op_name(func) -> str:
    name = getattr(func, "__name__", "")
    if name.startswith("__") and name.endswith("__"):
        name = name[2:-2]
        if name.startswith("r") and name[1:] in ("matmul", "pow"):
            name = name[1:]
    return name


def cuda_sdpa_backend(sm: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask, dropout_p: float,
                      enable_gqa: bool) -> str:
    """Backend CUDA's `select_sdp_backend` would take (sdp_utils.cpp, priority flash > efficient > math).

    Flash (`use_flash_attention`): sm80+, fp16/bf16, no attn_mask, head dim <= 256 and a multiple of 8,
    same head dim for q/k/v; on sm86/sm89 a head dim > 192 with grad is refused. GQA is accepted.
    Memory-efficient (`use_mem_efficient_attention`): sm50+, fp16/bf16/fp32, head dim a multiple of 8 (4 for
    fp32), masks accepted, GQA (differing head counts) refused. Otherwise math.
    """
    d = q.shape[-1]
    same_d = k.shape[-1] == d and v.shape[-1] == d
    gqa = q.shape[-3] != k.shape[-3]
    half = q.dtype in (torch.float16, torch.bfloat16)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    flash_ok = (sm >= 80 and half and attn_mask is None and same_d and d <= 256 and d % 8 == 0
                and not (sm in (86, 89) and d > 192 and needs_grad))
    if flash_ok:
        return "flash"
    eff_align = 8 if half else 4
    eff_ok = (sm >= 50 and q.dtype in (torch.float16, torch.bfloat16, torch.float32) and same_d
              and d % eff_align == 0 and not gqa)
    if eff_ok:
        return "efficient"
    return "math"


def _tiny_like(t: torch.Tensor) -> torch.Tensor:
    # A real CPU tensor of t's shape and dtype that allocates only its last dim (stride 1 there, 0 elsewhere).
    # requires_grad carries over: the CPU backend check refuses the fused kernel for an attn_mask that needs
    # a gradient (e.g. Swin's learned relative-position bias)
    base = torch.empty((1,) * (t.dim() - 1) + (t.shape[-1],), dtype=t.dtype, requires_grad=t.requires_grad)
    return base.expand(t.shape)


class MoeRoutingPolicy:
    """Token counts of a mixture-of-experts layer's data-dependent ops, by a stated policy (`spec.MoeRouting`).

    Inside an experts module's eager forward (transformers' `eager` experts implementation, e.g.
    `MixtralExperts.forward`), `nonzero` of the (E,) or (E+1,) hit vector returns the experts that receive
    tokens, and each `where`/`nonzero` of an expert's (top_k, T) mask its assignments:
    balanced: the T * top_k assignments spread evenly over all E experts (the first (T*k) mod E get one more);
    worst: all T tokens go to the same top_k experts (T each): the largest per-expert batches (an upper bound
    on any expert's temporaries; the step's peak can still be lower than balanced, where every expert is hit
    and each hit expert adds its weight-gradient buffer).
    A truth test of a meta tensor there (`if expert_idx == num_experts`) is False: the policy's experts are
    real ones; indexing by a 0-dim expert id selects a row, as the real id would. Sizes come from the policy,
    never 0 by default.
    """

    def __init__(self, routing: str, num_experts: int, top_k: int, tokens: int):
        self.E = num_experts
        if routing == "worst":
            self.counts = [tokens if e < top_k else 0 for e in range(num_experts)]
        else:
            q, r = divmod(tokens * top_k, num_experts)
            self.counts = [q + (e < r) for e in range(num_experts)]
        self.hit = [e for e, c in enumerate(self.counts) if c > 0]
        self._next = 0  # index into `hit` of the expert whose mask is asked next

    def nonzero(self, t: torch.Tensor) -> torch.Tensor:
        """The nonzero() result, (n, t.dim()) int64, of the hit vector or of the next expert's mask."""
        if t.dim() == 1 and t.shape[0] in (self.E, self.E + 1):
            n = len(self.hit)
        else:
            n = self.counts[self.hit[self._next % len(self.hit)]]
            self._next += 1
        return torch.empty((n, t.dim()), dtype=torch.int64, device=t.device)


# Factories that copy host data (Python numbers, lists, arrays) into a new tensor: torch/csrc/utils/tensor_new.cpp
# `internal_new_from_data` builds it with the Python dispatch key excluded, then moves it to the device.
_HOST_DATA_FACTORIES = (torch.tensor, torch.as_tensor, torch.asarray)


class KernelPolicyMode(TorchFunctionMode):
    """Torch-function mode applying the target's SDPA, dropout and autocast behaviour to meta tensors.

    `autocast_dtype`: the mixed-precision compute dtype, or None. Autocast is active only inside
    `autocast_region()` and not inside `autocast_disabled()`. The tracer's callbacks (None: not called):
    `current_module()` names the module running now; `on_output(out)` sees every torch-function result
    (autograd-node module tagging); `on_host_data(out)` a tensor made from host data on the traced device
    (torch.tensor(x, device=...)), whose storage is allocated outside the dispatcher, so no dispatch mode sees it
    born; `on_host_output(t)` an op output the target's kernel makes in host memory (no device allocation);
    `on_weight_cast(weight, copy)` each weight's low-precision copy autocast caches.
    """

    def __init__(self, device: Device, sm: int, autocast_dtype: torch.dtype | None, *,
                 current_module: Callable[[], str] = lambda: "", on_output: Callable[[Any], None] | None = None,
                 on_host_data: Callable[[torch.Tensor], None] | None = None,
                 on_host_output: Callable[[torch.Tensor], None] | None = None,
                 on_weight_cast: Callable[[torch.Tensor, torch.Tensor], None] | None = None):
        super().__init__()
        self.device = device
        self.sm = sm
        self.autocast_dtype = autocast_dtype
        self.table = CUDA_AUTOCAST if device is Device.CUDA else CPU_AUTOCAST
        self.composite = frozenset() if device is Device.CUDA else CPU_AUTOCAST_COMPOSITE
        self._autocast_depth = 0
        self.on_weight_cast = on_weight_cast
        self._below_autocast_kernel = 0  # > 0 while an op autocast handled runs (its inner calls are not cast)
        self._disabled_depth = 0
        self._cast_cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.sdpa_calls: list[tuple[str, str]] = []  # (backend, module path) of every SDPA call
        self.current_module = current_module
        self.on_output = on_output
        self.on_host_data = on_host_data
        self.on_host_output = on_host_output
        self.moe: MoeRoutingPolicy | None = None  # set while an experts module's eager forward runs
        self.unresolved: list[str] = []  # what the target's kernels do that the trace cannot size

    # -- autocast regions -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def autocast_region(self):
        self._autocast_depth += 1
        try:
            yield
        finally:
            self._autocast_depth -= 1
            if self._autocast_depth == 0:
                self._cast_cache.clear()  # autocast_mode.cpp: clear_cache() when the outermost region exits

    @contextlib.contextmanager
    def autocast_disabled(self):
        self._disabled_depth += 1
        try:
            yield
        finally:
            self._disabled_depth -= 1

    @contextlib.contextmanager
    def _autocast_kernel(self, active: bool):
        """While an op that autocast casts runs: autocast_mode.cpp's wrappers call the op with the Autocast key
        excluded (`ExcludeDispatchKeyGuard`), so the kernels below it are not cast again."""
        self._below_autocast_kernel += active
        try:
            yield
        finally:
            self._below_autocast_kernel -= active

    @property
    def kernel_autocast_dtype(self) -> torch.dtype | None:
        """The autocast dtype a C++ kernel running now sees for its own inner op calls (None: not active)."""
        return self.autocast_dtype if self.autocast_active and not self._below_autocast_kernel else None

    @property
    def autocast_active(self) -> bool:
        return self.autocast_dtype is not None and self._autocast_depth > 0 and self._disabled_depth == 0

    def _eligible(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype is not torch.float64

    def _cast(self, t, dtype: torch.dtype):
        """autocast_mode.cpp `cached_cast`: cast eligible tensors; cache leaf fp32 weights cast to lower precision."""
        if not self._eligible(t) or t.dtype is dtype:
            return t
        cacheable = (dtype is self.autocast_dtype and t.dtype is torch.float32 and t.requires_grad and t.is_leaf
                     and not t._is_view())
        if cacheable:
            hit = self._cast_cache.get(id(t))
            if hit is not None and hit[0] is t:
                return hit[1]
        out = t.to(dtype)
        if cacheable:
            self._cast_cache[id(t)] = (t, out)
            if self.on_weight_cast is not None:
                self.on_weight_cast(t, out)
        return out

    def _map(self, fn, args, kwargs):
        """`fn` applied to every argument, the last first: autocast's wrappers cast them in one call's argument
        list (autocast_mode.h `WrapFunction_`: `(*F)(cached_cast(to_type, args, device_type)...)`), which GCC
        evaluates right to left, so a Linear's bias is cast, then its weight, then its input (the H100 snapshots
        of issue 39 allocate them in that order); a list argument is cast front to back (`cached_cast` of a
        TensorList loops over it). The order decides the caching allocator's best fit, not the bytes."""
        def m(a):
            if isinstance(a, (list, tuple)):
                return type(a)(m(x) for x in a)
            return fn(a)
        new_kwargs = {k: m(kwargs[k]) for k in reversed(list(kwargs))}
        new_args = [m(a) for a in reversed(args)][::-1]
        return tuple(new_args), {k: new_kwargs[k] for k in kwargs}

    def _apply_autocast(self, func, name, args, kwargs):
        policy = self.table.get(name)
        if policy is None and name in self.composite:  # the cast of its inner bmm/mm, at its boundary
            dtype = self.autocast_dtype
            return self._map(lambda a: a.to(dtype) if self._eligible(a) and a.dtype is not dtype else a, args, kwargs)
        if policy is None:
            return args, kwargs
        if policy is CastPolicy.LOWER:
            return self._map(lambda a: self._cast(a, self.autocast_dtype), args, kwargs)
        if policy is CastPolicy.FP32:
            return self._map(lambda a: self._cast(a, torch.float32), args, kwargs)
        if policy is CastPolicy.FP32_SET_OPT_DTYPE:
            first = args[0] if args else None
            if self._eligible(first) and kwargs.get("dtype") is None and not (len(args) > 2 and args[2] is not None):
                kwargs = {**kwargs, "dtype": torch.float32}
            return args, kwargs
        # PROMOTE: widest floating dtype among the eligible tensors
        flat = [a for a in args for a in (a if isinstance(a, (list, tuple)) else (a,))] + list(kwargs.values())
        dts = [t.dtype for t in flat if self._eligible(t)]
        if not dts:
            return args, kwargs
        widest = torch.float32 if torch.float32 in dts else dts[0]
        return self._map(lambda a: self._cast(a, widest), args, kwargs)

    # -- SDPA -----------------------------------------------------------------------------------------------
    def _sdpa(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if self.autocast_active:  # the last argument first (`_map`)
            if attn_mask is not None and attn_mask.is_floating_point():
                attn_mask = self._cast(attn_mask, self.autocast_dtype)
            value, key, query = (self._cast(t, self.autocast_dtype) for t in (value, key, query))
        if self.device is Device.CUDA:
            backend = cuda_sdpa_backend(self.sm, query, key, value, attn_mask, dropout_p, enable_gqa)
        else:
            # the stand-ins are the tracer's own, not the step's: made and asked with no mode recording them
            with torch.utils._python_dispatch._disable_current_modes(), torch._C.DisableTorchFunction():
                mask = None if attn_mask is None else _tiny_like(attn_mask)
                choice = torch._fused_sdp_choice(_tiny_like(query), _tiny_like(key), _tiny_like(value), mask,
                                                 dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
            backend = "flash" if choice == _SDP_FLASH else "math"
        self.sdpa_calls.append((backend, self.current_module()))
        if backend == "math":
            return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                                  is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        if attn_mask is not None and attn_mask.dtype is torch.bool:
            # attention.cpp convert_boolean_attn_mask: where(~mask, -inf, 0) in the query's dtype
            attn_mask = torch.where(attn_mask.logical_not(), float("-inf"),
                                    torch.scalar_tensor(0.0, dtype=query.dtype, device=query.device))
        aten = torch.ops.aten
        if self.device is Device.CPU:
            return aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, dropout_p, is_causal,
                                                                     attn_mask=attn_mask, scale=scale)[0]
        if backend == "flash":
            return aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False,
                                                            scale=scale)[0]
        lse = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        out = aten._scaled_dot_product_efficient_attention(query, key, value, attn_mask, lse, dropout_p, is_causal,
                                                           scale=scale)
        if self.on_host_output is not None:
            # its philox seed and offset are CPU tensors outside CUDA-graph capture, with or without dropout
            # (aten/src/ATen/native/transformers/cuda/attention.cu `_efficient_attention_forward`: `device =
            # in_capture_stream ? kCUDA : kCPU`); the meta kernel makes them on the traced device. The H100 runs
            # of issue 39 allocate nothing for them (GPT-2 fp32, T5's self-attention)
            for t in out[2:4]:
                self.on_host_output(t)
        return out[0]

    def _moe_op(self, func, args, kwargs):
        """An MoE data-dependent op answered by the routing policy, or NotImplemented."""
        first = args[0] if args else None
        if not isinstance(first, torch.Tensor) or first.device.type != "meta":
            return NotImplemented
        if func in (torch.nonzero, torch.Tensor.nonzero) and not kwargs.get("as_tuple"):
            return self.moe.nonzero(first)
        if (func is torch.where and len(args) == 1) or (func in (torch.nonzero, torch.Tensor.nonzero) and kwargs.get("as_tuple")):
            idx = self.moe.nonzero(first)
            return tuple(idx[:, d] for d in range(first.dim()))
        if func is torch.Tensor.__bool__:
            return False
        index = args[1] if len(args) > 1 else None
        if (func is torch.Tensor.__getitem__ and isinstance(index, torch.Tensor) and index.dim() == 0
                and not index.is_floating_point() and index.device.type == "meta"):
            # an expert id as a 0-dim tensor selects one row (a view, as with the real id); any id has its shape
            return func(first, 0)
        return NotImplemented

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.moe is not None:
            out = self._moe_op(func, args, kwargs)
            if out is not NotImplemented:
                return out
        if func is F.scaled_dot_product_attention:
            with self._autocast_kernel(self.autocast_active):
                return self._sdpa(*args, **kwargs)
        if func is F.multi_head_attention_forward:
            # nn.MultiheadAttention's (and nn.Transformer*Layer's) training and autocast path: run its body with
            # this mode active, so its SDPA call and matmuls get the target's backend and autocast policy
            with bridges.skip_next_torch_function_check(), self:
                return func(*args, **kwargs)
        if self.device is Device.CUDA and func in (torch._native_multi_head_attention,
                                                   torch._transformer_encoder_layer_fwd):
            self.unresolved.append(f"{func.__name__} in {self.current_module() or '(root)'}: the eval fast path's "
                                   "CUDA kernel is traced as one op; its internal buffers are not counted")
        if self.device is Device.CUDA and func is F.dropout:
            return self._cuda_dropout(*args, **kwargs)
        if func in _HOST_DATA_FACTORIES and self.on_host_data is not None:
            out = func(*args, **kwargs)
            if isinstance(out, torch.Tensor):
                self.on_host_data(out)
            return out
        cast = False
        if self.autocast_active:
            name = _op_name(func)
            if name == "cross_entropy" and self.device is Device.CUDA:
                return self._cuda_cross_entropy(*args, **kwargs)
            args, kwargs = self._apply_autocast(func, name, args, kwargs)
            cast = name in self.table
        with self._autocast_kernel(cast):
            out = func(*args, **kwargs)
        if self.on_output is not None and isinstance(out, torch.Tensor) and out.grad_fn is not None:
            self.on_output(out)
        return out

    def _cuda_dropout(self, input, p=0.5, training=True, inplace=False):
        # Dropout.cpp: is_fused_kernel_acceptable(input, p) -> native_dropout (bool mask) for CUDA tensors
        if training and 0 < p < 1 and input.numel() > 0:
            out = torch.ops.aten.native_dropout(input, p, True)[0]
            return input.copy_(out) if inplace else out
        return F.dropout(input, p, training, inplace)

    def _cuda_cross_entropy(self, input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                            reduction="mean", label_smoothing=0.0):
        """cross_entropy under CUDA autocast. `cross_entropy_loss` is CompositeImplicitAutograd and on no autocast
        list, so autocast acts on the ops it calls (aten/src/ATen/native/LossNLL.cpp `cross_entropy_loss_symint`):
        `at::log_softmax(self, class_dim, self.scalar_type())` passes the input's own dtype, which the
        fp32_set_opt_dtype policy keeps (autocast_mode.h `set_opt_dtype`: an explicit dtype is respected), so the
        log-probabilities are in the input's dtype (SoftMax.cpp `log_softmax`: `toType` to the same dtype is no
        copy); then `nll_loss` (fp32 policy) casts them to fp32, a copy autograd saves. On a bf16 (N, V) input: a
        bf16 (N, V) and an fp32 (N, V) tensor live into the backward, whose nll_loss_backward gradient is fp32
        (N, V) and the cast's backward and _log_softmax_backward_data's are bf16 (H100 snapshot of t5-base, 8 x
        512 tokens: 263,192,576 + 526,385,152 + 526,385,152 B live at the peak). Label smoothing and probability
        targets take the input cast to fp32 (not mirrored op by op)."""
        if label_smoothing > 0 or input.dim() == 0 or target.is_floating_point():
            return F.cross_entropy(self._cast(input, torch.float32), target, weight, size_average, ignore_index,
                                   reduce, reduction, label_smoothing)
        lsm = torch.log_softmax(input, 1 if input.dim() > 1 else 0, dtype=input.dtype)
        return F.nll_loss(self._cast(lsm, torch.float32), target, self._cast(weight, torch.float32), size_average,
                          ignore_index, reduce, reduction)


@contextlib.contextmanager
def _quiet_native_stderr():
    """Silence file descriptor 2 (kineto writes a 'profiler_start/stop' line per profiler run from C++)."""
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        sys.stderr.flush()
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def cpu_zeros_like(tree):
    """`tree` with every tensor replaced by CPU zeros of its sizes, strides and dtype (a real stand-in for a
    meta tensor); other leaves unchanged."""
    return torch.utils._pytree.tree_map(
        lambda x: torch.empty_strided(tuple(x.shape), x.stride(), dtype=x.dtype).zero_()
        if isinstance(x, torch.Tensor) else x, tree)


def unique_storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views and aliases counted once)."""
    seen, total = set(), 0
    for t in tensors:
        st = t.untyped_storage()
        if (key := StorageWeakRef(st)) not in seen:
            seen.add(key)
            total += st.nbytes()
    return total


def run_profiled(fn):
    """(fn(), peak bytes): the running maximum of the allocation sum over torch.profiler's `[memory]` allocator
    events (`profile_memory=True`) while `fn` runs, relative to its start."""
    with _quiet_native_stderr(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                        profile_memory=True) as prof:
        out = fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    cur = peak = 0
    for e in events:
        cur += e.nbytes()
        peak = max(peak, cur)
    return out, peak


STEP_MARK_BYTES = 7_654_321  # an odd-sized allocation between the two steps: where the measured one starts


def run_profiled_steps(first, second) -> int:
    """Peak bytes of the allocator while `second()` runs, counted from before `first()`: the running sum of
    torch.profiler's `[memory]` events over both calls (so what `first` left alive is counted, and its frees
    during `second` are seen: the profiler reports no free of an allocation made before it started, c10's
    ProfiledCPUMemoryReporter keeps sizes only while profiling), maximised over the events of `second`. The
    boundary is a sentinel allocation of `STEP_MARK_BYTES` in the same event stream (timestamps of different
    event kinds are not comparable)."""
    with _quiet_native_stderr(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                        profile_memory=True) as prof:
        first()
        mark = torch.empty(STEP_MARK_BYTES, dtype=torch.uint8)
        del mark
        second()
    cur, peak, measuring = 0, None, False
    for e in sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns()):
        if abs(e.nbytes()) == STEP_MARK_BYTES:
            measuring = True
            continue
        cur += e.nbytes()
        if measuring:
            peak = cur if peak is None else max(peak, cur)
    return cur if peak is None else peak


def cpu_environment() -> dict[str, str | int]:
    """What a CPU target's kernel workspaces depend on, as plain data: the CPU model, its flags that change
    oneDNN's kernels (avx512_bf16, avx512_fp16, amx_*), the oneDNN ISA cap in effect (`ONEDNN_MAX_CPU_ISA`,
    else every ISA the CPU has), ATen's vectorisation level (`torch.backends.cpu.get_cpu_capability()`), the
    intra-op thread count (`torch.get_num_threads()`) and the torch version."""
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not model:
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    wanted = sorted(f for f in flags if f in ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni")
                    or f.startswith("amx"))
    return {"cpu": model or "unknown", "cpu_flags": " ".join(wanted),
            "onednn_max_isa": os.environ.get("ONEDNN_MAX_CPU_ISA") or "(all the CPU has)",
            "aten_capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
            "torch": torch.__version__}


@contextlib.contextmanager
def rank_threads(world: int | None):
    """This process's intra-op thread count set, while the block runs, to what one rank of a `world`-rank CPU job
    runs with, and restored after: torchrun starts each of more than one local rank with `OMP_NUM_THREADS=1`
    unless the variable is set (torch/distributed/run.py `config_from_args`), so 1 for `world` > 1 without
    `OMP_NUM_THREADS` (with it, this process already runs with that many). The CPU kernels' workspaces depend on
    the thread count (oneDNN's per-thread scratchpads of bf16 matmuls on an AVX-512-BF16 CPU), and the probe's
    cache keys and `cpu_environment()` read it, so a sharded trace is probed as its ranks run."""
    before = torch.get_num_threads()
    if world is None or world <= 1 or "OMP_NUM_THREADS" in os.environ or before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# What a CPU kernel raises on stand-ins it does not accept (the meta kernel's layouts are not the CPU kernel's)
KERNEL_ERRORS = (RuntimeError, ValueError, TypeError, IndexError, NotImplementedError)

# Tensors above this many bytes make an op worth running at reduced sizes (`CpuWorkspaceProbe`): a Llama-2-7b
# matmul at batch 4 x 2048 (8192 x 4096 by 4096 x 11008, fp32: 480 MiB) takes seconds on two cores.
REDUCE_ABOVE_BYTES = 256 << 20
# So do more FLOPs than this (torch.utils.flop_counter's formula for the op, where it has one): a bf16 matmul on a
# CPU without native bf16 (at::native's cpublas fallback; this AVX2 machine) runs at about 0.5 GFLOP/s, so Llama-2-7b's
# 8192 x 4096 by 4096 x 4096 bf16 matmul (160 MiB of tensors, 275 GFLOP) would take nine minutes at full size.
REDUCE_ABOVE_FLOPS = 10**9
# A run at reduced sizes beyond the three smallest is made while its tensors stay within this many bytes
# (`CpuWorkspaceProbe._extrapolated`): more points on the line, at a bounded cost.
REDUCED_RUN_BYTES = 16 << 20


def available_host_bytes() -> int:
    """MemAvailable of /proc/meminfo (bytes), else the free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


# The CPU target's collectives are gloo's (torch.distributed's CPU backend), and two of them allocate a temporary
# for the duration of the collective (torch/csrc/distributed/c10d/ProcessGroupGloo.cpp): `_reduce_scatter_base`
# (`reduce_scatter_tensor_coalesced`) clones the whole input, all-reduces the clone in place and copies this rank's
# chunk out; `_allgather_base` gathers into a temporary of the output's size, then copies it into the output. NCCL
# (a CUDA target) reduces and gathers in place. Op -> the argument (0: output, 1: input) whose bytes it holds.
GLOO_TEMPORARY = {"c10d._reduce_scatter_base_.default": 1, "c10d._allgather_base_.default": 0}


class Probed(NamedTuple):
    """What the CPU probe found for one op signature: its workspace (bytes), the outputs to lay out as the CPU
    kernel does ((leaf index, shape, stride, dtype), ...), and what the report says of it (or None): why it could
    not be measured, how its outputs differ from the meta kernel's, how it was extrapolated."""
    workspace: int
    layouts: tuple
    failure: str | None = None
    note: str | None = None
    extrapolated: str | None = None


# The probe's results in this process, shared by every `CpuWorkspaceProbe` (the compiled trace and the eager one
# it is compared with run the same large kernels): key (op, argument layouts, autocast dtype, thread count, the
# probe's thresholds, whether its memory limit applies) -> Probed. A memo of measurements of this process's CPU
# kernels, which do not change in it.
_PROBED: dict[tuple, Probed] = {}


# The probe's results on disk, for the next process on this machine: a directory, or "off". Default:
# $XDG_CACHE_HOME/vramtrace (else ~/.cache/vramtrace).
PROBE_CACHE_ENV = "VRAMTRACE_CPU_PROBE_CACHE"
# The version of the probe's rules, part of the disk cache's file name (`ProbeDiskCache`). Bump it with any change
# to what the probe stores for an op signature or to how it reaches it: the key (`CpuWorkspaceProbe`'s signature),
# the measurement (the profiled run, oneDNN's scratchpad queries in onednn.py), the extrapolation and reduction
# rules, the stored layouts or notes. A stale file is then never read; a change elsewhere keeps the cache.
PROBE_RULES_VERSION = 1


class ProbeDiskCache:
    """The probe's results (`Probed`) on disk, one JSON line per op signature, in a file named by a digest of
    `cpu_environment()` (CPU model and flags, oneDNN ISA cap, ATen's vectorisation, threads, torch version) and of
    `PROBE_RULES_VERSION` (a change to the probe's rules bumps it and starts a new file). A measurement is a fact
    about this machine's kernels, so a later run finds it instead of running the kernel again (Llama-2-7b's probes
    take tens of seconds on two cores), and a process running beside it finds what the other measured since (`get`).
    Failures are not kept (they may depend on the memory free at the time). Best effort:
    a file it cannot read or write is a cache that finds nothing. Where: `path`; off: `VRAMTRACE_CPU_PROBE_CACHE=off`;
    to clear it, delete the directory."""

    def __init__(self, path: Path | None):
        self.path = path
        self._found: dict[str, Probed] = {}
        self._read_to = 0  # bytes of the file read so far (whole lines)

    @classmethod
    def for_this_machine(cls) -> "ProbeDiskCache":
        where = os.environ.get(PROBE_CACHE_ENV, "")
        if where.lower() == "off":
            return cls(None)
        try:
            base = Path(where) if where else (
                Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vramtrace")
            keyed = {"environment": cpu_environment(), "probe_rules": PROBE_RULES_VERSION}
            digest = hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()[:16]
        except RuntimeError:  # no home directory: no cache
            return cls(None)
        return cls(base / f"cpu-kernels-{digest}.jsonl")

    def _read_new(self) -> None:
        """Read the whole lines written to the file since the last read (by any process)."""
        if self.path is None:
            return
        try:
            with open(self.path, "rb") as f:
                f.seek(self._read_to)
                data = f.read()
        except OSError:
            return
        whole = data[:data.rfind(b"\n") + 1]  # a line still being written is read next time
        self._read_to += len(whole)
        for line in whole.decode("utf-8", errors="replace").splitlines():
            try:
                k, (ws, layouts, note, extrapolated) = json.loads(line)
                self._found[k] = Probed(ws, tuple((i, tuple(shape), tuple(stride), getattr(torch, dtype))
                                                  for i, shape, stride, dtype in layouts),
                                        note=note, extrapolated=extrapolated)
            except (ValueError, TypeError, AttributeError):
                continue  # a line cut short by a process that stopped while writing it

    def get(self, key: tuple) -> Probed | None:
        """The result stored for `key`, or None. A miss reads the file again: another process on this machine may
        have measured it since (`--compile`'s eager comparison runs in a second process, and both trace the
        optimizer's and the loss's ops, and matmuls of the same layouts)."""
        if repr(key) not in self._found:
            self._read_new()
        return self._found.get(repr(key))

    def put(self, key: tuple, found: Probed) -> None:
        if self.path is None or found.failure is not None:
            return
        layouts = [(i, list(shape), list(stride), str(dtype).removeprefix("torch."))
                   for i, shape, stride, dtype in found.layouts]
        line = json.dumps([repr(key), [found.workspace, layouts, found.note, found.extrapolated]])
        self._found[repr(key)] = found
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line + "\n")
        except OSError:
            pass


_DISK: dict[str, ProbeDiskCache] = {}  # by (cache setting, thread count)


def _disk_cache() -> ProbeDiskCache:
    """This machine's `ProbeDiskCache` under the current `VRAMTRACE_CPU_PROBE_CACHE` and thread count."""
    key = f"{os.environ.get(PROBE_CACHE_ENV, '')}|{torch.get_num_threads()}"
    if key not in _DISK:
        _DISK[key] = ProbeDiskCache.for_this_machine()
    return _DISK[key]


class CpuWorkspaceProbe:
    """Bytes a CPU kernel allocates and frees inside one op (its workspace), beyond its new outputs.

    Measured, not modelled, for every op that computes (all but views): the op is run once on real CPU
    tensors of the same sizes, strides and dtypes (zeros), in this process (same thread count, same oneDNN ISA),
    under torch.profiler's allocator events (`profile_memory=True`); the workspace is the peak of the running
    allocation sum inside the op minus the bytes of the output storages it allocated (an in-place op's output
    is its input: not subtracted). Cached per signature (op, shapes, strides, dtypes, other arguments, thread
    count) for the whole process (`_PROBED`), and on disk for the next process (`ProbeDiskCache`; `--compile`'s
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
        local = _dtensor_local_op(func, args, kwargs, out)
        if local is not None:
            return self(func, *local)[0], out
        if str(func) in GLOO_TEMPORARY:  # a collective: the fake backend runs no kernel to probe
            t = args[GLOO_TEMPORARY[str(func)]]
            return t.numel() * t.element_size(), out
        if func.namespace in ("c10d", "_c10d_functional"):  # the other collectives: nothing the fake backend runs
            return 0, out  # is gloo's, and a collective run here would wait in c10d's work registry for ever
        autocast = self.autocast_dtype()
        # the memory limit enters as whether it applies: each probe reads the memory available when it starts
        over = _tensor_bytes((args, kwargs, out)) > self.limit_bytes
        key = (str(func), self._key(args), self._key(tuple(sorted(kwargs.items()))), autocast,
               torch.get_num_threads(), over, self.reduce_above, self.reduce_above_flops)
        if key not in _PROBED:
            found = _disk_cache().get(key)
            if found is None:
                found = self._probe(func, args, kwargs, out, autocast)
                _disk_cache().put(key, found)
            _PROBED[key] = found
        ws, layouts, failure, note, extrapolated = _PROBED[key]
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
        matmuls (4096 and more) 1/32, 1/16, 1/8: a bf16 matmul on a CPU without native bf16 runs at about
        0.5 GFLOP/s (this AVX2 machine), so its 1/2 run alone would take minutes. A step between the largest run and
        full size is not seen. A kernel whose blocking changes with the sizes is not affine over the runs and runs
        at full size, unless an op rule (`REDUCTION_RULES`) knows where its blocking is constant.

        Before the line: an op whose workspace a library states (`SCRATCHPAD_QUERIES`: oneDNN's matmul scratchpad)
        takes the library's answer at full size when its answers at the reduced sizes equal every measured run (one
        of them not 0). oneDNN's bf16 matmul scratchpads on an AVX-512-BF16 CPU step with the sizes: a line through
        three runs can be exactly affine and wrong at full size, both ways (`onednn.py`; (1024, 4096) @ (4096,
        1024): 657,024 B on the line, 3,442,432 B booked)."""
        if str(func) in NOT_EXTRAPOLATED:
            return None
        rule = REDUCTION_RULES.get(str(func))
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
        query = SCRATCHPAD_QUERIES.get(str(func))
        found, answered = [], query is not None
        for sizes, x in cuts:
            reduced = tuple(_reduced(tree, sizes) for tree in (args, kwargs, out))
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
        r_args, r_kwargs, r_out = (_reduced(tree, sizes) for tree in (args, kwargs, out))
        return r_args is not None and op_flops(func, r_args, r_kwargs, r_out) <= self.reduce_above_flops

    def _reduced_run(self, func, r_args, r_kwargs, r_out, autocast) -> int | None:
        """The workspace of one run of `func` on its arguments cut to reduced sizes (`_reduced`: meta, None where a
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


def _dtensor_local_op(func, args, kwargs, out) -> tuple | None:
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


def op_flops(func, args, kwargs, out) -> int:
    """FLOPs of one op by torch.utils.flop_counter's formula for it (`flop_registry`), 0 where it has none."""
    flop_rule = flop_registry.get(func.overloadpacket)
    return int(flop_rule(*args, **kwargs, out_val=out)) if flop_rule is not None else 0


def _reduced(tree, sizes: dict[int, int]):
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
# every run at reduced sizes, so an op that does not reach that library here (ATen's own bf16 gemm on a CPU without
# native bf16, MKL's fp32 sgemm: 0 bytes measured) keeps the measured line.
SCRATCHPAD_QUERIES = {f"aten.{op}.default": _onednn_matmul for op in ("mm", "bmm", "addmm", "baddbmm")}

# Ops run at full size however large (`CpuWorkspaceProbe._extrapolated`): oneDNN's convolutions pick their
# blocking and reorders from the channel counts, and a line through runs at reduced channels can be exactly affine
# and wrong. Measured: a 1x1 convolution of 32 x 1024 x 7 x 7 to 2048 channels (ResNet-50's last stage), cut
# to 1/8, 1/4, 1/2: 12,845,056 B on the line, 14,811,136 B at full size in fp32 (on an AVX-512 CPU and under
# ONEDNN_MAX_CPU_ISA=AVX2 alike), 6,422,528 against 7,807,104 B in bf16 on AVX-512-BF16.
NOT_EXTRAPOLATED = frozenset({"aten.convolution.default", "aten.convolution_backward.default"})

# Ops whose large runs are cut by a rule of their own (`CpuWorkspaceProbe._extrapolated`): op -> the rule.
REDUCTION_RULES = {
    "aten._scaled_dot_product_flash_attention_for_cpu.default": _flash_attention_points,
    "aten._scaled_dot_product_flash_attention_for_cpu_backward.default": _flash_attention_points,
}
