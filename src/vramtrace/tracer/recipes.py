"""`--recipe axolotl|llamafactory`: the model built as that fine-tuning framework builds it before the optimizer.

Each step mirrors the framework's own source (versions and line numbers:
docs/research/issue-41-config-sources.md sections 1.2, 2.1, 2.3); neither framework is imported.

axolotl 0.21.0 (`axolotl/loaders/model.py` `ModelLoader.load`):
- `_set_quantization_config`: `BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch_dtype,
  bnb_4bit_use_double_quant=True, bnb_4bit_quant_type="nf4", bnb_4bit_quant_storage=torch.bfloat16)` (fp32 storage
  for jamba, qwen2_moe, nemotron_h). The spec takes double quantization on and refuses fp4 with this recipe
  (`RunSpec._check_recipe`); here the compute dtype defaults to the weight dtype and the storage dtype is
  axolotl's; the packed weight has the same bytes in either storage dtype (a bf16 storage of n / 4 elements holds
  the n / 2 bytes: the storage bytes are bitsandbytes' own, `quantize_4bit` on the meta device).
- `from_pretrained(..., dtype=torch_dtype)`: the weights in the precision's weight dtype.
- `_configure_embedding_dtypes` (no FSDP): `should_convert_embedding_dtypes` is True for an adapter run or an
  attention implementation other than eager/sdpa. First `_convert_embedding_modules_dtype(..., float32,
  before_kbit_train_or_finetune=True)`: every module whose name contains "norm", or ends ".gate", goes to fp32;
  without the later conversion also the embedding modules (`get_linear_embedding_layers`: embed_tokens, lm_head).
  Then, quantized with an adapter, peft's `prepare_model_for_kbit_training` (everything frozen, the fp16/bf16
  parameters that are not `Params4bit` cast to fp32), patched by axolotl (`monkeypatch/peft/utils.py
  patch_peft_prep_code`) to skip the embedding modules. Then, when converting, `_convert_embedding_modules_dtype(
  embedding_modules, torch_dtype, False)`: the "norm" modules and the embedding modules back to the weight dtype.
  Here peft's unpatched function runs and the embedding modules are cast back by that last conversion: the
  parameters end in the same dtypes (a meta model allocates nothing while it is cast, so only the final dtypes
  matter to the trace; a real load's transient fp32 copy of the embeddings is not part of the step).
- `load_lora`: `get_peft_model(model, LoraConfig(..., bias="none", task_type="CAUSAL_LM"))` with peft's default
  `autocast_adapter_dtype=True`: the adapters in fp32.

LLaMA-Factory 0.9.5 (`llamafactory/model/loader.py` `load_model`):
- `model_utils/quantization.py configure_quantization` (on-the-fly bnb): `BitsAndBytesConfig(load_in_4bit=True,
  bnb_4bit_compute_dtype=compute_dtype, bnb_4bit_use_double_quant=double_quantization, bnb_4bit_quant_type=
  quantization_type, bnb_4bit_quant_storage=compute_dtype)`: the compute and storage dtype default to the weight
  dtype here; no `prepare_model_for_kbit_training` (the other parameters stay in the loaded dtype).
- `model/adapter.py init_adapter`: `get_peft_model(model, LoraConfig(task_type=CAUSAL_LM, ...))`, then every
  trainable parameter cast to fp32 (`cast_trainable_params_to_fp32`, True but for pure_bf16 / ZeRO-3); a full
  fine-tune (`_setup_full_tuning`) casts every parameter to fp32.
- checkpointing (`model_utils/checkpointing.py prepare_model_for_training`) reentrant by default:
  `spec.RECIPE_CHECKPOINTING`.
"""

from __future__ import annotations

import torch

from ..spec import Precision, Recipe, RunSpec

# axolotl/loaders/utils.py `get_linear_embedding_layers`: the input and output embedding modules' names
_EMBEDDINGS_OF_TYPE = {"gpt_neox": ("embed_in", "embed_out"), "falcon": ("word_embeddings", "lm_head")}
_EMBEDDINGS = ("embed_tokens", "lm_head")
# axolotl/loaders/model.py `_set_quantization_config`: fp32 quant storage for these model types (no DeepSpeed/FSDP)
_FP32_QUANT_STORAGE = ("jamba", "qwen2_moe", "nemotron_h")
# axolotl/utils/schemas/enums.py ATTN_IMPLS_WITHOUT_DTYPE_CAST
_NO_DTYPE_CAST_ATTN = ("eager", "sdpa")


def bnb_kwargs(spec: RunSpec, weight_dtype: torch.dtype, model_type: str) -> dict:
    """The recipe's BitsAndBytesConfig keywords beyond the spec's (4-bit only; {} without a recipe or for int8):
    bnb_4bit_compute_dtype (the spec's, else the weight dtype) and bnb_4bit_quant_storage."""
    if spec.recipe is None:
        return {}
    kwargs = {"bnb_4bit_compute_dtype": weight_dtype} if spec.bnb_compute_dtype is None else {}
    if spec.recipe is Recipe.AXOLOTL:
        kwargs["bnb_4bit_quant_storage"] = torch.float32 if model_type in _FP32_QUANT_STORAGE else torch.bfloat16
    else:
        kwargs["bnb_4bit_quant_storage"] = kwargs.get("bnb_4bit_compute_dtype", weight_dtype)
    return kwargs


def lora_kwargs(spec: RunSpec) -> dict:
    """The recipe's LoraConfig keywords beyond the spec's: both frameworks build a CAUSAL_LM LoraConfig (axolotl
    with bias="none", peft's default)."""
    return {} if spec.recipe is None else {"task_type": "CAUSAL_LM"}


def _embedding_names(model_type: str) -> tuple[str, ...]:
    return _EMBEDDINGS_OF_TYPE.get(model_type, _EMBEDDINGS)


def _axolotl_convert(model: torch.nn.Module, embeddings: tuple[str, ...], dtype: torch.dtype, before: bool) -> None:
    """axolotl's `_convert_embedding_modules_dtype(embeddings, dtype, before)` (loaders/model.py), fp32 norm
    patterns unset: "norm" modules to `dtype`; before kbit preparation ".gate" modules too; the embedding modules
    that have a weight to `dtype`."""
    for name, module in model.named_modules():
        if "norm" in name:
            module.to(dtype)
        if before and name.endswith(".gate"):
            module.to(dtype)
        if any(m in name for m in embeddings) and hasattr(module, "weight"):
            module.to(dtype)


def _axolotl_prepare(spec: RunSpec, model: torch.nn.Module, weight_dtype: torch.dtype) -> torch.nn.Module:
    """axolotl's `_configure_embedding_dtypes` (no FSDP, no DeepSpeed): see the module docstring."""
    model_type = getattr(getattr(model, "config", None), "model_type", "")
    embeddings = _embedding_names(model_type)
    attn = getattr(getattr(model, "config", None), "_attn_implementation", None)
    should_convert = spec.lora_rank is not None or (attn is not None and attn not in _NO_DTYPE_CAST_ATTN)
    _axolotl_convert(model, () if should_convert else embeddings, torch.float32, before=True)
    if spec.lora_rank is not None and spec.quantization is not None:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    if should_convert:
        _axolotl_convert(model, embeddings, weight_dtype, before=False)
    return model


def prepare(spec: RunSpec, model: torch.nn.Module, weight_dtype: torch.dtype) -> torch.nn.Module:
    """The recipe's model before `get_peft_model` (axolotl's dtype conversions and kbit preparation; LLaMA-Factory
    does nothing here). Checkpointing is applied later with the step's (`checkpointing.apply_checkpointing`), as
    HF Trainer enables it last."""
    if spec.recipe is Recipe.AXOLOTL:
        return _axolotl_prepare(spec, model, weight_dtype)
    return model


def finish(spec: RunSpec, model: torch.nn.Module) -> torch.nn.Module:
    """The recipe's model after `get_peft_model` (or after freezing, without LoRA): LLaMA-Factory casts every
    trainable parameter to fp32 (`init_adapter`, `_setup_full_tuning`)."""
    # not under pure_bf16 (`cast_trainable_params_to_fp32` False: model/adapter.py init_adapter), which a
    # LLaMA-Factory file's `pure_bf16: true` reads as --precision bf16
    if spec.recipe is Recipe.LLAMAFACTORY and spec.precision is not Precision.BF16:
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.to(torch.float32)
    return model
