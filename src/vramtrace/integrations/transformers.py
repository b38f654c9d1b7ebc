"""HF `Trainer` integration: `VramtraceCallback` predicts the training step of the trainer it is given to, at
`on_train_begin` (before the first step); `check(trainer)` does the same without a callback.

What is read from the trainer (transformers 5.24):
- the model as built (`Trainer.model`: peft wrappers, frozen parameters, dtypes, checkpointing already enabled),
  copied to the meta device (`meta_copy`: no weight is copied, no memory allocated; the trainer's model is not
  changed);
- the batch: `per_device_train_batch_size` rows of the train dataloader's dataset (its first rows, indexed, under
  `torch.random.fork_rng`) through the dataloader's own `collate_fn` (the Trainer's collator and column
  removal): the keys, dtypes and shapes of what the Trainer feeds the model. `seq=N` replaces the collated
  sequence length (dimension 1 of every tensor that has it) by N, e.g. the longest row of a padded dataset.
  When the model accepts loss kwargs and the batch has `labels`, the Trainer also passes `num_items_in_batch`
  (an int64 scalar, `Trainer.get_batch_samples`): it is passed too;
- the loss as `Trainer.compute_loss` takes it: `outputs["loss"]` (or `outputs[0]`), after accelerate's
  `convert_outputs_to_fp32` under bf16/fp16 (accelerate/accelerator.py `prepare_model`: the model's forward runs
  under autocast and its half-precision outputs are copied to fp32);
- `args`: `gradient_accumulation_steps`, `bf16`/`fp16` with the weights' dtype -> precision (fp32 weights:
  bf16-mixed / fp16-mixed; bf16 or fp16 weights: bf16-autocast / fp16-autocast), `optim` (HF names,
  `optimizer_names.HF_OPTIM_NAMES`), `max_grad_norm` -> `clip_grad_norm` (`clip_of`: inf when it is 0, the
  norm the Trainer still takes), `activation_checkpointing` (`gradient_checkpointing` before 5.23) and its kwargs
  (None or {}: non-reentrant, `Trainer.train` passes `kwargs or None`; `every_n_layers` N > 1: `nth:N`);
- the device: the model's. A CUDA model: the preset named by `torch.cuda.get_device_name()` (`gpus.preset_for_device`)
  and as capacity what this process may still use, `mem_get_info()` free + `memory_reserved()` + the CUDA context
  vramtrace assumes (the context is counted in the peak); a CPU model: the CPU target (a verdict only with
  `gpu_memory`);
- what the Trainer's loop holds besides the batch it feeds (`loop_held`): the step's other micro-batches,
  accelerate's batch ahead on the CPU target, the previous step's loss and gradient norm scalars.
A quantized model (QLoRA) keeps its bitsandbytes weights in the copy; the trace counts them and their constants
from the step's start (`tracer/trace.py` registers an in-process model's quantized weights).
Not modelled (a warning line each, the prediction goes on): `label_smoothing_factor`, more than one GPU
(DataParallel), DeepSpeed and FSDP (`args.deepspeed`, `args.fsdp`), `torch_compile`. A `compute_loss_func` or an
overridden `compute_loss` is not seen: the loss is the model's own.
"""

from __future__ import annotations

import copy
import enum
import inspect
import logging
from collections.abc import Mapping
from typing import Any

import torch
from transformers import TrainerCallback

from ..errors import UsageError, WouldNotFit
from ..pipeline import analyze
from ..spec import Device, Precision, RunSpec
from ..tracer.custom import in_process_model
from ..units import format_bytes, parse_bytes

LOG = logging.getLogger("vramtrace")
TOP_TENSORS = 5  # tensors live at the peak that are logged


class OomRisk(str, enum.Enum):
    """What the check does when the step does not fit: log a warning, raise `WouldNotFit`, or only log the peak."""

    WARN = "warn"
    RAISE = "raise"
    IGNORE = "ignore"


def oom_risk(value: OomRisk | str) -> OomRisk:
    """`value` as an OomRisk. Raises UsageError naming the choices."""
    try:
        return OomRisk(value)
    except ValueError:
        raise UsageError(f"unknown on_oom_risk {value!r}; choose one of: "
                         f"{', '.join(r.value for r in OomRisk)}") from None


def meta_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of `model` whose parameters, buffers and tensor attributes are meta tensors of the same shape,
    strides, dtype, class (peft's layers, bitsandbytes' `Params4bit` with its `quant_state` tensors) and
    `requires_grad`: nothing is copied to real memory. Tied weights stay tied. Every tensor's meta twin is in the
    deepcopy memo before anything is copied (a `Params4bit` refers to its module, whose copy must find the twin).
    accelerate's forward wrapper (`_original_forward`, set by `Accelerator.prepare_model` under mixed precision) is
    dropped from the copy: its forward is the class's (the check applies autocast itself)."""
    memo: dict[int, Any] = {}
    subclassed: list[tuple[torch.Tensor, torch.Tensor]] = []
    for module in model.modules():
        for value in [*module._parameters.values(), *module._buffers.values(), *vars(module).values()]:
            _remember(value, memo, subclassed, depth=0)
    for original, twin in subclassed:
        vars(twin).update(copy.deepcopy(vars(original), memo))  # bitsandbytes' quant_state, blocksize, module, ...
    copied = copy.deepcopy(model, memo)
    for module in copied.modules():
        if "_original_forward" in vars(module):
            vars(module).pop("_original_forward")
            vars(module).pop("forward", None)
    return copied


def _remember(value: Any, memo: dict[int, Any], subclassed: list, depth: int) -> None:
    """Put a meta twin of `value` (a tensor, or the tensors among an object's attributes, two levels deep: a
    quant_state and its nested state2) into `memo`; a parameter with attributes goes to `subclassed` too."""
    if isinstance(value, torch.Tensor):
        if id(value) in memo:
            return
        meta = torch.empty_strided(value.size(), value.stride(), dtype=value.dtype, device="meta")
        if isinstance(value, torch.nn.Parameter):
            meta = torch.Tensor._make_subclass(type(value), meta, value.requires_grad)
            if vars(value):
                subclassed.append((value, meta))
        memo[id(value)] = meta
        for v in list(vars(value).values()):
            _remember(v, memo, subclassed, depth + 1)
    elif depth < 3 and hasattr(value, "__dict__") and not isinstance(value, (torch.nn.Module, type)):
        for v in list(vars(value).values()):
            _remember(v, memo, subclassed, depth + 1)


def accepts_loss_kwargs(model: torch.nn.Module) -> bool:
    """Whether the Trainer passes `num_items_in_batch` to the model (transformers/trainer.py `Trainer.__init__`:
    the unwrapped model's `accepts_loss_kwargs`, else a `**kwargs` in its forward's signature)."""
    unwrapped = model.get_base_model() if hasattr(model, "get_base_model") else model
    if hasattr(unwrapped, "accepts_loss_kwargs"):
        return bool(unwrapped.accepts_loss_kwargs)
    params = inspect.signature(unwrapped.forward).parameters.values()
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def first_batch(dataloader, batch_size: int) -> Mapping:
    """The first `batch_size` rows of `dataloader.dataset` through `dataloader.collate_fn`, under
    `torch.random.fork_rng` (the training's random state is left as it was). Raises UsageError for a dataset
    without indexing (an IterableDataset) or a batch that is not a dict of tensors."""
    dataset = getattr(dataloader, "dataset", None)
    if dataset is None or not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
        raise UsageError("the train dataset is not indexable (an IterableDataset?): vramtrace's Trainer check "
                         "needs dataset[i] to build a batch's shape")
    if len(dataset) < batch_size:
        raise UsageError(f"the train dataset has {len(dataset)} rows, fewer than per_device_train_batch_size "
                         f"{batch_size}")
    with torch.random.fork_rng():
        batch = dataloader.collate_fn([dataset[i] for i in range(batch_size)])
    if not isinstance(batch, Mapping) or not any(isinstance(v, torch.Tensor) for v in batch.values()):
        raise UsageError(f"the collated batch is a {type(batch).__name__}, not a dict of tensors; vramtrace's "
                         "Trainer check feeds the model keyword arguments as Trainer.compute_loss does")
    return batch


def meta_inputs(batch: Mapping, batch_size: int, seq: int | None, num_items: bool
                ) -> tuple[dict[str, Any], int | None]:
    """(the model's keyword inputs, the sequence length): each tensor of `batch` as a shape spec
    `DTYPE[DIMS]` (`custom_inputs.InputSpec`) whose dimension 0 is B when it is the batch size and dimension 1 is S
    when it is the collated sequence length, so that a lever changing --batch or --seq changes them too; with
    `seq`, S is `seq` instead of the collated length; `num_items_in_batch` (an int64 scalar) when `num_items` and
    the batch has labels. A value that is None is left out. Raises UsageError for any other non-tensor value."""
    from ..custom_inputs import INPUT_DTYPES

    ids = batch.get("input_ids", next(v for v in batch.values() if isinstance(v, torch.Tensor)))
    length = ids.shape[1] if ids.dim() >= 2 else None
    inputs: dict[str, Any] = {}
    for key, value in batch.items():
        if value is None:
            continue
        if not isinstance(value, torch.Tensor):
            raise UsageError(f"the collated batch's {key!r} is a {type(value).__name__}, not a tensor: vramtrace's "
                             "Trainer check feeds tensors only")
        dtype = str(value.dtype).removeprefix("torch.")
        if dtype not in INPUT_DTYPES:
            inputs[key] = torch.empty(value.shape, dtype=value.dtype, device="meta")
            continue
        dims = [str(d) for d in value.shape]
        if dims and value.shape[0] == batch_size:
            dims[0] = "B"
        if len(dims) >= 2 and length is not None and value.shape[1] == length:
            dims[1] = "S"
        inputs[key] = f"{dtype}[{','.join(dims)}]"
    if num_items and "labels" in batch:
        inputs["num_items_in_batch"] = "int64[]"
    return inputs, (seq if seq is not None else length)


def loop_held(inputs: dict[str, Any], grad_accum: int, device: Device, grad_dtype: torch.dtype) -> dict[str, Any]:
    """What HF Trainer's loop keeps alive through a step besides the batch the model is fed, as shape specs (or
    meta tensors) by name (transformers 5.24 `Trainer._run_epoch`, accelerate 1.15 `DataLoaderShard.__iter__`):
    - `get_batch_samples` fetches the step's `gradient_accumulation_steps` micro-batches before its first
      micro-step and the list holds them to the step's end: N - 1 batches besides the one fed;
    - accelerate's `DataLoaderShard` iterates one batch ahead ("to check when we are at the end"), in host memory
      (it moves a batch to the device when it yields it): one more batch on the CPU target;
    - the previous step's `tr_loss_step` (`loss.detach()`, an fp32 scalar) until the next `training_step` returns,
      and its `grad_norm` (the total norm `clip_of` takes, a scalar of the gradients' dtype) until the next one: counted
      through the step (what each of them is replaced by lives to the step's end in its place)."""
    batches = grad_accum - 1 + (device is Device.CPU)
    held = {f"Trainer batch +{i + 1}: {key}": t for i in range(batches)
            for key, t in inputs.items() if key != "num_items_in_batch"}
    held["Trainer tr_loss_step"] = "float32[]"
    held["Trainer grad_norm"] = torch.empty((), dtype=grad_dtype, device="meta")
    return held


def precision_of(model: torch.nn.Module, args) -> Precision:
    """The step's precision from `args.bf16`/`args.fp16` and the weights' dtypes: mixed precision (autocast over
    fp32 weights) when any floating-point weight is fp32, else autocast over half-precision weights; without
    either flag the weights as built (fp32, or bf16/fp16 when all of them are)."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if args.bf16 or args.fp16:
        half = "bf16" if args.bf16 else "fp16"
        if torch.float32 in dtypes or not dtypes:
            return Precision(f"{half}-mixed")
        return Precision(f"{half}-autocast")
    if dtypes == {torch.bfloat16}:
        return Precision.BF16
    if dtypes == {torch.float16}:
        return Precision.FP16
    return Precision.FP32


def checkpointing_of(model: torch.nn.Module, args) -> str:
    """The `--checkpointing` policy the Trainer applies: `args.activation_checkpointing` (transformers >= 5.23;
    before, `gradient_checkpointing`) with its kwargs as `Trainer.train` passes them (`every_n_layers` and
    `offload` popped, the rest `or None`, None being non-reentrant in
    `PreTrainedModel.activation_checkpointing_enable`); else the model's own when its layers were checkpointed
    before (peft's `prepare_model_for_kbit_training`: reentrant); else 'none'. Raises UsageError for kwargs
    vramtrace does not model (`offload`, a `context_fn`, ...)."""
    on = getattr(args, "activation_checkpointing", False) or getattr(args, "gradient_checkpointing", False)
    kwargs = (getattr(args, "activation_checkpointing_kwargs", None)
              or getattr(args, "gradient_checkpointing_kwargs", None) or {})
    if not on:
        if not _checkpointed(model):
            return "none"
        funcs = [m._gradient_checkpointing_func for m in model.modules()
                 if getattr(m, "_gradient_checkpointing_func", None) is not None]
        kwargs = dict(getattr(funcs[0], "keywords", {}) if funcs else {})
        # enabled with kwargs {} (peft's prepare_model_for_kbit_training): checkpoint() without use_reentrant warns
        # and runs reentrant in torch 2.13 (torch/utils/checkpoint.py `checkpoint`)
        kwargs.setdefault("use_reentrant", True)
    kwargs = dict(kwargs)
    every = kwargs.pop("every_n_layers", 1)
    offload = kwargs.pop("offload", False)
    reentrant = bool(kwargs.pop("use_reentrant", False))
    if offload or kwargs:
        unknown = ", ".join(["offload"] * bool(offload) + sorted(kwargs))
        raise UsageError(f"activation_checkpointing_kwargs {unknown} are not modelled by vramtrace; drop them or "
                         "check the run without them")
    if every > 1:
        if reentrant:
            raise UsageError("reentrant checkpointing of every n-th layer is not modelled by vramtrace; use "
                             "use_reentrant=False or every_n_layers=1")
        return f"nth:{every}"
    return "layers:reentrant" if reentrant else "layers"


def _checkpointed(model: torch.nn.Module) -> bool:
    """Whether the model's layers run under activation checkpointing (`is_activation_checkpointing`, transformers
    >= 5.23; before, `is_gradient_checkpointing`)."""
    if hasattr(type(model), "is_activation_checkpointing") or hasattr(model, "activation_checkpointing_enable"):
        return bool(getattr(model, "is_activation_checkpointing", False))
    return bool(getattr(model, "is_gradient_checkpointing", False))


def _not_modelled(args) -> list[str]:
    """One line per TrainingArguments setting that changes memory and that the check does not model."""
    lines = []
    if getattr(args, "label_smoothing_factor", 0):
        lines.append("label_smoothing_factor (the Trainer's LabelSmoother computes the loss from the logits)")
    if getattr(args, "n_gpu", 1) > 1:
        lines.append(f"{args.n_gpu} GPUs under DataParallel (the check predicts one GPU's step)")
    if getattr(args, "deepspeed", None):
        lines.append("deepspeed (the callback predicts one GPU without ZeRO; use vramtrace's --deepspeed FILE --dp N)")
    if getattr(args, "fsdp", None):
        lines.append("fsdp (use vramtrace's --fsdp N on the command line)")
    if getattr(args, "torch_compile", False):
        lines.append("torch_compile (use vramtrace's --compile on the command line)")
    return lines


def target_of(model: torch.nn.Module, device: str | None, gpu: str | None, gpu_memory: int | str | None,
              headroom: float) -> dict[str, Any]:
    """RunSpec's target fields for the trainer's model: `device` (default: where the model's parameters are),
    on CUDA the `gpu` preset (default: `gpus.preset_for_device(torch.cuda.get_device_name())`) and as capacity
    `gpu_memory` or what this process may use (`mem_get_info()` free + `memory_reserved()` + the CUDA context the
    verdict counts), less `headroom` (a fraction). Raises UsageError (a GPU no preset matches and no `gpu`)."""
    from ..gpus import preset_for_device

    if not 0 <= headroom < 1:
        raise UsageError(f"headroom must be a fraction in [0, 1), e.g. 0.05; got {headroom!r}")
    first = next(model.parameters(), None)
    where = first.device if first is not None else torch.device("cpu")
    target = Device.parse(device, "device") if device else Device.CUDA if where.type == "cuda" else Device.CPU
    capacity = parse_bytes(gpu_memory, "gpu_memory") if isinstance(gpu_memory, str) else gpu_memory
    out: dict[str, Any] = {"device": target}
    if target is Device.CUDA:
        if gpu is None and where.type == "cuda":
            found = preset_for_device(torch.cuda.get_device_name(where))
            if found is None:
                raise UsageError(f"no GPU preset matches {torch.cuda.get_device_name(where)!r}: pass gpu= with the "
                                 "closest preset (same compute capability) and gpu_memory=")
            gpu = found.name
        out["gpu"] = gpu or "H100-80GB"
        major = int((torch.version.cuda or "0").split(".")[0])
        if major in (12, 13):
            out["cuda_version"] = major
        if capacity is None and where.type == "cuda":
            free, _total = torch.cuda.mem_get_info(where)
            context = RunSpec("probe", 1, None, **out).cuda_context
            capacity = free + torch.cuda.memory_reserved(where) + context
    if capacity is not None:
        out["gpu_memory_bytes"] = int(capacity * (1 - headroom))
    return out


def trainer_spec(model: torch.nn.Module, args, batch: Mapping, *, seq: int | None = None, device: str | None = None,
                 gpu: str | None = None, gpu_memory: int | str | None = None, headroom: float = 0.0
                 ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(RunSpec's options, the model's keyword inputs as shape specs) of the Trainer's step: see the module
    docstring."""
    for line in _not_modelled(args):
        LOG.warning("vramtrace: not modelled: %s", line)
    inputs, length = meta_inputs(batch, args.per_device_train_batch_size, seq, accepts_loss_kwargs(model))
    options = dict(batch=args.per_device_train_batch_size, seq=length, precision=precision_of(model, args),
                   optimizer=str(getattr(args.optim, "value", args.optim)),
                   grad_accum=args.gradient_accumulation_steps, checkpointing=checkpointing_of(model, args),
                   clip_grad_norm=clip_of(args),
                   **target_of(model, device, gpu, gpu_memory, headroom))
    return options, inputs


def clip_of(args) -> float:
    """`clip_grad_norm` of the Trainer's step: `max_grad_norm` when > 0, else inf: without clipping the Trainer
    still takes the norm for its logs as `clip_grad_norm_(model.parameters(), float("inf"))` (transformers/trainer.py
    `Trainer._get_grad_norm`), the same ops as a clip."""
    return float(args.max_grad_norm) if args.max_grad_norm and args.max_grad_norm > 0 else float("inf")


def trainer_loss(precision: Precision):
    """The loss as `Trainer.compute_loss` takes it from the outputs: under mixed precision first accelerate's
    `convert_to_fp32` (accelerate/utils/operations.py, applied by `Accelerator.prepare_model` around the autocast
    forward when `native_amp`: half-precision output tensors copied to fp32), then `outputs["loss"]` for a dict
    output, else `outputs[0]`."""
    half = precision not in (Precision.FP32, Precision.BF16, Precision.FP16)

    def loss(outputs, *inputs):
        if half:
            from accelerate.utils import convert_to_fp32

            outputs = convert_to_fp32(outputs)
        return outputs["loss"] if isinstance(outputs, Mapping) else outputs[0]
    return loss


def predict(model: torch.nn.Module, args, dataloader, *, on_oom_risk: OomRisk | str = OomRisk.WARN,
            seq: int | None = None, headroom: float = 0.0, device: str | None = None, gpu: str | None = None,
            gpu_memory: int | str | None = None, json_path: str | None = None):
    """The MemoryReport of the Trainer step of `model` under `args`, fed from `dataloader` (the module
    docstring says what is read), logged to the `vramtrace` logger; with `on_oom_risk` 'raise' a step that does not
    fit raises `WouldNotFit` naming the levers that fit, with 'warn' it logs a warning. `json_path`: also write the
    JSON report there. Raises UsageError (what the check cannot model), WouldNotFit, and analyze's errors."""
    risk = oom_risk(on_oom_risk)
    batch = first_batch(dataloader, args.per_device_train_batch_size)
    options, inputs = trainer_spec(model, args, batch, seq=seq, device=device, gpu=gpu, gpu_memory=gpu_memory,
                                   headroom=headroom)
    copied = meta_copy(model)
    if _checkpointed(copied):  # the trace applies the policy again, routing each checkpointed region through its
        disable = getattr(copied, "activation_checkpointing_disable", None) or copied.gradient_checkpointing_disable
        disable()  # recorder
    trainable = [p.dtype for p in model.parameters() if p.requires_grad]
    held = loop_held(inputs, options["grad_accum"], options["device"], trainable[0] if trainable else torch.float32)
    spec = RunSpec(in_process_model(copied, inputs, trainer_loss(options["precision"]), held), **options)
    report = analyze(spec, levers=risk is not OomRisk.IGNORE)
    if json_path is not None:
        from ..render.output import report_json

        report_json(report, json_path)
    for line in summary_lines(report):
        LOG.info("vramtrace: %s", line)
    if report.fit is not None and not report.fit.fits and risk is not OomRisk.IGNORE:
        message = would_not_fit_text(report)
        if risk is OomRisk.RAISE:
            raise WouldNotFit(message)
        LOG.warning("vramtrace: %s", message)
    return report


def summary_lines(report) -> list[str]:
    """The peak (where it is), the verdict and the tensors live at the peak, one line each."""
    lines = [f"predicted peak {format_bytes(report.peak_allocated_bytes)} allocated ({report.peak_allocated_bytes:,} B)"
             f" in {report.peak_phase} at {report.peak_op} ({report.peak_module or 'the loop'})"
             + ("" if report.peak_reserved_bytes is None
                else f"; {format_bytes(report.peak_reserved_bytes)} reserved")]
    if report.fit is not None:
        fit = report.fit
        lines.append(f"{'fits' if fit.fits else 'does NOT fit'} {fit.gpu} ({format_bytes(fit.capacity_bytes)}, "
                     f"{fit.basis}): headroom {format_bytes(fit.headroom_bytes, signed=True)}")
    for row in report.top_tensors[:TOP_TENSORS]:
        lines.append(f"  live at the peak: {format_bytes(row.bytes)} {row.category} {row.dtype}"
                     f"[{','.join(map(str, row.shape))}] {row.name or row.module}")
    return lines


def would_not_fit_text(report) -> str:
    """One line: the step does not fit, and the levers that make it fit (cheapest first) or the combination."""
    fit, levers = report.fit, report.levers
    head = (f"the training step does not fit {fit.gpu}: peak {format_bytes(fit.capacity_bytes - fit.headroom_bytes)}"
            f" > capacity {format_bytes(fit.capacity_bytes)}")
    fitting = [row.options for row in (levers.levers if levers is not None else ()) if row.fits]
    if fitting:
        return f"{head}; levers that fit: {'; '.join(fitting[:3])}"
    if levers is not None and levers.combination is not None and levers.combination.fits:
        return f"{head}; no single lever fits, combined: {levers.combination.options}"
    return f"{head}; no lever vramtrace traced makes it fit"


def check(trainer, *, on_oom_risk: OomRisk | str = OomRisk.WARN, seq: int | None = None, headroom: float = 0.0,
          device: str | None = None, gpu: str | None = None, gpu_memory: int | str | None = None,
          json_path: str | None = None):
    """`VramtraceCallback`'s check of `trainer` (a `transformers.Trainer`) without training: its model, arguments
    and `get_train_dataloader()`. Returns the MemoryReport; raises as `predict`."""
    return predict(trainer.model, trainer.args, trainer.get_train_dataloader(), on_oom_risk=on_oom_risk, seq=seq,
                   headroom=headroom, device=device, gpu=gpu, gpu_memory=gpu_memory, json_path=json_path)


class VramtraceCallback(TrainerCallback):
    """A `TrainerCallback` that predicts the trainer's step at `on_train_begin`, before the first step (`predict`;
    options as `check`'s). The report is kept as `self.report`. With `on_oom_risk='raise'` a step that does not fit
    stops `trainer.train()` with `WouldNotFit` before any step has run."""

    def __init__(self, on_oom_risk: OomRisk | str = OomRisk.WARN, seq: int | None = None, headroom: float = 0.0,
                 device: str | None = None, gpu: str | None = None, gpu_memory: int | str | None = None,
                 json_path: str | None = None):
        self.options = dict(on_oom_risk=oom_risk(on_oom_risk), seq=seq, headroom=headroom, device=device, gpu=gpu,
                            gpu_memory=gpu_memory, json_path=json_path)
        self.report = None

    def on_train_begin(self, args, state, control, model=None, train_dataloader=None, **kwargs):
        if model is None or train_dataloader is None:
            raise UsageError("VramtraceCallback.on_train_begin got no model or train_dataloader from the Trainer")
        self.report = predict(model, args, train_dataloader, **self.options)
