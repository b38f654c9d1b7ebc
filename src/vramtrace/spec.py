"""The run specification: what to trace and for which target. Frozen, validated, torch-free."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from .analysis.device import AllocConf, CudaContext, cuda_context_default, default_cuda_major
from .errors import SpecError, UsageError
# the choices live in choices.py; every name is re-exported here (`from vramtrace.spec import Precision`)
from .choices import (  # noqa: F401
    _Choice, Mode, CacheKind, KvDtype, FsdpPlan, Quantization, Precision, Recipe, OptimizerKind, OptimizerImpl, Loop,
    ZeroGrad, Device, Task, AttnImplementation, PipelineSchedule, OPTIMIZER_IMPLS, BNB_OPTIMIZER_BUILDS, BNB_OPTIMIZERS, COMPILE_MODES,
    TASK_ALIASES, DEFAULT_CHOICES, ZeroOffload,
)

from .custom_inputs import InProcessModel, InputSpec, custom_ref
from .gpus import GpuPreset, parse_gpu
from .optimizer_names import HF_OPTIM_NAMES

if TYPE_CHECKING:
    from .sources.base import SourceEntry


def _bad(template: str) -> SpecError:
    """A SpecError whose message names RunSpec's fields as `{field}` (`RUN_SPEC_FIELDS`): the API's words, which the
    CLI words as its options (cli/options.py `flag_of`)."""
    return SpecError(template, RUN_SPEC_FIELDS)


# Selective checkpointing's default: save the matmul outputs, recompute pointwise ops and the attention core
# (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models").
DEFAULT_SAVE_OPS = ("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten._scaled_mm")
_CKPT_USAGE = ("none, layers, layers:reentrant, every:K, nth:N, selective, selective:OP,OP (e.g. aten.mm,aten.addmm), "
               "modules:PATTERN (e.g. modules:blocks.*) or auto")
# peft's `prepare_model_for_kbit_training(model)` (peft/utils/other.py) enables transformers' checkpointing by
# default (use_gradient_checkpointing=True) with `gradient_checkpointing_kwargs={}`: torch.utils.checkpoint without
# use_reentrant, whose default is the reentrant variant (torch/utils/checkpoint.py `checkpoint`)
KBIT_TRAINING_CHECKPOINTING = "layers:reentrant"
# the checkpointing a recipe runs when none is given: axolotl's `gradient_checkpointing` defaults to False
# (utils/schemas/config.py), and peft's kbit default does not apply (loaders/model.py _prepare_model_for_quantization
# passes use_gradient_checkpointing=cfg.gradient_checkpointing); LLaMA-Factory's `disable_gradient_checkpointing`
# defaults to False with `use_reentrant_gc` True (hparams/model_args.py, model_utils/checkpointing.py
# prepare_model_for_training)
RECIPE_CHECKPOINTING = {Recipe.AXOLOTL: "none", Recipe.LLAMAFACTORY: "layers:reentrant"}


class CheckpointingKind(_Choice):
    """The kinds of activation checkpointing (`Checkpointing.kind`), named as `--checkpointing` writes them."""

    NONE = "none"
    LAYERS = "layers"  # each layer of the stack (transformers' gradient_checkpointing_enable)
    EVERY = "every"  # K consecutive layers per segment
    NTH = "nth"  # every N-th layer (transformers' `every_n_layers`)
    SELECTIVE = "selective"  # each layer, saving the outputs of `save_ops`
    MODULES = "modules"  # the submodules whose qualified name matches a pattern
    AUTO = "auto"  # a planner picks one under a memory budget


@dataclass(frozen=True, slots=True)
class Checkpointing:
    """An activation-checkpointing policy. kind (`CheckpointingKind`): none | layers | every (K consecutive layers
    per segment) | nth (every N-th layer, transformers' `every_n_layers`) | selective (save `save_ops`' outputs) |
    modules (the submodules whose qualified name matches the fnmatch `pattern`, outermost match only) | auto (a
    planner picks one under `RunSpec.memory_budget_bytes`); a kind's name is parsed too. `k` is K or N.
    `reentrant` (layers only, 'layers:reentrant'): torch.utils.checkpoint's reentrant variant
    (`use_reentrant=True`), else the non-reentrant one. Raises UsageError for an unknown kind."""

    kind: CheckpointingKind = CheckpointingKind.NONE
    k: int = 1
    save_ops: tuple[str, ...] = ()
    pattern: str = ""
    reentrant: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", CheckpointingKind.parse(self.kind, "checkpointing"))

    @classmethod
    def parse(cls, text: "str | Checkpointing") -> "Checkpointing":
        """Parse '--checkpointing' text. Raises UsageError listing the valid forms."""
        if isinstance(text, Checkpointing):
            return text
        K = CheckpointingKind
        name, _, arg = str(text).strip().partition(":")
        kind = K._value2member_map_.get(name.lower())
        if kind is K.MODULES and arg.strip():
            return cls(K.MODULES, pattern=arg.strip())
        if kind in (K.NONE, K.LAYERS, K.AUTO) and not arg:
            return cls(kind)
        if kind is K.LAYERS and arg.strip().lower() == "reentrant":
            return cls(K.LAYERS, reentrant=True)
        if kind is K.SELECTIVE:
            ops = tuple(o.strip() for o in arg.split(",") if o.strip()) if arg else DEFAULT_SAVE_OPS
            return cls(K.SELECTIVE, 1, ops)
        if kind in (K.EVERY, K.NTH) and arg.isdigit() and int(arg) >= 1:
            return cls(kind, int(arg))
        raise UsageError(f"unknown checkpointing {text!r}; use {_CKPT_USAGE}")

    def __str__(self) -> str:
        K, name = CheckpointingKind, self.kind.value
        if self.kind in (K.EVERY, K.NTH):
            return f"{name}:{self.k}"
        if self.kind is K.MODULES:
            return f"modules:{self.pattern}"
        if self.kind is K.SELECTIVE and self.save_ops != DEFAULT_SAVE_OPS:
            return "selective:" + ",".join(self.save_ops)
        return f"{name}:reentrant" if self.reentrant else name


class MoeRouting(_Choice):
    """How many tokens each expert of a mixture-of-experts layer receives (data-dependent, so a policy):
    balanced sends an equal share of the B*S*top_k assignments to every expert; worst sends every token to the
    same top_k experts (an upper bound on the largest expert batch)."""

    BALANCED = "balanced"
    WORST = "worst"


@dataclass(frozen=True, slots=True)
class RunSpec:
    """What to analyse.

    model: a Hub id, a bundled id, a local directory holding config.json, a path to a config.json, or a custom
        module `path/to/model.py:NAME` / `package.module:NAME` (an nn.Module class or a function returning one);
        or an `InProcessModel`, the nn.Module passed to `analyze(model=...)` (`in_process`).
    batch, seq: the (B, S) of the int64 `input_ids` (and the symbols B, S of `inputs`); seq may be None for
        models without a sequence (vision models, custom inputs without S).
    inputs: `--input` texts for custom modules (`InputSpec` grammar).
    freeze: glob patterns (fnmatch) of parameter names to freeze (requires_grad=False).
    lora_rank, lora_alpha, lora_targets: a peft LoRA adapter (rank None: no LoRA; targets None: peft's default
        target modules for the architecture).
    lora_dropout: peft's `lora_dropout`, the probability of the dropout each adapter applies to its input (0 <= P
        < 1; a dropout mask and output per adapted input in training); None: peft's default, 0.
    quantization: bitsandbytes 4-bit or int8 weights (`Quantization`, `tracer/quantization.py`); None: none.
    double_quant: `bnb_4bit_use_double_quant` (the absmax quantized to uint8 with a nested fp32 absmax per 256
        blocks).
    bnb_compute_dtype: `bnb_4bit_compute_dtype` ('bf16', 'fp16' or 'fp32'); None: BitsAndBytesConfig's default,
        fp32.
    image_size: H = W of vision models' `pixel_values` (B, 3, H, W); None: the config's image_size. For a
        vision-language model, H = W of each image before its processor's resize (`tracer/vlm.py`).
    images: N images per sample of a vision-language model (Qwen2-VL, Qwen2.5-VL, Gemma-3; `tracer/vlm.py`),
        their image tokens counted in `seq`; None: 1 (`vlm.DEFAULT_IMAGES`).
    moe_routing: the tokens-per-expert policy of mixture-of-experts layers.
    strict: an op without a meta kernel is an error (else the report lists it as unresolved).
    precision: None picks the default for the mode (bf16-mixed to train, bf16 for inference).
    checkpointing: a `Checkpointing` or its text ('none', 'layers', 'every:4', 'selective', 'auto', ...); None:
        'none', or with --quantization and --lora-rank in training peft's `prepare_model_for_kbit_training` default
        (`KBIT_TRAINING_CHECKPOINTING`, reentrant layers).
    memory_budget_bytes: the budget `auto` checkpointing must fit, in bytes, on the fit verdict's basis: peak
        reserved (caching-allocator model) for device cuda, peak allocated for cpu. Only with checkpointing auto.
    replicate_layers: trace 4 of a stack's identical layers and rebuild the rest (False: trace every layer).
    task: the head to build (`Task`, or a transformers pipeline name); None: the config's `architectures`.
    choices: C of a multiple-choice head's input_ids (B, C, S); None: `DEFAULT_CHOICES`.
    attn_implementation: transformers' `attn_implementation=`; None: the config's, else transformers' default
        (sdpa where the model supports it). flash_attention_2: a CUDA target only, traced with flash-attn 2.8.3's
        allocations (`tracer/flash_attn.py`, no flash_attn package needed).
    loop: the training loop around the step (`Loop`): when the loop releases the model's outputs.
    grad_accum: N micro-batches per optimizer step (each loss divided by N, `backward()` each, one `step()`).
    zero_grad: `ZeroGrad`; none is `zero_grad(set_to_none=True)`.
    clip_grad_norm: max norm of `torch.nn.utils.clip_grad_norm_` between the backward and the step, or None.
    use_cache: None: the config's `use_cache`; False: the config's `use_cache` set False before the model is built
        (no KV cache in the training forward).
    step: `path/to/file.py:FUNC`: the user's own step function, called as `FUNC(model, batch, optimizer)` once per
        step (batch: the inputs dict, or the tuple of positional inputs of a custom module); it replaces the
        loop, accumulation, clipping and GradScaler options.
    gpu_memory_bytes: the device's capacity in bytes (`--gpu-memory`), replacing the `gpu` preset's; on the CPU
        target, a capacity the peak allocated is checked against (None: no verdict on the CPU).
    cuda_context_bytes: the CUDA context's bytes outside the allocator (`--cuda-context`); None: the figure for the
        GPU's family and CUDA version (`analysis/device.py::cuda_context_default`). CUDA target only.
    cuda_version: the CUDA major version of the target's torch build (`--cuda-version`, 12 or 13); None: PyPI's
        torch 2.13 wheel, CUDA 13 (12 on a GPU below sm75, `device.default_cuda_major`). CUDA target only.
    alloc_conf: PYTORCH_CUDA_ALLOC_CONF as the target sets it (`--alloc-conf`, `analysis/device.py::AllocConf`).
    serve_requests: R, for `vramtrace serve`'s trace of a paged-attention server's profile run: an inference
        forward of batch 1 × seq tokens packed as R requests, logits only at each request's last token, then the
        server's dummy sampler over those R rows (`tracer/serving.py`). None: an ordinary forward.
    fsdp: N ranks of PyTorch's FSDP2 (`fully_shard` on each layer and the root, `tracer/sharding.py`), batch
        being the per-rank micro-batch; None: one device.
    fsdp_plan: the modules `fully_shard` wraps (`FsdpPlan`).
    reshard_after_forward: FSDP2's `reshard_after_forward` (False keeps each layer's parameters unsharded from
        its forward to its backward, ZeRO-2 style).
    cpu_offload: FSDP2's `CPUOffloadPolicy()` (pinned host memory): the sharded parameters, their gradients and
        the optimizer state (the optimizer steps on the CPU) live in host memory; a CUDA target with `fsdp` only.
    tp: N ranks of tensor parallelism, transformers' own (the model's `base_model_tp_plan` applied by
        `transformers.distributed.tensor_parallel.apply_tensor_parallelism`, `tracer/sharding.py`); with `fsdp` M
        too, a 2-D mesh of M × N ranks (FSDP2 over the data-parallel dimension, TP within each group). The batch is
        per data-parallel rank (TP ranks share it). None: no tensor parallelism.
    rank: the rank whose program is traced (0 .. world - 1, world = fsdp × tp; with both, rank r is data-parallel
        rank r // tp and TP rank r % tp); None: every distinct rank class (`analyze`).
    ddp: N ranks of PyTorch's DistributedDataParallel (its defaults: 25 MiB gradient buckets, buffers broadcast
        each forward; `tracer/sharding.py`), batch being the per-rank micro-batch; None: one device.
    pp: P stages of `torch.distributed.pipelining` (manual PipelineStages of a decoder LM, `tracer/pipelining.py`),
        each traced on a fake rank of P; `batch` is the batch of one `schedule.step`, split into `micro_batches`;
        None: no pipeline. pp_schedule: `PipelineSchedule` (all four traced). micro_batches: M (None: P),
        `batch` a multiple of it. virtual_stages: V stages per rank under interleaved-1f1b and zero-bubble (None:
        2; rank r holds stages r, r + P, ..., P × V stages in all). pp_split: decoder layers per stage (P × V of
        them under interleaved-1f1b and zero-bubble), summing to the model's (None: even, the remainder on the
        earliest stages). stage: the stage traced and reported, the rank under interleaved-1f1b and zero-bubble
        (None: every distinct one, the largest reported).
    compile: the model is `torch.compile(model, mode=compile_mode)` (Inductor; the optimizer eager): the step's
        graphs as Inductor compiles them (`tracer/compiled_step.py`); a CPU target's training step only.
    compile_mode: `COMPILE_MODES`: the Inductor options of torch.compile's `mode` (torch/_inductor/__init__.py
        `list_mode_options`) are set while the graphs are compiled.
    recipe: build the model as a fine-tuning framework builds it (`Recipe`, `tracer/recipes.py`): its
        BitsAndBytesConfig, dtype casts, LoRA config and the trainable parameters' dtype, with its defaults for
        use_cache (False), checkpointing (`RECIPE_CHECKPOINTING`), 4-bit double quantization (on) and precision
        (bf16-autocast); training only.
        None: transformers' and peft's defaults.
    packing: sample packing in training (`tracer/packing.py`): `batch` sequences of `seq` tokens each, packed with
        position ids restarting per sequence and no attention mask; `use_cache` becomes False (transformers
        separates packed sequences only without a cache). flash_attention_2: one row `input_ids` (1, batch*seq) with
        axolotl's `cu_seq_lens_q/k` and `max_length_q/k` (varlen kernels); sdpa and eager: rows (batch, seq) of
        `PACKED_PER_ROW` sequences each, the block-diagonal mask transformers builds from the position ids.
    sources: the fields set by training config files (`vramtrace.sources.spec_from`, `--from`), each a
        `SourceEntry` (field, value, file, key); reported as `run.sources`.
    source_warnings: one line per key of those files that changes memory and is not modelled; added to the
        report's `run.warnings`.
    """

    model: str | InProcessModel
    batch: int
    seq: int | None
    mode: Mode = Mode.TRAIN
    precision: Precision | None = None
    optimizer: OptimizerKind = OptimizerKind.ADAMW
    optimizer_impl: OptimizerImpl = OptimizerImpl.DEFAULT
    device: Device = Device.CUDA
    gpu: str = "H100-80GB"
    checkpointing: Checkpointing | str | None = None
    memory_budget_bytes: int | None = None
    trust_remote_code: bool = False
    replicate_layers: bool = True
    inputs: tuple[str, ...] = ()
    freeze: tuple[str, ...] = ()
    lora_rank: int | None = None
    lora_alpha: float | None = None
    lora_dropout: float | None = None
    lora_targets: tuple[str, ...] | None = None
    quantization: Quantization | None = None
    double_quant: bool = False
    bnb_compute_dtype: str | None = None
    image_size: int | None = None
    images: int | None = None
    moe_routing: MoeRouting = MoeRouting.BALANCED
    strict: bool = False
    task: Task | None = None
    choices: int | None = None
    attn_implementation: AttnImplementation | None = None
    loop: Loop = Loop.TRAINER
    grad_accum: int = 1
    zero_grad: ZeroGrad = ZeroGrad.NONE
    clip_grad_norm: float | None = None
    use_cache: bool | None = None
    step: str | None = None
    gpu_memory_bytes: int | None = None
    cuda_context_bytes: int | None = None
    cuda_version: int | None = None
    alloc_conf: AllocConf | str = ""
    new_tokens: int | None = None
    cache: CacheKind = CacheKind.DYNAMIC
    kv_dtype: KvDtype = KvDtype.AUTO
    serve_requests: int | None = None
    fsdp: int | None = None
    ddp: int | None = None
    tp: int | None = None
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    fsdp_plan: FsdpPlan = FsdpPlan.LAYERS
    rank: int | None = None
    compile: bool = False
    compile_mode: str = "default"
    recipe: Recipe | None = None
    packing: bool = False
    sources: tuple[SourceEntry, ...] = ()
    source_warnings: tuple[str, ...] = ()
    pp: int | None = None
    pp_schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B
    micro_batches: int | None = None
    virtual_stages: int | None = None
    pp_split: tuple[int, ...] | None = None
    stage: int | None = None
    zero: int | None = None
    dp: int | None = None
    offload_optimizer: ZeroOffload | None = None
    offload_param: ZeroOffload | None = None
    deepspeed_config: str | None = None

    def __post_init__(self) -> None:
        for name in ("batch", "seq", "lora_rank", "image_size", "images", "choices", "grad_accum", "new_tokens",
                     "serve_requests", "fsdp", "ddp", "tp"):
            v = getattr(self, name)
            if v is None and name != "batch":
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise _bad(f"{{{name}}} must be a positive integer, got {v!r}")
        object.__setattr__(self, "inputs", tuple(str(InputSpec.parse(t)) if not isinstance(t, InputSpec) else str(t)
                                                 for t in self.inputs))
        if self.inputs and custom_ref(self.model) is None:
            raise _bad("{inputs} applies to custom modules (path/to/model.py:NAME); transformers models get "
                       "their inputs from the config")
        if self.lora_rank is None and (self.lora_alpha is not None or self.lora_targets
                                       or self.lora_dropout is not None):
            raise _bad("{lora_alpha}, {lora_targets} and {lora_dropout} need {lora_rank}")
        if self.lora_dropout is not None and (isinstance(self.lora_dropout, bool)
                                              or not isinstance(self.lora_dropout, (int, float))
                                              or not 0 <= self.lora_dropout < 1):
            raise _bad(f"{{lora_dropout}} must be a probability in [0, 1), e.g. 0.05; got {self.lora_dropout!r}")
        if self.task is not None:
            object.__setattr__(self, "task", Task.parse(self.task))
        if self.attn_implementation is not None:
            object.__setattr__(self, "attn_implementation",
                               AttnImplementation.parse(self.attn_implementation, "attention implementation"))
        self._check_custom_options()
        if self.choices is not None and self.task not in (None, Task.MULTIPLE_CHOICE):
            raise _bad(f"{{choices}} applies to multiple-choice heads, not {{task}} {self.task.value}")
        object.__setattr__(self, "moe_routing", MoeRouting.parse(self.moe_routing, "MoE routing"))
        object.__setattr__(self, "mode", Mode.parse(self.mode, "mode"))
        object.__setattr__(self, "cache", CacheKind.parse(self.cache, "{cache}"))
        object.__setattr__(self, "kv_dtype", KvDtype.parse(self.kv_dtype, "{kv_dtype}"))
        object.__setattr__(self, "fsdp_plan", FsdpPlan.parse(self.fsdp_plan, "{fsdp_plan}"))
        if self.recipe is not None:
            object.__setattr__(self, "recipe", Recipe.parse(self.recipe, "{recipe}"))
        self._check_quantization()
        self._check_generate_options()
        self._check_serve_profile()
        self._check_sharding()
        self._check_zero()
        if self.precision is not None:
            object.__setattr__(self, "precision", Precision.parse(self.precision, "precision"))
            if self.precision.is_autocast and (self.fsdp is not None or self.tp is not None):
                raise _bad(f"{{precision}} {self.precision.value} with {{fsdp}} or {{tp}} is not modelled yet (FSDP2's "
                           "MixedPrecisionPolicy casts fp32 weights); use bf16-mixed or fp16-mixed")
        self._resolve_optimizer()
        object.__setattr__(self, "device", Device.parse(self.device, "device"))
        object.__setattr__(self, "gpu", parse_gpu(self.gpu).name)
        object.__setattr__(self, "loop", Loop.parse(self.loop, "loop"))
        object.__setattr__(self, "zero_grad", ZeroGrad.parse(self.zero_grad, "{zero_grad} value"))
        if self.clip_grad_norm is not None and not (isinstance(self.clip_grad_norm, (int, float))
                                                    and not isinstance(self.clip_grad_norm, bool)
                                                    and self.clip_grad_norm > 0):
            raise _bad(f"{{clip_grad_norm}} must be a positive number, got {self.clip_grad_norm!r}")
        self._check_step_options()
        self._check_pipeline()
        self._check_compile()
        self._check_recipe()
        if self.checkpointing is None:  # not given: none, or for QLoRA peft's default
            kbit_lora = self.quantization is not None and self.lora_rank is not None and self.mode is Mode.TRAIN
            object.__setattr__(self, "checkpointing", KBIT_TRAINING_CHECKPOINTING if kbit_lora else "none")
        ckpt = Checkpointing.parse(self.checkpointing)
        object.__setattr__(self, "checkpointing", ckpt)
        if ckpt.kind is not CheckpointingKind.NONE and self.mode is not Mode.TRAIN:
            raise _bad(f"{{checkpointing}} applies to training; drop it for {{mode}} {self.mode.value}")
        if ckpt.kind is CheckpointingKind.AUTO and not self.memory_budget_bytes:
            raise _bad("{checkpointing} auto needs {memory_budget_bytes}, e.g. {memory_budget_bytes} 40GiB")
        if self.memory_budget_bytes is not None and self.memory_budget_bytes <= 0:
            raise _bad("{memory_budget_bytes} must be positive, e.g. 40GiB")
        self._check_device_options()
        if self.memory_budget_bytes is not None and ckpt.kind is not CheckpointingKind.AUTO:
            raise _bad("{memory_budget_bytes} applies to {checkpointing} auto only; add {checkpointing} auto or "
                       "drop {memory_budget_bytes}")

    def _check_device_options(self) -> None:
        """Parse `alloc_conf`; raise UsageError for a bad `gpu_memory_bytes` or `cuda_context_bytes`, CUDA options
        on a CPU target, or a bad `cuda_version`."""
        if self.gpu_memory_bytes is not None and (isinstance(self.gpu_memory_bytes, bool)
                                                  or not isinstance(self.gpu_memory_bytes, int)
                                                  or self.gpu_memory_bytes <= 0):
            raise _bad(f"{{gpu_memory_bytes}} must be a positive size, e.g. 48GiB, got {self.gpu_memory_bytes!r}")
        object.__setattr__(self, "alloc_conf", AllocConf.parse(self.alloc_conf)
                           if not isinstance(self.alloc_conf, AllocConf) else self.alloc_conf)
        if self.device is not Device.CUDA and (self.cuda_context_bytes is not None or str(self.alloc_conf)
                                               or self.cuda_version is not None):
            raise _bad("{cuda_context_bytes}, {cuda_version} and {alloc_conf} describe a CUDA device; drop them for "
                       "{device} cpu")
        if self.cuda_context_bytes is not None and (isinstance(self.cuda_context_bytes, bool)
                                                    or not isinstance(self.cuda_context_bytes, int)
                                                    or self.cuda_context_bytes < 0):
            raise _bad(f"{{cuda_context_bytes}} must be a size, e.g. 800MiB, got {self.cuda_context_bytes!r}")
        self._check_cuda_version()

    def _check_cuda_version(self) -> None:
        """Raise UsageError for a CUDA version other than 12 or 13, or CUDA 13 on a GPU it has no kernels for."""
        if self.cuda_version is not None and (isinstance(self.cuda_version, bool)
                                              or not isinstance(self.cuda_version, int)):
            raise _bad(f"{{cuda_version}} must be 12 or 13, got {self.cuda_version!r}")
        if self.device is Device.CUDA:
            cuda_context_default(self.gpu_preset.sm, self.cuda_major)

    def _check_packing(self) -> None:
        """Raise UsageError for packing outside a transformers model's training step or with its KV cache on; else
        the config's use_cache is False (transformers looks for packed sequences only with no cache)."""
        if not self.packing:
            return
        if self.mode is not Mode.TRAIN or self.serve_requests is not None:
            raise _bad("{packing} packs training sequences; drop it for --mode inference or generate")
        if custom_ref(self.model) is not None or self.step is not None or self.compile:
            raise _bad("{packing} applies to a transformers model's own training step (no custom module, {step} "
                       "or {compile})")
        if self.use_cache:
            raise _bad("{packing} runs without a KV cache (transformers separates packed sequences only with no "
                       "cache); drop {use_cache} true")
        object.__setattr__(self, "use_cache", False)  # what packing trainers set; the report says use_cache false

    def _check_custom_options(self) -> None:
        """Raise UsageError for a transformers-only option given with a custom module (`custom_ref`)."""
        if custom_ref(self.model) is None:
            return
        if self.task is not None or self.attn_implementation is not None:
            raise _bad("{task} and {attn_implementation} apply to transformers models, not custom modules")
        if self.use_cache is not None:  # no config to set use_cache on
            raise _bad("{use_cache} sets a transformers config's use_cache; a custom module has no KV-cache "
                       "option: drop {use_cache}")

    def _resolve_optimizer(self) -> None:
        """Parse `optimizer` (also HF Trainer's names: `adamw_torch_fused` also sets the fused implementation) and
        `optimizer_impl`; raise UsageError for an implementation the optimizer does not have."""
        hf = HF_OPTIM_NAMES.get(str(getattr(self.optimizer, "value", self.optimizer)).strip().lower())
        kind = OptimizerKind.parse(self.optimizer, "optimizer")
        impl = OptimizerImpl.parse(self.optimizer_impl, "optimizer implementation")
        if hf is not None and hf[1] is not None:
            if impl not in (OptimizerImpl.DEFAULT, OptimizerImpl(hf[1])):
                raise _bad(f"{{optimizer}} {self.optimizer} is {kind.value} with {{optimizer_impl}} {hf[1]}; drop "
                           f"{{optimizer_impl}} {impl.value}")
            impl = OptimizerImpl(hf[1])
        if impl not in OPTIMIZER_IMPLS[kind]:
            raise _bad(f"{{optimizer}} {kind.value} has no {impl.value} implementation; use {{optimizer_impl}} "
                       f"{' or '.join(i.value for i in OPTIMIZER_IMPLS[kind])}")
        object.__setattr__(self, "optimizer", kind)
        object.__setattr__(self, "optimizer_impl", impl)

    def _check_generate_options(self) -> None:
        """Raise UsageError for generation options given without --mode generate, or missing with it, and for
        packing outside a training step (`_check_packing`)."""
        self._check_packing()
        if self.mode is not Mode.GENERATE:
            if self.new_tokens is not None or self.cache is not CacheKind.DYNAMIC or self.kv_dtype is not KvDtype.AUTO:
                raise _bad("{new_tokens}, {cache} and {kv_dtype} apply to {mode} generate; add it or drop them")
            return
        if self.kv_dtype is not KvDtype.AUTO and self.cache is not CacheKind.DYNAMIC:
            raise _bad(f"{{kv_dtype}} {self.kv_dtype.value} is transformers' QuantizedCache, a dynamic cache; drop "
                       f"{{cache}} {self.cache.value}")
        if self.new_tokens is None:
            raise _bad("{mode} generate needs {new_tokens} N (the prompt is {seq} tokens)")
        if self.seq is None:
            raise _bad("{mode} generate needs {seq} S, the prompt length")
        if custom_ref(self.model) is not None:
            raise _bad("{mode} generate runs transformers' model.generate(); a custom module has none")
        if self.lora_rank is not None:
            raise _bad("{mode} generate with {lora_rank} is not supported yet (peft's generate wraps the "
                       "model's); merge the adapter or drop {lora_rank}")

    def _check_recipe(self) -> None:
        """Parse `recipe`; refuse it outside training, for a custom module, for quantization without LoRA, and
        axolotl with fp4; its defaults: 4-bit double quantization (axolotl's `_set_quantization_config` always,
        LLaMA-Factory's `double_quantization` default True: so `double_quant` False is not expressible with a
        recipe), use_cache False (axolotl `loaders/utils.py check_model_config`, LLaMA-Factory
        `model_utils/kv_cache.py configure_kv_cache`) and the checkpointing it enables (`RECIPE_CHECKPOINTING`)
        when none is given."""
        if self.recipe is None:
            return
        recipe = Recipe.parse(self.recipe, "{recipe}")
        object.__setattr__(self, "recipe", recipe)
        if self.mode is not Mode.TRAIN:
            raise _bad(f"{{recipe}} {recipe.value} builds a model for training; drop it for {{mode}} {self.mode.value}")
        if custom_ref(self.model) is not None or isinstance(self.model, InProcessModel):
            raise _bad(f"{{recipe}} {recipe.value} builds a transformers model from its config; drop it for a "
                       "custom or in-process module")
        if self.quantization is not None and self.lora_rank is None:
            raise _bad(f"{{recipe}} {recipe.value} quantizes the weights for an adapter only (axolotl validate_adapter, "
                       "LLaMA-Factory's quantization_bit with finetuning_type lora); add {lora_rank} or drop "
                       "{quantization}")
        if recipe is Recipe.AXOLOTL and self.quantization is Quantization.FP4:
            raise _bad("{recipe} axolotl quantizes 4-bit weights as nf4 (loaders/model.py _set_quantization_config); "
                       "use {quantization} nf4")
        if self.quantization in (Quantization.NF4, Quantization.FP4):
            # axolotl always, LLaMA-Factory by default (`double_quantization: true`) quantize the absmax too
            object.__setattr__(self, "double_quant", True)
        if self.use_cache is None:
            object.__setattr__(self, "use_cache", False)
        if self.checkpointing is None:
            object.__setattr__(self, "checkpointing", RECIPE_CHECKPOINTING[recipe])
        if recipe is Recipe.LLAMAFACTORY and self.freeze and str(self.checkpointing) != "none":
            raise _bad("{recipe} llamafactory checkpoints only the layers that have trainable parameters "
                       "(its get_custom_gradient_checkpointing_func), which is not modelled with {freeze}; add "
                       "{checkpointing} none or drop {freeze}")

    def _check_quantization(self) -> None:
        if self.quantization is not None:
            object.__setattr__(self, "quantization", Quantization.parse(self.quantization, "{quantization}"))
        elif self.double_quant or self.bnb_compute_dtype is not None:
            raise _bad("{double_quant} and {bnb_compute_dtype} apply to {quantization} nf4|fp4; add it or drop "
                       "them")
        if self.bnb_compute_dtype is not None and self.bnb_compute_dtype not in ("bf16", "fp16", "fp32"):
            raise _bad(f"unknown {{bnb_compute_dtype}} {self.bnb_compute_dtype!r}; choose one of: bf16, fp16, fp32")
        if self.quantization is None:
            return
        if self.quantization is Quantization.INT8 and (self.double_quant or self.bnb_compute_dtype is not None):
            raise _bad("{double_quant} and {bnb_compute_dtype} apply to the 4-bit types (nf4, fp4), not to int8 "
                       "(its matmuls compute in the input's dtype); drop them")
        if custom_ref(self.model) is not None:
            raise _bad("{quantization} loads a transformers model through BitsAndBytesConfig; a custom module "
                       "has no quantizer")
        if self.fsdp is not None or self.tp is not None or self.ddp is not None:
            raise _bad("{quantization} with {fsdp}, {tp} or {ddp} is not supported yet; drop one")

    @property
    def world(self) -> int | None:
        """The ranks of a distributed step (fsdp × tp, or ddp); None on one device."""
        if self.ddp is not None:
            return self.ddp
        if self.fsdp is None and self.tp is None:
            return None
        return (self.fsdp or 1) * (self.tp or 1)

    def _check_sharding(self) -> None:
        """Raise UsageError for sharding options that do not go together."""
        if self.ddp is not None:
            if self.fsdp is not None or self.tp is not None:
                raise _bad("{ddp} replicates the model on N ranks; it does not combine with {fsdp} or {tp} "
                           "(use {fsdp} M {tp} N for a 2-D mesh)")
            if (self.rank is not None or not self.reshard_after_forward or self.fsdp_plan is not FsdpPlan.LAYERS
                    or self.cpu_offload):
                raise _bad("{reshard_after_forward}, {fsdp_plan}, {cpu_offload} and {rank} apply to {fsdp} N or "
                           "{tp} N; drop them")
            self._check_distributed("{ddp}")
            return
        if self.fsdp is None and (not self.reshard_after_forward or self.fsdp_plan is not FsdpPlan.LAYERS
                                  or self.cpu_offload):
            raise _bad("{reshard_after_forward}, {fsdp_plan} and {cpu_offload} apply to {fsdp} N; add it or "
                       "drop them")
        if self.cpu_offload and (self.fsdp_plan is not FsdpPlan.LAYERS
                                 or Device.parse(self.device, "device") is not Device.CUDA):
            raise _bad("{cpu_offload} moves FSDP2's shards from a GPU to host memory: it needs {fsdp_plan} "
                       "layers and a CUDA target (with {device} cpu they are in host memory already)")
        if self.fsdp_plan is FsdpPlan.TRANSFORMERS and not self.reshard_after_forward:
            raise _bad("{fsdp_plan} transformers says per module whether it reshards after forward; drop "
                       "{reshard_after_forward}")
        if self.world is None:
            if self.rank is not None and self.zero is None:  # --zero checks its own (`_check_zero`)
                raise _bad("{rank} applies to {fsdp} N or {tp} N; add one or drop it")
            return
        if self.fsdp is not None or self.mode is Mode.TRAIN:  # TP alone also serves (inference, generate)
            self._check_distributed("{fsdp}" if self.fsdp is not None else "{tp}")
        elif custom_ref(self.model) is not None:
            raise _bad("{tp} applies the transformers model's own plan; a custom module has none")
        if self.rank is not None and (isinstance(self.rank, bool) or not isinstance(self.rank, int)
                                      or not 0 <= self.rank < self.world):
            raise _bad(f"{{rank}} must be in 0..{self.world - 1} for {self.world} ranks, got {self.rank}")

    def _check_zero(self) -> None:
        """Parse the ZeRO offloads; raise UsageError for ZeRO options that do not go together (tracer/zero.py)."""
        for name in ("offload_optimizer", "offload_param"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, ZeroOffload.parse(getattr(self, name), f"{{{name}}} device"))
        if self.zero is None:
            if self.dp is not None or self.offload_optimizer or self.offload_param or self.deepspeed_config:
                raise _bad("{dp}, {offload_optimizer}, {offload_param} and {deepspeed_config} apply to {zero} 1|2|3; "
                           "add it or drop them")
            return
        if isinstance(self.zero, bool) or self.zero not in (1, 2, 3):
            raise _bad(f"{{zero}} must be 1, 2 or 3 (DeepSpeed's ZeRO stage), got {self.zero!r}")
        if self.dp is None or isinstance(self.dp, bool) or not isinstance(self.dp, int) or self.dp <= 0:
            raise _bad(f"{{zero}} needs {{dp}} N, the data-parallel ranks (a positive integer), got {self.dp!r}")
        if self.fsdp is not None or self.tp is not None or self.ddp is not None:
            raise _bad("{zero} is DeepSpeed's sharding; it does not combine with {fsdp}, {tp} or {ddp}")
        self._match_ds_config()
        if self.offload_param is not None and self.zero != 3:
            raise _bad("{offload_param} offloads ZeRO-3's parameter partitions; it needs {zero} 3")
        if ZeroOffload.NVME in (self.offload_optimizer, self.offload_param):
            raise _bad("NVMe offload is not modelled yet (DeepSpeed's aio swapper); use cpu")
        if self.quantization is not None or self.lora_rank is not None or self.compile:
            raise _bad("{zero} with {quantization}, {lora_rank} or {compile} is not modelled yet; drop one")
        ignored = [name for name, given in (
            ("{optimizer_impl}", OptimizerImpl.parse(self.optimizer_impl, "optimizer implementation")
             is not OptimizerImpl.DEFAULT),
            ("{zero_grad}", ZeroGrad.parse(self.zero_grad, "{zero_grad} value") is not ZeroGrad.NONE),
            ("{loop}", Loop.parse(self.loop, "loop") is not Loop.TRAINER)) if given]
        if ignored:  # DeepSpeed's engine runs its own step, zeroing and optimizer (tracer/zero.py `zero_config`)
            raise _bad(f"{{zero}} runs DeepSpeed's engine loop (engine.backward, engine.step), which "
                       f"{', '.join(ignored)} would not change; drop {'it' if len(ignored) == 1 else 'them'}")
        if OptimizerKind.parse(self.optimizer, "{optimizer}") not in (OptimizerKind.ADAMW, OptimizerKind.ADAM):
            raise _bad("{zero} runs DeepSpeed's Adam/AdamW (the ds_config's optimizer); {optimizer} "
                       f"{OptimizerKind.parse(self.optimizer, '{optimizer}').value} is not modelled with it yet")
        if self.rank is not None and (isinstance(self.rank, bool) or not isinstance(self.rank, int)
                                      or not 0 <= self.rank < self.dp):
            raise _bad(f"{{rank}} must be in 0..{self.dp - 1} for {self.dp} ranks, got {self.rank}")
        self._check_distributed("{zero}")

    def _match_ds_config(self) -> None:
        """With `deepspeed_config`: the file's offload devices where the spec gives none; raise UsageError where
        the file fixes (not "auto") a stage, micro-batch, accumulation or clipping (when `clip_grad_norm` is given)
        that the spec's differs from (HF's integration refuses such a mismatch: transformers
        integrations/deepspeed.py `HfDeepSpeedConfig.fill_match`), or for a file `read_ds_config` refuses."""
        if self.deepspeed_config is None:
            return
        from .sources.deepspeed import read_ds_config

        ds = read_ds_config(self.deepspeed_config)
        for name in ("offload_optimizer", "offload_param"):
            if getattr(self, name) is None and getattr(ds, name) is not None:
                object.__setattr__(self, name, ZeroOffload.parse(getattr(ds, name), f"{{{name}}} device"))
        for key, value, field in (("zero_optimization.stage", ds.stage, "zero"),
                                  ("train_micro_batch_size_per_gpu", ds.micro_batch, "batch"),
                                  ("gradient_accumulation_steps", ds.grad_accum, "grad_accum")):
            if value is not None and value != getattr(self, field):
                raise _bad(f"{{deepspeed_config}} {ds.path} sets {key} {value} but {{{field}}} is "
                           f"{getattr(self, field)}; make them agree or set it to \"auto\" in the file")
        clipping = ds.config.get("gradient_clipping")
        if self.clip_grad_norm is not None and clipping not in (None, "auto") and clipping != self.clip_grad_norm:
            raise _bad(f"{{deepspeed_config}} {ds.path} sets gradient_clipping {clipping} but {{clip_grad_norm}} is "
                       f"{self.clip_grad_norm}; make them agree or set it to \"auto\" in the file")

    def _check_distributed(self, option: str) -> None:
        if self.mode is not Mode.TRAIN:
            raise _bad(f"{option} runs a training step on N ranks; {{mode}} {self.mode.value} is not supported "
                       "with it yet")
        if custom_ref(self.model) is not None:
            raise _bad(f"{option} wraps a transformers model (its layer stack and plans); a custom module "
                       f"({self.model}) has none: drop {option}, or use a transformers model")
        if self.step is not None:
            raise _bad(f"{option} runs vramtrace's own loop on each rank; {{step}} {self.step} replaces it: drop "
                       f"{{step}} or {option}")

    def _check_pipeline(self) -> None:
        """Parse `pp_schedule` and `pp_split`; raise UsageError for pipeline options that do not go together
        (tracer/pipelining.py says what a --pp run traces)."""
        from .pp_options import check_pipeline

        check_pipeline(self, _bad)

    def _check_serve_profile(self) -> None:
        if self.serve_requests is None:
            return
        if self.mode is not Mode.INFERENCE or self.batch != 1 or self.seq is None or self.serve_requests > self.seq:
            raise _bad("a serving profile run is one inference forward of batch 1 and at least as many "
                       "tokens as requests")

    def _check_compile(self) -> None:
        """--compile: what the compiled tracer (`tracer/compiled_step.py`) models, else a UsageError naming the
        option to drop."""
        if self.compile_mode not in COMPILE_MODES:
            raise _bad(f"unknown {{compile_mode}} {self.compile_mode!r}; use {' or '.join(COMPILE_MODES)} (the "
                       "CUDA-graph modes, reduce-overhead and max-autotune, are CUDA's)")
        if not self.compile:
            return
        if self.device is not Device.CPU:
            raise _bad("{compile} is traced for {device} cpu only: Inductor's CUDA graphs (Triton kernels, "
                       "flash or memory-efficient SDPA) cannot be captured on a CPU-only torch; add {device} cpu")
        if self.mode is not Mode.TRAIN:
            raise _bad("{compile} models a training step; drop {compile} for {mode} inference or generate")
        for flag, value in (("{fsdp}", self.fsdp), ("{tp}", self.tp), ("{ddp}", self.ddp),
                            ("{quantization}", self.quantization), ("{step}", self.step),
                            ("{lora_rank}", self.lora_rank)):
            if value is not None:
                raise _bad(f"{{compile}} with {flag} is not traced yet; drop one of the two")
        if self.optimizer in BNB_OPTIMIZERS:  # their state setup reads values the fake twin does not have
            raise _bad(f"{{compile}} with bitsandbytes' optimizer {self.optimizer.value} is not traced yet; use a "
                       "torch.optim optimizer or drop {compile}")

    def _check_step_options(self) -> None:
        """Raise UsageError for step options that would be silently ignored."""
        loop_options = [name for name, given in (
            ("{loop}", self.loop is not Loop.TRAINER), ("{grad_accum}", self.grad_accum != 1),
            ("{zero_grad}", self.zero_grad is not ZeroGrad.NONE), ("{clip_grad_norm}", self.clip_grad_norm is not None))
            if given]
        if self.mode is not Mode.TRAIN and (loop_options or self.step):
            raise _bad(f"{', '.join(loop_options + (['{step}'] if self.step else []))} appl"
                       f"{'ies' if len(loop_options) + bool(self.step) == 1 else 'y'} to training; drop "
                       f"it for {{mode}} {self.mode.value}")
        if self.step is not None:
            target = custom_ref(self.step)
            if target is None or not target[0].endswith(".py"):
                raise _bad(f"bad {{step}} {self.step!r}; use path/to/file.py:FUNC")
            if loop_options:
                raise _bad(f"{{step}} runs your own step function as written: drop {', '.join(loop_options)} "
                           "(write it in the function)")

    @property
    def pp_micro_batches(self) -> int | None:
        """M, the micro-batches of one pipeline step: `micro_batches`, else `pp` (M = P, real_pp.py's default); None
        without `pp`."""
        return None if self.pp is None else self.micro_batches or self.pp

    @property
    def pp_virtual_stages(self) -> int | None:
        """V, the stages each pipeline rank holds: `virtual_stages` under interleaved-1f1b and zero-bubble, else
        their default 2 (tests/pp_oracle.py's); 1 for the one-stage-per-rank schedules; None without `pp`."""
        if self.pp is None:
            return None
        if not self.pp_schedule.multi_stage:  # a PipelineSchedule, parsed by `_check_pipeline`
            return 1
        return self.virtual_stages or 2

    @property
    def in_process(self) -> InProcessModel | None:
        """The nn.Module passed to `analyze(model=...)` that `model` carries, else None (a reference string)."""
        return self.model if isinstance(self.model, InProcessModel) else None

    @property
    def effective_precision(self) -> Precision:
        if self.precision is not None:
            return self.precision
        if self.recipe is not None:
            return Precision.BF16_AUTOCAST
        return Precision.BF16_MIXED if self.mode is Mode.TRAIN else Precision.BF16

    @property
    def gpu_preset(self) -> GpuPreset:
        return parse_gpu(self.gpu)

    @property
    def cuda_major(self) -> int:
        """The CUDA major version of the target's torch build: `cuda_version`, else the default for its GPU."""
        return self.cuda_version if self.cuda_version is not None else default_cuda_major(self.gpu_preset.sm)

    @property
    def cuda_context_figure(self) -> CudaContext:
        """The CUDA context the verdict assumes and why: `--cuda-context` when given, else the figure for the GPU's
        family and CUDA version (`device.cuda_context_default`). Raises UsageError (a CUDA version with no kernels
        for the GPU). CUDA target only."""
        if self.cuda_context_bytes is not None:
            return CudaContext(self.cuda_context_bytes, "--cuda-context")  # the report's source, not an error
        preset, major = self.gpu_preset, self.cuda_major
        found = cuda_context_default(preset.sm, major)
        return CudaContext(found.nbytes, f"default for {preset.name} (sm{preset.sm}) with CUDA {major}"
                           f"{'' if self.cuda_version is not None else ' (torch 2.13 PyPI wheel)'}: {found.source}")

    @property
    def cuda_context(self) -> int:
        """Bytes of the CUDA context on the target (0 on the CPU target)."""
        if self.device is not Device.CUDA:
            return 0
        return self.cuda_context_figure.nbytes

    @property
    def capacity(self) -> tuple[str, int] | None:
        """(name, bytes) of the capacity the fit verdict checks: `--gpu-memory` when given, else the GPU preset's on
        a CUDA target; None on the CPU target without `--gpu-memory`."""
        if self.gpu_memory_bytes is not None:
            return ("a CUDA device" if self.device is Device.CUDA else "the CPU"), self.gpu_memory_bytes
        if self.device is Device.CUDA:
            return self.gpu_preset.name, self.gpu_preset.memory_bytes
        return None


RUN_SPEC_FIELDS = frozenset(f.name for f in fields(RunSpec))  # the `{field}` names of a SpecError's template
