"""LLaMA-Factory 0.9.5 training YAML -> RunSpec fields. Defaults and resolutions are LLaMA-Factory's (wheel 0.9.5
= tag v0.9.5, `llamafactory/hparams/*.py`, `llamafactory/model/*.py`), as recorded in
docs/research/issue-41-config-sources.md section 2; its TrainingArguments keys keep transformers' defaults
(hparams/training_args.py adds none). LLaMA-Factory is not imported (it pins transformers <= 5.6)."""

from __future__ import annotations

from .base import DEEPSPEED_WARNING, Reading, Target, round_up
from .common import checkpointing_of, read_attn, read_compile, read_optimizer
from . import training_args

HARMLESS = training_args.HARMLESS | frozenset({
    "trust_remote_code", "do_train", "do_eval", "do_predict", "dataset", "eval_dataset", "dataset_dir", "template",
    "max_samples", "overwrite_cache", "preprocessing_num_workers", "plot_loss", "overwrite_output_dir", "val_size",
    "tokenized_path", "mix_strategy", "interleave_probs", "streaming", "buffer_size", "enable_thinking",
    "default_system", "use_fast_tokenizer", "cache_dir", "train_on_prompt", "mask_history", "use_rslora",
    "pissa_init", "pissa_iter", "pissa_convert", "loraplus_lr_ratio", "loraplus_lr_embedding", "rope_scaling",
    "quantization_device_map", "image_max_pixels", "image_min_pixels", "video_max_pixels", "video_min_pixels",
    "video_fps", "video_maxlen", "compute_accuracy", "predict_with_generate", "hf_hub_token", "ms_hub_token",
    "om_hub_token", "low_cpu_mem_usage", "print_param_status", "stage",
})
WARNED = {**training_args.WARNED, "additional_target": None, "use_dora": False, "use_unsloth": False,
          "use_unsloth_gc": False, "enable_liger_kernel": False, "upcast_layernorm": False,
          "upcast_lmhead_output": False, "train_from_scratch": False, "use_badam": False, "use_galore": False,
          "use_apollo": False, "mixture_of_depths": None, "shift_attn": False, "use_llama_pro": False,
          "adapter_name_or_path": None, "block_diag_attn": False, "gradient_checkpointing": False,
          "activation_checkpointing": False}


def read(r: Reading, target: Target) -> str | None:
    """Read a LLaMA-Factory mapping into `r`; returns `model_name_or_path`. `target.bf16` stands for
    LLaMA-Factory's `infer_optim_dtype` (extras/misc.py:241) when neither bf16 nor fp16 is set."""
    r.set("recipe", "llamafactory", "model_name_or_path")
    r.mark("model_name_or_path")
    stage = r.get("stage", "sft")
    if stage != "sft":
        r.warn("stage", f"{stage!r}: vramtrace models the sft step only (rm/dpo/kto/ppo add pairs, heads or "
                        "models); the prediction is an sft step")
    r.set("batch", int(r.get("per_device_train_batch_size", 8)), "per_device_train_batch_size")
    packing = _read_packing(r, stage)
    # cutoff_len default 2048 (data_args.py:46); the collator pads to a multiple of 8 (train/sft/workflow.py:62-72);
    # a packed row is cutoff_len + 1 tokens (data/processor/supervised.py PackedSupervisedDatasetProcessor)
    r.set("seq", round_up(int(r.get("cutoff_len", 2048)) + (1 if packing else 0), 8), "cutoff_len")
    r.set("grad_accum", int(r.get("gradient_accumulation_steps", 1)), "gradient_accumulation_steps")
    tuning = r.get("finetuning_type", "lora")  # finetuning_args.py:464
    compute_dtype = _read_precision(r, tuning, target.bf16)
    read_optimizer(r, r.get("optim", "adamw_torch_fused"), "optim")
    norm = float(r.get("max_grad_norm", 1.0))
    if norm > 0:
        r.set("clip_grad_norm", norm, "max_grad_norm")
    # model_args.py:145,149: checkpointing on unless disable_gradient_checkpointing, use_reentrant_gc True
    # (model/model_utils/checkpointing.py prepare_model_for_training l.143-176)
    on = not r.get("disable_gradient_checkpointing", False)
    r.set("checkpointing", checkpointing_of(on, bool(r.get("use_reentrant_gc", True))),
          "disable_gradient_checkpointing", "use_reentrant_gc")
    _read_tuning(r, tuning)
    _read_quantization(r, compute_dtype)
    _read_attention(r)
    read_compile(r, target, bool(r.get("torch_compile", False)), "torch_compile", r.get("torch_compile_mode"))
    r.mark("use_cache")  # LLaMA-Factory's own use_cache is for generation; training sets it False:
    r.set("use_cache", False, "use_cache")  # prepare_model_for_training: model.config.use_cache = False
    if r.has("deepspeed"):
        r.warn("deepspeed", DEEPSPEED_WARNING)
    r.check_rest(HARMLESS, WARNED, "LLaMA-Factory")
    return r.data.get("model_name_or_path")


def _read_packing(r: Reading, stage: str) -> bool:
    """`packing` (None -> stage == "pt", hparams/parser.py:520); `neat_packing` (data_args.py:112) implies it."""
    packing = r.get("packing")
    packing = stage == "pt" if packing is None else bool(packing)
    if r.get("neat_packing", False):
        r.warn("neat_packing", "its block-diagonal 4D attention mask (data/collator.py "
                               "SFTDataCollatorWith4DAttentionMask) is not modelled; read as packing")
        packing = True
    if packing:
        r.set("packing", True, "packing")
    return packing


def _read_precision(r: Reading, tuning: str, bf16_gpu: bool) -> str:
    """RunSpec.precision and the compute dtype (hparams/parser.py:512-515). The model is loaded in the
    checkpoint's dtype (model/loader.py:155 `torch_dtype="auto"`, read as bf16 here); trainable parameters are cast
    to fp32 unless pure_bf16 (model/adapter.py init_adapter): a full fine-tune under bf16 AMP is bf16-mixed, a
    LoRA one bf16-autocast (frozen bf16 base, fp32 adapters). Returns the compute dtype ('bf16'/'fp16'/'fp32')."""
    pure, bf16, fp16 = bool(r.get("pure_bf16", False)), bool(r.get("bf16", False)), bool(r.get("fp16", False))
    if pure:
        r.set("precision", "bf16", "pure_bf16")
        return "bf16"
    if bf16 or fp16:
        half = "bf16" if bf16 else "fp16"
        r.set("precision", f"{half}-mixed" if tuning == "full" else f"{half}-autocast", half, "finetuning_type")
        return half
    r.warn("bf16", "neither bf16 nor fp16: the Trainer runs no autocast and the weights keep the checkpoint's "
                   "dtype, which this file does not give; add --precision (without it: the "
                   "recipe's default, bf16-autocast)", "precision")
    return "bf16" if bf16_gpu else "fp16"  # extras/misc.py infer_optim_dtype, for a bf16 checkpoint


def _read_tuning(r: Reading, tuning: str) -> None:
    """`finetuning_type` lora (finetuning_args.py: lora_rank 8, lora_alpha None -> 2 * rank (l.568), lora_dropout
    0, lora_target "all" -> every Linear but lm_head, model/model_utils/misc.py find_all_linear_modules)."""
    if tuning == "full":
        return
    if tuning != "lora":
        r.warn("finetuning_type", f"{tuning!r} is not modelled (vramtrace builds LoRA or a full fine-tune); the "
                                  "prediction is a full fine-tune")
        return
    rank = int(r.get("lora_rank", 8))
    r.set("lora_rank", rank, "finetuning_type", "lora_rank")
    r.set("lora_alpha", float(r.get("lora_alpha") or rank * 2), "lora_alpha")
    r.set("lora_dropout", float(r.get("lora_dropout", 0.0)), "lora_dropout")
    target = r.get("lora_target", "all")  # a comma list, or a YAML list (its `split_arg` takes both)
    names = [str(t).strip() for t in (target if isinstance(target, list) else str(target).split(","))]
    targets = ("all-linear",) if names == ["all"] else tuple(t for t in names if t)
    r.set("lora_targets", targets, "lora_target")


def _read_quantization(r: Reading, compute_dtype: str) -> None:
    """`quantization_bit` 4/8 with the bnb method (model/model_utils/quantization.py configure_quantization
    l.166-192): 4 -> BitsAndBytesConfig(load_in_4bit, quant_type quantization_type (nf4), double quant
    double_quantization (True), compute dtype the compute dtype); 8 -> load_in_8bit."""
    bits = r.get("quantization_bit")
    if bits is None:
        r.mark("quantization_method", "quantization_type", "double_quantization")
        return
    r.mark("quantization_type", "double_quantization")
    method = r.get("quantization_method", "bnb")
    if method != "bnb" or int(bits) not in (4, 8):
        r.warn("quantization_method", f"{method} with {bits} bits is not modelled (vramtrace has bitsandbytes 4 "
                                      "and 8 bits); the prediction is unquantized")
        return
    if int(bits) == 8:
        r.set("quantization", "int8", "quantization_bit")
        return
    r.set("quantization", str(r.get("quantization_type", "nf4")), "quantization_bit", "quantization_type")
    double = bool(r.get("double_quantization", True))
    r.set("double_quant", double, "double_quantization")
    if not double:  # RunSpec's recipe turns it on (spec.py _check_recipe): say so rather than drop it
        r.warn("double_quantization", "false is not modelled with the LLaMA-Factory recipe: the prediction uses "
                                      "double quantization, whose constants are a quarter of single quantization's "
                                      "(under by about 0.047 bytes per 4-bit weight)", "double_quant")
    r.set("bnb_compute_dtype", compute_dtype, "bf16")


def _read_attention(r: Reading) -> None:
    """`flash_attn` (model/model_utils/attention.py configure_attn_implementation): auto leaves transformers'
    default; disabled -> eager, sdpa -> sdpa, fa2 -> flash_attention_2; fa3 is refused by LLaMA-Factory."""
    value = str(r.get("flash_attn", "auto")).lower()
    names = {"disabled": "eager", "sdpa": "sdpa", "fa2": "flash_attention_2"}
    if value in names:
        read_attn(r, names[value], "flash_attn")
    elif value != "auto":
        r.warn("flash_attn", f"{value!r} is not modelled; the prediction uses transformers' default, sdpa",
               "attn_implementation")
