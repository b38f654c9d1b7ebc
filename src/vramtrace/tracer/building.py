"""Build a transformers model on the meta device from a resolved config (no weights, no memory)."""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..errors import ModelLoadError, TraceError, UnsupportedOpError, UsageError
from ..spec import (DEFAULT_CHOICES, CheckpointingKind, KvDtype, Mode,
                    Precision, RunSpec, Task)
from .loading import ResolvedConfig
from .checkpoint_headers import precision_for
from .checkpointing import layer_stack
from .custom import output_loss
from .flash_attn import check_attn_implementation
from .replication import TRACED_LAYERS, LayerPlan
from .vlm import VlmLayout, vlm_family, vlm_inputs, vlm_layout

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(slots=True)
class LoadedModel:
    """The model on meta, the inputs of one step, and its parameter names.

    model: `nn.Module` whose parameters and buffers are on the meta device (or a real device for a real run).
    inputs: keyword arguments of the forward (`step_inputs`; a custom module's `--input`s); `args`: positional
        ones (a custom module's `example_inputs`).
    loss: the training loss of the forward's output (`custom.output_loss`, or a custom file's `loss`).
    task: a `Task` value ('causal-lm', 'sequence-classification', 'question-answering', ...), 'contrastive' (CLIP)
        or 'custom'.
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
    traced_model: torch.nn.Module | None = None  # the same model with `layer_plan.traced` layers (with layer_plan)
    replication_note: str = ""  # why every layer is traced, when it is
    num_layers: int = 0  # layers in the model's checkpointable stack (0: none found)
    layer_stack_path: str = ""  # its qualified name, e.g. 'model.layers'
    args: tuple = ()
    loss: Callable[[Any], torch.Tensor] = output_loss
    precision: Precision = Precision.BF16_MIXED  # effective: --precision, else the checkpoint's dtype, else the default
    vlm: VlmLayout | None = None  # a vision-language model's images (tracer/vlm.py), else None
    held: dict[str, torch.Tensor] = field(default_factory=dict)  # alive through the step, not inputs of the model

    def input_summary(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """(name, dtype, shape) of each tensor input, positional ones named args[i]."""
        named = [*((f"args[{i}]", a) for i, a in enumerate(self.args)), *self.inputs.items()]
        return [(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in named if isinstance(t, torch.Tensor)]

    @property
    def images(self) -> int:
        """A vision-language model's images per sample (--images), else 0."""
        return self.vlm.images if self.vlm is not None else 0

    @property
    def image_size(self) -> list[int] | None:
        """[H, W] of each image: a vision-language model's after its processor's resize, else of `pixel_values`
        (B, C, H, W), or None."""
        if self.vlm is not None:
            return list(self.vlm.image_hw)
        pv = self.inputs.get("pixel_values")
        return list(pv.shape[-2:]) if isinstance(pv, torch.Tensor) else None


def weight_and_compute_dtype(precision: Precision) -> tuple[torch.dtype, torch.dtype | None]:
    """(weight dtype, autocast dtype or None) for a precision: the mixed ones keep fp32 weights, the autocast
    ones (bf16-autocast, fp16-autocast) keep the weights in the autocast dtype, as HF Trainer's bf16=True/fp16=True
    on a model loaded with `from_pretrained(dtype=...)` (accelerate/accelerator.py `autocast`)."""
    if precision is Precision.BF16_AUTOCAST:
        return torch.bfloat16, torch.bfloat16
    if precision is Precision.FP16_AUTOCAST:
        return torch.float16, torch.float16
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
            raise ModelLoadError(f"building the remote-code config of {resolved.ref} failed: {e}") from e
    if model_type not in CONFIG_MAPPING:
        raise ModelLoadError(
            f"unknown model_type {model_type!r} in {resolved.location}; transformers "
            f"{transformers.__version__} does not know it (upgrade transformers, or pass --trust-remote-code for custom code)")
    cfg.pop("model_type")
    try:
        return CONFIG_MAPPING[model_type].from_dict(cfg)
    except Exception as e:
        raise ModelLoadError(f"invalid {model_type} config in {resolved.location}: {e}") from e


# The Auto class whose `from_config` builds each head, as a user builds it.
TASK_AUTO_CLASS = {
    Task.CAUSAL_LM: "AutoModelForCausalLM",
    Task.MASKED_LM: "AutoModelForMaskedLM",
    Task.SEQ2SEQ_LM: "AutoModelForSeq2SeqLM",
    Task.SEQUENCE_CLASSIFICATION: "AutoModelForSequenceClassification",
    Task.TOKEN_CLASSIFICATION: "AutoModelForTokenClassification",
    Task.QUESTION_ANSWERING: "AutoModelForQuestionAnswering",
    Task.MULTIPLE_CHOICE: "AutoModelForMultipleChoice",
    Task.IMAGE_CLASSIFICATION: "AutoModelForImageClassification",
    Task.CTC: "AutoModelForCTC",
    Task.FEATURE_EXTRACTION: "AutoModel",
}
# A second Auto class for a task whose first does not map the config: a speech seq2seq LM (Whisper) is a seq2seq LM
# whose encoder reads audio.
_TASK_AUTO_FALLBACK = {Task.SEQ2SEQ_LM: "AutoModelForSpeechSeq2Seq"}
# Each Auto class's public table, model_type -> class name (transformers/models/auto/modeling_auto.py, the
# `MODEL_FOR_*_MAPPING_NAMES` each Auto class's mapping is built from).
_AUTO_NAMES = {
    "AutoModel": "MODEL_MAPPING_NAMES", "AutoModelForCausalLM": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "AutoModelForMaskedLM": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "AutoModelForSeq2SeqLM": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "AutoModelForSpeechSeq2Seq": "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
    "AutoModelForSequenceClassification": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    "AutoModelForTokenClassification": "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
    "AutoModelForQuestionAnswering": "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES",
    "AutoModelForMultipleChoice": "MODEL_FOR_MULTIPLE_CHOICE_MAPPING_NAMES",
    "AutoModelForImageClassification": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    "AutoModelForCTC": "MODEL_FOR_CTC_MAPPING_NAMES",
}


def _auto_mapped(auto_name: str, config) -> str | tuple | None:
    """The class name (or names, for a model_type with several, e.g. DeiT's image classifiers) the Auto class
    `auto_name` builds for `config`'s model_type, or None when it does not map it."""
    from transformers.models.auto import modeling_auto

    return getattr(modeling_auto, _AUTO_NAMES[auto_name]).get(getattr(config, "model_type", None))


def _first_name(mapped: str | tuple) -> str:
    """The class an Auto class builds for a model_type mapped to several without `architectures`: the first
    (transformers/models/auto/auto_factory.py, `_get_model_class`)."""
    return mapped[0] if isinstance(mapped, (tuple, list)) else mapped


def _task_class(config, task: Task, trust_remote_code: bool):
    """(Auto class, name of the class it builds) for `--task`. Raises ModelLoadError when transformers has no
    such head for the config's model_type."""
    import transformers

    auto = getattr(transformers, TASK_AUTO_CLASS[task])
    for name in (TASK_AUTO_CLASS[task], _TASK_AUTO_FALLBACK.get(task)):
        mapped = _auto_mapped(name, config) if name else None
        if mapped is not None:
            return getattr(transformers, name), _first_name(mapped)
    if trust_remote_code and auto.__name__ in (getattr(config, "auto_map", None) or {}):
        return auto, f"{auto.__name__} (remote code)"
    raise ModelLoadError(f"model_type {config.model_type!r} has no {task.value} head in transformers "
                         f"{transformers.__version__} ({auto.__name__} does not map it); pick another --task")


def _model_class(config, trust_remote_code: bool, task: Task | None = None):
    """(class or Auto class to build, architecture name): `--task`'s head, else the first class of the config's
    `architectures` that transformers has, else the first of the speech-seq2seq (before causal LM: a Whisper
    config maps WhisperForCausalLM too, its decoder alone), causal-LM, seq2seq-LM, masked-LM, image-classification
    and CTC Auto classes that maps the config. Raises ModelLoadError."""
    import transformers

    if task is not None:
        return _task_class(config, task, trust_remote_code)
    for arch in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, arch, None)
        if cls is not None:
            return cls, arch
    for auto in ("AutoModelForSpeechSeq2Seq", "AutoModelForCausalLM", "AutoModelForSeq2SeqLM", "AutoModelForMaskedLM",
                 "AutoModelForImageClassification", "AutoModelForCTC"):
        if (mapped := _auto_mapped(auto, config)) is not None:
            return getattr(transformers, auto), _first_name(mapped)
    if trust_remote_code and getattr(config, "auto_map", None):
        return transformers.AutoModelForCausalLM, "AutoModelForCausalLM (remote code)"
    raise ModelLoadError(
        f"transformers has no speech-seq2seq, causal-LM, seq2seq-LM, masked-LM, image-classification or CTC head "
        f"for model_type {config.model_type!r}; set config.architectures to the class to build, or pass --task "
        f"feature-extraction for the base model")


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a peft wrapper (or `model` itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


# Head class name part -> task, checked before is_encoder_decoder (BartForSequenceClassification is a classifier).
_HEAD_TASKS = (("ForSequenceClassification", Task.SEQUENCE_CLASSIFICATION),
               ("ForTokenClassification", Task.TOKEN_CLASSIFICATION),
               ("ForQuestionAnswering", Task.QUESTION_ANSWERING), ("ForMultipleChoice", Task.MULTIPLE_CHOICE),
               ("ForImageClassification", Task.IMAGE_CLASSIFICATION), ("ForCTC", Task.CTC))


def _task(model: torch.nn.Module) -> str:
    """The task of a built model, from its class (as transformers names heads): a `Task` value or 'contrastive'.
    A base model (the class `AutoModel` maps its config to, e.g. Dinov2Model, the Hub's DINOv2 checkpoints) is
    'feature-extraction'; CLIPModel, also AutoModel's, is 'contrastive'."""
    import transformers

    model = unwrap(model)
    if isinstance(model, transformers.PreTrainedModel):
        name = type(model).__name__
        for part, task in _HEAD_TASKS:
            if part in name:
                return task.value
        if hasattr(model, "get_image_features") and hasattr(model, "get_text_features"):
            return "contrastive"
        if _auto_mapped("AutoModel", model.config) == name:
            return Task.FEATURE_EXTRACTION.value
        if getattr(model.config, "is_encoder_decoder", False):
            return Task.SEQ2SEQ_LM.value
        if "MaskedLM" in name or name.endswith("ForPreTraining"):
            return Task.MASKED_LM.value
    return Task.CAUSAL_LM.value


def count_params(model: torch.nn.Module) -> tuple[int, int]:
    """(all, trainable) parameter counts; tied weights count once, as `model.parameters()` yields them once. A
    bitsandbytes 4-bit weight counts the elements it quantized (`quant_state.shape`), not its packed bytes."""
    total = trainable = 0
    for p in model.parameters():
        state = getattr(p, "quant_state", None)
        n = math.prod(state.shape) if state is not None else p.numel()
        total += n
        trainable += n if p.requires_grad else 0
    return total, trainable


def _build(cls, config, kwargs, arch: str, location: str, device: str = "meta") -> torch.nn.Module:
    """Build `cls` from `config`: under `torch.device('meta')`, or on the CPU and moved to `device`."""
    try:
        with torch.device("meta") if device == "meta" else contextlib.nullcontext(), \
                contextlib.redirect_stderr(io.StringIO()):
            build = cls.from_config if hasattr(cls, "from_config") else cls._from_config
            model = build(config, **kwargs)
    except Exception as e:
        raise ModelLoadError(f"transformers could not build {arch} from {location}: {e}") from e
    return model if device in ("meta", "cpu") else model.to(device)


def _layer_signature(layer: torch.nn.Module) -> tuple:
    return (type(layer), tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in layer.named_parameters()),
            tuple((n, tuple(b.shape), b.dtype) for n, b in layer.named_buffers()),
            tuple((n, type(m).__name__, getattr(m, "training", None)) for n, m in layer.named_modules()))


def layer_config(config):
    """The config that holds the layer count: `config`, or a vision-language model's text config (transformers'
    `get_text_config()`) when it has no num_hidden_layers of its own (Qwen2-VL, Gemma-3 multimodal: `vlm_family`).
    Other composite configs (SigLIP, CLIP) are `config` itself: their text config's count is not the stack a
    vision head runs."""
    if hasattr(config, "num_hidden_layers") or vlm_family(config) is None:
        return config
    return config.get_text_config()


def layer_plan(model: torch.nn.Module, config, head: int = 1) -> tuple[LayerPlan | None, dict[str, Any], str]:
    """(plan, config overrides for the shallow model, note) for tracing `head` + 3 of the model's layers
    (`LayerPlan.head`: how many leading layers are kept as traced; head 1 traces `TRACED_LAYERS`).

    The plan needs `config.num_hidden_layers` = L > head + 3, exactly one `nn.ModuleList` of L layers, the
    layers alike (class, parameter and buffer shapes, submodules), and no per-layer config list whose entries
    differ (e.g. `layer_types` alternating sliding and full attention). Otherwise the plan is None and `note`
    says why. A config without its own num_hidden_layers (a vision-language model's) is read, and overridden,
    through its text config (`layer_config`).
    """
    config = layer_config(config)
    L = getattr(config, "num_hidden_layers", None)
    traced = head + 3
    if not isinstance(L, int):  # a composite config (SigLIP, CLIP) keeps its layer counts in its sub-configs
        return None, {}, "every layer traced (the config has no num_hidden_layers)"
    if L <= traced:
        return None, {}, f"{L} layers: every layer traced"
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m) == L]
    if len(lists) != 1:
        return None, {}, f"{len(lists)} stacks of {L} layers: every layer traced"
    prefix, layers = lists[0]
    first = _layer_signature(layers[0])
    if any(_layer_signature(m) != first for m in layers):
        return None, {}, "the layers differ: every layer traced"
    overrides: dict[str, Any] = {"num_hidden_layers": traced}
    for key, value in config.to_dict().items():
        if isinstance(value, (list, tuple)) and len(value) == L and key != "architectures":
            if any(v != value[0] for v in value):
                return None, {}, f"config.{key} differs between layers: every layer traced"
            overrides[key] = list(value[:traced])
    return LayerPlan(prefix, L, head), overrides, ""


def _image_size(spec: RunSpec, config) -> tuple[int, int]:
    if spec.image_size is not None:
        return spec.image_size, spec.image_size
    size = getattr(config, "image_size", None) or 224  # ResNet and ConvNeXt configs name none: ImageNet's 224
    return (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))


def step_inputs(spec: RunSpec, config, task: str, device: str, float_dtype: torch.dtype) -> dict[str, Any]:
    """Keyword inputs of one step of a transformers model of `task`, on `device` (empty on meta; random,
    seeded, in range on a real device):

    - LMs: `input_ids` int64 (B, S) in [0, vocab_size), plus `labels` = input_ids to train (seq2seq inference:
      `decoder_input_ids` = input_ids);
    - the other text heads read `input_ids` (B, S) and, to train: sequence-classification `labels` (B,)
      (`sequence_labels`), token-classification `labels` int64 (B, S) in [0, num_labels), question-answering
      `start_positions` and `end_positions` int64 (B,) in [0, S);
    - multiple-choice: `input_ids` (B, C, S) (C: --choices, else DEFAULT_CHOICES), plus `labels` int64 (B,) in
      [0, C) to train;
    - image-classification: `pixel_values` (B, C, H, W) in `float_dtype` (C: config.num_channels, H = W:
      --image-size or config.image_size), plus `labels` int64 (B,) in [0, num_labels) to train;
    - contrastive (CLIP): `input_ids` (B, S) and `pixel_values`, plus `return_loss=True` to train;
    - --mode generate: the prompt `input_ids` (B, S) and its `attention_mask` int64 (B, S) of ones, as a tokenizer
      returns them for unpadded prompts (`model.generate(**inputs)`); for a seq2seq LM the prompt is the encoder's
      input, the decoder starts from `decoder_start_token_id`.
    Raises UsageError when --seq is needed and missing, or --mode generate is asked of a head that cannot generate.
    """
    train = spec.mode is Mode.TRAIN
    real = device != "meta"

    def ints(shape, high, pad=None):  # no padding tokens: the trace assumes none
        return _ints(shape, high, device, pad)

    inputs: dict[str, Any] = {}
    if task in ("image-classification", "contrastive"):
        vision = getattr(config, "vision_config", config)
        h, w = _image_size(spec, vision)
        shape = (spec.batch, getattr(vision, "num_channels", 3), h, w)
        inputs["pixel_values"] = (torch.randn(shape, dtype=float_dtype, device=device) if real
                                  else torch.empty(shape, dtype=float_dtype, device="meta"))
        if task == "image-classification":
            if train:
                inputs["labels"] = ints((spec.batch,), config.num_labels)
            return inputs
    if spec.seq is None:
        raise UsageError("--seq is required for this model, e.g. --seq 2048")
    text = getattr(config, "text_config", config)
    B, S, pad = spec.batch, spec.seq, getattr(text, "pad_token_id", None)
    if task == Task.MULTIPLE_CHOICE.value:
        C = spec.choices or DEFAULT_CHOICES
        inputs["input_ids"] = ints((B, C, S), text.vocab_size, pad)  # (B, C, S)
        if train:
            inputs["labels"] = ints((B,), C)  # (B,): the right choice
        return inputs
    inputs["input_ids"] = ids = ints((B, S), text.vocab_size, pad)  # (B, S)
    if spec.mode is Mode.GENERATE:
        if task not in (Task.CAUSAL_LM.value, Task.SEQ2SEQ_LM.value):
            raise UsageError(f"--mode generate needs a causal or seq2seq LM head (--task causal-lm or seq2seq-lm); "
                             f"this model is built as {task}")
        if task == Task.SEQ2SEQ_LM.value and spec.kv_dtype is not KvDtype.AUTO:
            raise UsageError(f"--kv-dtype {spec.kv_dtype.value}: transformers' QuantizedCache has no encoder-decoder "
                             "form; drop --kv-dtype")
        inputs["attention_mask"] = (torch.ones((B, S), dtype=torch.int64, device=device) if real
                                    else torch.empty((B, S), dtype=torch.int64, device="meta"))
        return inputs
    if spec.serve_requests is not None:
        if task != Task.CAUSAL_LM.value:
            raise UsageError(f"vramtrace serve needs a causal LM head; this model is built as {task}")
        inputs["logits_to_keep"] = serve_logits_indices(S, spec.serve_requests, device)  # (R,)
        return inputs
    if task == "contrastive":
        if train:
            inputs["return_loss"] = True
    elif not train:
        if task == Task.SEQ2SEQ_LM.value:
            inputs["decoder_input_ids"] = ids  # inference: the decoder reads S tokens too
    elif task == Task.SEQUENCE_CLASSIFICATION.value:
        inputs["labels"] = sequence_labels(config, B, device, float_dtype)
    elif task == Task.TOKEN_CLASSIFICATION.value:
        inputs["labels"] = ints((B, S), config.num_labels)  # (B, S): one class per token
    elif task == Task.QUESTION_ANSWERING.value:
        inputs["start_positions"] = ints((B,), S)  # (B,): the answer span's first and last token
        inputs["end_positions"] = ints((B,), S)
    else:  # causal, masked and seq2seq LM
        inputs["labels"] = ids
    return inputs


# -- audio and base-model (feature-extraction) inputs: chosen by the model's `main_input_name` ------------------
def main_input_name(model: torch.nn.Module) -> str:
    """The forward argument the model reads its data from (transformers' `PreTrainedModel.main_input_name`):
    'input_ids', 'pixel_values', 'input_features' (Whisper), 'input_values' (wav2vec2)."""
    return getattr(unwrap(model), "main_input_name", "input_ids")


def feature_loss(output) -> torch.Tensor:
    """The training loss of `--task feature-extraction` (a base model, no head): the mean of
    `output.last_hidden_state` (for an encoder-decoder base model, the decoder's), a 0-d tensor."""
    return output.last_hidden_state.mean()


def _floats(shape, dtype: torch.dtype, device: str) -> torch.Tensor:
    if device == "meta":
        return torch.empty(shape, dtype=dtype, device="meta")
    return torch.randn(shape, dtype=dtype, device=device)


def _ints(shape, high: int, device: str, pad=None) -> torch.Tensor:
    """int64 `shape` in [0, high), no `pad` token; empty on meta."""
    if device == "meta":
        return torch.empty(shape, dtype=torch.int64, device="meta")
    ids = torch.randint(0, high, shape, dtype=torch.int64, device=device)
    if pad is not None and 0 <= pad < high and high > 1:
        ids[ids == pad] = (pad + 1) % high
    return ids


def whisper_frames(config) -> int:
    """The mel frames a Whisper-style encoder requires: `max_source_positions` × its two convolutions' strides
    (1 and 2), 3,000 for 30 s (transformers/models/whisper/modeling_whisper.py `WhisperEncoder.forward`:
    `expected_seq_length = max_source_positions * conv1.stride[0] * conv2.stride[0]`; WhisperFeatureExtractor pads
    every clip to `chunk_length` 30 s = 3,000 frames of `hop_length` 160 at 16 kHz)."""
    return 2 * config.max_source_positions


def whisper_prompt_tokens(config) -> int:
    """The decoder prompt Whisper's generate() builds from a config (transformers/models/whisper/
    generation_whisper.py `WhisperGenerationMixin._retrieve_init_tokens`, with the generation config transformers
    derives from the config, which names no language, task or timestamp tokens): `decoder_start_token_id`, then
    the config's `forced_decoder_ids` [[1, id], [2, id], ...] when they start at position 1, their None ids left
    out. Raises UsageError for forced_decoder_ids that generate() rejects (positions not 1, 2, 3, ...)."""
    forced = list(getattr(config, "forced_decoder_ids", None) or [])
    if not forced or forced[0][0] != 1:  # generate() ignores forced ids that do not start at position 1
        return 1
    if [position for position, _ in forced] != list(range(1, len(forced) + 1)):
        raise UsageError(f"the config's forced_decoder_ids {forced} do not follow Whisper's prompt pattern (positions "
                         "1, 2, 3, ...), which generate() rejects; fix them in the config")
    return 1 + sum(token is not None for _, token in forced)


def _whisper_generate_check(spec: RunSpec, config) -> None:
    """Raise UsageError unless --seq is the decoder prompt Whisper's generate() builds (`whisper_prompt_tokens`)
    and the prompt plus --new-tokens fit the decoder's `max_target_positions` (generation_whisper.py
    `_set_max_new_tokens_and_length` raises otherwise)."""
    prompt = whisper_prompt_tokens(config)
    if spec.seq != prompt:
        raise UsageError(f"--seq of a Whisper generation is the decoder prompt its generate() builds from the config "
                         f"(decoder_start_token_id and the forced_decoder_ids): {prompt} token(s); pass --seq {prompt}")
    if prompt + spec.new_tokens > config.max_target_positions:
        raise UsageError(f"--new-tokens {spec.new_tokens} after a decoder prompt of {prompt} exceeds the decoder's "
                         f"max_target_positions ({config.max_target_positions}); use --new-tokens "
                         f"{config.max_target_positions - prompt} or fewer")


def encoder_frames(config, samples: int) -> int:
    """Frames a wav2vec2-style feature encoder makes of `samples` audio samples: each convolution maps n to
    (n - kernel) // stride + 1 (transformers/models/wav2vec2/modeling_wav2vec2.py
    `Wav2Vec2PreTrainedModel._get_feat_extract_output_lengths`)."""
    n = samples
    for kernel, stride in zip(config.conv_kernel, config.conv_stride):
        n = (n - kernel) // stride + 1
    return n


def media_inputs(spec: RunSpec, config, task: str, main_input: str, device: str,
                 float_dtype: torch.dtype) -> dict[str, Any] | None:
    """Keyword inputs of one step of an audio model (`main_input` 'input_features' or 'input_values') or of a
    base model without a head (`task` 'feature-extraction'), random on a real device, empty on meta; None for
    the others (`step_inputs` builds theirs).

    - input_features (Whisper): float (B, num_mel_bins, `whisper_frames`), as WhisperFeatureExtractor pads a clip;
      the decoder reads --seq tokens: `labels` int64 (B, S) to train (the model shifts them right into
      decoder_input_ids), `decoder_input_ids` (B, S) for inference and feature extraction; --mode generate passes
      input_features alone (Whisper's generate builds the decoder prompt of `whisper_prompt_tokens`, which --seq
      must equal; the token values it reads are answered by bridges.GENERATION_QUESTIONS);
    - input_values (wav2vec2): float (B, S), S = --seq audio samples; sequence classification trains with
      `sequence_labels`; CTC training is refused (no meta kernel for ctc_loss);
    - feature extraction of a pixel_values model: (B, C, H, W) as image classification; of an input_ids model:
      input_ids (B, S) (+ decoder_input_ids (B, S) for an encoder-decoder); no labels: the loss is `feature_loss`.
    Raises UsageError (no --seq where one is needed; a task these inputs have no labels for; --mode generate of a
    model that does not generate, or of Whisper with --seq other than its decoder prompt; audio shorter than the
    feature encoder's receptive field), TraceError / UnsupportedOpError (what cannot be traced yet: SpecAugment,
    CTC training)."""
    audio = main_input in ("input_features", "input_values")
    if not audio and task != Task.FEATURE_EXTRACTION.value:
        return None
    if spec.mode is Mode.GENERATE and (main_input != "input_features" or task != Task.SEQ2SEQ_LM.value):
        raise UsageError(f"--mode generate needs a causal or seq2seq LM head; this model is built as {task}")
    B, train = spec.batch, spec.mode is Mode.TRAIN
    if main_input == "pixel_values":
        h, w = _image_size(spec, config)
        return {"pixel_values": _floats((B, getattr(config, "num_channels", 3), h, w), float_dtype, device)}
    if spec.seq is None and spec.mode is not Mode.GENERATE:
        raise UsageError("--seq is required for this model: the decoder's tokens (Whisper), the audio samples "
                         "(wav2vec2) or the tokens (text), e.g. --seq 64")
    if main_input == "input_values":
        return _wav2vec2_inputs(spec, config, task, device, float_dtype)
    inputs: dict[str, Any] = {}
    if main_input == "input_features":
        if not hasattr(config, "max_source_positions") or not hasattr(config, "num_mel_bins"):
            raise UsageError(f"{config.model_type}: only Whisper-style input_features (num_mel_bins, "
                             "max_source_positions) are built")
        if spec.mode is Mode.GENERATE:
            _whisper_generate_check(spec, config)
        inputs["input_features"] = _floats((B, config.num_mel_bins, whisper_frames(config)), float_dtype, device)
        if spec.mode is Mode.GENERATE:  # generate(input_features, ...): Whisper builds the decoder prompt itself
            return inputs
    ids = _ints((B, spec.seq), config.vocab_size, device, getattr(config, "pad_token_id", None))  # (B, S)
    if main_input == "input_ids":
        inputs["input_ids"] = ids
    if task == Task.SEQ2SEQ_LM.value and train:
        inputs["labels"] = ids
    elif task in (Task.SEQ2SEQ_LM.value, Task.FEATURE_EXTRACTION.value):
        if getattr(config, "is_encoder_decoder", False):
            inputs["decoder_input_ids"] = ids
    else:
        raise UsageError(f"input_features models are built as speech seq2seq LMs or base models "
                         f"(--task seq2seq-lm or feature-extraction), not {task}")
    return inputs


def _wav2vec2_inputs(spec: RunSpec, config, task: str, device: str, float_dtype: torch.dtype) -> dict[str, Any]:
    """`media_inputs` of an input_values model: input_values (B, S) and the task's labels."""
    B, S = spec.batch, spec.seq
    frames = encoder_frames(config, S) if hasattr(config, "conv_kernel") else S
    if frames < 1:
        raise UsageError(f"--seq {S} audio samples is shorter than the feature encoder's receptive field; use "
                         "--seq 16000 (1 s at 16 kHz) or more")
    inputs: dict[str, Any] = {"input_values": _floats((B, S), float_dtype, device)}
    if spec.mode is not Mode.TRAIN:
        return inputs
    if task == Task.CTC.value:
        raise UnsupportedOpError("CTC training cannot be traced yet: torch has no meta kernel for ctc_loss (its "
                                 "buffers depend on the label lengths) and transformers' CTC loss masks the labels "
                                 "(masked_select); trace --mode inference, or --task feature-extraction to train "
                                 "the encoder")
    if getattr(config, "apply_spec_augment", False) and (getattr(config, "mask_time_prob", 0) > 0
                                                          or getattr(config, "mask_feature_prob", 0) > 0):
        # modeling_wav2vec2.py `_mask_hidden_states`: `hidden_states[mask_time_indices] = masked_spec_embed`
        raise TraceError("SpecAugment (the config's apply_spec_augment with mask_time_prob or mask_feature_prob "
                         "> 0) masks frames drawn by numpy at random in training, which a meta trace cannot "
                         "follow; set apply_spec_augment to false in the config to trace training without it")
    if task == Task.FEATURE_EXTRACTION.value:
        return inputs
    if task == Task.SEQUENCE_CLASSIFICATION.value:
        inputs["labels"] = sequence_labels(config, B, device, float_dtype)
    else:
        raise UsageError(f"input_values models are built as CTC, sequence-classification or base models "
                         f"(--task ctc, sequence-classification or feature-extraction), not {task}")
    return inputs


# LayerDrop probabilities (transformers' wav2vec2-family `layerdrop`, Whisper's and BART's `encoder_layerdrop` and
# `decoder_layerdrop`): in training each layer is skipped when `torch.rand([]) < p`.
LAYERDROP_FIELDS = ("layerdrop", "encoder_layerdrop", "decoder_layerdrop")


def every_layer_runs(config, mode: Mode) -> None:
    """In training (`mode`), set the config's LayerDrop probabilities (`LAYERDROP_FIELDS`) to 0, in place: a
    training step that skips layers at random (modeling_wav2vec2.py `Wav2Vec2Encoder.forward`: `skip_the_layer =
    self.training and dropout_probability < self.config.layerdrop`) is traced as the step that runs every layer,
    the one with the most activations: the prediction is that worst case, the same each run, not one draw."""
    if mode is not Mode.TRAIN:
        return
    for field in LAYERDROP_FIELDS:
        if isinstance(getattr(config, field, None), (int, float)) and getattr(config, field) > 0:
            setattr(config, field, 0.0)


def serve_logits_indices(tokens: int, requests: int, device: str) -> torch.Tensor:
    """The positions of each request's last token when `tokens` are packed as `requests` requests, the first
    requests one token shorter when they do not divide (vLLM 0.33 `vllm/v1/worker/gpu/model_runner.py`
    `GPUModelRunner._dummy_run`: `num_tokens // num_reqs + (i >= num_reqs - num_tokens % num_reqs)`): int64 (R,),
    empty on meta. The model computes logits at these positions only (transformers' `logits_to_keep`)."""
    if device == "meta":
        return torch.empty((requests,), dtype=torch.int64, device="meta")
    sizes = [tokens // requests + (i >= requests - tokens % requests) for i in range(requests)]
    return torch.tensor(sizes, dtype=torch.int64, device=device).cumsum(0) - 1


@contextlib.contextmanager
def quiet_transformers_logs():
    """transformers' logger at ERROR until exit (its warnings about deprecated names or `use_cache` under
    checkpointing are noise in a trace), then at the level it had: the caller's logging is left as it was."""
    logger = logging.getLogger("transformers")  # transformers.utils.logging's library root logger
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def seeded(device: str):
    """Seed 0 for a real build on `device` ('cpu', 'cuda', 'cuda:N'; nothing for 'meta'), inside
    `torch.random.fork_rng`: the caller's CPU (and CUDA) RNG state is restored on exit."""
    if device == "meta":
        yield
        return
    cuda = range(torch.cuda.device_count()) if device.startswith("cuda") else []
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(0)
        yield


def sequence_labels(config, batch: int, device: str, float_dtype: torch.dtype) -> torch.Tensor:
    """`labels` of a sequence-classification head, as its loss reads them (transformers/loss/loss_utils.py,
    `ForSequenceClassificationLoss`): single-label classification (problem_type unset and num_labels > 1):
    int64 (B,) in [0, num_labels); regression (num_labels == 1 or problem_type 'regression'): `float_dtype`
    (B,) for one label, (B, num_labels) for more; 'multi_label_classification': `float_dtype` (B, num_labels)
    of 0 and 1. Random on a real device, empty on meta."""
    n, problem = config.num_labels, getattr(config, "problem_type", None)
    real = device != "meta"
    if problem == "regression" or (problem is None and n == 1):
        shape = (batch,) if n == 1 else (batch, n)
        return torch.randn(shape, dtype=float_dtype, device=device) if real else torch.empty(shape, dtype=float_dtype, device="meta")
    if problem == "multi_label_classification":
        if not real:
            return torch.empty((batch, n), dtype=float_dtype, device="meta")
        return torch.randint(0, 2, (batch, n), device=device).to(float_dtype)
    if not real:
        return torch.empty((batch,), dtype=torch.int64, device="meta")
    return torch.randint(0, n, (batch,), dtype=torch.int64, device=device)


def load_model(spec: RunSpec, resolved: ResolvedConfig, device: str = "meta") -> LoadedModel:
    """Build the model of `resolved` for `spec` on `device`: on the meta device (no weights, no memory) plus
    its 4-layer copy for tracing when the layers repeat (`layer_plan`); on 'cpu' or 'cuda' for real, with
    random weights and inputs (seed 0, the caller's RNG state untouched), as `vramtrace validate` runs it.
    Freezing and LoRA (`adapters.apply_adapters`) are applied before the plan. `spec.precision`: the run's, as
    `search.resolve_precision` resolved it into the spec (a TraceSession, validate, serve); a spec whose precision
    is not resolved (None or `stored`: a test or `fx_export` building from a bare RunSpec) gets
    `checkpoint_headers.precision_for`'s here. Raises ModelLoadError, UsageError."""
    from .flash_attn import standin_context

    with quiet_transformers_logs(), seeded(device), standin_context(spec, device):
        return _load_model(spec, resolved, device)


def _load_model(spec: RunSpec, resolved: ResolvedConfig, device: str) -> LoadedModel:
    from .adapters import apply_adapters

    precision = spec.precision
    if precision is None or precision is Precision.STORED:  # not resolved by search.resolve_precision
        precision = precision_for(spec, resolved)[0]
    param_dtype, compute_dtype = weight_and_compute_dtype(precision)
    if resolved.source == "custom":
        from .custom import build_custom

        built = build_custom(spec, device, param_dtype if param_dtype is not torch.float32 else None)
        model = apply_adapters(spec, built.model, device)
        model.train(spec.mode is Mode.TRAIN)
        total, trainable = count_params(model)
        stack = layer_stack(model)
        return LoadedModel(
            model=model, inputs=built.kwargs, args=built.args, loss=built.loss, task="custom", precision=precision,
            architecture=type(built.model).__name__, model_type="custom", params=total, trainable_params=trainable,
            param_dtype=param_dtype, compute_dtype=compute_dtype, attn_implementation="custom",
            replication_note="custom module: every layer traced", num_layers=len(stack) if stack is not None else 0,
            layer_stack_path=_path_of(model, stack), held=built.held)
    config = build_config(resolved, spec.trust_remote_code)
    if spec.use_cache is not None:  # a VLM's use_cache is its text config's, the one its language model reads
        if not hasattr(text_config := config.get_text_config(), "use_cache"):
            raise UsageError(f"--use-cache: {config.model_type} models have no KV cache (their config has no use_cache)")
        text_config.use_cache = spec.use_cache  # what `config.use_cache = False` before from_config does
    every_layer_runs(config, spec.mode)
    cls, arch = _model_class(config, spec.trust_remote_code, spec.task)
    kwargs: dict[str, Any] = {"dtype": param_dtype, **({"trust_remote_code": True} if spec.trust_remote_code else {})}
    attn = spec.attn_implementation.value if spec.attn_implementation is not None else None
    check_attn_implementation(attn or getattr(config, "_attn_implementation", None), spec, device)
    if attn is not None:
        kwargs["attn_implementation"] = attn  # what `from_config(config, attn_implementation=...)` selects
    model = apply_adapters(spec, _quantized(spec, _build(cls, config, kwargs, arch, resolved.location, device),
                                            param_dtype), device, param_dtype)
    model.train(spec.mode is Mode.TRAIN)
    plan, traced_model, note = None, None, "layer replication off: every layer traced"
    ckpt = spec.checkpointing
    if device != "meta":
        note = "built for real"
    elif spec.replicate_layers and ckpt.kind in (CheckpointingKind.EVERY, CheckpointingKind.NTH) and ckpt.k > 1:
        note = f"checkpointing {ckpt} differs between layers: every layer traced"
    elif spec.replicate_layers and ckpt.kind is CheckpointingKind.MODULES:
        note = f"checkpointing {ckpt} may differ between layers: every layer traced"
    elif spec.replicate_layers:
        # a compiled step keeps two leading layers (replication.py): Inductor's first layer reuses no buffers
        plan, overrides, note = layer_plan(model, config, head=2 if spec.compile else 1)
    if plan is not None:
        shallow = copy.deepcopy(config)
        for key, value in overrides.items():
            setattr(layer_config(shallow), key, value)
        traced_model = apply_adapters(spec, _quantized(spec, _build(cls, shallow, kwargs, arch, resolved.location,
                                                                    device), param_dtype), device, param_dtype)
        traced_model.train(spec.mode is Mode.TRAIN)
        stack = dict(traced_model.named_modules()).get(plan.prefix)
        if not isinstance(stack, torch.nn.ModuleList) or len(stack) != plan.traced:
            plan, traced_model, note = None, None, (f"the {plan.traced}-layer copy has no matching layer stack: "
                                                    "every layer traced")
    task = _task(model)
    if task == Task.QUESTION_ANSWERING.value and getattr(config, "num_labels", 2) != 2:
        raise ModelLoadError(f"{arch} splits its logits into start and end (transformers' qa_outputs): it needs "
                             f"num_labels 2, the config has {config.num_labels}")
    if spec.choices is not None and task != Task.MULTIPLE_CHOICE.value:
        raise UsageError(f"--choices applies to multiple-choice heads; {arch} is a {task} model")
    max_pos = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if (max_pos and spec.seq and spec.seq > max_pos
            and config.model_type in ("gpt2", "bert", "roberta", "opt", "bart", "xlm-roberta", "deberta-v2")):
        raise ModelLoadError(f"--seq {spec.seq} exceeds {arch}'s learned position embeddings ({max_pos}); "
                             f"use --seq <= {max_pos}")
    vlm, inputs, loss = _inputs_and_loss(spec, config, task, arch, model, device, param_dtype)
    total, trainable = count_params(model)
    stack = layer_stack(model)
    return LoadedModel(
        model=model, inputs=inputs, task=task, loss=loss, architecture=type(unwrap(model)).__name__,
        model_type=config.model_type, params=total, trainable_params=trainable, param_dtype=param_dtype,
        compute_dtype=compute_dtype, precision=precision,
        attn_implementation=str(getattr(unwrap(model).config, "_attn_implementation", None) or "eager"),
        layer_plan=plan, traced_model=traced_model, replication_note=note,
        num_layers=len(stack) if stack is not None else 0, layer_stack_path=_path_of(model, stack), vlm=vlm)


def _model_inputs(spec: RunSpec, config, task: str, arch: str, device: str, float_dtype: torch.dtype
                  ) -> tuple[VlmLayout | None, dict[str, Any]]:
    """(the images' layout or None, the step's inputs): a vision-language model's (`vlm.vlm_inputs`), else
    `step_inputs`. Raises UsageError (--images given to a model vramtrace feeds no images)."""
    family = vlm_family(config)
    if spec.images is not None and (family is None or task != Task.CAUSAL_LM.value):
        raise UsageError(f"--images applies to vision-language models (Qwen2-VL, Qwen2.5-VL, Gemma-3); {arch} is not "
                         "one vramtrace feeds images to")
    if family is None or task != Task.CAUSAL_LM.value:
        return None, step_inputs(spec, config, task, device, float_dtype)
    layout = vlm_layout(spec, config, family)
    return layout, vlm_inputs(spec, config, layout, device, float_dtype)


def _inputs_and_loss(spec: RunSpec, config, task: str, arch: str, model: torch.nn.Module, device: str,
                     float_dtype: torch.dtype) -> tuple[VlmLayout | None, dict[str, Any], Callable[[Any], torch.Tensor]]:
    """(the images' layout or None, the step's keyword inputs, its training loss): `media_inputs` (audio, feature
    extraction), else `_model_inputs` (a vision-language model's or `step_inputs`); `feature_loss` for feature
    extraction, else `output_loss`. Raises UsageError (--images given to a model vramtrace feeds no images)."""
    loss = feature_loss if task == Task.FEATURE_EXTRACTION.value else output_loss
    inputs = media_inputs(spec, config, task, main_input_name(model), device, float_dtype)
    if inputs is not None and spec.images is None:
        return None, inputs, loss
    vlm, inputs = _model_inputs(spec, config, task, arch, device, float_dtype)
    if spec.packing:
        from .packing import check_packable, packed_inputs

        check_packable(spec, model, task, vlm is not None)
        inputs = packed_inputs(spec, inputs, device)
    return vlm, inputs, loss


def _quantized(spec: RunSpec, model: torch.nn.Module, weight_dtype: torch.dtype) -> torch.nn.Module:
    """`model` with `spec.quantization`'s bitsandbytes weights (`quantization.quantize`), or as it is."""
    if spec.quantization is not None:
        from .quantization import quantize

        quantize(model, spec, weight_dtype)
    return model


def _path_of(model: torch.nn.Module, sub: torch.nn.Module | None) -> str:
    return next((n for n, m in model.named_modules() if m is sub), "") if sub is not None else ""
