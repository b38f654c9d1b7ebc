"""FlashAttention-2 on a CUDA target: a meta stand-in of the flash_attn package's `flash_attn_func` and
`flash_attn_varlen_func` (flash-attn v2.8.3), traced under transformers' own `flash_attention_2` path
(integrations/flash_attention.py `flash_attention_forward`, modeling_flash_attention_utils.py
`_flash_attention_forward`).

The flash_attn package is neither installed nor needed: its CUDA kernels are written as the tensors they allocate,
with `torch.empty` on the inputs' (meta) device, so the recorder sees each allocation where the real kernel makes
it. Each rule cites its source at tag v2.8.3 of Dao-AILab/flash-attention:

* `flash_attn/flash_attn_interface.py` `FlashAttnFunc.forward` / `FlashAttnVarlenFunc.forward`: a head dim not a
  multiple of 8 pads q, k, v (`F.pad` to the next multiple: new tensors); `_flash_attn_forward` makes q, k, v
  contiguous only where `stride(-1) != 1` (`maybe_contiguous`); saves (q, k, v, out_padded, softmax_lse,
  rng_state) (varlen: with cu_seqlens_q, cu_seqlens_k) for backward; returns `out_padded[..., :d]` (a view).
* `csrc/flash_attn/flash_api.cpp` `mha_fwd`: out `empty_like(q)` (padded shape), softmax_lse fp32 (b, h, s_q),
  p `empty({0})` (no return_softmax), the split-KV accumulators of `set_params_splitkv` when
  `num_splits_heuristic` picks more than one split (no dropout; a one-token GQA query is sized as h_k heads of
  ngroups rows, `seqlenq_ngroups_swapped`), rng_state int64 (2,). `mha_varlen_fwd`: out
  `empty_like(q)`, softmax_lse fp32 (h, total_q), p, rng_state (split-KV only for decoding with swapped groups,
  which a training or prefill step never takes).
* `FlashAttnFunc.backward`: dq, dk, dv `empty_like` of the saved (padded) q, k, v, a padded dout where the head
  dim is padded; `flash_api.cpp` `mha_bwd`: softmax_d fp32 (b, h, round128(s_q)), dq_accum fp32
  (b, round128(s_q), h, head_size_rounded) (deterministic: zeros (nsplits, ...), nsplits = ceil(SMs / (b*h))),
  and for GQA/MQA dk_expanded, dv_expanded (b, s_k, h, d) in q's dtype, summed into dk, dv (`at::sum_out`).
  `mha_varlen_bwd`: softmax_d fp32 (h, total_q + 128*n), dq_accum fp32 (total_q + 128*n, h, head_size_rounded),
  n the number of sequences (`cu_seqlens_q.numel() - 1`); GQA dk/dv_expanded (total_k, h, d).
  `head_size_rounded = round_multiple(d, d <= 128 ? 32 : 64)` (v2.8.3; d already a multiple of 8).

What autograd saves is categorised as SDPA's flash attention's saved tensors are (activations); the backward's
buffers are temporaries, as SDPA's backward outputs are.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..errors import ModelLoadError
from ..spec import AttnImplementation, CacheKind, Device, Mode, RunSpec

FA_VERSION = "flash-attn 2.8.3"
_ROWS = 128  # flash_api.cpp: seqlen rounded to a multiple of 128 (`round_multiple(seqlen_q, 128)`), varlen + 128*n


def _round(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def head_size_rounded(d: int) -> int:
    """flash_api.cpp (v2.8.3) `mha_fwd`/`mha_bwd`: `round_multiple(head_size, head_size <= 128 ? 32 : 64)` of the
    head size padded to a multiple of 8."""
    d = _round(d, 8)
    return _round(d, 32 if d <= 128 else 64)


def num_splits(b: int, h: int, s_q: int, s_k: int, d: int, num_sms: int) -> int:
    """flash_api.cpp (v2.8.3) `set_params_splitkv` with `num_splits_heuristic(b*h*ceil(s_q/64), 2*SMs, n_blocks,
    128)`: the split-KV count of a dense forward without dropout (1: no accumulators)."""
    block_n = 256 if d <= 64 else (128 if d <= 128 else 64)
    n_blocks = (s_k + block_n - 1) // block_n
    work, sms = b * h * ((s_q + 63) // 64), 2 * num_sms
    if work >= 0.8 * sms:
        return 1
    max_splits = min(128, sms, n_blocks)

    def eligible(n: int) -> bool:
        return n == 1 or -(-n_blocks // n) != -(-n_blocks // (n - 1))

    eff = {}
    for n in range(1, max_splits + 1):
        if eligible(n):
            waves = work * n / sms
            eff[n] = waves / math.ceil(waves)
    best = max(eff.values(), default=0.0)
    return next((n for n in sorted(eff) if eff[n] >= 0.85 * best), 1)


def _check(q: torch.Tensor, k: torch.Tensor) -> None:
    """flash_api.cpp `mha_fwd` TORCH_CHECKs, as one-line errors: fp16/bf16, head dim <= 256, heads divisible."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise ModelLoadError(f"attention flash_attention_2 runs fp16 and bf16 only ({FA_VERSION} mha_fwd), its "
                             f"inputs here are {str(q.dtype).removeprefix('torch.')}: use --precision bf16-mixed, "
                             "bf16 or fp16, or --attn-implementation sdpa")
    if q.shape[-1] > 256:
        raise ModelLoadError(f"attention flash_attention_2 supports head dims up to 256 ({FA_VERSION}), this "
                             f"model's is {q.shape[-1]}: use --attn-implementation sdpa")


def _pad8(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    d = ts[0].shape[-1]
    return tuple(F.pad(t, [0, 8 - d % 8]) for t in ts) if d % 8 else ts


def _contiguous(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # flash_attn_interface.py `maybe_contiguous`: a copy only where the last dim is strided
    return tuple(t.contiguous() if t.stride(-1) != 1 else t for t in ts)


def _empty(shape, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype or like.dtype, device=like.device)


class FlashAttnFunc(torch.autograd.Function):
    """flash_attn_interface.py `FlashAttnFunc` with `mha_fwd`/`mha_bwd`'s allocations (module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, dropout_p, window_size, deterministic, num_sms, is_grad_enabled):
        _check(q, k)
        is_grad = is_grad_enabled and any(t.requires_grad for t in (q, k, v))
        d = q.shape[-1]
        q, k, v = _contiguous(*_pad8(q, k, v))
        b, s_q, h, dp = q.shape
        out = torch.empty_like(q)
        lse = _empty((b, h, s_q), q, torch.float32)
        _empty((0,), q)  # p: empty unless return_softmax
        split_h, split_s = _split_heads_and_rows(q, k, dropout_p, window_size)
        splits = num_splits(b, split_h, split_s, k.shape[1], dp, num_sms) if dropout_p == 0 else 1
        held = []  # set_params_splitkv's accumulators, live until mha_fwd returns
        if splits > 1:
            held = [_empty((splits, b, h, s_q), q, torch.float32),
                    _empty((splits, b, h, s_q, head_size_rounded(dp)), q, torch.float32)]
        rng = _empty((2,), q, torch.int64)
        del held
        if is_grad:
            ctx.save_for_backward(q, k, v, out, lse, rng)
            ctx.meta = (d, deterministic, num_sms)
        return out[..., :d]

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, rng = ctx.saved_tensors
        d, deterministic, num_sms = ctx.meta
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        (dout,) = _contiguous(*_pad8(dout))
        b, s_q, h, dp = q.shape
        rows = _round(s_q, _ROWS)
        held = _mha_bwd_buffers(q, k, dk, dv, (b, h, rows), (b, rows, h, head_size_rounded(dp)), b * h,
                                deterministic, num_sms)
        del held  # mha_bwd returned: its buffers are freed
        return dq[..., :d], dk[..., :d], dv[..., :d], None, None, None, None, None


def _split_heads_and_rows(q, k, dropout_p: float, window_size) -> tuple[int, int]:
    """(heads, query rows) that flash_api.cpp `mha_fwd` (v2.8.3) sizes split-KV with: a one-token query of GQA/MQA
    with no window and no dropout is transposed to (b, ngroups, h_k, d) (`seqlenq_ngroups_swapped`: h_k heads of
    ngroups rows); a window at least as long as the keys is no window."""
    s_q, h, s_k, hk = q.shape[1], q.shape[2], k.shape[1], k.shape[2]
    left, right = (-1 if w >= s_k else w for w in window_size)  # causal is off for one query row
    if s_q == 1 and h > hk and left < 0 and right < 0 and dropout_p == 0:
        return hk, h // hk
    return h, s_q


def _mha_bwd_buffers(q, k, dk, dv, softmax_d: tuple, dq_accum: tuple, bh: int, deterministic: bool,
                     num_sms: int) -> list[torch.Tensor]:
    """flash_api.cpp `mha_bwd`/`mha_varlen_bwd`: softmax_d and dq_accum (fp32), then for GQA/MQA dk_expanded and
    dv_expanded in q's dtype, all live while the kernel runs, then summed into dk, dv (`at::sum_out`). Returns them:
    the caller drops them when mha_bwd would return."""
    held = [_empty(softmax_d, q, torch.float32)]
    if deterministic:
        held.append(torch.zeros(((num_sms + bh - 1) // bh, *dq_accum), dtype=torch.float32, device=q.device))
    else:
        held.append(_empty(dq_accum, q, torch.float32))
    h, hk = q.shape[-2], k.shape[-2]
    if h != hk:
        expanded = [_empty((*k.shape[:-2], h, k.shape[-1]), q) for _ in (dk, dv)]
        for grad, full in zip((dk, dv), expanded):
            torch.sum(full.reshape(*k.shape[:-2], hk, h // hk, k.shape[-1]), dim=-2, out=grad)
        held += expanded
    return held


class FlashAttnVarlenFunc(torch.autograd.Function):
    """flash_attn_interface.py `FlashAttnVarlenFunc` with `mha_varlen_fwd`/`mha_varlen_bwd`'s allocations."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, dropout_p, deterministic, num_sms, is_grad_enabled):
        _check(q, k)
        is_grad = is_grad_enabled and any(t.requires_grad for t in (q, k, v))
        d = q.shape[-1]
        q, k, v = _contiguous(*_pad8(q, k, v))
        total_q, h, _ = q.shape
        out = torch.empty_like(q)
        lse = _empty((h, total_q), q, torch.float32)
        _empty((0,), q)  # p
        rng = _empty((2,), q, torch.int64)
        if is_grad:
            ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, rng)
            ctx.meta = (d, deterministic, num_sms)
        return out[..., :d]

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu_q, cu_k, rng = ctx.saved_tensors
        d, deterministic, num_sms = ctx.meta
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        (dout,) = _contiguous(*_pad8(dout))
        total_q, h, dp = q.shape
        n = cu_q.shape[0] - 1
        rows = total_q + _ROWS * n
        held = _mha_bwd_buffers(q, k, dk, dv, (h, rows), (rows, h, head_size_rounded(dp)), n * h, deterministic,
                                num_sms)
        del held  # mha_varlen_bwd returned
        return dq[..., :d], dk[..., :d], dv[..., :d], None, None, None, None, None, None


def standins(num_sms: int):
    """(flash_attn_func, flash_attn_varlen_func) of flash-attn v2.8.3 with their exact parameter names (transformers
    reads them: modeling_flash_attention_utils.py `_lazy_define_process_function`), for a GPU of `num_sms` SMs
    (split-KV and deterministic split counts). Window, softcap and ALiBi change no allocation and are accepted;
    `return_attn_probs` and a paged `block_table` are refused (ModelLoadError)."""

    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                        alibi_slopes=None, deterministic=False, return_attn_probs=False):
        if return_attn_probs:
            raise ModelLoadError("attention flash_attention_2 with return_attn_probs is not traced")
        return FlashAttnFunc.apply(q, k, v, dropout_p, tuple(window_size), deterministic, num_sms,
                                   torch.is_grad_enabled())

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                               deterministic=False, return_attn_probs=False, block_table=None):
        if return_attn_probs or block_table is not None:
            raise ModelLoadError("attention flash_attention_2 with return_attn_probs or a paged KV cache is not "
                                 "traced")
        return FlashAttnVarlenFunc.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, dropout_p, deterministic, num_sms,
                                         torch.is_grad_enabled())

    return flash_attn_func, flash_attn_varlen_func


def uses_standin(spec, device: str) -> bool:
    """Whether a build on `device` for `spec` runs flash_attention_2 through the stand-in: asked for with
    `attn_implementation`, on the meta device, for a CUDA target (a real build uses the installed package)."""
    from ..spec import AttnImplementation, Device

    return (spec.attn_implementation is AttnImplementation.FLASH_ATTENTION_2 and device == "meta"
            and spec.device is Device.CUDA)


def standin_context(spec, device: str = "meta", policy=None):
    """The FLASH_ATTENTION_STANDIN bridge (feature_bridges.flash_attention_standin) with this GPU's stand-ins where
    `uses_standin`, else a context that does nothing; `policy`: the recorded step's kernel policy (its autocast).
    Raises BridgeError when a target is missing."""
    import contextlib

    if not uses_standin(spec, device):
        return contextlib.nullcontext()
    from ..feature_bridges import flash_attention_standin

    return flash_attention_standin(*standins(spec.gpu_preset.sm_count), policy)


def check_attn_implementation(attn: str | None, spec: RunSpec, device: str) -> None:
    """Refuse, in one line, an attention implementation that cannot be traced faithfully on meta or cannot run
    on the target (no silent fallback to another one). `attn`: the `--attn-implementation` value, else the
    config's `attn_implementation`. Raises ModelLoadError.

    - flash_attention_2 runs the flash_attn package's CUDA kernels: not on a CPU; on a CUDA target it is traced
      through tracer/flash_attn.py's stand-in when asked for with --attn-implementation (`uses_standin`).
    - flex_attention: torch's `flex_attention` refuses meta tensors (`_validate_device`) and compiles a kernel per
      device, and has no CPU backward (torch/nn/attention/flex_attention.py).
    """
    if attn is None or not isinstance(attn, str):
        return
    target = Device.CPU if device == "cpu" else spec.device
    if attn.startswith("flash_attention"):
        if target is Device.CPU:
            raise ModelLoadError(f"attention {attn} runs only on CUDA GPUs (the flash_attn package); use "
                                 "--attn-implementation sdpa or eager for --device cpu")
        if attn != AttnImplementation.FLASH_ATTENTION_2.value:
            raise ModelLoadError(f"attention {attn} is not supported: vramtrace traces flash_attention_2 (flash-attn "
                                 "2.8.3); use --attn-implementation flash_attention_2 or sdpa")
        if spec.attn_implementation is not AttnImplementation.FLASH_ATTENTION_2:
            raise ModelLoadError("this model's config asks for flash_attention_2: pass --attn-implementation "
                                 "flash_attention_2 (traced with flash-attn 2.8.3's allocations) or sdpa")
        if spec.mode is Mode.GENERATE and spec.cache is not CacheKind.DYNAMIC:
            raise ModelLoadError(f"attention flash_attention_2 with --cache {spec.cache.value} is not traced (the "
                                 "cache's padding mask takes flash-attn's unpadding path, which reads values); use "
                                 "--cache dynamic or --attn-implementation sdpa")
        return
    if attn == AttnImplementation.FLEX_ATTENTION.value:
        raise ModelLoadError("attention flex_attention cannot be traced: torch's flex_attention refuses meta tensors "
                             "and compiles its kernel per device (and has no CPU backward); use --attn-implementation "
                             "sdpa or eager")
