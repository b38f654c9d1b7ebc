"""A DeepSpeed config file (ds_config.json, `--deepspeed FILE`): what it sets of a `--zero` run, and its "auto"
values filled as HF's integration fills them. Torch-free.

`read_ds_config(path)` reads the file (JSON, one object) into a `DsConfig`: the ZeRO stage and offload devices,
the micro-batch, the accumulation and the precision it fixes (None where it says "auto" or nothing).
`resolve_auto(config, ...)` fills the "auto" values as transformers 5.24 `integrations/deepspeed.py`
`HfTrainerDeepSpeedConfig` does for a Trainer run:

- `trainer_config_process`: `train_micro_batch_size_per_gpu` <- the per-device batch, `gradient_accumulation_steps`
  <- the accumulation, `train_batch_size` <- world size x batch x accumulation, `gradient_clipping` <-
  `max_grad_norm` (1.0 by default), the optimizer's `lr`, `betas`, `eps`, `weight_decay` <- the Trainer's
  (TrainingArguments' defaults 5e-5, (0.9, 0.999), 1e-8, 0.0), `fp16.enabled`/`bf16.enabled` <- the precision;
- `trainer_config_finalize`, with H the model's `hidden_size` (or the largest of `hidden_sizes`, or the text
  config's): `zero_optimization.reduce_bucket_size` <- H*H; ZeRO-3 only: `stage3_prefetch_bucket_size` <-
  int(0.9*H*H), `stage3_param_persistence_threshold` <- 10*H.

Every other `zero_optimization` key goes to DeepSpeed as the file has it (it is DeepSpeed's engine that runs).
`bucket_sources` says for each bucket size where its value comes from: the file, HF's "auto", or DeepSpeed's
default (deepspeed 0.19.8 runtime/zero/config.py `DeepSpeedZeroConfig`).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

from ..choices import BucketSource
from ..errors import UsageError

AUTO = "auto"
# deepspeed 0.19.8 runtime/zero/config.py `DeepSpeedZeroConfig` field defaults (elements, or parameters)
DEEPSPEED_DEFAULTS: dict[str, int] = {
    "reduce_bucket_size": 500_000_000, "allgather_bucket_size": 500_000_000,
    "stage3_prefetch_bucket_size": 50_000_000, "stage3_param_persistence_threshold": 100_000,
    "stage3_max_live_parameters": 1_000_000_000, "sub_group_size": 1_000_000_000,
}
STAGE3_ONLY = ("stage3_prefetch_bucket_size", "stage3_param_persistence_threshold", "stage3_max_live_parameters")
# TrainingArguments' defaults (transformers/training_args.py) for the optimizer's "auto" hyperparameters
HF_OPTIMIZER_DEFAULTS = {"lr": 5e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
HF_MAX_GRAD_NORM = 1.0


@dataclass(frozen=True, slots=True)
class DsConfig:
    """What a ds_config file fixes of a run (None: "auto" or absent) and the whole file (`config`)."""

    path: str
    config: dict
    stage: int | None
    offload_optimizer: str | None
    offload_param: str | None
    micro_batch: int | None
    grad_accum: int | None
    precision: str | None  # 'bf16', 'fp16', 'fp32' (neither enabled), None when either says "auto"


def _bad(path: str, what: str) -> UsageError:
    return UsageError(f"--deepspeed {path}: {what}")


def _int_or_auto(path: str, config: dict, key: str) -> int | None:
    value = config.get(key)
    if value is None or value == AUTO:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise _bad(path, f"{key} must be a positive integer or \"auto\", got {value!r}")
    return value


def _offload(path: str, zero: dict, key: str) -> str | None:
    block = zero.get(key)
    if block is None:
        return None
    if not isinstance(block, dict):
        raise _bad(path, f"zero_optimization.{key} must be an object like {{\"device\": \"cpu\"}}, got {block!r}")
    device = str(block.get("device", "none")).lower()
    if device not in ("none", "cpu", "nvme"):
        raise _bad(path, f"zero_optimization.{key}.device must be none, cpu or nvme, got {block.get('device')!r}")
    return None if device == "none" else device


def _precision(config: dict) -> str | None:
    flags = {}
    for name in ("bf16", "fp16"):
        block = config.get(name) or {}
        flags[name] = block.get("enabled", False) if isinstance(block, dict) else False
    if AUTO in flags.values():
        return None
    return "bf16" if flags["bf16"] else "fp16" if flags["fp16"] else "fp32"


def read_ds_config(path: str | Path) -> DsConfig:
    """The ds_config at `path`. Raises UsageError (one line naming the file): missing, not JSON, not an object,
    a bad stage (stage 0 too: not ZeRO), batch, accumulation or offload device."""
    path = str(path)
    try:
        config = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise _bad(path, "no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise _bad(path, f"cannot read it ({e})") from None
    except json.JSONDecodeError as e:
        raise _bad(path, f"not JSON (line {e.lineno}: {e.msg})") from None
    if not isinstance(config, dict):
        raise _bad(path, "a ds_config is a JSON object")
    zero = config.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise _bad(path, "zero_optimization must be an object")
    stage = zero.get("stage")
    if stage is not None and (isinstance(stage, bool) or stage not in (0, 1, 2, 3)):
        raise _bad(path, f"zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
    if stage == 0:
        raise _bad(path, "stage 0 is not ZeRO: drop --deepspeed or set stage 1-3")
    return DsConfig(path, config, stage, _offload(path, zero, "offload_optimizer"),
                    _offload(path, zero, "offload_param"), _int_or_auto(path, config, "train_micro_batch_size_per_gpu"),
                    _int_or_auto(path, config, "gradient_accumulation_steps"), _precision(config))


def hidden_size(model_config) -> int | None:
    """H as transformers' `trainer_config_finalize` reads it: `hidden_size`, else max(`hidden_sizes`), else the
    text config's; None when the config has none."""
    for cfg in (model_config, getattr(model_config, "text_config", None)):
        if cfg is None:
            continue
        if getattr(cfg, "hidden_size", None):
            return int(cfg.hidden_size)
        if getattr(cfg, "hidden_sizes", None):
            return int(max(cfg.hidden_sizes))
    return None


def resolve_auto(ds: DsConfig, *, batch: int, grad_accum: int, dp: int, stage: int, bf16: bool,
                 hidden: int | None, clip_grad_norm: float | None = None) -> dict:
    """A copy of `ds.config` with every "auto" filled as HF's integration fills it (the module docstring), stage-3
    "auto" keys of a stage below 3 dropped (HF fills them for ZeRO-3 only). Raises UsageError when a bucket size
    is "auto" and the model config has no hidden size (HF raises then too)."""
    cfg = copy.deepcopy(ds.config)
    fill = {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": grad_accum,
            "train_batch_size": batch * grad_accum * dp,
            "gradient_clipping": HF_MAX_GRAD_NORM if clip_grad_norm is None else clip_grad_norm}
    for key, value in fill.items():
        if cfg.get(key) == AUTO:
            cfg[key] = value
    params = (cfg.get("optimizer") or {}).get("params") or {}
    for key, value in HF_OPTIMIZER_DEFAULTS.items():
        if params.get(key) == AUTO:
            params[key] = value
    for name, on in (("bf16", bf16), ("fp16", False)):
        if isinstance(cfg.get(name), dict) and cfg[name].get("enabled") == AUTO:
            cfg[name]["enabled"] = on
    zero = cfg.setdefault("zero_optimization", {})
    autos = {"reduce_bucket_size": lambda h: h * h}
    if stage == 3:
        autos.update(stage3_prefetch_bucket_size=lambda h: int(0.9 * h * h),
                     stage3_param_persistence_threshold=lambda h: 10 * h)
    for key in [k for k, v in zero.items() if v == AUTO]:
        if key in autos:
            if hidden is None:
                raise _bad(ds.path, f"zero_optimization.{key} is \"auto\" and the model's config has no hidden_size "
                                    "(HF's integration cannot fill it either); give a number")
            zero[key] = autos[key](hidden)
        elif key in STAGE3_ONLY and stage != 3:
            del zero[key]
        else:
            raise _bad(ds.path, f"zero_optimization.{key} is \"auto\", which HF's integration does not fill; "
                                "give a value")
    return cfg


def bucket_sources(ds: DsConfig | None, resolved: dict, stage: int) -> dict[str, dict]:
    """{key: {"value": elements, "source": a `BucketSource`}} of the bucket sizes that
    apply at `stage` (the stage-3 ones at stage 3 only)."""
    given = (ds.config.get("zero_optimization", {}) if ds is not None else {})
    zero = resolved.get("zero_optimization", {})
    out = {}
    for key, default in DEEPSPEED_DEFAULTS.items():
        if key in STAGE3_ONLY and stage != 3:
            continue
        if key in given:
            source = BucketSource.HF_AUTO if given[key] == AUTO else BucketSource.FILE
            out[key] = {"value": int(zero[key]), "source": source}
        else:
            out[key] = {"value": default, "source": BucketSource.DEEPSPEED_DEFAULT}
    return out


def spec_config(spec, model_config) -> tuple[DsConfig | None, dict | None]:
    """(the `--deepspeed` file of `spec` (a RunSpec with `zero`), its config with "auto" filled for the spec and
    the model's config) or (None, None) without a file. Raises UsageError (`read_ds_config`, `resolve_auto`)."""
    if spec.deepspeed_config is None:
        return None, None
    ds = read_ds_config(spec.deepspeed_config)
    bf16 = spec.effective_precision.value.startswith("bf16")
    return ds, resolve_auto(ds, batch=spec.batch, grad_accum=spec.grad_accum, dp=spec.dp, stage=spec.zero,
                            bf16=bf16, hidden=hidden_size(model_config), clip_grad_norm=spec.clip_grad_norm)
