"""The run specification: what to trace and for which target. Frozen, validated, torch-free."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .errors import UsageError


class _Choice(str, enum.Enum):
    @classmethod
    def parse(cls, value: "str | _Choice", what: str):
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            valid = ", ".join(m.value for m in cls)
            raise UsageError(f"unknown {what} {value!r}; choose one of: {valid}") from None


class Mode(_Choice):
    TRAIN = "train"
    INFERENCE = "inference"


class Precision(_Choice):
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    BF16_MIXED = "bf16-mixed"
    FP16_MIXED = "fp16-mixed"

    @property
    def is_mixed(self) -> bool:
        return self in (Precision.BF16_MIXED, Precision.FP16_MIXED)


class OptimizerKind(_Choice):
    ADAMW = "adamw"
    ADAM = "adam"
    SGD = "sgd"
    SGD_MOMENTUM = "sgd-momentum"
    NONE = "none"


class OptimizerImpl(_Choice):
    DEFAULT = "default"  # foreach on CUDA, for-loop on CPU, as torch.optim picks (torch/optim/optimizer.py)
    FOREACH = "foreach"
    FORLOOP = "for-loop"


class Device(_Choice):
    CUDA = "cuda"
    CPU = "cpu"


# Selective checkpointing's default: save the matmul outputs, recompute pointwise ops and the attention core
# (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models").
DEFAULT_SAVE_OPS = ("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten._scaled_mm")
_CKPT_USAGE = "none, layers, every:K, nth:N, selective, selective:OP,OP (e.g. aten.mm,aten.addmm) or auto"


@dataclass(frozen=True, slots=True)
class Checkpointing:
    """An activation-checkpointing policy. kind: none | layers | every (K consecutive layers per segment) |
    nth (every N-th layer, transformers' `every_n_layers`) | selective (save `save_ops`' outputs) | auto
    (a planner picks one under `RunSpec.memory_budget_bytes`). `k` is K or N."""

    kind: str = "none"
    k: int = 1
    save_ops: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: "str | Checkpointing") -> "Checkpointing":
        """Parse '--checkpointing' text. Raises UsageError listing the valid forms."""
        if isinstance(text, Checkpointing):
            return text
        kind, _, arg = str(text).strip().lower().partition(":")
        if kind in ("none", "layers", "auto") and not arg:
            return cls(kind)
        if kind == "selective":
            ops = tuple(o.strip() for o in arg.split(",") if o.strip()) if arg else DEFAULT_SAVE_OPS
            return cls("selective", 1, ops)
        if kind in ("every", "nth") and arg.isdigit() and int(arg) >= 1:
            return cls(kind, int(arg))
        raise UsageError(f"unknown checkpointing {text!r}; use {_CKPT_USAGE}")

    def __str__(self) -> str:
        if self.kind in ("every", "nth"):
            return f"{self.kind}:{self.k}"
        if self.kind == "selective" and self.save_ops != DEFAULT_SAVE_OPS:
            return "selective:" + ",".join(self.save_ops)
        return self.kind


@dataclass(frozen=True, slots=True)
class GpuPreset:
    """A target GPU. `memory_bytes` is the device's total memory in bytes as `torch.cuda.mem_get_info` reports it."""

    name: str
    memory_bytes: int
    sm: int  # compute capability * 10, e.g. 90 for sm90 (Hopper)


GiB = 2**30
# Total memory as reported by the driver (cudaMemGetInfo), in binary GiB.
GPU_PRESETS: dict[str, GpuPreset] = {
    p.name.lower(): p
    for p in (
        GpuPreset("H100-80GB", int(79.19 * GiB), 90),
        GpuPreset("H200", int(139.81 * GiB), 90),
        GpuPreset("A100-80GB", int(79.15 * GiB), 80),
        GpuPreset("A100-40GB", int(39.39 * GiB), 80),
        GpuPreset("L4", int(22.05 * GiB), 89),
        GpuPreset("RTX4090", int(23.64 * GiB), 89),
        GpuPreset("A10G", int(22.07 * GiB), 86),
        GpuPreset("V100-32GB", int(31.74 * GiB), 70),
    )
}


def parse_gpu(name: str) -> GpuPreset:
    key = name.lower().replace("_", "-")
    aliases = {"h100": "h100-80gb", "a100": "a100-80gb", "4090": "rtx4090", "v100": "v100-32gb"}
    key = aliases.get(key, key)
    if key not in GPU_PRESETS:
        valid = ", ".join(p.name for p in GPU_PRESETS.values())
        raise UsageError(f"unknown GPU {name!r}; choose one of: {valid}")
    return GPU_PRESETS[key]


@dataclass(frozen=True, slots=True)
class RunSpec:
    """What to analyse.

    model: a Hub id, a bundled id, a local directory holding config.json, or a path to a config.json.
    batch, seq: the (B, S) of the int64 `input_ids`.
    precision: None picks the default for the mode (bf16-mixed to train, bf16 for inference).
    checkpointing: a `Checkpointing` or its text ('none', 'layers', 'every:4', 'selective', 'auto', ...).
    memory_budget_bytes: the budget `auto` checkpointing must fit (bytes of peak allocated).
    replicate_layers: trace 4 of a stack's identical layers and rebuild the rest (False: trace every layer).
    """

    model: str
    batch: int
    seq: int
    mode: Mode = Mode.TRAIN
    precision: Precision | None = None
    optimizer: OptimizerKind = OptimizerKind.ADAMW
    optimizer_impl: OptimizerImpl = OptimizerImpl.DEFAULT
    device: Device = Device.CUDA
    gpu: str = "H100-80GB"
    checkpointing: Checkpointing | str = "none"
    memory_budget_bytes: int | None = None
    trust_remote_code: bool = False
    replicate_layers: bool = True

    def __post_init__(self) -> None:
        for name in ("batch", "seq"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise UsageError(f"--{name} must be a positive integer, got {v!r}")
        object.__setattr__(self, "mode", Mode.parse(self.mode, "mode"))
        if self.precision is not None:
            object.__setattr__(self, "precision", Precision.parse(self.precision, "precision"))
        object.__setattr__(self, "optimizer", OptimizerKind.parse(self.optimizer, "optimizer"))
        object.__setattr__(self, "optimizer_impl", OptimizerImpl.parse(self.optimizer_impl, "optimizer implementation"))
        object.__setattr__(self, "device", Device.parse(self.device, "device"))
        object.__setattr__(self, "gpu", parse_gpu(self.gpu).name)
        ckpt = Checkpointing.parse(self.checkpointing)
        object.__setattr__(self, "checkpointing", ckpt)
        if ckpt.kind != "none" and self.mode is Mode.INFERENCE:
            raise UsageError("--checkpointing applies to training; drop it for --mode inference")
        if ckpt.kind == "auto" and not self.memory_budget_bytes:
            raise UsageError("--checkpointing auto needs --memory-budget, e.g. --memory-budget 40GiB")
        if self.memory_budget_bytes is not None and self.memory_budget_bytes <= 0:
            raise UsageError("--memory-budget must be positive, e.g. 40GiB")

    @property
    def effective_precision(self) -> Precision:
        if self.precision is not None:
            return self.precision
        return Precision.BF16_MIXED if self.mode is Mode.TRAIN else Precision.BF16

    @property
    def gpu_preset(self) -> GpuPreset:
        return parse_gpu(self.gpu)
