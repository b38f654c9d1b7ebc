"""The choices of a run specification (spec.py `RunSpec`): str enums whose `parse` raises `SpecError` naming the
field, and the tables that go with them. Torch-free; `vramtrace.spec` re-exports every name."""

from __future__ import annotations

import enum
import re

from .errors import SpecError, UsageError
from .optimizer_names import BNB_CLASS_NAMES, HF_OPTIM_NAMES, HF_UNTRACED_OPTIM_NAMES


class _Choice(str, enum.Enum):
    @classmethod
    def parse(cls, value: "str | _Choice", what: str):
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).lower())
        except ValueError as e:
            valid = ", ".join(m.value for m in cls)
            # `what` names the RunSpec field as `{field}` (SpecError's template): the CLI words it as its option
            raise SpecError(f"unknown {what} {value!r}; choose one of: {valid}",
                            frozenset(re.findall(r"\{(\w+)\}", what))) from e


class Mode(_Choice):
    TRAIN = "train"
    INFERENCE = "inference"  # one no_grad forward over the whole sequence
    GENERATE = "generate"  # model.generate(): a prefill over the prompt, then one decode step per new token


class CacheKind(_Choice):
    """The KV cache `model.generate()` builds (`--cache`): transformers' `DynamicCache`, which grows by `torch.cat`
    every decode step, or `StaticCache`, preallocated to the prompt + new tokens (`cache_implementation='static'`)."""

    DYNAMIC = "dynamic"
    STATIC = "static"


class KvDtype(_Choice):
    """The dtype of the KV cache `model.generate()` keeps (`--kv-dtype`): `auto`, the model's compute dtype, or
    `fp8`, transformers' `QuantizedCache(backend="fp8")` (`cache_implementation="quantized"`,
    transformers/cache_utils.py `Fp8QuantizedLayer`): keys and values stored as float8_e4m3fn with one fp32 scale
    per layer, frozen at the prefill; every decode step appends the new token and dequantizes the whole cache
    (a float32 copy, then the compute dtype) for attention. A dynamic cache: it grows by `torch.cat`."""

    AUTO = "auto"
    FP8 = "fp8"


class FsdpPlan(_Choice):
    """Which modules `--fsdp` wraps with `fully_shard` (`--fsdp-plan`): `layers`, each layer of the stack then the
    root (torchtitan's `apply_fsdp`, HF accelerate's FSDP2 plugin with TRANSFORMER_BASED_WRAP), or `transformers`,
    the model's own FSDP plan as `from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=N))` applies
    it (transformers/distributed/fsdp.py `apply_fully_sharded_data_parallelism`: the embeddings and each layer
    resharded after forward, the final norm and `lm_head` kept unsharded, then the root)."""

    LAYERS = "layers"
    TRANSFORMERS = "transformers"


class Quantization(_Choice):
    """bitsandbytes weight quantization (`--quantization`), what transformers' `BitsAndBytesConfig` loads:
    `load_in_4bit=True` with `bnb_4bit_quant_type` nf4 or fp4 (`Linear4bit`, blocksize 64), or `load_in_8bit=True`
    (int8: LLM.int8(), `Linear8bitLt` with row-wise int8 weights and the outlier threshold 6.0)."""

    NF4 = "nf4"
    FP4 = "fp4"
    INT8 = "int8"

    @property
    def four_bit(self) -> bool:
        return self is not Quantization.INT8


class Precision(_Choice):
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    BF16_MIXED = "bf16-mixed"
    FP16_MIXED = "fp16-mixed"
    # weights in bf16/fp16 as `from_pretrained(dtype=...)` loads them, the step under `torch.autocast(dtype)`: HF
    # Trainer with bf16=True/fp16=True on a model loaded in that dtype (accelerate/accelerator.py `autocast`,
    # `native_amp`); fp16 adds the Trainer's GradScaler, as fp16-mixed does
    BF16_AUTOCAST = "bf16-autocast"
    FP16_AUTOCAST = "fp16-autocast"
    # pure precision in the checkpoint's stored dtype (its safetensors headers); resolved to one of the above
    # before the model is built (tracer/checkpoint_headers.py::precision_for)
    STORED = "stored"

    @property
    def is_mixed(self) -> bool:
        return self in (Precision.BF16_MIXED, Precision.FP16_MIXED)

    @property
    def is_autocast(self) -> bool:
        """Weights in the low dtype and the step under autocast (bf16-autocast, fp16-autocast)."""
        return self in (Precision.BF16_AUTOCAST, Precision.FP16_AUTOCAST)

    @property
    def scales_loss(self) -> bool:
        """The step runs a `torch.amp.GradScaler` (fp16 autocast: fp16-mixed, fp16-autocast)."""
        return self in (Precision.FP16_MIXED, Precision.FP16_AUTOCAST)


class Recipe(_Choice):
    """How a fine-tuning framework builds the model before the optimizer (`RunSpec.recipe`, `tracer/recipes.py`),
    as its own source does it: axolotl 0.21.0 (`axolotl/loaders/model.py` `ModelLoader`), LLaMA-Factory 0.9.5
    (`llamafactory/model/loader.py` `load_model`). None: transformers' and peft's defaults."""

    AXOLOTL = "axolotl"
    LLAMAFACTORY = "llamafactory"


class OptimizerKind(_Choice):
    """The optimizer of the step, as `tracer/optim.py::make_optimizer` builds it (the hyper-parameters that
    change memory are named; learning rates do not). `parse` also takes HF Trainer's `optim` names
    (`HF_OPTIM_NAMES`)."""

    ADAMW = "adamw"  # torch.optim.AdamW
    ADAM = "adam"  # torch.optim.Adam
    SGD = "sgd"  # torch.optim.SGD, no momentum: no state
    SGD_MOMENTUM = "sgd-momentum"  # torch.optim.SGD(momentum=0.9)
    SGD_NESTEROV = "sgd-nesterov"  # torch.optim.SGD(momentum=0.9, nesterov=True)
    RMSPROP = "rmsprop"  # torch.optim.RMSprop (alpha 0.99, no momentum, not centered: square_avg only)
    ADAGRAD = "adagrad"  # torch.optim.Adagrad (state `sum` created in __init__, not lazily)
    # transformers.optimization.Adafactor as HF Trainer's optim="adafactor" builds it
    # (trainer_optimizer.py::_get_adafactor: scale_parameter=False, relative_step=False)
    ADAFACTOR = "adafactor"
    TORCH_ADAFACTOR = "torch-adafactor"  # torch.optim.Adafactor
    # bitsandbytes' optimizers as HF Trainer builds them (transformers/trainer_optimizer.py
    # `_get_bitsandbytes_optimizer`: `bnb.optim.AdamW`, `Lion`, `RMSprop` or `AdEMAMix` with optim_bits 8 or 32 and,
    # but for RMSprop, is_paged; `BNB_OPTIMIZER_BUILDS`): 8-bit states are uint8 tensors with an fp32 absmax per
    # 256-element block and 256-entry fp32 maps, for parameters of at least min_8bit_size = 4096 elements (fp32
    # states below it); paged states live in CUDA managed memory
    ADAMW_8BIT = "adamw-8bit"
    # bnb.optim.Adam8bit (bitsandbytes/optim/adam.py): the same Optimizer2State("adam", 8 bits) as AdamW8bit, so the
    # same states; only its default weight_decay differs (0 against 1e-2), a scalar of the kernel
    ADAM_8BIT = "adam-8bit"
    PAGED_ADAMW_8BIT = "paged-adamw-8bit"
    PAGED_ADAMW = "paged-adamw"
    LION_8BIT = "lion-8bit"
    LION_32BIT = "lion-32bit"
    PAGED_LION = "paged-lion"
    PAGED_LION_8BIT = "paged-lion-8bit"
    RMSPROP_BNB = "rmsprop-bnb"
    RMSPROP_BNB_8BIT = "rmsprop-bnb-8bit"
    ADEMAMIX = "ademamix"
    ADEMAMIX_8BIT = "ademamix-8bit"
    PAGED_ADEMAMIX = "paged-ademamix"
    PAGED_ADEMAMIX_8BIT = "paged-ademamix-8bit"
    NONE = "none"

    @classmethod
    def parse(cls, value: "str | OptimizerKind", what: str = "optimizer") -> "OptimizerKind":
        """An OptimizerKind from its name, an HF Trainer `optim` name (`HF_OPTIM_NAMES`) or a bitsandbytes class
        name (`BNB_CLASS_NAMES`, case-insensitive). Raises UsageError, one message for every name outside them
        (an HF Trainer name vramtrace does not trace is said to be one), listing the valid names."""
        if isinstance(value, cls):
            return value
        key = str(value).strip().lower()
        if key in HF_OPTIM_NAMES:
            return cls(HF_OPTIM_NAMES[key][0])
        if key in BNB_CLASS_NAMES:
            return cls(BNB_CLASS_NAMES[key])
        if key.replace("_", "-") in cls._value2member_map_:
            return cls(key.replace("_", "-"))
        valid = ", ".join([m.value for m in cls] + sorted(k for k in HF_OPTIM_NAMES if k not in cls._value2member_map_))
        note = " (an HF Trainer optim name that vramtrace does not trace yet)" if key in HF_UNTRACED_OPTIM_NAMES else ""
        raise UsageError(f"unsupported {what} {value!r}{note}; choose one of: {valid}")


class OptimizerImpl(_Choice):
    """torch.optim's implementations: default (what torch picks with foreach=None, fused=None:
    torch/optim/optimizer.py::_default_to_fused_or_foreach takes foreach when every parameter is on a device of
    `_get_foreach_kernels_supported_devices`, CUDA but not CPU), foreach, for-loop, fused (`fused=True`: Adam,
    AdamW, SGD, Adagrad)."""

    DEFAULT = "default"
    FOREACH = "foreach"
    FORLOOP = "for-loop"
    FUSED = "fused"


# Which implementations each optimizer has (torch/optim/*.py: a `foreach` and a `fused` argument, or neither for
# transformers' Adafactor). torch.optim.RMSprop and Adafactor have no fused kernel.
OPTIMIZER_IMPLS = {
    OptimizerKind.ADAMW: tuple(OptimizerImpl), OptimizerKind.ADAM: tuple(OptimizerImpl),
    OptimizerKind.SGD: tuple(OptimizerImpl), OptimizerKind.SGD_MOMENTUM: tuple(OptimizerImpl),
    OptimizerKind.SGD_NESTEROV: tuple(OptimizerImpl), OptimizerKind.ADAGRAD: tuple(OptimizerImpl),
    OptimizerKind.RMSPROP: (OptimizerImpl.DEFAULT, OptimizerImpl.FOREACH, OptimizerImpl.FORLOOP),
    OptimizerKind.TORCH_ADAFACTOR: (OptimizerImpl.DEFAULT, OptimizerImpl.FOREACH, OptimizerImpl.FORLOOP),
    OptimizerKind.ADAFACTOR: (OptimizerImpl.DEFAULT, OptimizerImpl.FORLOOP),
    OptimizerKind.NONE: (OptimizerImpl.DEFAULT,),
}
# each bitsandbytes optimizer: (its class in bitsandbytes.optim, optim_bits, is_paged; None: the class has none)
BNB_OPTIMIZER_BUILDS = {
    OptimizerKind.ADAMW_8BIT: ("AdamW", 8, False), OptimizerKind.ADAM_8BIT: ("Adam", 8, False),
    OptimizerKind.PAGED_ADAMW_8BIT: ("AdamW", 8, True),
    OptimizerKind.PAGED_ADAMW: ("AdamW", 32, True), OptimizerKind.LION_8BIT: ("Lion", 8, False),
    OptimizerKind.LION_32BIT: ("Lion", 32, False), OptimizerKind.PAGED_LION: ("Lion", 32, True),
    OptimizerKind.PAGED_LION_8BIT: ("Lion", 8, True), OptimizerKind.RMSPROP_BNB: ("RMSprop", 32, None),
    OptimizerKind.RMSPROP_BNB_8BIT: ("RMSprop", 8, None), OptimizerKind.ADEMAMIX: ("AdEMAMix", 32, False),
    OptimizerKind.ADEMAMIX_8BIT: ("AdEMAMix", 8, False), OptimizerKind.PAGED_ADEMAMIX: ("AdEMAMix", 32, True),
    OptimizerKind.PAGED_ADEMAMIX_8BIT: ("AdEMAMix", 8, True),
}
BNB_OPTIMIZERS = frozenset(BNB_OPTIMIZER_BUILDS)
# torch.compile's modes traced by --compile (a CPU target: the CUDA-graph modes do not apply)
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")
OPTIMIZER_IMPLS.update({k: (OptimizerImpl.DEFAULT,) for k in BNB_OPTIMIZERS})


class Loop(_Choice):
    """The training loop around the step: when the loop releases the model's `outputs` (`tracer/step.py`).

    trainer: released when the loss has been taken, before backward() (HF Trainer's compute_loss, Lightning's
        training_step, torchtitan's `del pred`).
    function: `def train_step(batch): outputs = model(**batch); outputs.loss.backward(); opt.step();
        opt.zero_grad()`: `outputs` lives until the function returns.
    script: the top-level loop of the PyTorch and HF tutorials: `outputs` of step k lives until step k+1's
        forward has returned, so the previous logits are alive during the next forward."""

    TRAINER = "trainer"
    FUNCTION = "function"
    SCRIPT = "script"


class ZeroGrad(_Choice):
    """`optimizer.zero_grad(set_to_none=...)`: none (True, torch >= 2.0's default) frees the gradients; zeros
    (False, PyTorch < 2.0's default) keeps them allocated across steps."""

    NONE = "none"
    ZEROS = "zeros"


class Device(_Choice):
    CUDA = "cuda"
    CPU = "cpu"


class Task(_Choice):
    """The head a transformers model is built with, and so its inputs and labels (`--task`). Values are the
    report's `model.task`; `parse` also takes transformers' pipeline names (`TASK_ALIASES`)."""

    CAUSAL_LM = "causal-lm"
    MASKED_LM = "masked-lm"
    SEQ2SEQ_LM = "seq2seq-lm"
    SEQUENCE_CLASSIFICATION = "sequence-classification"
    TOKEN_CLASSIFICATION = "token-classification"
    QUESTION_ANSWERING = "question-answering"
    MULTIPLE_CHOICE = "multiple-choice"
    IMAGE_CLASSIFICATION = "image-classification"
    CTC = "ctc"  # speech recognition by CTC (Wav2Vec2ForCTC, HubertForCTC): AutoModelForCTC
    FEATURE_EXTRACTION = "feature-extraction"  # the base model, no head (AutoModel); loss: mean of last_hidden_state

    @classmethod
    def parse(cls, value: "str | Task", what: str = "task") -> "Task":
        """A Task from its name or a transformers pipeline alias. Raises UsageError listing every valid name."""
        if isinstance(value, cls):
            return value
        key = str(value).strip().lower().replace("_", "-")
        key = TASK_ALIASES.get(key, key)
        try:
            return cls(key)
        except ValueError:
            valid = ", ".join(sorted([m.value for m in cls] + list(TASK_ALIASES)))
            raise UsageError(f"unknown {what} {value!r}; choose one of: {valid}") from None


# transformers' pipeline task names (transformers/pipelines/__init__.py, SUPPORTED_TASKS and TASK_ALIASES)
TASK_ALIASES = {
    "text-generation": "causal-lm", "fill-mask": "masked-lm", "text2text-generation": "seq2seq-lm",
    "summarization": "seq2seq-lm", "translation": "seq2seq-lm", "text-classification": "sequence-classification",
    "sentiment-analysis": "sequence-classification", "ner": "token-classification",
    "image-feature-extraction": "feature-extraction",
}
# Multiple-choice heads read input_ids (B, C, S); C without --choices (SWAG, the task's classic data set, has 4
# endings; 2 is the smallest valid C and what transformers' own multiple-choice tests use).
DEFAULT_CHOICES = 2


class AttnImplementation(_Choice):
    """transformers' `attn_implementation=` (the `from_config`/`from_pretrained` keyword), `--attn-implementation`."""

    EAGER = "eager"
    SDPA = "sdpa"
    FLASH_ATTENTION_2 = "flash_attention_2"
    FLEX_ATTENTION = "flex_attention"


class PipelineSchedule(_Choice):
    """The `torch.distributed.pipelining` schedule of a `--pp` run (`--pp-schedule`): `ScheduleGPipe` (every
    micro-batch's forward, then every backward), `Schedule1F1B` (stage k warms up min(M, P - k) forwards, then
    alternates), `ScheduleInterleaved1F1B` (several stages per rank, `--virtual-stages`) and the zero-bubble
    schedules (torch/distributed/pipelining/schedules.py). Traced: all four; zero-bubble is
    `ScheduleInterleavedZeroBubble` (the interleaved placement, V stages per rank)."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved-1f1b"
    ZERO_BUBBLE = "zero-bubble"

    @property
    def multi_stage(self) -> bool:
        """Whether a rank holds several stages (`--virtual-stages`): interleaved-1f1b and zero-bubble."""
        return self in (PipelineSchedule.INTERLEAVED_1F1B, PipelineSchedule.ZERO_BUBBLE)


class ZeroOffload(_Choice):
    """Where DeepSpeed ZeRO offloads (`--offload-optimizer`, `--offload-param`: the ds_config's
    `zero_optimization.offload_optimizer.device` / `offload_param.device`, deepspeed/runtime/zero/offload_config.py
    `OffloadDeviceEnum`; its `none` is no offload, a None here)."""

    CPU = "cpu"
    NVME = "nvme"


class BucketSource(_Choice):
    """Where a --zero run's bucket size comes from (report `run.zero.buckets[].source`): the --deepspeed file, its
    "auto" filled as HF's integration fills it (transformers integrations/deepspeed.py), or DeepSpeed's default
    (deepspeed/runtime/zero/config.py `DeepSpeedZeroConfig`)."""

    FILE = "file"
    HF_AUTO = "HF auto"
    DEEPSPEED_DEFAULT = "DeepSpeed default"
