"""bitsandbytes 4-bit and int8 weights on the meta device, as transformers loads them (`--quantization
nf4|fp4|int8`).

`quantize(model, spec, weight_dtype)` runs transformers' own quantizer on the meta model: `AutoHfQuantizer` of the
`BitsAndBytesConfig` that `bnb_config(spec)` builds replaces the Linear layers by bitsandbytes `Linear4bit`
(transformers/integrations/bitsandbytes.py `replace_with_bnb_linear`; `lm_head` and the modules of
`llm_int8_skip_modules` stay as they are, transformers/quantizers/quantizer_bnb_4bit.py
`_process_model_before_weight_loading`), then every weight is quantized as the loader quantizes a checkpoint
tensor (`Bnb4bitQuantize.convert`: `Params4bit(value, requires_grad=False, **old.__dict__)` moved to the device,
which calls `Params4bit._quantize`, bitsandbytes/nn/modules.py), here with the device meta: bitsandbytes' own
`quantize_4bit` (bitsandbytes/functional.py) runs on its registered fake kernels (bitsandbytes/_ops.py), so the
storages come out as bitsandbytes lays them out: the packed weight of ceil(n / 2) uint8, one fp32 absmax per
block of 64 (with double quantization: one uint8 per block, plus the nested fp32 absmax per 256 blocks, its
256-entry code table and the offset), the 16-entry code table of the 4-bit type.

The step then runs bitsandbytes' own `Linear4bit.forward` (`bnb.matmul_4bit`): in training `MatMul4Bit`
dequantizes the weight for the forward matmul and again for the input gradient in the backward
(bitsandbytes/autograd/_functions.py), each a temporary of the weight's full size in the compute dtype. What is
not traced: bitsandbytes' CPU repacking of 4-bit weights for inference on AVX512-BF16 CPUs
(`_convert_weight_packed_for_cpu`, only without autograd).

int8 (`load_in_8bit=True`, LLM.int8()): transformers puts `Linear8bitLt(has_fp16_weights=False, threshold=6.0)` in
place of the Linear layers and loads each weight as `Int8Params(value, requires_grad=False, ...).to(device)`
(`Bnb8bitQuantize.convert`), which quantizes it row-wise (`Int8Params._quantize`: the weight cast to fp16, then
`int8_vectorwise_quant`): an int8 weight of the full shape and one fp32 scale per output row (SCB). The step runs
`bnb.matmul` (bitsandbytes/autograd/_functions.py): `MatMul8bitLt` on CUDA (the input cast to fp16 and quantized
row-wise, the int8 matmul, the input saved for the backward, whose input gradient dequantizes the weight into a
temporary of the input's dtype), and on a CPU in training `MatMul8bitFp` (the weight dequantized for the forward
and again for the backward; `bridges.INT8_MATMUL_DEVICE` makes the meta step take the target's). The outlier
columns of LLM.int8() (input columns with a value of magnitude >= the threshold, multiplied in fp16 apart) depend
on the data: the trace assumes none (`quantized_recording`: its meta kernels), and the report says so.
"""

from __future__ import annotations

import torch

from ..analysis.allocator import round_size
from ..analysis.categories import Category
from ..errors import UsageError
from ..spec import Quantization, RunSpec
from .op_rules import op_table

COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# bitsandbytes/backends/cuda/ops.py `_GEMM_4BIT_CUSTOM_FLOOR_M`: its fused kernel serves up to 4 rows always
GEMM_4BIT_CUSTOM_FLOOR_M = 4


def cuda_workspace(func, args, kwargs, out):
    """(workspace bytes, out) of bitsandbytes' CUDA kernel of `func` (the recorder's `workspace` hook on a CUDA
    target). `gemm_4bit` (bitsandbytes/backends/cuda/ops.py, the kernel registered for "bitsandbytes::gemm_4bit")
    runs its fused kernel, which allocates only the output, for M <= 4 rows (`_GEMM_4BIT_CUSTOM_FLOOR_M`) and
    otherwise, above 1536 rows or with K not a multiple of the blocksize always, `_dequant_linear_fallback`: the
    nested absmax dequantized to fp32 and offset (two fp32 tensors of the absmax's length, with double
    quantization), the weight dequantized to A's dtype (N × K), then `F.linear`. Between 5 and 1536 rows the
    choice is a per-architecture heuristic (`_gemm_4bit_use_custom_cuda`), not modelled: the fallback is assumed,
    an over-estimate of at most the dequantized weight. The three allocations are one workspace here, each rounded
    as the caching allocator rounds it (`round_size`). The int8 ops: `_cuda_int8_workspace`. Other ops: none."""
    if func.namespace != "bitsandbytes":  # its ops exist once bitsandbytes is imported: compared by overload here
        return 0, out
    bnb = torch.ops.bitsandbytes
    named = {a.name: v for a, v in zip(func._schema.arguments, args)} | kwargs
    if func in (bnb.int8_vectorwise_quant.default, bnb.int8_mixed_scaled_mm.default, bnb.int8_scaled_mm.default):
        return _cuda_int8_workspace(func, named, out), out
    if func is not bnb.gemm_4bit.default:
        return 0, out
    a, shape_b = named["A"], named["shapeB"]
    k = a.shape[-1]
    m = a.numel() // k
    if m <= GEMM_4BIT_CUSTOM_FLOOR_M and k % named["blocksize"] == 0:
        return 0, out
    absmax_8bit = named.get("absmax_8bit")
    nested = 2 * round_size(absmax_8bit.numel() * 4) if isinstance(absmax_8bit, torch.Tensor) else 0
    return nested + round_size(shape_b[0] * shape_b[1] * a.element_size()), out


def _cuda_int8_workspace(func, named: dict, out) -> int:
    """Bytes the CUDA kernels of bitsandbytes' int8 ops hold inside the op beyond its outputs (bitsandbytes/backends/
    cuda/ops.py and, for the composite ops, backends/default/ops.py), each rounded by `round_size`:
    `int8_vectorwise_quant` with a threshold, `A.abs()` (fp16) and the bool mask `>= threshold`, held together
    (an over-estimate by the fp16 temporary, freed before the outputs are allocated); `int8_scaled_mm` and
    `int8_mixed_scaled_mm` (no outlier columns, `quantized_recording`), the int32 product of `int8_linear_matmul`
    and the fp16 output of `int8_mm_dequant` (its kernel writes fp16 only), cast to the requested dtype after."""
    if func is torch.ops.bitsandbytes.int8_vectorwise_quant.default:
        a = named["A"]
        return round_size(a.numel() * 2) + round_size(a.numel()) if named.get("threshold", 0.0) > 0.0 else 0
    c = out[0] if isinstance(out, tuple) else out
    rows_cols = c.numel()
    fp16_copy = round_size(rows_cols * 2) if c.dtype != torch.float16 else 0
    return round_size(rows_cols * 4) + fp16_copy


def _no_outlier_quant(A, threshold=0.0):
    """bitsandbytes::int8_vectorwise_quant for meta inputs, with no outlier column (its fake kernel needs a
    FakeTensorMode for the data-dependent count)."""
    out_row = torch.empty(A.shape, device=A.device, dtype=torch.int8)
    row_stats = torch.empty(A.numel() // A.shape[-1], device=A.device, dtype=torch.float32)
    return out_row, row_stats, None if threshold == 0.0 else A.new_empty(0, dtype=torch.int64)


def _no_outlier_double_quant(A, threshold=0.0):
    """bitsandbytes::int8_double_quant for meta inputs, with no outlier column."""
    out_row, row_stats, _ = _no_outlier_quant(A, threshold)
    col_stats = torch.empty(A.shape[-1], device=A.device, dtype=torch.float32)
    return out_row, torch.empty_like(out_row), row_stats, col_stats, A.new_empty(0, dtype=torch.int64)


def _no_outlier_mixed_mm(A, CA, CB, SCA, SCB, outlier_cols=None, bias=None):
    """bitsandbytes::int8_mixed_scaled_mm for meta inputs with no outlier column: the output and an empty subA of
    A's dtype (backends/default/ops.py, its `else` branch)."""
    out = torch.empty((*CA.shape[:-1], CB.shape[0]), device=A.device, dtype=A.dtype)
    return out, torch.empty(0, device=A.device, dtype=A.dtype)


def quantized_recording(four_bit: bool) -> tuple[dict, dict, dict]:
    """The recorder's per-op tables for a quantized model (`StepRecorder.op_categories`, `meta_kernels`,
    `derived_categories`), keyed by op overload (op_rules.py), after importing bitsandbytes, which defines its ops
    (bitsandbytes/_ops.py, torch.library) when it loads: so they are built here, where bitsandbytes is in use, not
    when this module is. Raises UsageError without bitsandbytes, OpRuleError naming an op it lacks.

    op_categories: the ops whose outputs, or whose kernel's workspace, are a dequantized weight: the backward's
    `dequantize_4bit`, the forward's `gemm_4bit` (dequantize, then matmul). int8 only (else empty): meta_kernels,
    the kernels for meta inputs of the int8 ops whose outputs' sizes depend on the data (the number of outlier
    columns): none assumed; derived_categories, the int8 weight (or its `.data`) cast to a float dtype:
    bitsandbytes' dequantization of an int8 weight (`state.CB.to(dtype).mul_(SCB / 127)` in MatMul8bitFp's forward
    and both classes' backward)."""
    bitsandbytes_module()
    op_categories = op_table("QUANT_OP_CATEGORIES", {
        "bitsandbytes.dequantize_4bit.default": ("outputs", Category.DEQUANTIZED_WEIGHTS),
        "bitsandbytes.gemm_4bit.default": ("workspace", Category.DEQUANTIZED_WEIGHTS)})
    if four_bit:
        return op_categories, {}, {}
    meta_kernels = op_table("INT8_META_KERNELS", {"bitsandbytes.int8_vectorwise_quant.default": _no_outlier_quant,
                                                  "bitsandbytes.int8_double_quant.default": _no_outlier_double_quant,
                                                  "bitsandbytes.int8_mixed_scaled_mm.default": _no_outlier_mixed_mm})
    derived = {(torch.ops.aten._to_copy.default, Category.QUANTIZED_WEIGHTS): Category.DEQUANTIZED_WEIGHTS}
    return op_categories, meta_kernels, derived
INT8_OUTLIER_NOTE = ("int8: no LLM.int8() outlier columns assumed (input columns holding a value of magnitude >= 6.0 "
                     "are multiplied in fp16 apart; each adds about tokens x 2 bytes to a Linear's temporaries, and "
                     "in training on CUDA to its saved tensors)")


def bitsandbytes_module():
    """The bitsandbytes module. Raises UsageError, saying how to install it, without it."""
    try:
        import bitsandbytes
    except ImportError as e:
        raise UsageError("bitsandbytes (--quantization, the 8-bit and paged optimizers) is not installed: pip install "
                         "'vramtrace[quant]'") from e
    return bitsandbytes


def bnb_config(spec: RunSpec, weight_dtype: torch.dtype | None = None, model_type: str = ""):
    """transformers' `BitsAndBytesConfig` for `spec`: load_in_4bit, bnb_4bit_quant_type, bnb_4bit_use_double_quant,
    bnb_4bit_compute_dtype (None: its default, fp32); for int8, load_in_8bit (its llm_int8_threshold 6.0). With
    `spec.recipe`, the recipe's compute and storage dtypes (`recipes.bnb_kwargs`, of `weight_dtype`, the dtype the
    weights are loaded in, and the config's `model_type`)."""
    from transformers import BitsAndBytesConfig

    from .recipes import bnb_kwargs

    if spec.quantization is Quantization.INT8:
        return BitsAndBytesConfig(load_in_8bit=True)
    kwargs = {"load_in_4bit": True, "bnb_4bit_quant_type": spec.quantization.value,
              "bnb_4bit_use_double_quant": spec.double_quant}
    if spec.bnb_compute_dtype is not None:
        kwargs["bnb_4bit_compute_dtype"] = COMPUTE_DTYPES[spec.bnb_compute_dtype]
    if weight_dtype is not None:
        kwargs.update(bnb_kwargs(spec, weight_dtype, model_type))
    return BitsAndBytesConfig(**kwargs)


def quantize(model: torch.nn.Module, spec: RunSpec, weight_dtype: torch.dtype) -> None:
    """Quantize `model` (built on meta in `weight_dtype`, the `dtype` of `from_pretrained`) in place, as
    `from_pretrained(..., quantization_config=bnb_config(spec), dtype=weight_dtype)` does. Raises UsageError
    without bitsandbytes."""
    bnb = bitsandbytes_module()
    from transformers.quantizers import AutoHfQuantizer

    model_type = getattr(getattr(model, "config", None), "model_type", "")
    quantizer = AutoHfQuantizer.from_config(bnb_config(spec, weight_dtype, model_type))
    quantizer.preprocess_model(model, dtype=weight_dtype, device_map=None)
    # bitsandbytes caches the dynamic code table of the nested quantization on the device of the first tensor it
    # quantizes (functional.py `quantize_blockwise`: the module global `name2qmap`): a meta table would break a
    # real quantization later in this process, so the cache is put back as it was
    saved = dict(bnb.functional.name2qmap)
    try:
        _quantize_weights(bnb, model, weight_dtype)
    finally:
        bnb.functional.name2qmap.clear()
        bnb.functional.name2qmap.update(saved)
    quantizer.postprocess_model(model)


def _quantize_weights(bnb, model: torch.nn.Module, weight_dtype: torch.dtype) -> None:
    meta = torch.device("meta")
    for module in model.modules():
        if not isinstance(module, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)):
            continue
        value = torch.empty(module.out_features, module.in_features, dtype=weight_dtype, device=meta)
        kwargs = dict(module.weight.__dict__)
        if isinstance(module, bnb.nn.Linear4bit):
            weight = bnb.nn.Params4bit(value, requires_grad=False, **kwargs)
        else:
            kwargs.pop("SCB", None)  # as Bnb8bitQuantize.convert
            weight = bnb.nn.Int8Params(value, requires_grad=False, **kwargs)
        module.weight = weight._quantize(meta)  # what `.to(device)` runs for a real device
        if module.bias is not None:
            # the new layer's bias is made fp32 and frozen; the loader sets the checkpoint's bias in `dtype`, as a
            # Parameter that requires grad (floating point: transformers/modeling_utils.py)
            module.bias = torch.nn.Parameter(torch.empty_like(module.bias, dtype=weight_dtype))


def quant_state_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of every quantization constant the model's quantized weights hold (a 4-bit weight's
    QuantState absmax, code, offset, and its nested state's absmax and code; an int8 weight's row scales SCB), alive
    from step start; a tensor shared by several weights (the nested code table) once per weight, the recorder
    counting its storage once."""
    out = []
    for name, p in model.named_parameters():
        if isinstance(getattr(p, "SCB", None), torch.Tensor):
            out.append((f"{name}:SCB", p.SCB))
        state = getattr(p, "quant_state", None)
        while state is not None:
            for key in ("absmax", "code", "offset"):
                t = getattr(state, key, None)
                if isinstance(t, torch.Tensor):
                    out.append((f"{name}:{key}", t))
            state, name = getattr(state, "state2", None), f"{name}:nested"
    return out


def categorise(model: torch.nn.Module, register) -> None:
    """Register the quantized weights (their category QUANTIZED_WEIGHTS, not PARAMETER) and their constants with
    `register(tensor, category, name)` (the recorder's `register_existing`)."""
    for name, p in model.named_parameters():
        if getattr(p, "quant_state", None) is not None or getattr(p, "SCB", None) is not None:
            register(p, Category.QUANTIZED_WEIGHTS, name)
    for name, t in quant_state_tensors(model):
        register(t, Category.QUANT_CONSTANTS, name)
