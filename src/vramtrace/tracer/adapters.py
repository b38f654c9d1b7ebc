"""Frozen weights and LoRA: what a fine-tuning script does to the model before it builds the optimizer.

- `--freeze PATTERN`: parameters whose qualified name matches an fnmatch pattern get `requires_grad=False`, so
  they get no gradient and no optimizer state (the optimizer is built over trainable parameters only, as
  fine-tuning scripts do: `[p for p in model.parameters() if p.requires_grad]`).
- `--lora-rank R [--lora-alpha A] [--lora-targets q_proj,v_proj]`: peft's own `get_peft_model(model,
  LoraConfig(r=R, lora_alpha=A, target_modules=...))`, on the meta device for a trace, so the traced forward is
  the real peft forward. Without targets, peft picks its default target modules for the architecture
  (`peft/utils/constants.py`, TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING). peft freezes every base
  parameter; the adapters' A and B matrices are trainable.
"""

from __future__ import annotations

import contextlib
import fnmatch
import warnings

import torch

from ..errors import UsageError
from ..spec import RunSpec
from . import recipes


def freeze(model: torch.nn.Module, patterns: tuple[str, ...]) -> int:
    """Set `requires_grad=False` on the parameters whose name matches one of `patterns` (fnmatch). Returns the
    number of parameters frozen. Raises UsageError for a pattern that matches no parameter."""
    params = dict(model.named_parameters())
    frozen: set[str] = set()
    for pattern in patterns:
        hits = [n for n in params if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            raise UsageError(f"--freeze {pattern!r} matches no parameter; names look like "
                             f"{', '.join(list(params)[:3])} (use globs such as 'model.embed_tokens.*' or '*.layers.0.*')")
        for n in hits:
            params[n].requires_grad_(False)
        frozen.update(hits)
    return len(frozen)


def apply_adapters(spec: RunSpec, model: torch.nn.Module, device: str,
                   weight_dtype: torch.dtype | None = None) -> torch.nn.Module:
    """`model` with `spec.freeze` applied, then wrapped by peft LoRA when `spec.lora_rank` is set (the returned
    module is then a `peft.PeftModel`). New adapter weights are created on `device`. peft (the optional extra
    `vramtrace[lora]`) is imported only here. With `spec.recipe`, the recipe's casts before and after LoRA
    (`recipes.prepare`, `recipes.finish`; `weight_dtype`: the dtype the weights were loaded in). Raises UsageError
    when peft is not installed, or for a LoRA config peft refuses (e.g. no target modules known for a custom
    module)."""
    if spec.freeze:
        freeze(model, spec.freeze)
    if spec.recipe is not None:
        model = recipes.prepare(spec, model, weight_dtype or torch.get_default_dtype())
    if spec.lora_rank is None:
        return recipes.finish(spec, model)
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as e:
        raise UsageError("--lora-rank needs peft: pip install 'vramtrace[lora]'") from e
    kwargs: dict = {"r": spec.lora_rank, "lora_dropout": spec.lora_dropout or 0.0}
    if spec.lora_alpha is not None:
        kwargs["lora_alpha"] = spec.lora_alpha
    if spec.lora_targets:
        # peft's "all-linear" shorthand is a str, not a module name (peft/tuners/tuners_utils.py
        # _maybe_include_all_linear_layers: every Linear but the output layer)
        targets = list(spec.lora_targets)
        kwargs["target_modules"] = "all-linear" if targets == ["all-linear"] else targets
    kwargs.update(recipes.lora_kwargs(spec))
    if spec.quantization is not None and spec.recipe is None:  # a recipe prepares the model itself
        # QLoRA: what `prepare_model_for_kbit_training` does to a quantized model before `get_peft_model`
        # (peft/utils/other.py): every parameter frozen, the unquantized fp16/bf16 ones (norms, embeddings,
        # lm_head) cast to fp32. Its checkpointing default is the spec's (spec.KBIT_TRAINING_CHECKPOINTING),
        # applied with the other policies (checkpointing.apply_checkpointing).
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    try:
        config = LoraConfig(**kwargs)
        with torch.device(device) if device == "meta" else contextlib.nullcontext(), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # peft reads transformers' deprecated names
            return recipes.finish(spec, get_peft_model(model, config))
    except ValueError as e:
        text = str(e).splitlines()[0] if str(e) else "invalid LoRA config"
        raise UsageError(f"peft refused the LoRA config: {text} (name the modules with --lora-targets, "
                         "e.g. --lora-targets q_proj,v_proj)") from e
