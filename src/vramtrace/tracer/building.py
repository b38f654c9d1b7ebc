"""Build a transformers model on the meta device from a resolved config (no weights, no memory)."""

from __future__ import annotations

import contextlib
import copy
import io
import logging
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ModelLoadError
from ..spec import Mode, Precision, RunSpec
from .loading import ResolvedConfig
from .checkpointing import layer_stack
from .replication import TRACED_LAYERS, LayerPlan

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(slots=True)
class LoadedModel:
    """The model on meta, the inputs of one step, and its parameter names.

    model: `nn.Module` whose parameters and buffers are on the meta device.
    inputs: keyword arguments of the forward; `input_ids` is int64 (B, S).
    task: 'causal-lm', 'masked-lm' or 'seq2seq-lm'.
    param_dtype: dtype the weights are stored in (fp32 under a mixed precision).
    compute_dtype: autocast dtype for mixed precision, else None.
    """

    model: torch.nn.Module
    inputs: dict[str, torch.Tensor]
    task: str
    architecture: str
    model_type: str
    params: int
    trainable_params: int
    param_dtype: torch.dtype
    compute_dtype: torch.dtype | None
    attn_implementation: str
    layer_plan: LayerPlan | None = None  # where the repeated layers are, when the model can be traced shallow
    traced_model: torch.nn.Module | None = None  # the same model with TRACED_LAYERS layers (with layer_plan)
    replication_note: str = ""  # why every layer is traced, when it is
    num_layers: int = 0  # layers in the model's checkpointable stack (0: none found)
    layer_stack_path: str = ""  # its qualified name, e.g. 'model.layers'


def weight_and_compute_dtype(precision: Precision) -> tuple[torch.dtype, torch.dtype | None]:
    """(weight dtype, autocast dtype or None) for a precision."""
    if precision is Precision.BF16_MIXED:
        return torch.float32, torch.bfloat16
    if precision is Precision.FP16_MIXED:
        return torch.float32, torch.float16
    return DTYPES[precision.value], None


def build_config(resolved: ResolvedConfig, trust_remote_code: bool):
    """Turn a config dict into a transformers `PretrainedConfig`. Raises ModelLoadError."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cfg = dict(resolved.config)
    if "auto_map" in cfg and not trust_remote_code:
        raise ModelLoadError(
            f"{resolved.ref} needs remote code (its config has auto_map); refusing to run it. "
            "Pass --trust-remote-code if you trust that repository"
        )
    model_type = cfg.get("model_type")
    if not model_type:
        raise ModelLoadError(f"{resolved.location} has no model_type; it is not a transformers config.json")
    if "auto_map" in cfg:
        try:
            return transformers.AutoConfig.from_pretrained(
                resolved.location.rsplit("/", 1)[0] if resolved.source == "local" else resolved.ref,
                trust_remote_code=True)
        except Exception as e:  # remote code can raise anything
            raise ModelLoadError(f"building the remote-code config of {resolved.ref} failed: {e}") from None
    if model_type not in CONFIG_MAPPING:
        raise ModelLoadError(
            f"unknown model_type {model_type!r} in {resolved.location}; transformers "
            f"{transformers.__version__} does not know it (upgrade transformers, or pass --trust-remote-code for custom code)")
    cfg.pop("model_type")
    try:
        return CONFIG_MAPPING[model_type].from_dict(cfg)
    except Exception as e:
        raise ModelLoadError(f"invalid {model_type} config in {resolved.location}: {e}") from None


def _model_class(config, trust_remote_code: bool):
    import transformers

    for arch in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, arch, None)
        if cls is not None:
            return cls, arch
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModelForSeq2SeqLM, transformers.AutoModelForMaskedLM):
        if type(config) in auto._model_mapping:
            return auto, auto._model_mapping[type(config)].__name__
    if trust_remote_code and getattr(config, "auto_map", None):
        return transformers.AutoModelForCausalLM, "AutoModelForCausalLM (remote code)"
    raise ModelLoadError(
        f"transformers has no causal-LM, seq2seq-LM or masked-LM head for model_type {config.model_type!r}")


def _task(model: torch.nn.Module) -> str:
    import transformers

    if isinstance(model, transformers.PreTrainedModel):
        name = type(model).__name__
        if getattr(model.config, "is_encoder_decoder", False):
            return "seq2seq-lm"
        if "MaskedLM" in name or name.endswith("ForPreTraining"):
            return "masked-lm"
    return "causal-lm"


def count_params(model: torch.nn.Module) -> tuple[int, int]:
    """(all, trainable) parameter counts; tied weights count once, as `model.parameters()` yields them once."""
    total = trainable = 0
    for p in model.parameters():
        total += p.numel()
        trainable += p.numel() if p.requires_grad else 0
    return total, trainable


def _build(cls, config, kwargs, arch: str, location: str) -> torch.nn.Module:
    try:
        with torch.device("meta"), contextlib.redirect_stderr(io.StringIO()):
            if hasattr(cls, "from_config"):
                return cls.from_config(config, **kwargs)
            return cls._from_config(config, **kwargs)
    except Exception as e:
        raise ModelLoadError(f"transformers could not build {arch} from {location}: {e}") from None


def _layer_signature(layer: torch.nn.Module) -> tuple:
    return (type(layer), tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in layer.named_parameters()),
            tuple((n, tuple(b.shape), b.dtype) for n, b in layer.named_buffers()),
            tuple((n, type(m).__name__, getattr(m, "training", None)) for n, m in layer.named_modules()))


def layer_plan(model: torch.nn.Module, config) -> tuple[LayerPlan | None, dict[str, Any], str]:
    """(plan, config overrides for the shallow model, note) for tracing `TRACED_LAYERS` of the model's layers.

    The plan needs `config.num_hidden_layers` = L > TRACED_LAYERS, exactly one `nn.ModuleList` of L layers, the
    layers alike (class, parameter and buffer shapes, submodules), and no per-layer config list whose entries
    differ (e.g. `layer_types` alternating sliding and full attention). Otherwise the plan is None and `note`
    says why.
    """
    L = getattr(config, "num_hidden_layers", None)
    if not isinstance(L, int) or L <= TRACED_LAYERS:
        return None, {}, f"{L} layers: every layer traced"
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m) == L]
    if len(lists) != 1:
        return None, {}, f"{len(lists)} stacks of {L} layers: every layer traced"
    prefix, layers = lists[0]
    first = _layer_signature(layers[0])
    if any(_layer_signature(m) != first for m in layers):
        return None, {}, "the layers differ: every layer traced"
    overrides: dict[str, Any] = {"num_hidden_layers": TRACED_LAYERS}
    for key, value in config.to_dict().items():
        if isinstance(value, (list, tuple)) and len(value) == L and key != "architectures":
            if any(v != value[0] for v in value):
                return None, {}, f"config.{key} differs between layers: every layer traced"
            overrides[key] = list(value[:TRACED_LAYERS])
    return LayerPlan(prefix, L), overrides, ""


def load_model(spec: RunSpec, resolved: ResolvedConfig) -> LoadedModel:
    """Build the model of `resolved` on the meta device for `spec`, plus its 4-layer copy for tracing when the
    layers repeat (`layer_plan`). Raises ModelLoadError."""
    config = build_config(resolved, spec.trust_remote_code)
    cls, arch = _model_class(config, spec.trust_remote_code)
    param_dtype, compute_dtype = weight_and_compute_dtype(spec.effective_precision)
    kwargs: dict[str, Any] = {"dtype": param_dtype}
    if spec.trust_remote_code:
        kwargs["trust_remote_code"] = True
    logging.getLogger("transformers").setLevel(logging.ERROR)
    model = _build(cls, config, kwargs, arch, resolved.location)
    model.train(spec.mode is Mode.TRAIN)
    plan, traced_model, note = None, None, "layer replication off: every layer traced"
    ckpt = spec.checkpointing
    if spec.replicate_layers and ckpt.kind in ("every", "nth") and ckpt.k > 1:
        note = f"checkpointing {ckpt} differs between layers: every layer traced"
    elif spec.replicate_layers:
        plan, overrides, note = layer_plan(model, config)
    if plan is not None:
        shallow = copy.deepcopy(config)
        for key, value in overrides.items():
            setattr(shallow, key, value)
        traced_model = _build(cls, shallow, kwargs, arch, resolved.location)
        traced_model.train(spec.mode is Mode.TRAIN)
        stack = dict(traced_model.named_modules()).get(plan.prefix)
        if not isinstance(stack, torch.nn.ModuleList) or len(stack) != TRACED_LAYERS:
            plan, traced_model, note = None, None, "the 4-layer copy has no matching layer stack: every layer traced"
    task = _task(model)
    B, S = spec.batch, spec.seq
    max_pos = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if max_pos and S > max_pos and config.model_type in ("gpt2", "bert", "roberta", "opt", "bart"):
        raise ModelLoadError(f"--seq {S} exceeds {arch}'s learned position embeddings ({max_pos}); use --seq <= {max_pos}")
    input_ids = torch.empty((B, S), dtype=torch.int64, device="meta")  # (B, S)
    inputs: dict[str, torch.Tensor] = {"input_ids": input_ids}
    if spec.mode is Mode.TRAIN:
        inputs["labels"] = input_ids
    total, trainable = count_params(model)
    return LoadedModel(
        model=model, inputs=inputs, task=task, architecture=type(model).__name__, model_type=config.model_type,
        params=total, trainable_params=trainable, param_dtype=param_dtype, compute_dtype=compute_dtype,
        attn_implementation=str(getattr(config, "_attn_implementation", None) or "eager"),
        layer_plan=plan, traced_model=traced_model, replication_note=note,
        num_layers=len(stack) if (stack := layer_stack(model)) is not None else 0,
        layer_stack_path=next((n for n, m in model.named_modules() if m is stack), "") if stack is not None else "",
    )
