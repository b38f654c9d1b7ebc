"""Readings the format readers share: checkpointing, attention and optimizer names. Torch-free."""

from __future__ import annotations

from ..errors import UsageError
from ..spec import COMPILE_MODES, AttnImplementation, OptimizerKind
from .base import Reading, Target


def checkpointing_of(enabled: bool, reentrant: bool, every_n_layers: int = 1) -> str:
    """RunSpec.checkpointing text of transformers' layer checkpointing: 'none', 'layers', 'layers:reentrant'
    (torch.utils.checkpoint's `use_reentrant=True`) or 'nth:N' (transformers' `every_n_layers`, non-reentrant)."""
    if not enabled:
        return "none"
    if every_n_layers > 1:
        return f"nth:{every_n_layers}"
    return "layers:reentrant" if reentrant else "layers"


def read_attn(r: Reading, name: str, key: str) -> None:
    """Set `attn_implementation` from a transformers `attn_implementation` name; a name vramtrace has no
    `AttnImplementation` for (flash_attention_3, xformers, sage, hub kernels, ...) is a warning and left to
    transformers' default (sdpa)."""
    value = str(name).strip().lower()
    if value in AttnImplementation._value2member_map_:
        r.set("attn_implementation", value, key)
    else:
        r.warn(key, f"{name!r} is not modelled (vramtrace has {', '.join(m.value for m in AttnImplementation)}); "
                    "the prediction uses transformers' default, sdpa", "attn_implementation")


def read_optimizer(r: Reading, name: str, key: str) -> None:
    """Set `optimizer` from an HF Trainer `optim` name (spec.OptimizerKind.parse takes them, with
    `adamw_torch_fused`'s fused implementation); a name vramtrace does not trace (axolotl's optimi_adamw,
    ao_adamw_*, galore, ...) is a warning and leaves vramtrace's default, adamw."""
    try:
        OptimizerKind.parse(str(name))
    except UsageError:
        r.warn(key, f"{name!r} is not traced by vramtrace; the prediction uses adamw (torch.optim.AdamW)",
               "optimizer")
        return
    r.set("optimizer", str(name), key)


def read_compile(r: Reading, target: Target, on: bool, key: str, mode: str | None) -> None:
    """`torch_compile`: RunSpec.compile on a CPU target (vramtrace traces torch.compile there only); on a CUDA
    target a warning (the prediction is the eager step). A mode other than `COMPILE_MODES` is a warning too."""
    if not on:
        return
    if target.cuda:
        r.warn(key, "vramtrace traces torch.compile for --device cpu only; the prediction is the eager step",
               "compile")
        return
    r.set("compile", True, key)
    if mode not in (None, "default"):
        if mode in COMPILE_MODES:
            r.set("compile_mode", mode, "torch_compile_mode")
        else:
            r.warn("torch_compile_mode", f"{mode!r} is not traced (vramtrace has {', '.join(COMPILE_MODES)}); the "
                                         "prediction uses the default mode", "compile_mode")
