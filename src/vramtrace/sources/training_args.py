"""transformers 5.24 `TrainingArguments` JSON (`args.to_json_string()`, or a dict of its keys) -> RunSpec fields.
Defaults: transformers/training_args.py (5.24), as recorded in docs/research/issue-41-config-sources.md section 3
(a real `TrainingArguments(...).to_json_string()` is docs/research/issue-41-examples/transformers/)."""

from __future__ import annotations

from ..errors import UsageError
from .base import DEEPSPEED_WARNING, Reading, Target
from .common import checkpointing_of, read_compile, read_optimizer

# TrainingArguments' keys that do not change one training step's memory (logging, saving, evaluation, the hub,
# schedules, data loading, distributed launch details of other ranks)
HARMLESS = frozenset({
    "output_dir", "num_train_epochs", "max_steps", "learning_rate", "lr_scheduler_type", "lr_scheduler_kwargs",
    "warmup_steps", "warmup_ratio", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon",
    "average_tokens_across_devices", "bf16_full_eval", "fp16_full_eval", "tf32", "logging_strategy", "logging_steps",
    "logging_first_step", "log_on_each_node", "logging_nan_inf_filter", "include_num_input_tokens_seen", "log_level",
    "log_level_replica", "disable_tqdm", "report_to", "run_name", "project", "trackio_space_id",
    "trackio_bucket_id", "trackio_static_space_id", "eval_strategy", "eval_steps", "eval_delay",
    "per_device_eval_batch_size", "prediction_loss_only", "eval_on_start", "eval_do_concat_batches",
    "eval_use_gather_object", "eval_accumulation_steps", "include_for_metrics", "batch_eval_metrics",
    "save_only_model", "save_strategy", "save_steps", "save_on_each_node", "save_total_limit",
    "enable_jit_checkpoint", "push_to_hub", "hub_token", "hub_private_repo", "hub_model_id", "hub_strategy",
    "hub_always_push", "hub_revision", "load_best_model_at_end", "metric_for_best_model", "greater_is_better",
    "ignore_data_skip", "restore_callback_states_from_checkpoint", "full_determinism", "seed", "data_seed",
    "accelerator_config", "dataloader_drop_last", "dataloader_num_workers", "dataloader_pin_memory",
    "dataloader_persistent_workers", "dataloader_prefetch_factor", "dataloader_multiprocessing_context",
    "dataloader_in_order", "remove_unused_columns", "label_names", "train_sampling_strategy", "length_column_name",
    "ddp_find_unused_parameters", "ddp_bucket_cap_mb", "ddp_broadcast_buffers", "ddp_static_graph", "ddp_backend",
    "ddp_timeout", "debug", "skip_memory_metrics", "do_train", "do_eval", "do_predict", "resume_from_checkpoint",
    "local_rank", "torch_compile_backend", "torch_compile_mode",
})
# keys that change memory and are not modelled: key -> TrainingArguments' default (5.24)
WARNED = {
    "optim_args": None, "optim_target_modules": None, "label_smoothing_factor": 0.0, "use_liger_kernel": False,
    "liger_kernel_config": None, "neftune_noise_alpha": None, "torch_empty_cache_steps": None,
    "auto_find_batch_size": False, "parallelism_config": None, "use_cpu": False,
}


def read(r: Reading, target: Target) -> None:
    """Read a TrainingArguments mapping into `r` (it names no model and no sequence length)."""
    r.set("batch", int(r.get("per_device_train_batch_size", 8)), "per_device_train_batch_size")
    r.set("grad_accum", int(r.get("gradient_accumulation_steps", 1)), "gradient_accumulation_steps")
    _read_precision(r)
    read_optimizer(r, r.get("optim", "adamw_torch_fused"), "optim")
    norm = float(r.get("max_grad_norm", 1.0))  # Trainer clips when max_grad_norm > 0 (trainer.py)
    if norm > 0:
        r.set("clip_grad_norm", norm, "max_grad_norm")
    _read_checkpointing(r)
    read_compile(r, target, bool(r.get("torch_compile", False)), "torch_compile", r.get("torch_compile_mode"))
    # Trainer.__init__ (trainer.py:645): model.config.use_cache = args.use_cache, default False
    r.set("use_cache", bool(r.get("use_cache", False)), "use_cache")
    if r.has("deepspeed"):
        _read_deepspeed(r)
    _read_fsdp(r)
    r.check_rest(HARMLESS, WARNED, "TrainingArguments")


def _read_deepspeed(r: Reading) -> None:
    """`deepspeed`: the path of a ds_config, read as `--deepspeed FILE` (cli/from_files.py `apply_deepspeed_config`:
    its stage sets --zero; --dp comes from the command line). A relative path is read from the current directory,
    as the Trainer opens it (transformers/integrations/deepspeed.py `HfDeepSpeedConfig`). A dict, or a file that is
    not there, keeps the prediction on one GPU, with a warning."""
    from pathlib import Path

    value = r.get("deepspeed")
    path = Path(value).expanduser() if isinstance(value, str) else None
    if path is not None and path.is_file():
        r.set("deepspeed_config", str(path.resolve()), "deepspeed")
    else:
        r.warn("deepspeed", DEEPSPEED_WARNING)


def _read_precision(r: Reading) -> None:
    """bf16/fp16: the Trainer autocasts; the weights are in the dtype the script loads them in, which the file
    does not hold: read as transformers 5's `from_pretrained` default (dtype="auto": a half-precision
    checkpoint's own dtype)."""
    for key in ("bf16", "fp16"):
        if r.get(key, False):
            r.set("precision", f"{key}-autocast", key)
            r.warn(key, f"read as {key} weights under autocast (from_pretrained's default dtype 'auto' on a {key} "
                        f"checkpoint); for weights loaded in fp32 add --precision {key}-mixed", "precision")
            return
    r.warn("bf16", "bf16 and fp16 are false: no autocast, the weights keep the dtype the script loads them in, "
                   "which this file does not give; add --precision fp32|bf16|fp16 (default bf16-mixed)", "precision")


def _read_checkpointing(r: Reading) -> None:
    """`activation_checkpointing(_kwargs)` (5.x), else the deprecated `gradient_checkpointing(_kwargs)` aliases
    (training_args.py `__post_init__` l.1533-1545). Kwargs None -> `{"use_reentrant": False}`
    (modeling_utils.py `_activation_checkpointing_enable` l.3151-3158); `every_n_layers` and `offload` are the
    Trainer's and popped, and an empty rest is passed as None (trainer.py:1503-1528); a rest without
    use_reentrant -> torch 2.13's `checkpoint(use_reentrant=None)` default, True."""
    new = r.has("activation_checkpointing") or r.has("activation_checkpointing_kwargs")
    prefix = "activation" if new else "gradient"
    r.mark("gradient_checkpointing", "gradient_checkpointing_kwargs")
    on = bool(r.get(f"{prefix}_checkpointing", False))
    kwargs = r.data.get(f"{prefix}_checkpointing_kwargs")
    r.mark(f"{prefix}_checkpointing_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise UsageError(f"{r.file}: {prefix}_checkpointing_kwargs: expected a mapping, got {kwargs!r}")
    # the Trainer pops every_n_layers and offload and passes the rest, or None when nothing is left
    # (trainer.py:1503-1528 `gc_kwargs or None`): None -> use_reentrant False; a rest without use_reentrant ->
    # torch's default, True
    rest = {k: v for k, v in (kwargs or {}).items() if k not in ("every_n_layers", "offload")}
    reentrant = bool(rest.get("use_reentrant", True)) if rest else False
    if on and kwargs and kwargs.get("offload"):
        r.warn(f"{prefix}_checkpointing_kwargs", "offload (save_on_cpu) is not modelled: the prediction keeps the "
                                                 "checkpoints on the GPU", "checkpointing")
    every = int((kwargs or {}).get("every_n_layers", 1))
    r.set("checkpointing", checkpointing_of(on, reentrant, every), f"{prefix}_checkpointing",
          f"{prefix}_checkpointing_kwargs")


def _read_fsdp(r: Reading) -> None:
    """`fsdp` (true, or the legacy "full_shard auto_wrap" strings) with `fsdp_config` (`_process_fsdp_args`
    l.2775: `fsdp_` prefixes dropped, version 2 by default): the ranks come from the launcher, not the file."""
    fsdp = r.get("fsdp")
    config = {k.removeprefix("fsdp_"): v for k, v in dict(r.get("fsdp_config") or {}).items()}
    if not fsdp:
        return
    if config.get("version", 2) != 2:
        r.warn("fsdp_config", f"version {config['version']} (FSDP1) is read as FSDP2's layout")
    if config.get("activation_checkpointing"):
        r.set("checkpointing", "layers", "fsdp_config.activation_checkpointing")
    flags = "--fsdp N" + ("" if config.get("reshard_after_forward", True) else " --reshard-after-forward false")
    flags += " --cpu-offload" if config.get("cpu_offload") or config.get("offload_params") else ""
    r.warn("fsdp", f"FSDP over the launch's N GPUs, which this file does not name: add {flags} (without it the "
                   "prediction is for one GPU)", "fsdp")
