"""axolotl 0.21.0 training YAML -> RunSpec fields. Every default and resolution below is axolotl's (wheel 0.21.0,
`axolotl/utils/schemas/*.py`, `axolotl/utils/config/__init__.py`, `axolotl/loaders/*.py`), as recorded in
docs/research/issue-41-config-sources.md section 1; axolotl itself is not imported (it needs Python >= 3.12)."""

from __future__ import annotations

from ..errors import UsageError
from .base import DEEPSPEED_WARNING, Reading, Target, round_up
from .common import checkpointing_of, read_attn, read_compile, read_optimizer

# keys that do not change one training step's memory: data, logging, saving, evaluation, schedules, tokenizer
HARMLESS = frozenset({
    "datasets", "test_datasets", "dataset_prepared_path", "val_set_size", "output_dir", "num_epochs", "max_steps",
    "lr_scheduler", "learning_rate", "warmup_ratio", "warmup_steps", "cosine_min_lr_ratio", "weight_decay",
    "adam_beta1", "adam_beta2", "adam_epsilon", "evals_per_epoch", "eval_steps", "saves_per_epoch", "save_steps",
    "save_total_limit", "save_first_step", "logging_steps", "resume_from_checkpoint", "special_tokens",
    "tokenizer_type", "tokenizer_config", "tokenizer_use_fast", "hub_model_id", "model_type", "base_model_config",
    "trust_remote_code", "strict", "eval_sample_packing", "eval_batch_size", "loss_watchdog_threshold",
    "loss_watchdog_patience", "chat_template", "train_on_inputs", "early_stopping_patience", "seed", "tf32",
    "wandb_project", "wandb_entity", "wandb_watch", "wandb_name", "wandb_log_model", "shuffle_merged_datasets",
    "dataloader_num_workers", "dataloader_pin_memory", "dataloader_prefetch_factor", "ddp_timeout",
    "is_llama_derived_model", "is_mistral_derived_model", "is_qwen_derived_model", "low_cpu_mem_usage",
    "dataset_processes", "group_by_length", "gradient_checkpointing_kwargs", "peft_use_rslora",
    "bnb_config_kwargs", "eval_table_size", "max_packed_sequence_len", "lora_fan_in_fan_out",
})
# keys that change memory and are not modelled: key -> axolotl's default (a value other than it is warned about)
WARNED = {
    "unfrozen_parameters": None, "liger_rope": False, "liger_rms_norm": False, "liger_glu_activation": False,
    "liger_layer_norm": False, "liger_fused_linear_cross_entropy": False, "liger_cross_entropy": False,
    "cut_cross_entropy": False, "activation_offloading": False, "fp8": False,
    "peft_use_dora": False, "lora_modules_to_save": None, "relora": False, "plugins": None, "rl": None,
    "context_parallel_size": 1, "sequence_parallel_degree": 1, "tensor_parallel_size": 1, "gptq": False,
    "chunked_cross_entropy": False, "tiled_mlp": False, "neftune_noise_alpha": None, "lora_model_dir": None,
    "peft_autocast_adapter_dtype": None, "embeddings_skip_upcast": False, "multipack_real_batches": False,
    "reward_model": False, "process_reward_model": False,
}


def read(r: Reading, target: Target) -> str | None:
    """Read an axolotl mapping into `r`; returns `base_model`. Raises UsageError for what axolotl 0.21 itself
    refuses (both `flash_attention` and `attn_implementation`; an adapter without `lora_r`). `target.bf16` stands
    for axolotl's `transformers.utils.is_torch_bf16_gpu_available()` (axolotl/cli/config.py:369)."""
    r.set("recipe", "axolotl", "base_model")
    r.mark("base_model", "pad_to_sequence_len")  # the padding rule below holds with it or without
    r.set("batch", int(r.get("micro_batch_size", 1)), "micro_batch_size")  # schemas/training.py:117
    # sequence_len default 512 (schemas/config.py:706); rows are padded to a multiple of 64 (collator
    # pad_to_multiple_of = 64 * ceil(sequence_len / 64), core/builders/causal.py:390-401): the longest row
    r.set("seq", round_up(int(r.get("sequence_len", 512)), 64), "sequence_len")
    r.set("grad_accum", int(r.get("gradient_accumulation_steps", 1)), "gradient_accumulation_steps")
    torch_dtype = _read_precision(r, target.bf16)
    read_optimizer(r, r.get("optimizer", "adamw_torch_fused"), "optimizer")  # schemas/training.py:162
    # max_grad_norm None is not passed: TrainingArguments' default 1.0 (core/builders/base.py:726-752)
    norm = float(r.get("max_grad_norm", 1.0))
    if norm > 0:
        r.set("clip_grad_norm", norm, "max_grad_norm")
    _read_checkpointing(r)
    _read_adapter(r, torch_dtype)
    _read_attention(r)
    if r.get("sample_packing", False):  # schemas/config.py:729
        r.set("packing", True, "sample_packing")
    if r.get("torch_compile") == "auto":
        r.warn("torch_compile", "auto: axolotl decides at run time whether to compile; the prediction is the eager "
                                "step (add --compile with --device cpu to trace it compiled)", "compile")
    read_compile(r, target, r.get("torch_compile", False) is True, "torch_compile", r.get("torch_compile_mode"))
    r.set("use_cache", False, "use_cache")  # HF Trainer: model.config.use_cache = args.use_cache (False)
    _read_distributed(r)
    r.check_rest(HARMLESS, WARNED, "axolotl")
    return r.data.get("base_model")


def _read_precision(r: Reading, bf16_gpu: bool) -> str:
    """RunSpec.precision as axolotl resolves `bf16`/`fp16` (axolotl/utils/config/__init__.py `resolve_dtype`,
    l.163-200: bf16 "auto" -> the GPU's bf16 support, else fp16; `cfg.torch_dtype` = bf16 if bf16 or bfloat16,
    fp16 if load_in_8bit or fp16 or float16, else fp32). The model is loaded in torch_dtype
    (loaders/model.py:959) and the Trainer autocasts when bf16/fp16 (core/builders/base.py:318). Returns the
    torch_dtype ('bf16', 'fp16' or 'fp32')."""
    bf16, fp16 = r.get("bf16", "auto"), r.get("fp16")
    bfloat16, float16 = bool(r.get("bfloat16", False)), bool(r.get("float16", False))
    if bf16 == "auto" and not fp16:
        bf16 = bf16_gpu
        if not bf16 and fp16 is None and not float16:
            fp16 = True
    bf16 = bf16 in (True, "full")
    fp16 = bool(fp16) and not bf16
    torch_dtype = ("bf16" if bf16 or bfloat16 else
                   "fp16" if r.get("load_in_8bit", False) or fp16 or float16 else "fp32")
    if bf16:
        precision = "bf16-autocast"
    elif fp16:  # torch_dtype is then fp16 but with `bfloat16: true`, which vramtrace reads as fp16 weights
        precision = "fp16-autocast"
    else:
        precision = torch_dtype
    r.set("precision", precision, "bf16", "fp16")
    return torch_dtype


def _read_checkpointing(r: Reading) -> None:
    """`gradient_checkpointing` (default False, schemas/config.py:641) with its kwargs: axolotl 0.21 sets
    `use_reentrant: False` unless DeepSpeed ZeRO-3 (utils/config/__init__.py normalize_config l.470-483), and the
    Trainer re-enables it with those kwargs last (transformers trainer.py:1503-1528)."""
    gc = r.get("gradient_checkpointing", False)
    kwargs = r.get("gradient_checkpointing_kwargs") or {}
    reentrant = kwargs.get("use_reentrant")
    if reentrant is None:
        deepspeed = str(r.get("deepspeed", ""))
        reentrant = "zero3" in deepspeed  # schemas/utils.py is_deepspeed_zero3_config, by the file's name
    if gc in ("offload", "offload_disk"):
        r.warn("gradient_checkpointing", f"{gc} moves the checkpointed activations to "
               f"{'the CPU' if gc == 'offload' else 'disk'} (activation_offloading); not modelled: the prediction "
               "keeps them on the GPU", "checkpointing")
    r.set("checkpointing", checkpointing_of(bool(gc), reentrant), "gradient_checkpointing")


def _read_adapter(r: Reading, torch_dtype: str) -> None:
    """`adapter` lora/qlora with `lora_*` (schemas/peft.py) and `load_in_4bit`/`load_in_8bit`: the
    BitsAndBytesConfig of loaders/model.py `_set_quantization_config` (l.1006: nf4, double quant, compute dtype
    torch_dtype)."""
    adapter = r.get("adapter")
    four, eight = r.get("load_in_4bit", False), r.get("load_in_8bit", False)  # both read: neither is unknown
    if four and eight:  # axolotl refuses it too (schemas/peft.py validate_qlora)
        raise UsageError(f"{r.file}: load_in_4bit and load_in_8bit are both true; axolotl loads one: set one false")
    if four:
        r.set("quantization", "nf4", "adapter", "load_in_4bit")
        r.set("double_quant", True, "load_in_4bit")
        r.set("bnb_compute_dtype", torch_dtype, "load_in_4bit", "bf16")
    elif eight:
        r.set("quantization", "int8", "adapter", "load_in_8bit")
    if adapter is None:
        return
    if adapter not in ("lora", "qlora"):
        r.warn("adapter", f"{adapter!r} is not modelled (vramtrace builds peft LoRA); the prediction is a full "
                          "fine-tune")
        return
    if adapter == "qlora" and not four:  # schemas/peft.py validate_qlora
        raise UsageError(f"{r.file}: adapter qlora needs load_in_4bit: true (axolotl refuses it too)")
    if not r.has("lora_r"):  # axolotl has no default (schemas/peft.py:69): refuse to invent one
        raise UsageError(f"{r.file}: adapter {adapter} without lora_r; axolotl has no default rank: add lora_r")
    r.set("lora_rank", int(r.get("lora_r")), "lora_r")
    if r.has("lora_alpha"):
        r.set("lora_alpha", float(r.get("lora_alpha")), "lora_alpha")
    else:
        r.warn("lora_alpha", "absent: axolotl passes None to peft's LoraConfig (unverified); the prediction uses "
                             "peft's default (alpha does not change memory)", "lora_alpha")
    r.set("lora_dropout", float(r.get("lora_dropout", 0.0)), "lora_dropout")  # validate_lora_dropout: 0.0
    modules = r.get("lora_target_modules")
    if r.get("lora_target_linear", False):
        # loaders/adapter.py find_all_linear_names: every Linear but the output layer (lm_head), = peft's
        # "all-linear" (peft/tuners/tuners_utils.py _maybe_include_all_linear_layers) for a causal LM
        r.set("lora_targets", ("all-linear",), "lora_target_linear")
        if modules:  # axolotl adds them to the linear layers (loaders/adapter.py:186-194)
            r.warn("lora_target_modules", "beside lora_target_linear: only the linear layers are modelled "
                                          "(peft's all-linear); a listed non-linear or output module is not", "lora_targets")
    elif modules:
        r.set("lora_targets", tuple([modules] if isinstance(modules, str) else modules), "lora_target_modules")


def _read_attention(r: Reading) -> None:
    """`attn_implementation`, or the deprecated `flash_attention` / `sdp_attention` flags (schemas/config.py
    `normalize_attn_implementation` l.1645, enums.py:128 LEGACY_ATTN_FLAG_TO_IMPL); None: transformers' default."""
    legacy = [(k, v) for k, v in (("flash_attention", "flash_attention_2"), ("sdp_attention", "sdpa"))
              if r.get(k, False)]
    if legacy and r.has("attn_implementation"):
        raise UsageError(f"{r.file}: {legacy[0][0]} and attn_implementation are both set; axolotl 0.21 refuses "
                         "that (normalize_attn_implementation): keep attn_implementation")
    if legacy:
        r.warn(legacy[0][0], f"deprecated in axolotl 0.21; read as attn_implementation: {legacy[0][1]}")
        read_attn(r, legacy[0][1], legacy[0][0])
    elif r.has("attn_implementation"):
        read_attn(r, r.get("attn_implementation"), "attn_implementation")


def _read_distributed(r: Reading) -> None:
    """`deepspeed`, the top-level `fsdp` list (rejected by 0.21, validation.py check_fsdp_version l.1442) and
    `fsdp_config` (FSDP2 over the launcher's ranks, which the file does not name)."""
    if r.has("deepspeed"):
        r.warn("deepspeed", DEEPSPEED_WARNING)
    if r.has("fsdp"):
        r.warn("fsdp", "the top-level fsdp list is rejected by axolotl 0.21 (validation.py check_fsdp_version: "
                       "use fsdp_config with fsdp_version: 2); not read")
    if r.has("fsdp_config"):
        config = {k.removeprefix("fsdp_"): v for k, v in dict(r.get("fsdp_config")).items()}
        version = r.get("fsdp_version", config.get("version", 2))
        if version != 2:
            r.warn("fsdp_version", f"{version}: axolotl 0.21 runs FSDP2 only and refuses other versions")
        flags = "--fsdp N" + ("" if config.get("reshard_after_forward", True) else " --reshard-after-forward false")
        flags += " --cpu-offload" if config.get("offload_params") else ""
        r.warn("fsdp_config", f"FSDP2 over the launch's N GPUs, which this file does not name: add {flags} "
                              "(without it the prediction is for one GPU)", "fsdp")
