"""Ground truth for the CPU tests: the real step, written from public APIs only.

This module imports nothing from vramtrace (a test asserts it), so a bug in vramtrace's model building,
inputs, optimizer or checkpointing cannot hide behind itself. It reads a case description (a `RunSpec` is
passed in, but only its plain fields are read: model reference, batch, seq, mode, precision, optimizer,
checkpointing, inputs, freeze, LoRA, quantization, image size, multiple-choice count) and builds everything itself:

- transformers models: `AutoConfig` and the class its `architectures` names (`getattr(transformers, arch)`),
  built with `from_config`, random weights (seed 0); inputs drawn here per head;
- custom modules (`path.py:NAME`): the file imported with importlib, `NAME()` called;
- a quantized case (`quantization` nf4|fp4|int8): the model saved, then loaded back with `from_pretrained(dir,
  quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=..., bnb_4bit_use_double_quant=...,
  bnb_4bit_compute_dtype=...) or BitsAndBytesConfig(load_in_8bit=True), device_map="cpu")`; with LoRA,
  `peft.prepare_model_for_kbit_training(model)` (its default: reentrant checkpointing, the case's "layers:reentrant")
  or `prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)` and the case's checkpointing, before
  `get_peft_model` (QLoRA); the quantization constants (bitsandbytes' public `Params4bit.quant_state`, an int8
  weight's `SCB`, which `Linear8bitLt.state` holds after the first forward) count as alive before the warm-up;
- the optimizer: a plain `torch.optim.AdamW(params)` (or the case's Adam/SGD, for-loop or foreach), or
  bitsandbytes' `bnb.optim.AdamW|Lion|AdEMAMix(optim_bits=8|32, is_paged=...)` / `bnb.optim.RMSprop(optim_bits=...)`
  as HF Trainer builds them from the name, or `bnb.optim.Adam8bit` for adam-8bit;
- a packing case (`packing`, sdpa/eager): use_cache False in the config, and `position_ids` (batch, seq) whose rows
  hold two sequences (seq - seq // 2 and seq // 2 tokens, positions restarting at 0), no attention_mask: transformers
  builds the block-diagonal mask from them;
- a generation case (mode generate): `model.generate(input_ids, attention_mask=ones, max_new_tokens=N,
  min_new_tokens=N, do_sample=False, cache_implementation='static' or None, or 'quantized' with
  cache_config={'backend': 'fp8'})`, transformers' documented call;
- the literal loop of the case (`loop` trainer | function | script, `grad_accum`, `clip_grad_norm`, `zero_grad`,
  fp16-mixed with `torch.amp.GradScaler("cpu")`; see `RealStep`), or the case's `--step` file's function called
  as FUNC(model, batch, optimizer); one warm-up step then the measured one;
- a compiled case (`compile`): `torch._dynamo.reset()`, then `model = torch.compile(model, mode=compile_mode)`
  (Inductor; the case's mode, default when it has none) after checkpointing, as HF Trainer's `torch_compile=True`
  does; one step runs before the profiler starts (it compiles; the optimizer state it creates is counted as alive
  at start);
- the measurement: the bytes of every unique storage alive before the warm-up (parameters, buffers, inputs)
  plus the running sum of torch.profiler's `[memory]` allocator events (`profile_memory=True`) from the warm-up's
  start, maximised over the measured step;
- a distributed case (`fsdp` or `ddp` = N ranks; `measure_cpu_peak_ranks`): N CPU processes over gloo (forked
  from a fork server), each building the same case (seed 0, same inputs, `batch` per rank) and wrapping the model
  before making the optimizer: FSDP2 as torchtitan applies it (`fully_shard` on each decoder layer then the root,
  `reshard_after_forward`, a `MixedPrecisionPolicy(param_dtype, reduce_dtype=fp32)` instead of autocast for
  bf16/fp16-mixed) or `DistributedDataParallel(model)` with its defaults; each rank measured as one process is.
  Tensor parallelism (`tp`): transformers' own, the case's model saved and loaded back with
  `from_pretrained(dir, distributed_config=DistributedConfig(tp_size=N))`; with `fsdp_plan` 'transformers',
  `DistributedConfig(fsdp_size=M, tp_size=N)`: transformers' own FSDP plan, with TP when N > 1.
  FSDP's all-gather and reduce-scatter are gloo's own (their CPU temporaries counted), called so that their
  buffers are freed on the rank's main thread (see `_GlooAllGather`). A free that a gloo worker thread makes
  anyway (transformers' TP collectives) has no profiler event; a rank's measurement is kept only when clean (no
  bytes lost: `_measure_clean`), else the steps run again.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import gc
import importlib
import importlib.util
import itertools
import json
import os
import re
import sys
import warnings
import weakref
from pathlib import Path

import torch
import transformers

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MIXED = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}
# weights loaded in the low dtype (`dtype=`), the step under torch.autocast in it: HF Trainer with bf16=True/fp16=True
# on a model loaded in that dtype (accelerate's `autocast`)
AUTOCAST = {"bf16-autocast": torch.bfloat16, "fp16-autocast": torch.float16}
VLM_TYPES = ("qwen2_vl", "qwen2_5_vl", "gemma3")  # vision-language models fed images (`vlm_batch`)
INPUT_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
                "float16": torch.float16, "int64": torch.int64, "long": torch.int64, "int32": torch.int32,
                "bool": torch.bool}


def _v(x):
    """An enum's value, or the thing itself."""
    return getattr(x, "value", x)


# -- the model ----------------------------------------------------------------------------------------------
def hf_config(ref: str):
    """The transformers config of a config.json path or a local directory."""
    path = Path(ref)
    if path.is_dir():
        return transformers.AutoConfig.from_pretrained(str(path))
    cfg = json.loads(path.read_text())
    return transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)


AUTO_CLASSES = ("AutoModelForCausalLM", "AutoModelForMaskedLM", "AutoModelForSeq2SeqLM", "AutoModelForImageClassification",
                "AutoModelForSequenceClassification", "AutoModelForTokenClassification",
                "AutoModelForQuestionAnswering", "AutoModelForMultipleChoice", "AutoModelForPreTraining",
                "AutoModelForSpeechSeq2Seq", "AutoModelForCTC", "AutoModelForAudioClassification",
                "AutoModelForImageTextToText", "AutoModel")


def hf_model(config, dtype: torch.dtype) -> torch.nn.Module:
    """`AutoModelFor<head>.from_config(config, dtype=dtype)` for the head `config.architectures[0]` names, with
    random weights (seed 0), as a user builds it."""
    arch = config.architectures[0]
    for name in AUTO_CLASSES:
        auto = getattr(transformers, name)
        if auto._model_mapping.get(type(config), type(None)).__name__ == arch:
            torch.manual_seed(0)
            return auto.from_config(config, dtype=dtype)
    raise ValueError(f"oracle: no Auto class builds {arch}")


def _quantized(model, spec, dtype: torch.dtype):
    """`model` saved and loaded back 4-bit or int8 by bitsandbytes, as `from_pretrained(..., quantization_config=...)`
    loads a checkpoint on the CPU."""
    import tempfile

    if _v(spec.quantization) == "int8":
        kw = {"load_in_8bit": True}
    else:
        kw = {"load_in_4bit": True, "bnb_4bit_quant_type": _v(spec.quantization),
              "bnb_4bit_use_double_quant": bool(getattr(spec, "double_quant", False))}
    if getattr(spec, "bnb_compute_dtype", None):
        kw["bnb_4bit_compute_dtype"] = DTYPES[spec.bnb_compute_dtype]
    with tempfile.TemporaryDirectory(prefix="oracle-bnb-") as directory:
        model.save_pretrained(directory)
        cls = type(model)
        del model
        return cls.from_pretrained(directory, quantization_config=transformers.BitsAndBytesConfig(**kw), dtype=dtype,
                                   device_map="cpu")


def _import_custom(ref: str):
    target, _, name = ref.rpartition(":")
    if target.endswith(".py"):
        spec = importlib.util.spec_from_file_location(f"oracle_custom_{abs(hash(target))}", target)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    return module, getattr(module, name)


def _input_tensor(text: str, batch: int, seq: int | None) -> tuple[str, torch.Tensor]:
    """`NAME=DTYPE[DIMS][:LO..HI]` (vramtrace's --input grammar, parsed here on its own) as a random tensor."""
    m = re.fullmatch(r"(\w+)=(\w+)\[([^\]]*)\](?::(-?\d+)\.\.(-?\d+))?", text.strip())
    name, dtype, dims, lo, hi = m.groups()
    shape = tuple(batch if d == "B" else seq if d == "S" else int(d) for d in (x.strip() for x in dims.split(",")))
    dt = INPUT_DTYPES[dtype]
    if dt.is_floating_point:
        return name, torch.randn(shape, dtype=dt)
    low, high = (int(lo), int(hi)) if lo is not None else (0, 2)
    return name, torch.randint(low, high, shape).to(dt)


def _as_tensor(x, batch: int, seq: int | None):
    return _input_tensor(f"_={x}", batch, seq)[1] if isinstance(x, str) else x


# -- inputs per head --------------------------------------------------------------------------------------------
def _ids(shape, vocab: int, pad) -> torch.Tensor:
    ids = torch.randint(0, vocab, shape)
    if pad is not None and 0 <= pad < vocab and vocab > 1:
        ids[ids == pad] = (pad + 1) % vocab  # no padding tokens
    return ids


def _qwen_vl_pixels(images: torch.Tensor, patch: int, merge: int, temporal: int) -> torch.Tensor:
    """Qwen2VLImageProcessor's `patchify` (transformers models/qwen2_vl/image_processing_qwen2_vl.py), written out:
    images (N, C, H, W) -> (N·H/patch·W/patch, C·temporal·patch²), each frame repeated `temporal` times."""
    n, c, h, w = images.shape
    gh, gw = h // patch, w // patch
    x = images.reshape(n, c, gh // merge, merge, patch, gw // merge, merge, patch).permute(0, 2, 5, 3, 6, 1, 4, 7)
    x = x.unsqueeze(6).expand(-1, -1, -1, -1, -1, -1, temporal, -1, -1)
    return x.reshape(n * gh * gw, c * temporal * patch * patch)


def vlm_batch(config, batch: int, seq: int, train: bool, image_size: int | None, images: int,
              float_dtype: torch.dtype, generate: bool) -> dict:
    """What Qwen2-VL's / Qwen2.5-VL's / Gemma-3's processor returns for `images` random images per sample and text
    of `seq` tokens in all (image tokens included; each sample: its image blocks, then text), plus labels = input_ids
    to train (TRL's DataCollatorForVisionLanguageModeling masks only padding). No tokenizer offline: the ids are
    laid out by hand as the processors expand them. Qwen-VL: <|vision_start|>, (H/14/2)·(W/14/2) <|image_pad|>,
    <|vision_end|> per image (processing_qwen2_vl.py `replace_image_token`, the chat template's delimiters),
    pixel_values patchified, image_grid_thw [1, H/14, W/14], mm_token_type_ids 1 at image tokens; Gemma-3: boi,
    mm_tokens_per_image image tokens, eoi (processing_gemma3.py `full_image_sequence`), pixel_values (N, 3, S, S),
    token_type_ids 1 at image tokens. Qwen images must be multiples of 28 (the processor would resize others)."""
    vision, text = config.vision_config, config.get_text_config()
    qwen = config.model_type in ("qwen2_vl", "qwen2_5_vl")
    n = batch * images
    if qwen:
        size = image_size or 224
        patch, merge = vision.patch_size, vision.spatial_merge_size
        assert size % (patch * merge) == 0 and size * size >= 56 * 56, "oracle: a size the processor would resize"
        grid = size // patch
        per_image = grid * grid // merge**2
        block = [config.vision_start_token_id] + [config.image_token_id] * per_image + [config.vision_end_token_id]
        special = {config.image_token_id, config.video_token_id, config.vision_start_token_id,
                   config.vision_end_token_id}
    else:
        size = vision.image_size
        block = [config.boi_token_index] + [config.image_token_index] * config.mm_tokens_per_image + [config.eoi_token_index]
        special = {config.boi_token_index, config.eoi_token_index, config.image_token_index}
    rows = []
    for _ in range(batch):
        words = [w for w in torch.randint(0, text.vocab_size, (4 * seq,)).tolist()
                 if w not in special and w != text.pad_token_id][: seq - images * len(block)]
        rows.append(block * images + words)
    ids = torch.tensor(rows)
    image_id = config.image_token_id if qwen else config.image_token_index
    types = (ids == image_id).long()
    pixels = torch.randn(n, 3, size, size)  # normalised pixels, as the processor's output
    out = {"input_ids": ids}
    if qwen:
        out["pixel_values"] = _qwen_vl_pixels(pixels, patch, merge, vision.temporal_patch_size).to(float_dtype)
        out["image_grid_thw"] = torch.tensor([[1, grid, grid]] * n)
        out["mm_token_type_ids"] = types
    else:
        out["pixel_values"] = pixels.to(float_dtype)
        out["token_type_ids"] = types
    if generate:
        out["attention_mask"] = torch.ones_like(ids)
    elif train:
        out["labels"] = ids
    return out


def hf_batch(model: torch.nn.Module, config, batch: int, seq: int | None, train: bool, image_size: int | None,
             float_dtype: torch.dtype, choices: int = 2) -> dict:
    """The keyword inputs a user feeds this head (transformers' documented forward arguments); a multiple-choice
    head reads `choices` candidates per example, input_ids (batch, choices, seq)."""
    name = type(model).__name__
    out: dict = {}
    media = _media_batch(model, config, batch, seq, train, image_size, float_dtype)
    if media is not None:
        return media
    if "ForImageClassification" in name or hasattr(model, "get_image_features"):
        vision = getattr(config, "vision_config", config)
        size = image_size or getattr(vision, "image_size", None) or 224
        out["pixel_values"] = torch.randn(batch, getattr(vision, "num_channels", 3), size, size, dtype=float_dtype)
        if "ForImageClassification" in name:
            if train:
                out["labels"] = torch.randint(0, config.num_labels, (batch,))
            return out
    text = getattr(config, "text_config", config)
    ids = _ids((batch, seq), text.vocab_size, getattr(text, "pad_token_id", None))  # (B, S)
    if "ForMultipleChoice" in name:
        out["input_ids"] = _ids((batch, choices, seq), text.vocab_size, getattr(text, "pad_token_id", None))
        if train:
            out["labels"] = torch.randint(0, choices, (batch,))
        return out
    out["input_ids"] = ids
    if hasattr(model, "get_image_features"):  # CLIP
        if train:
            out["return_loss"] = True
        return out
    if not train:
        if getattr(config, "is_encoder_decoder", False):
            out["decoder_input_ids"] = ids
        return out
    if "ForSequenceClassification" in name:  # labels as transformers' ForSequenceClassificationLoss reads them
        n = config.num_labels
        problem = config.problem_type or ("regression" if n == 1 else "single_label_classification")
        if problem == "single_label_classification":
            out["labels"] = torch.randint(0, n, (batch,))
        elif problem == "regression":
            out["labels"] = torch.randn((batch,) if n == 1 else (batch, n), dtype=float_dtype)
        else:  # multi_label_classification: 0/1 per label
            out["labels"] = torch.randint(0, 2, (batch, n)).to(float_dtype)
    elif "ForTokenClassification" in name:
        out["labels"] = torch.randint(0, config.num_labels, (batch, seq))
    elif "ForQuestionAnswering" in name:
        out["start_positions"] = torch.randint(0, seq, (batch,))
        out["end_positions"] = torch.randint(0, seq, (batch,))
    else:  # causal, masked and seq2seq LM
        out["labels"] = ids
    return out


def is_base_model(model, config) -> bool:
    """A model without a head: the class `AutoModel` builds for the config (Dinov2Model, Wav2Vec2Model), not CLIP."""
    return (transformers.AutoModel._model_mapping.get(type(config), None) is type(model)
            and not hasattr(model, "get_image_features"))


def base_model_loss(out):
    """What a user trains a headless model on here: the mean of its last hidden state."""
    return out.last_hidden_state.mean()


def _media_batch(model, config, batch: int, seq: int | None, train: bool, image_size: int | None,
                 float_dtype: torch.dtype) -> dict | None:
    """Audio models' inputs and base models' (feature extraction), as their documentation feeds them; None for the
    rest. Whisper: `input_features` from WhisperFeatureExtractor (the window the encoder takes, its default 30 s
    for 1,500 source positions; random 1 s waveforms at 16 kHz), `labels` (train) or `decoder_input_ids` of `seq` tokens; wav2vec2: `input_values` (batch, seq
    samples); a base model's inputs carry no labels."""
    main = model.main_input_name
    base = is_base_model(model, config)
    if main not in ("input_features", "input_values") and not base:
        return None
    if main == "pixel_values":
        size = image_size or config.image_size
        return {"pixel_values": torch.randn(batch, config.num_channels, size, size, dtype=float_dtype)}
    if main == "input_values":
        out = {"input_values": torch.randn(batch, seq, dtype=float_dtype)}
        if train and "ForSequenceClassification" in type(model).__name__:
            out["labels"] = torch.randint(0, config.num_labels, (batch,))
        return out
    out = {}
    if main == "input_features":
        import numpy as np

        # the window the encoder takes: 2 frames per source position, 100 frames (hop 160 at 16 kHz) a second
        # (30 s for Whisper's 1,500 positions, the extractor's default)
        extractor = transformers.WhisperFeatureExtractor(feature_size=config.num_mel_bins,
                                                         chunk_length=config.max_source_positions * 2 // 100)
        waves = [np.random.default_rng(i).standard_normal(16000).astype(np.float32) for i in range(batch)]
        features = extractor(waves, sampling_rate=16000, return_tensors="pt").input_features
        out["input_features"] = features.to(float_dtype)
    ids = _ids((batch, seq), config.vocab_size, getattr(config, "pad_token_id", None))
    if main == "input_ids":
        out["input_ids"] = ids
    if train and not base:
        out["labels"] = ids
    elif config.is_encoder_decoder:
        out["decoder_input_ids"] = ids
    return out


# -- checkpointing, written as a user writes it --------------------------------------------------------------------
def _decoder_layers(model):
    from transformers.modeling_layers import GradientCheckpointingLayer

    return next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m)
                and all(isinstance(c, GradientCheckpointingLayer) for c in m))


def apply_checkpointing(model, policy: str) -> None:
    """`policy` in vramtrace's grammar, applied through transformers' and torch's public APIs."""
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    kind, _, arg = policy.partition(":")
    if kind == "none":
        return
    if kind in ("layers", "nth"):
        with warnings.catch_warnings():  # transformers 5.23 renamed it activation_checkpointing_enable
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": arg == "reentrant"},
                                                **({"every_n_layers": int(arg)} if kind == "nth" else {}))
    elif kind == "selective":
        names = arg.split(",") if arg else ["aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten._scaled_mm"]
        save = {getattr(torch.ops.aten, n.split(".")[1]) for n in names}

        def save_matmuls(ctx, func, *args, **kwargs):
            return CheckpointPolicy.MUST_SAVE if func.overloadpacket in save else CheckpointPolicy.PREFER_RECOMPUTE

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={
                "use_reentrant": False, "context_fn": functools.partial(create_selective_checkpoint_contexts, save_matmuls)})
    elif kind == "modules":
        done: list[str] = []
        for name, m in model.named_modules():
            if name and fnmatch.fnmatchcase(name, arg) and not any(name.startswith(d + ".") for d in done):
                done.append(name)
                m.forward = functools.partial(checkpoint, m.forward, use_reentrant=False)
    elif kind == "every":  # K consecutive layers under one checkpoint
        layers, k = _decoder_layers(model), int(arg)
        model.enable_input_require_grads()
        for start in range(0, len(layers), k):
            seg = list(layers[start:start + k])
            forwards = [m.forward for m in seg]

            def run_segment(h, *args, _fw=forwards, **kwargs):
                # as transformers' GradientCheckpointingLayer does under checkpointing: no KV cache
                off = (("use_cache", False), ("past_key_values", None), ("cache", None))  # 5.24: `cache`
                kwargs.update({k: v for k, v in off if k in kwargs})
                for f in _fw:
                    h = f(h, *args, **kwargs)
                return h

            seg[0].forward = functools.partial(checkpoint, run_segment, use_reentrant=False)
            for m in seg[1:]:
                m.forward = lambda h, *args, **kwargs: h
    else:
        raise ValueError(f"oracle: unknown checkpointing {policy!r}")


# -- the step -----------------------------------------------------------------------------------------------------
def make_optimizer(kind: str, impl: str, params):
    """The optimizer as a user writes it: torch.optim classes with their defaults (fused=True or foreach=True where
    the case asks; left to torch otherwise, which on the CPU is the for-loop implementation), and transformers'
    Adafactor as HF Trainer builds it for optim="adafactor" (scale_parameter=False, relative_step=False)."""
    if kind == "none" or not params:
        return None
    kw = {"fused": True} if impl == "fused" else {"foreach": True} if impl == "foreach" else {}
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-4, **kw)
    if kind == "adam":
        return torch.optim.Adam(params, lr=1e-4, **kw)
    if kind == "rmsprop":
        return torch.optim.RMSprop(params, lr=1e-3, **kw)
    if kind == "adagrad":
        return torch.optim.Adagrad(params, lr=1e-2, **kw)
    if kind == "torch-adafactor":
        return torch.optim.Adafactor(params, lr=1e-2, **kw)
    if kind == "adafactor":
        return transformers.optimization.Adafactor(params, lr=1e-4, scale_parameter=False, relative_step=False)
    if any(w in kind for w in ("8bit", "paged", "lion", "bnb", "ademamix")):
        import bitsandbytes as bnb  # as transformers/trainer_optimizer.py `_get_bitsandbytes_optimizer` builds them

        if kind == "adam-8bit":  # bitsandbytes' own 8-bit Adam class (bitsandbytes/optim/adam.py)
            return bnb.optim.Adam8bit(params, lr=1e-4)
        bits = {"optim_bits": 8 if "8bit" in kind else 32}
        if "rmsprop" in kind:
            return bnb.optim.RMSprop(params, lr=1e-4, **bits)
        name = "Lion" if "lion" in kind else "AdEMAMix" if "ademamix" in kind else "AdamW"
        return getattr(bnb.optim, name)(params, lr=1e-4, is_paged="paged" in kind, **bits)
    if kind not in ("sgd", "sgd-momentum", "sgd-nesterov"):
        raise ValueError(f"oracle: unknown optimizer {kind!r}")
    momentum = 0.0 if kind == "sgd" else 0.9
    return torch.optim.SGD(params, lr=1e-3, momentum=momentum, nesterov=kind == "sgd-nesterov", **kw)


@contextlib.contextmanager
def _quiet_fd2():
    """kineto prints a line per profiler run on fd 2."""
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    sys.stderr.flush()
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total


class RealStep:
    """A case built for real on the CPU: `model`, `args`/`kwargs` of its forward, `loss_of(output)`, the
    optimizer and the autocast dtype. `run()` is one literal step. `setup(model)` replaces applying the case's
    checkpointing; `wrap(model)` (a parallel wrapper: FSDP2, DDP) returns the model the step and the optimizer
    use, applied after checkpointing and before the optimizer is made."""

    def __init__(self, spec, setup=None, wrap=None):
        mode = _v(spec.mode)
        self.train = mode == "train"
        precision = _v(spec.precision) or ("bf16-mixed" if self.train else "bf16")
        self.autocast = MIXED.get(precision) or AUTOCAST.get(precision)
        weight_dtype = AUTOCAST.get(precision) or (torch.float32 if self.autocast else DTYPES[precision])
        self.args, self.kwargs = (), {}
        self.quantized = bool(getattr(spec, "quantization", None))
        self.loss_of = lambda out: out.loss
        ref = spec.model
        if re.search(r"\.py:\w+$|^[\w.]+:\w+$", ref):
            module, build = _import_custom(ref)
            torch.manual_seed(0)
            model = build()
            if weight_dtype is not torch.float32:
                model = model.to(weight_dtype)
            if getattr(spec, "inputs", ()):
                named = dict(_input_tensor(t, spec.batch, spec.seq) for t in spec.inputs)
                import inspect
                params = inspect.signature(model.forward).parameters
                if all(n in params for n in named):
                    self.kwargs = named
                else:
                    self.args = tuple(named.values())
            else:
                ex = module.example_inputs(spec.batch, spec.seq)
                if isinstance(ex, dict):
                    self.kwargs = {k: _as_tensor(v, spec.batch, spec.seq) for k, v in ex.items()}
                else:
                    self.args = tuple(_as_tensor(v, spec.batch, spec.seq) for v in (ex if isinstance(ex, tuple) else (ex,)))
            if hasattr(module, "loss"):
                self.loss_of = lambda out: module.loss(out, *self.args, *self.kwargs.values())
            else:
                self.loss_of = _first_float_mean
        else:
            config = hf_config(ref)
            if getattr(spec, "use_cache", None) is not None:
                config.get_text_config().use_cache = spec.use_cache  # a VLM's language model reads its text config
            packing = bool(getattr(spec, "packing", False))
            if packing:  # a packing trainer trains without a KV cache
                config.get_text_config().use_cache = False
            model = hf_model(config, weight_dtype)
            if self.quantized:
                model = _quantized(model, spec, weight_dtype)
            if config.model_type in VLM_TYPES:
                self.kwargs = vlm_batch(config, spec.batch, spec.seq, self.train, getattr(spec, "image_size", None),
                                        getattr(spec, "images", None) or 1, weight_dtype, mode == "generate")
            else:
                self.kwargs = hf_batch(model, config, spec.batch, spec.seq, self.train,
                                       getattr(spec, "image_size", None), weight_dtype, getattr(spec, "choices", None) or 2)
            if packing:  # sdpa/eager sample packing: each row holds 2 sequences, positions restarting, no mask
                first = spec.seq - spec.seq // 2
                row = torch.cat([torch.arange(first), torch.arange(spec.seq - first)])
                self.kwargs["position_ids"] = row.expand(spec.batch, spec.seq).contiguous()
            if mode == "generate" and "input_features" in self.kwargs:  # speech: the audio alone
                self.kwargs = {"input_features": self.kwargs["input_features"]}
            elif mode == "generate" and config.model_type not in VLM_TYPES:  # a tokenizer's output, unpadded prompts
                self.kwargs = {"input_ids": self.kwargs["input_ids"],
                               "attention_mask": torch.ones_like(self.kwargs["input_ids"])}
            if is_base_model(model, config):
                self.loss_of = base_model_loss
        self.generate = None
        if mode == "generate":
            cache = _v(getattr(spec, "cache", "dynamic"))
            self.generate = dict(max_new_tokens=spec.new_tokens, min_new_tokens=spec.new_tokens, do_sample=False,
                                 cache_implementation="static" if cache == "static" else None)
            if _v(getattr(spec, "kv_dtype", "auto")) == "fp8":  # transformers' QuantizedCache, fp8 backend
                self.generate.update(cache_implementation="quantized", cache_config={"backend": "fp8"})
        checkpointing = str(spec.checkpointing)
        for pattern in getattr(spec, "freeze", ()) or ():
            for n, p in model.named_parameters():
                if fnmatch.fnmatchcase(n, pattern):
                    p.requires_grad_(False)
        if getattr(spec, "lora_rank", None):
            import peft

            if getattr(spec, "quantization", None) and str(spec.checkpointing) == "layers:reentrant":
                with warnings.catch_warnings():  # as QLoRA recipes call it: its default enables checkpointing
                    warnings.simplefilter("ignore")  # (torch warns: no use_reentrant given)
                    model = peft.prepare_model_for_kbit_training(model)
                checkpointing = "none"
            elif getattr(spec, "quantization", None):
                model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
            lora = {"r": spec.lora_rank}
            if spec.lora_alpha is not None:
                lora["lora_alpha"] = spec.lora_alpha
            if getattr(spec, "lora_dropout", None):
                lora["lora_dropout"] = spec.lora_dropout
            if spec.lora_targets:
                lora["target_modules"] = list(spec.lora_targets)
            model = peft.get_peft_model(model, peft.LoraConfig(**lora))
        model.train(self.train)
        if setup is not None:
            setup(model)
        elif self.train:
            apply_checkpointing(model, checkpointing)
        if wrap is not None:  # the parallelism (FSDP2 / DDP) wraps the model before the optimizer sees it
            model = wrap(model)
        self.compiled = bool(getattr(spec, "compile", False))
        if self.compiled:  # `model = torch.compile(model, mode=...)` (Inductor), as HF Trainer's torch_compile
            torch._dynamo.reset()  # no earlier case's compiled code or recompile count
            model = torch.compile(model, mode=getattr(spec, "compile_mode", "default"))
        self.model = model
        params = [p for p in model.parameters() if p.requires_grad]
        self.opt = make_optimizer(_v(spec.optimizer), _v(spec.optimizer_impl), params) if self.train else None
        self.loop = _v(getattr(spec, "loop", "trainer"))
        self.n = getattr(spec, "grad_accum", 1)
        self.zero_grad = _v(getattr(spec, "zero_grad", "none"))
        self.clip = getattr(spec, "clip_grad_norm", None)
        self.scaler = torch.amp.GradScaler("cpu") if precision in ("fp16-mixed", "fp16-autocast") and not getattr(spec, "step", None) else None
        self.script_vars = {}
        self.user_step = None
        if getattr(spec, "step", None):
            module, self.user_step = _import_custom(spec.step)  # a fresh module: its globals start empty

    def _autocast(self):
        return torch.autocast("cpu", dtype=self.autocast) if self.autocast else contextlib.nullcontext()

    # -- the literal loops (issue 12): one optimizer step of N micro-steps ---------------------------------------
    def _opt_step(self):
        model, opt, scaler = self.model, self.opt, self.scaler
        if self.clip is not None:
            if scaler is not None:
                scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], self.clip)
        if opt is not None:
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
        (opt if opt is not None else model).zero_grad(set_to_none=self.zero_grad == "none")

    def _backward(self, loss):
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def _trainer_micro(self):  # HF Trainer's training_step: the output is released when the loss is taken
        with self._autocast():
            loss = self.loss_of(self.model(*self.args, **self.kwargs))
        if self.n > 1:
            loss = loss / self.n
        self._backward(loss)

    def _train_step(self, sync):  # `def train_step(batch)`: outputs live until it returns
        with self._autocast():
            outputs = self.model(*self.args, **self.kwargs)
            loss = self.loss_of(outputs)
        if self.n > 1:
            loss = loss / self.n
        self._backward(loss)
        if sync:
            self._opt_step()

    def _script_micro(self, sync):  # the tutorials' top-level loop: `outputs`, `loss` are the loop's variables
        v = self.script_vars
        with self._autocast():
            v["outputs"] = self.model(*self.args, **self.kwargs)
            v["loss"] = self.loss_of(v["outputs"])
        if self.n > 1:
            v["loss"] = v["loss"] / self.n
        self._backward(v["loss"])
        if sync:
            self._opt_step()

    def run(self) -> None:
        """One optimizer step of the case's loop (or one call of its --step function), literally."""
        if self.generate is not None:  # model.generate() runs under torch.no_grad() itself
            with self._autocast():
                out = self.model.generate(**self.kwargs, **self.generate)
            del out
            return
        if not self.train:
            with torch.no_grad(), self._autocast():
                out = self.model(*self.args, **self.kwargs)
            del out
            return
        if self.user_step is not None:
            self.user_step(self.model, self.kwargs if self.kwargs or not self.args else self.args, self.opt)
            return
        for i in range(self.n):
            sync = i == self.n - 1
            if self.loop == "trainer":
                self._trainer_micro()
                if sync:
                    self._opt_step()
            elif self.loop == "function":
                self._train_step(sync)
            else:
                self._script_micro(sync)

    def alive_at_start(self) -> list:
        alive = [*self.model.parameters(), *self.model.buffers(), *self.args, *self.kwargs.values()]
        for m in self.model.modules():  # an int8 Linear8bitLt's row scales: Int8Params.SCB, moved at the first
            alive += [getattr(getattr(m, "weight", None), "SCB", None),  # forward
                      getattr(getattr(m, "state", None), "SCB", None)]
        for p in self.model.parameters():  # bitsandbytes' QuantState: absmax, code, offset, and its nested state
            state = getattr(p, "quant_state", None)
            while state is not None:
                alive += [getattr(state, k, None) for k in ("absmax", "code", "offset")]
                state = getattr(state, "state2", None)
        if self.opt is not None:
            alive += [v for st in self.opt.state.values() for v in st.values()]
        return [t for t in alive if isinstance(t, torch.Tensor)]


def _first_float_mean(out):
    leaves = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return leaves[0].mean()


MARKER_BYTES = 1_234_577  # a size no tiny case allocates: marks where the measured step starts


def measure_cpu_peak(spec, setup=None) -> int:
    """Peak bytes of the case's steady-state step run for real on the CPU: the bytes alive before the warm-up step
    (parameters, buffers, inputs) plus the running sum of the profiler's allocator events from the warm-up's start,
    maximised over the measured step. Whatever the warm-up leaves alive (optimizer state, the script loop's
    outputs, gradients kept by zero_grad(set_to_none=False), an EMA copy, GradScaler state) is counted without
    being named, and its frees in the measured step are seen (the profiler reports no free of an allocation made
    before it started). `setup(model)` replaces applying the case's checkpointing."""
    assert _v(spec.device) == "cpu"
    return _measure_step(RealStep(spec, setup))


def _measure_step(step: RealStep) -> int:
    """`measure_cpu_peak`'s measurement of a built step: storages alive before the warm-up, then the profiler's
    `[memory]` events from the warm-up's start, maximised from the marker (the measured step) on."""
    _prepare(step)
    return _peak(_profiled_steps(step))


def _prepare(step: RealStep) -> None:
    """What runs before the profiler starts, once per built step."""
    if step.quantized:
        # bitsandbytes' Linear4bit casts its bias to the compute dtype in its first forward by replacing the
        # parameter's data (bitsandbytes/nn/modules.py `Linear4bit.forward`): a storage alive before the profiler
        # started, whose free it would not report. One forward first, so the bytes counted at start are the ones
        # the step keeps.
        with torch.no_grad(), step._autocast():
            step.model(*step.args, **step.kwargs)
    if step.compiled:
        # torch.compile compiles in the first step; its fake-tensor tracing under the profiler would record millions
        # of events. One step first: the optimizer state it creates is alive at start, counted below.
        step.run()


def _profiled_steps(step: RealStep, mode=None) -> tuple[int, list[int], list[int]]:
    """One profiled warm-up step and measured step: (bytes of the storages alive before the warm-up, the warm-up's
    `[memory]` event sizes, the measured step's), in time order, split at the marker allocation."""
    start = storage_bytes(_local(t) for t in step.alive_at_start())
    with _quiet_fd2(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                              profile_memory=True) as prof, mode or contextlib.nullcontext():
        step.run()  # warm-up: the optimizer creates its state
        marker = torch.empty(MARKER_BYTES, dtype=torch.uint8)  # a sentinel allocation in the same event stream
        del marker
        step.run()
    if step.compiled:
        torch._dynamo.reset()  # no compiled code of this case left for the process's later tests
    warm, measured, measuring = [], [], False
    for e in sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns()):
        if e.nbytes() == MARKER_BYTES:
            measuring = True
        elif not (measuring and e.nbytes() == -MARKER_BYTES):
            (measured if measuring else warm).append(e.nbytes())
    return start, warm, measured


def _peak(profiled: tuple[int, list[int], list[int]]) -> int:
    """The bytes alive at start plus the running sum of the events, maximised over the measured step's."""
    start, warm, measured = profiled
    running = list(itertools.accumulate(measured, initial=sum(warm)))  # the level at the marker, then each event's
    return start + (max(running[1:]) if measured else running[0])


def _local(t):
    """A DTensor's local shard (FSDP2's sharded parameters, their optimizer state), which holds its storage."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is not None and isinstance(t, dtensor.DTensor):
        with torch.no_grad():
            return t.to_local()
    return t


# -- the distributed step: N CPU ranks over gloo ------------------------------------------------------------------
_PLAIN_FIELDS = ("model", "batch", "seq", "mode", "precision", "optimizer", "optimizer_impl", "device",
                 "checkpointing", "inputs", "freeze", "lora_rank", "lora_alpha", "lora_dropout", "lora_targets",
                 "image_size", "images",
                 "choices", "use_cache", "loop", "grad_accum", "zero_grad", "clip_grad_norm", "step", "new_tokens",
                 "cache", "kv_dtype", "fsdp", "ddp", "tp", "reshard_after_forward", "fsdp_plan", "packing")


def _plain_spec(spec):
    """The spec's plain fields as a picklable namespace (enums as their values), so a child never unpickles (nor
    imports) the caller's spec class."""
    import types

    missing = object()
    fields = {}
    for name in _PLAIN_FIELDS:
        value = getattr(spec, name, missing)
        if value is missing:
            continue
        if name == "checkpointing":
            value = str(value)
        elif isinstance(value, (list, tuple)):
            value = tuple(_v(x) for x in value)
        else:
            value = _v(value)
        fields[name] = value
    return types.SimpleNamespace(**fields)


def _world(spec) -> tuple[str, int]:
    """(kind, world size): 'fsdp', 'ddp', 'tp', or 'transformers' (transformers' own distribution, its FSDP plan
    with or without TP: `fsdp_plan` 'transformers')."""
    given = {k: getattr(spec, k, None) for k in ("fsdp", "ddp", "tp")}
    if getattr(spec, "fsdp_plan", "layers") == "transformers" and given["fsdp"] and not given["ddp"]:
        return "transformers", given["fsdp"] * (given["tp"] or 1)
    if given["tp"] == 1 and given["fsdp"] is not None:  # one TP rank is no TP (transformers' prepare_distribute_model)
        given["tp"] = None
    set_ = [(k, v) for k, v in given.items() if v is not None]
    if len(set_) != 1:
        raise ValueError(f"oracle: a distributed case sets exactly one of fsdp, ddp, tp (got {given})")
    kind, n = set_[0]
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"oracle: {kind} must be a world size >= 1, got {n!r}")
    return kind, n


def _fsdp_wrap(spec, mixed):
    """torchtitan's FSDP2: `fully_shard` on each transformer block, then on the root; a bf16/fp16-mixed case casts
    through FSDP's MixedPrecisionPolicy (fp32 reduce) instead of autocast. Every FSDP module gets the
    `_GlooAllGather`/`_GlooReduceScatter` comms (FSDP's `set_custom_all_gather`/`set_custom_reduce_scatter`)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kw = {"reshard_after_forward": bool(getattr(spec, "reshard_after_forward", True))}
    if mixed is not None:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=mixed, reduce_dtype=torch.float32)

    def wrap(model):
        try:
            layers = _decoder_layers(model)
        except StopIteration:
            raise ValueError(f"oracle: fsdp needs a transformers model with a list of decoder layers, "
                             f"{type(model).__name__} has none") from None
        for module in (*layers, model):
            fully_shard(module, **kw)
            module.set_custom_all_gather(_GlooAllGather())
            module.set_custom_reduce_scatter(_GlooReduceScatter())
        return model

    return wrap


def _tp_wrap(world: int, directory: Path, fsdp: int | None = None, mixed=None):
    """transformers' tensor parallelism as a user gets it: the case's model saved (`save_pretrained`, by rank 0),
    then loaded by every rank
    with `from_pretrained(directory, distributed_config=DistributedConfig(tp_size=world))`, which shards it by the
    model's `base_model_tp_plan` over the process group's ranks. With `fsdp` M: `DistributedConfig(fsdp_size=M,
    tp_size=world // M, fsdp_mixed_precision=<mixed is bf16>)`, transformers' own FSDP2 plan on top (its FSDP
    modules then get the gloo comms of `_fsdp_wrap`)."""
    from transformers.distributed.configuration_utils import DistributedConfig

    def wrap(model):
        model.save_pretrained(directory)  # rank 0 writes (transformers' should_save_on_this_rank); same seed
        torch.distributed.barrier()
        dtype = next(model.parameters()).dtype
        del model
        config = (DistributedConfig(tp_size=world) if fsdp is None else
                  DistributedConfig(fsdp_size=fsdp, tp_size=world // fsdp, fsdp_mixed_precision=mixed is not None))
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, distributed_config=config, dtype=dtype)
        if fsdp is not None:
            from torch.distributed.fsdp import FSDPModule

            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.set_custom_all_gather(_GlooAllGather())
                    module.set_custom_reduce_scatter(_GlooReduceScatter())
        # On the CPU the load leaves every dim-0 shard a view of the mmap'd safetensors file (the whole
        # tensor's storage, file-backed pages, not an allocation: transformers/distributed/sharding_utils.py
        # `DtensorShardOperation.shard_tensor` slices the file's tensor and `.to("cpu")` keeps the view), where a
        # GPU load copies the shard alone. Each parameter is made resident, as a device load has it.
        with torch.no_grad():
            for module in model.modules():
                for name, p in list(module.named_parameters(recurse=False)):
                    setattr(module, name, torch.nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad))
        return model

    return wrap


# FSDP2's default comms on gloo, with one difference: no tensor is released by a gloo worker thread. Gloo runs each
# collective on a worker thread, and its Work object (which holds the collective's tensors) is dropped by whichever
# of the worker and the caller lets go last. A storage freed on the worker thread is freed where the profiler does
# not listen (its memory reporting is per thread), so its `[memory]` free event is lost, at random: the running sum
# then drifts up by that buffer for the rest of the run. These comms call the same collectives, wait, and hold the
# buffers until gloo's references to them are gone, so the caller's thread frees them, as in the common, unraced
# case. Sizes and lifetimes are gloo's: all-gather as `dist.all_gather_single`; reduce-scatter as gloo's
# `reduce_scatter_tensor` does it (ProcessGroupGloo.cpp: clone the input, all-reduce the clone in place, copy this
# rank's chunk out, drop the clone), written out here so that the clone is a tensor the caller holds. Gloo's own
# temporaries are counted too (its worker runs each collective under the caller's profiler state): all-gather
# fills a flat output of the full unsharded size on the worker, then copies it into FSDP's output. Both that and
# the reduce-scatter's full-size clone are gloo's, on the CPU; NCCL allocates neither.
def _storage_uses(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A new tensor on `t`'s storage: what the Work holds of it then counts in the storage's use count."""
    return t.view(t.shape)


def _await_release(held: list, timeout: float = 60.0) -> None:
    """Wait until each tensor's storage is referenced no more than it was before the collective (gloo's worker
    has dropped the Work holding it)."""
    import time

    deadline = time.monotonic() + timeout
    while any(_storage_uses(t) > n for t, n in held):
        if time.monotonic() > deadline:
            raise RuntimeError("oracle: gloo kept a collective's tensors alive after the collective completed")
        os.sched_yield()


class _GlooAllGather:
    """FSDP2's all-gather (DefaultAllGather: a fresh `torch.empty` output, `dist.all_gather_single`), synchronous."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        if async_op:
            raise NotImplementedError("oracle: FSDP's asynchronous all-gather (explicit unshard(async_op=True))")
        import torch.distributed as dist

        held = [(t, _storage_uses(t)) for t in (output_tensor, input_tensor)]
        work = dist.all_gather_single(_alias(output_tensor), _alias(input_tensor), group=group, async_op=True)
        work.wait()
        del work
        _await_release(held)
        return None


class _GlooReduceScatter:
    """FSDP2's reduce-scatter as gloo runs `reduce_scatter_tensor`: clone, in-place all-reduce, copy out the chunk."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        if async_op:
            raise NotImplementedError("oracle: FSDP's asynchronous reduce-scatter")
        import torch.distributed as dist

        buffer = input_tensor.clone()
        held = [(buffer, _storage_uses(buffer))]
        work = dist.all_reduce(_alias(buffer), op=op, group=group, async_op=True)
        work.wait()
        del work
        _await_release(held)
        output_tensor.copy_(buffer.chunk(group.size())[group.rank()])
        return None


def _thread_ids() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


class _GlooThreadsSettle:
    """While active (`sys.setprofile`, the rank's main thread only), each return from a `wait` (Work.wait,
    c10d_functional's wait_tensor: the main thread resumes after a collective) waits while one of gloo's threads is
    runnable (`R` in /proc/self/task/TID/stat): the worker that woke the caller still has its Work (which holds the
    collective's tensors) to drop, and drops it before the main thread drops its own references, so that the last
    reference, and the free, is the main thread's, as on an idle machine. Nothing of the step changes (no tensor,
    no op); a thread runnable for over a second is waited for no longer, and what it then frees off the profiled
    thread makes the measurement unclean (`_measure_clean`)."""

    def __init__(self, threads: set[int]):
        self.stats = [f"/proc/self/task/{tid}/stat" for tid in sorted(threads)]

    def _runnable(self) -> bool:
        for path in self.stats:
            with contextlib.suppress(OSError), open(path) as f:
                if f.read().rpartition(")")[2].split()[0] == "R":
                    return True
        return False

    def _event(self, frame, event, arg) -> None:
        if event == "c_return" and "wait" in getattr(arg, "__name__", ""):
            import time

            deadline = time.monotonic() + 1.0
            while self._runnable() and time.monotonic() < deadline:
                os.sched_yield()

    def __enter__(self):
        sys.setprofile(self._event)

    def __exit__(self, *exc):
        sys.setprofile(None)


def _rank_main(rank: int, world: int, spec, init_file: str, out_dir: str) -> None:
    """One rank (a child process): build the case, wrap it, measure; its peak or its traceback goes to a file."""
    import traceback

    torch.set_num_threads(1)  # N ranks share the machine's cores
    warnings.filterwarnings("ignore")
    result = {}
    try:
        import torch.distributed as dist

        kind, _ = _world(spec)
        # Gloo's worker threads finish each collective and drop its Work (and the tensors it holds) just after they
        # wake the waiting caller; a tensor whose last reference goes there is freed off the profiled thread, and
        # its free event is lost (see `_GlooAllGather`). DDP's own collectives (its buffer broadcast, its bucket
        # rebuild's broadcasts) cannot be rearranged from here, so the rank runs on one core, gloo's threads
        # included, with its main thread SCHED_BATCH: a woken batch thread does not preempt the running worker, which
        # drops the Work before the main thread runs on.
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]})  # inherited by gloo's threads, made next
        before = _thread_ids()
        with _quiet_fd2():  # gloo's connection lines
            dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        gloo_threads = _thread_ids() - before
        with contextlib.suppress(OSError, AttributeError):
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))  # this thread only: gloo's stay normal
        try:
            precision = _v(spec.precision) or "bf16-mixed"
            if kind == "fsdp":
                mixed = MIXED.get(precision)
                step = RealStep(spec, wrap=_fsdp_wrap(spec, mixed))
                step.autocast = None  # FSDP's MixedPrecisionPolicy casts, no autocast (torchtitan)
            elif kind == "tp":
                step = RealStep(spec, wrap=_tp_wrap(world, Path(out_dir, "weights")))
            elif kind == "transformers":
                mixed = MIXED.get(precision)
                if mixed not in (None, torch.bfloat16):
                    raise ValueError("oracle: transformers' fsdp_mixed_precision casts to bf16 only")
                step = RealStep(spec, wrap=_tp_wrap(world, Path(out_dir, "weights"), spec.fsdp, mixed))
                step.autocast = None  # FSDP's MixedPrecisionPolicy casts, no autocast
            else:
                from torch.nn.parallel import DistributedDataParallel

                step = RealStep(spec, wrap=DistributedDataParallel)
            result["peak"] = _measure_step(step) if kind == "ddp" else _measure_clean(step, gloo_threads)
        finally:
            dist.destroy_process_group()
    except BaseException:
        result = {"error": traceback.format_exc()}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def _measure_clean(step: RealStep, gloo_threads: set[int], attempts: int = 40) -> int:
    """`_measure_step` repeated until a clean measurement, the same on every rank (they run the steps together).
    A gloo worker thread that drops the last reference to a tensor (its Work, which holds the collective's tensors,
    outlives the caller's wait when the worker is descheduled right after waking the caller, as a loaded machine
    does) frees it outside the profiler: the allocator reports memory to the profiler of the thread that frees, and
    gloo's worker runs under the caller's profiler state only while it runs the collective. That free has no event
    at all, so the running sum stays up by the tensor's bytes for the rest of the run. A clean measurement has lost
    none: the warm-up's events add up to the bytes of the storages it left alive (its optimizer state), and the
    measured step's to zero (a steady state ends where it started). Each run settles gloo's threads after every
    wait (`_GlooThreadsSettle`), which makes a lost free rare even on a loaded machine. Returns the first clean
    run's peak; raises RuntimeError when none of `attempts` runs is clean."""
    import torch.distributed as dist

    _prepare(step)
    peak, seen = None, []
    for _ in range(attempts):
        profiled = _profiled_steps(step, _GlooThreadsSettle(gloo_threads))
        start, warm, measured = profiled
        kept = storage_bytes(_local(t) for t in step.alive_at_start()) - start  # what the warm-up left alive
        seen.append((sum(warm) - kept, sum(measured)))
        if peak is None and seen[-1] == (0, 0):
            peak = _peak(profiled)
        done = torch.tensor([int(peak is not None)])
        dist.all_reduce(done, op=dist.ReduceOp.MIN)  # the ranks stop together
        if done.item():
            return peak
    raise RuntimeError(f"oracle: no clean measurement in {attempts} runs of the step (bytes not returned by the "
                       f"warm-up and by the measured step: {seen})")


def measure_cpu_peak_ranks(spec, timeout: float = 600.0) -> list[int]:
    """Peak bytes of each rank (index = rank) of the case run for real as a distributed job (`_measure_ranks`)."""
    return _measure_ranks(spec, timeout)


def _measure_ranks(spec, timeout: float) -> list[int]:
    """Peak bytes of each rank (index = rank) of the case's steady-state step run for real as a distributed job:
    `spec.fsdp` (or `spec.ddp`) = N CPU processes over gloo, each building the same case (seed 0, same
    inputs: `batch` is the per-rank micro-batch), wrapping it before the optimizer is made and measured as
    `measure_cpu_peak` measures one process. FSDP2: `fully_shard` per decoder layer then the root, with
    `reshard_after_forward=spec.reshard_after_forward` (default True) and, for bf16/fp16-mixed, a
    MixedPrecisionPolicy(param_dtype, reduce_dtype=fp32) and no autocast. DDP: `DistributedDataParallel(model)`
    with its defaults, under the case's autocast; its gradient bucket, made at construction (before the warm-up,
    uncounted), is remade in gradient-ready order at the second forward (the measured step's), counted from there.
    Gradient accumulation is the literal loop: every micro-step's backward synchronises (no `no_sync` /
    `set_requires_gradient_sync(False)`). The peaks include gloo's own CPU buffers (see `_GlooAllGather`)."""
    import multiprocessing as mp
    import tempfile

    assert _v(spec.device) == "cpu"
    kind, world = _world(spec)
    if _v(spec.mode) != "train" and kind != "tp":  # TP also serves: inference and generate run as one process does
        raise NotImplementedError(f"oracle: {kind} cases measure a training step, not mode {_v(spec.mode)!r}")
    plain = _plain_spec(spec)
    # A fork server (a clean process, like spawn's) that has imported this module, torch, transformers' model code
    # and torch.distributed's wrappers once: each rank is then a fork of it, not a fresh interpreter (seconds).
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__, "transformers.modeling_utils", "torch.distributed.fsdp",
                                "torch.distributed.tensor", "torch.nn.parallel"])
    with tempfile.TemporaryDirectory(prefix="oracle-ranks-") as tmp:
        results, stopped, codes = run_rank_processes(
            ctx, world, lambda r: (_rank_main, (r, world, plain, os.path.join(tmp, "store"), tmp), f"oracle-rank{r}"),
            tmp, timeout, "distributed case")
    note = f" (ranks {stopped} were stopped)" if stopped else ""
    errors = [f"rank {r}:\n{res['error']}" for r, res in enumerate(results) if "error" in res]
    if errors:
        raise RuntimeError(f"oracle: a rank of the distributed case failed{note}\n" + "\n".join(errors))
    missing = [f"rank {r} (exit code {codes[r]})" for r, res in enumerate(results)
               if "peak" not in res and r not in stopped]
    if missing or stopped:
        raise RuntimeError(f"oracle: distributed case: no result from {', '.join(missing)}{note}; see the ranks' "
                           "stderr")
    return [res["peak"] for res in results]


def run_rank_processes(ctx, world: int, process_of, tmp: str, timeout: float, what: str
                       ) -> tuple[list[dict], list[int], list[int]]:
    """Run `world` rank processes from the multiprocessing context `ctx` (`process_of(r)` gives (target, args,
    name) of rank r) and wait for them: a failed rank (a non-zero exit code, or an "error" key in its result) stops
    the others, which may wait on it in a collective forever. Each rank writes its result dict to
    `tmp`/rank<r>.json (`_rank_result`). Returns (each rank's result, {} when it wrote none; the ranks that were
    still running and terminated; each rank's exit code). Raises TimeoutError after `timeout` seconds, naming `what` and the ranks still
    running. Shared by the FSDP/DDP/TP oracle (`_measure_ranks`), tests/pp_oracle.py and tests/zero_oracle.py."""
    import multiprocessing.connection
    import time

    procs = []
    for r in range(world):
        target, args, name = process_of(r)
        procs.append(ctx.Process(target=target, args=args, name=name, daemon=True))
    for p in procs:
        p.start()
    stopped = []
    try:
        deadline = time.monotonic() + timeout
        pending = {p.sentinel: r for r, p in enumerate(procs)}
        failed = False
        while pending and not failed:
            ready = multiprocessing.connection.wait(list(pending), timeout=max(deadline - time.monotonic(), 0))
            if not ready:
                raise TimeoutError(f"oracle: {what} timed out after {timeout:.0f}s (ranks still running: "
                                   f"{sorted(pending.values())})")
            for sentinel in ready:
                r = pending.pop(sentinel)
                procs[r].join()
                failed |= procs[r].exitcode != 0 or "error" in _rank_result(tmp, r)
    finally:
        for r, p in enumerate(procs):
            if p.is_alive():
                stopped.append(r)
                p.terminate()
            p.join()
    return [_rank_result(tmp, r) for r in range(world)], stopped, [p.exitcode for p in procs]


def _rank_result(tmp: str, rank: int) -> dict:
    path = Path(tmp, f"rank{rank}.json")
    return json.loads(path.read_text()) if path.exists() else {}


class _StorageCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Runtime oracle in the style of test/inductor/test_mem_estimation.py: live storages of a real run
    counted through weakref.finalize."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.cur = self.peak = 0

    def track(self, t):
        st = t.untyped_storage()
        key = st._cdata
        if key in self.live:
            return
        self.live[key] = st.nbytes()
        self.cur += st.nbytes()
        self.peak = max(self.peak, self.cur)
        weakref.finalize(st, self._free, key)

    def _free(self, key):
        self.cur -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.track(t)
        return out


def measure_cpu_dispatch_peak(spec) -> int:
    """Peak bytes of the steady-state step run for real on the CPU, counted by the dispatch-mode oracle (op
    outputs only: kernel workspaces are invisible to it)."""
    step = RealStep(spec)
    step.run()
    counter = _StorageCounter()
    for t in step.alive_at_start():
        counter.track(t)
    with counter:
        step.run()
    return counter.peak
