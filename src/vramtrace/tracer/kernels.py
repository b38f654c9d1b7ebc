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

What a CPU kernel allocates inside one op is measured, not modelled: `probe.py` (`CpuWorkspaceProbe`).
"""

from __future__ import annotations

import contextlib
import enum
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .. import bridges
from ..spec import Device
from .op_rules import aten_packet_names, op_table


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

# The three tables above stay keyed by name: a TorchFunctionMode sees Python functions (`F.linear`, `torch.matmul`,
# `Tensor.__matmul__`), not dispatched overloads, and `_op_name` reads the name they share with the aten op that
# autocast_mode.cpp lists (every overload of it). Each name is checked here to be such an aten op (op_rules.py), so
# a misspelled one fails at import; `cross_entropy` is `F.cross_entropy`, which calls aten::cross_entropy_loss.
aten_packet_names("CUDA_AUTOCAST", CUDA_AUTOCAST)
aten_packet_names("CPU_AUTOCAST", CPU_AUTOCAST, aliases={"cross_entropy": "cross_entropy_loss"})
aten_packet_names("CPU_AUTOCAST_COMPOSITE", CPU_AUTOCAST_COMPOSITE)

_SDP_MATH, _SDP_FLASH, _SDP_EFFICIENT = 0, 1, 2  # at::SDPBackend (sdp_utils_cpp.h)

# The order in which a CUDA kernel allocates its outputs where it is not the meta kernel's (StepRecorder.output_order):
# aten/src/ATen/native/cuda/Dropout.cu `dropout_cuda` makes the bool mask, then the output (`mask = at::empty_like`,
# then `ret = at::empty_like`); the H100 snapshots of issue 39 show each dropout's mask allocated first.
CUDA_OUTPUT_ORDER = op_table("CUDA_OUTPUT_ORDER", {"aten.native_dropout.default": (1, 0)})


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
