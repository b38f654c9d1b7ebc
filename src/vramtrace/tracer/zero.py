"""DeepSpeed ZeRO (`--zero 1|2|3 --dp N`): DeepSpeed's own engine on one fake rank of N, recorded.

`deepspeed.initialize(model=..., config=...)` with the ds_config of the spec (`zero_config`), then the step as HF
Trainer and DeepSpeed's tutorial run it: `loss = engine(**batch).loss; engine.backward(loss); engine.step()`, two
optimizer steps (the first, where the optimizer makes its state, and the steady one), under vramtrace's recorder
(`recorder.StepRecorder`), kernel policy and bridges, so that liveness, categories and kernel rules apply.

How it runs without memory (issue 42 research, docs/research/issue-42-zero.md, `fake_zero.py`):
- torch's fake process group as rank r of N (`sharding.fake_rank`): DeepSpeed's allocations do not depend on the
  values the collectives carry (a real 2-process run and the fake one allocate the same).
- Everything under `FakeTensorMode` (below the recorder): DeepSpeed makes tensors on explicit devices ('cpu' for
  offload buffers; a 2 GB gradient bucket with its default `reduce_bucket_size`), which on plain meta would be
  real allocations.
- DeepSpeed's accelerator is its CPU accelerator with the meta device as its device (`feature_bridges.
  deepspeed_zero`): what DeepSpeed puts on its accelerator (device memory on a GPU) is a meta tensor, as every
  other device tensor of a vramtrace trace; what it puts on 'cpu' (the offload's host buffers) is a fake CPU
  tensor, recorded as host memory on a CUDA target (`recorder.HOST_DEVICE`, outside the device peak), counted
  on a CPU target (one memory).
- DeepSpeed's own meta tensors (stage_1_and_2.py `round_robin_bit16_meta`: `torch.zeros_like(param, device="meta")`,
  shape placeholders that cost nothing on a real device) are recorded on `PLACEHOLDER_DEVICE`, which no target
  counts (research mismatch 1).

Every layer is traced (no layer replication: DeepSpeed's flat buffers span the whole model).
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable

import torch

from .. import bridges, feature_bridges
from ..analysis.categories import Category
from ..errors import UsageError, VramtraceError
from ..spec import Device, Precision, RunSpec
from .building import LoadedModel, quiet_transformers_logs
from .hooks import module_hooks
from .kernels import KernelPolicyMode
from .records import MicroMarks, OpInfo, Phase
from .recorder import HOST_DEVICE, StepRecorder
from .step import STEPS

PLACEHOLDER_DEVICE = "meta_placeholder"  # DeepSpeed's own meta tensors: no memory on any target

# DeepSpeed's optimizer attributes (deepspeed 0.19.8 runtime/zero/stage_1_and_2.py `DeepSpeedZeroOptimizer`,
# stage3.py `DeepSpeedZeroOptimizer_Stage3`) -> the category and name of the storages they hold
ZERO_STATE_ATTRIBUTES: tuple[tuple[str, Category, str], ...] = (
    ("bit16_groups_flat", Category.PARAMETER, "ZeRO bit16 flat parameters"),
    ("fp16_partitioned_groups_flat", Category.PARAMETER, "ZeRO-3 bit16 parameter partitions"),
    ("single_partition_of_fp32_groups", Category.OPTIMIZER_STATE, "ZeRO fp32 master partition"),
    ("fp32_partitioned_groups_flat", Category.OPTIMIZER_STATE, "ZeRO-3 fp32 master partition"),
    ("grads_in_partition", Category.GRADIENT, "ZeRO contiguous gradient partition"),
    ("averaged_gradients", Category.GRADIENT, "ZeRO averaged gradients"),
    ("grad_partitions_flat_buffer", Category.GRADIENT, "ZeRO-3 gradient partitions"),
)
# `ipg_buckets` (a dict dtype -> bucket): each bucket's `buffer`, `reduce_bucket_size` elements (ZeRO-1/2: made at
# every backward's start, stage_1_and_2.py `backward_prologue`; ZeRO-3: made in `__init__` and kept, stage3.py)
BUCKET_NAME = "ZeRO gradient reduce bucket (reduce_bucket_size)"


def zero_precision(precision: Precision) -> bool:
    """Whether the ds_config enables bf16 for `precision` (DeepSpeed's `bf16.enabled`: the module cast to bf16,
    fp32 master partitions in the optimizer, as HF's integration sets it for `bf16=True`); fp32 is neither.
    Raises UsageError for a precision the trace does not model."""
    if precision is Precision.FP32:
        return False
    if precision in (Precision.BF16, Precision.BF16_MIXED):
        return True
    raise UsageError(f"--zero with --precision {precision.value} is not modelled yet (DeepSpeed's fp16 loss "
                     "scaling reads values); use fp32 or bf16-mixed")


def rank_classes(spec: RunSpec) -> list[tuple[int, ...]]:
    """The ranks of `spec.dp` grouped by what they hold: one class. ZeRO-1/2 ranks hold equal partitions of the
    flat buffers padded to a multiple of the ranks (stage_1_and_2.py `get_data_parallel_partitions`); ZeRO-3 pads
    each parameter to a multiple of the ranks and gives every rank `aligned_size // ranks` elements
    (partition_parameters.py `_aligned_size`, `_partition_param`): the last rank's padding sits inside a partition
    of the same size. Real 2-rank runs agree (tests/zero_oracle.py: both ranks' start and peak equal, ZeRO-3
    included, once the gloo threads' frees are counted)."""
    return [tuple(range(spec.dp))]


def _fake_model(model: torch.nn.Module, fake) -> torch.nn.Module:
    """A deep copy of `model` (meta) whose parameters and buffers are FakeTensors of `fake` on meta (tied
    parameters stay one): DeepSpeed sets `param.data` to views of its fake buffers, which a real meta tensor
    refuses (`set_data` with an incompatible tensor type)."""
    model = copy.deepcopy(model)
    made: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                if id(p) not in made:
                    made[id(p)] = torch.nn.Parameter(fake.from_tensor(p), requires_grad=p.requires_grad)
                module._parameters[name] = made[id(p)]
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = fake.from_tensor(b)
    return model


def _categorise(rec: StepRecorder, optimizer: Any) -> None:
    """Categories of DeepSpeed's storages from its optimizer's attributes (`ZERO_STATE_ATTRIBUTES`), the base
    optimizer's state (OPTIMIZER_STATE) and DeepSpeed's meta placeholders (`PLACEHOLDER_DEVICE`)."""
    def tensors(value: Any):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            for v in value:
                yield from tensors(v)
        elif isinstance(value, dict):
            for v in value.values():
                yield from tensors(v)

    for attribute, category, name in ZERO_STATE_ATTRIBUTES:
        for t in tensors(getattr(optimizer, attribute, None)):
            rec.set_category(t, category, name)
    for bucket in getattr(optimizer, "ipg_buckets", {}).values():
        for t in tensors(getattr(bucket, "buffer", None)):
            rec.set_category(t, Category.COLLECTIVE_BUFFERS, BUCKET_NAME)
    base = getattr(optimizer, "optimizer", None)
    for state in getattr(base, "state", {}).values():
        for key, v in state.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                rec.set_category(v, Category.OPTIMIZER_STATE, f"ZeRO optimizer state: {key}")
    for t in tensors(getattr(optimizer, "round_robin_bit16_meta", None)):
        sid = rec.live_sid(t)
        if sid is not None:
            rec.storages[sid].device = PLACEHOLDER_DEVICE


def _run_engine(spec: RunSpec, engine, loaded: LoadedModel, kwargs: dict, args: tuple, rec: StepRecorder,
                obs) -> None:
    """STEPS optimizer steps of `spec.grad_accum` micro-steps each: forward, loss, `engine.backward(loss)`,
    `engine.step()` (every micro-step: DeepSpeed steps its optimizer at the accumulation boundary)."""
    for k in range(STEPS):
        for m in range(spec.grad_accum):
            obs.begin(k, m)
            obs.phase(Phase.FORWARD)
            outputs = engine(*args, **kwargs)
            obs.forward_returned(outputs)
            loss = loaded.loss(outputs)
            del outputs
            obs.loss_taken()
            obs.phase(Phase.BACKWARD)
            engine.backward(loss)
            _categorise(rec, engine.optimizer)  # ZeRO-1/2's bucket, made in this backward
            obs.backward_returned()
            del loss
            obs.phase(Phase.OPTIMIZER)
            engine.step()
            _categorise(rec, engine.optimizer)
            obs.body_end()


def zero_config(spec: RunSpec, bf16: bool, file_config: dict | None = None) -> dict:
    """The ds_config `deepspeed.initialize` gets: `file_config` (a `--deepspeed` file's, its "auto" values
    resolved: sources/deepspeed.py) with the spec's stage, offloads, batch, accumulation and clipping (when given)
    over it, else one as a user writes it: AdamW (`torch_adam`: torch.optim.AdamW, deepspeed/runtime/engine.py
    `_configure_basic_optimizer`),
    `train_micro_batch_size_per_gpu` = batch, `gradient_accumulation_steps`, `zero_optimization.stage` and the
    offloads (`pin_memory` true, DeepSpeed's default), `bf16.enabled` for bf16. DeepSpeed's defaults fill the rest
    (deepspeed/runtime/zero/config.py: `reduce_bucket_size` 5e8 elements, ...). Adam/AdamW always with
    `torch_adam` (torch.optim's, where a GPU run would take DeepSpeed's FusedAdam or, offloaded, DeepSpeedCPUAdam:
    the same two states per element; their step's temporaries are torch's). Raises UsageError for another
    optimizer type."""
    cfg = copy.deepcopy(file_config) if file_config else {"steps_per_print": 10**9, "wall_clock_breakdown": False}
    # no optimizer block: the client's optimizer (HF Trainer passes torch's AdamW), the same states
    optimizer = cfg.setdefault("optimizer", {"type": "AdamW", "params": {"lr": 1e-4}})
    if str(optimizer.get("type", "")).lower() not in ("adam", "adamw"):
        raise UsageError(f"--zero: the ds_config's optimizer {optimizer.get('type')!r} is not modelled yet; use "
                         "Adam or AdamW")
    optimizer.setdefault("params", {})["torch_adam"] = True  # torch.optim.AdamW: FusedAdam's states, no compile
    cfg.update(train_micro_batch_size_per_gpu=spec.batch, gradient_accumulation_steps=spec.grad_accum,
               train_batch_size=spec.batch * spec.grad_accum * spec.dp)
    if spec.clip_grad_norm is not None:  # DeepSpeed clips in its optimizer's step (engine.py `gradient_clipping`)
        cfg["gradient_clipping"] = spec.clip_grad_norm
    zero = cfg.setdefault("zero_optimization", {})
    zero["stage"] = spec.zero
    for key, device in (("offload_optimizer", spec.offload_optimizer), ("offload_param", spec.offload_param)):
        if device is None:
            zero.pop(key, None)  # the spec's offloads are what runs (the CLI takes the file's when not given)
        else:
            zero[key] = {"pin_memory": True, **zero.get(key, {}), "device": device.value}
    cfg.pop("fp16", None)
    cfg["bf16"] = {**cfg.get("bf16", {}), "enabled": bf16}
    return cfg


def trace_zero(spec: RunSpec, loaded: LoadedModel, say: Callable[[str], None]):
    """Record `spec`'s ZeRO step as rank `spec.rank` (0 when None) of `spec.dp`: a `trace.TracedGraph` of every
    layer. Raises MissingExtraError (no deepspeed), UsageError (a precision not modelled), BridgeError,
    TraceError (what DeepSpeed or the model raised, one line)."""
    from .sharding import fake_rank
    from .trace import _TraceObserver, _trace_error

    from ..sources.deepspeed import spec_config

    bf16 = zero_precision(loaded.precision)
    config = zero_config(spec, bf16, spec_config(spec, loaded.model.config)[1])
    rank = spec.rank or 0
    say(f"DeepSpeed ZeRO-{spec.zero}, rank {rank} of {spec.dp}")
    rec = StepRecorder()
    with (quiet_transformers_logs(), _quiet_warnings(), fake_rank(spec.dp, rank),
          feature_bridges.deepspeed_zero(spec.dp, rank)):
        import deepspeed
        from torch._subclasses.fake_tensor import FakeTensorMode

        policy = _policy(spec, rec)
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        model = _fake_model(loaded.model, fake)
        kwargs = {k: fake.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in loaded.inputs.items()}
        args = tuple(fake.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in loaded.args)
        obs = _TraceObserver(rec, say, policy, None)
        bucket = 0
        engine = None  # alive until the recorder stops listening: its state is not freed by the step
        try:
            with (fake, bridges.installed(policy, rec), module_hooks(model, rec), policy,
                  torch.autograd.graph.saved_tensors_hooks(rec.pack_hook, lambda t: t), rec):
                for n, t in [*model.named_buffers(), *kwargs.items(), *((f"args[{i}]", a) for i, a in enumerate(args))]:
                    if isinstance(t, torch.Tensor):
                        rec.register_existing(t, Category.INPUT, n)
                engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()
                                                                                if p.requires_grad], config=config)
                del model
                _categorise(rec, engine.optimizer)
                bucket = int(getattr(engine.optimizer, "reduce_bucket_size", 0))
                _run_engine(spec, engine, loaded, kwargs, args, rec, obs)
        except VramtraceError:
            raise
        except Exception as e:
            raise _trace_error(e, rec) from e
        finally:
            rec.detach()
            del engine
    _categorise_buckets(rec, bucket)
    return _traced_graph(spec, rec, policy, obs.marks)


def _categorise_buckets(rec: StepRecorder, elements: int) -> None:
    """The gradient reduce buckets among storages without a category: `torch.empty(reduce_bucket_size)` on the
    accelerator (ZeRO-1/2 make one per backward and drop it after the reduction, so no attribute holds it when the
    step ends)."""
    for s in rec.storages:
        if s.category is None and s.op == "aten.empty.memory_format" and s.shape == (elements,):
            s.category, s.name = Category.COLLECTIVE_BUFFERS, BUCKET_NAME


@contextlib.contextmanager
def _quiet_warnings():
    """The warnings a ZeRO trace makes that say nothing to the user, off while it runs (the caller's filters back
    after): DeepSpeed's calls of torch.distributed's deprecated collectives (torch/distributed/c10d_logger.py), and
    the data pointers DeepSpeed's alignment checks read of fake tensors (stage_1_and_2.py `data_ptr()`)."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning, message=r"`torch\.distributed\.")
        warnings.filterwarnings("ignore", category=UserWarning, message="Accessing the data pointer of FakeTensor")
        yield


def _policy(spec: RunSpec, rec: StepRecorder) -> KernelPolicyMode:
    """The kernel policy of the target, without autocast (DeepSpeed casts the module for bf16), and the
    recorder's settings for it (trace.py `recorder_settings`)."""
    from .trace import _policy_callbacks, recorder_settings

    policy = KernelPolicyMode(spec.device, spec.gpu_preset.sm, None, **_policy_callbacks(rec, {}))
    recorder_settings(spec, policy).apply(rec)
    return policy


def _traced_graph(spec: RunSpec, rec: StepRecorder, policy: KernelPolicyMode, marks: list[MicroMarks]):
    """The `TracedGraph` of the recording: DeepSpeed's host buffers (fake CPU tensors) in host memory on a CUDA
    target (`HOST_DEVICE`, outside the device's figures; on a CPU target one memory with the rest)."""
    from .trace import TracedGraph, _cpu_kernels, _sdpa_counts

    if spec.device is Device.CUDA:
        for s in rec.storages:
            if s.device == "cpu":
                s.device = HOST_DEVICE
    unresolved = tuple(dict.fromkeys(rec.unresolved + policy.unresolved)) + tuple(
        f"{op}: CPU kernel workspace not measured, counted as 0 bytes ({why})"
        for op, why in getattr(rec.workspace, "failures", {}).items())
    ops = tuple(OpInfo(o.index, o.name, o.phase, o.module, o.ins, o.outs, o.flops, o.recompute, o.step, o.micro,
                       o.frees) for o in rec.ops)
    return TracedGraph(
        ops=ops, storages=tuple(rec.storages), marks=tuple(marks),
        steps=max((o.step for o in ops), default=0) + 1,
        counted_devices=("meta",) if spec.device is Device.CUDA else ("meta", "cpu"),
        sdpa_backends=tuple(sorted(_sdpa_counts(policy.sdpa_calls, None).items())), has_optimizer=True,
        trace_note=f"DeepSpeed ZeRO-{spec.zero} engine, rank {spec.rank or 0} of {spec.dp}; traced every layer",
        unresolved=unresolved, cpu_environment=_cpu_kernels(rec.workspace) if spec.device is Device.CPU else ())
