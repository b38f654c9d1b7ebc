"""bitsandbytes 4-bit weights on the meta device, as transformers loads them (`--quantization nf4|fp4`).

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
"""

from __future__ import annotations

import torch

from ..analysis.categories import Category
from ..errors import UsageError
from ..spec import RunSpec

COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# bitsandbytes' ops (bitsandbytes/_ops.py) whose outputs are a dequantized weight (recorder.op_categories)
QUANT_OP_CATEGORIES = {"bitsandbytes.dequantize_4bit.default": ("outputs", Category.DEQUANTIZED_WEIGHTS)}


def _bitsandbytes():
    try:
        import bitsandbytes
    except ImportError as e:
        raise UsageError("--quantization needs bitsandbytes: pip install 'vramtrace[quant]'") from e
    return bitsandbytes


def bnb_config(spec: RunSpec):
    """transformers' `BitsAndBytesConfig` for `spec`: load_in_4bit, bnb_4bit_quant_type, bnb_4bit_use_double_quant,
    bnb_4bit_compute_dtype (None: its default, fp32)."""
    from transformers import BitsAndBytesConfig

    kwargs = {"load_in_4bit": True, "bnb_4bit_quant_type": spec.quantization.value,
              "bnb_4bit_use_double_quant": spec.double_quant}
    if spec.bnb_compute_dtype is not None:
        kwargs["bnb_4bit_compute_dtype"] = COMPUTE_DTYPES[spec.bnb_compute_dtype]
    return BitsAndBytesConfig(**kwargs)


def quantize(model: torch.nn.Module, spec: RunSpec, weight_dtype: torch.dtype) -> None:
    """Quantize `model` (built on meta in `weight_dtype`, the `dtype` of `from_pretrained`) in place, as
    `from_pretrained(..., quantization_config=bnb_config(spec), dtype=weight_dtype)` does. Raises UsageError
    without bitsandbytes."""
    bnb = _bitsandbytes()
    from transformers.quantizers import AutoHfQuantizer

    quantizer = AutoHfQuantizer.from_config(bnb_config(spec))
    quantizer.preprocess_model(model, dtype=weight_dtype, device_map=None)
    meta = torch.device("meta")
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            old = module.weight
            value = torch.empty(module.out_features, module.in_features, dtype=weight_dtype, device=meta)
            weight = bnb.nn.Params4bit(value, requires_grad=False, **old.__dict__)
            module.weight = weight._quantize(meta)  # what `.to(device)` runs for a real device
    quantizer.postprocess_model(model)


def quant_state_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of every quantization constant the model's 4-bit weights hold (QuantState's absmax, code,
    offset, and its nested state's absmax and code), alive from step start; a tensor shared by several weights (the
    nested code table) once per weight, the recorder counting its storage once."""
    out = []
    for name, p in model.named_parameters():
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
        if getattr(p, "quant_state", None) is not None:
            register(p, Category.QUANTIZED_WEIGHTS, name)
    for name, t in quant_state_tensors(model):
        register(t, Category.QUANT_CONSTANTS, name)
