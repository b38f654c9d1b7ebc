"""`vramtrace validate`: predict, then run the same step for real on the local device and compare.

The measured step is a user's training loop: the model built for real with random weights, one warm-up step
(the optimizer creates its state), then the measured steady-state step.

- CPU: the bytes live before the warm-up (every unique storage of parameters, buffers and the inputs) plus the
  running sum of torch.profiler's `[memory]` allocator events (`profile_memory=True`) from the warm-up's start,
  maximised over the measured step: whatever the warm-up left alive (optimizer state, the script loop's outputs,
  gradients kept by zero_grad(set_to_none=False), a --step function's EMA copy) is counted without naming it.
- CUDA: `torch.cuda.max_memory_allocated()` and `max_memory_reserved()` after `reset_peak_memory_stats()`
  between the two steps.

Nothing is allocated when the prediction does not fit the local device's free memory.
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass, replace
from typing import Callable

from .errors import TraceError, UsageError, VramtraceError
from .report.data import to_data
from .spec import CheckpointingKind, Device, Mode, RunSpec


@dataclass(frozen=True, slots=True)
class Measurement:
    """A real step's peak bytes on `device` ('cpu' or 'cuda'); `peak_reserved_bytes` on CUDA only."""

    device: str
    peak_allocated_bytes: int
    peak_reserved_bytes: int | None = None


def real_model(spec: RunSpec, device: str = "cpu"):
    """`spec`'s model built for real on `device` with random weights (seed 0), its step inputs (random, in
    range), loss and autocast dtype: a `LoadedModel`, the same code path as the meta build (and the same
    precision, `search.resolve_precision`)."""
    from .search import resolve_precision
    from .tracer.building import load_model
    from .tracer.loading import resolve_config

    resolved = resolve_config(spec.model)
    return load_model(resolve_precision(spec, resolved)[0], resolved, device)


def alive_at_start(model, inputs, opt) -> list:
    """Tensors alive at the start of a steady-state step: parameters, buffers, the inputs (a list of values;
    non-tensors are skipped), optimizer state."""
    import torch

    alive = list(model.parameters()) + list(model.buffers()) + [t for t in inputs if isinstance(t, torch.Tensor)]
    if opt is not None:
        alive += [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return alive


def measure_step(spec: RunSpec, setup: Callable | None = None) -> Measurement:
    """Run the step of `spec` for real on `spec.device` and measure it. The model gets `spec.checkpointing` as
    a user's code applies it, or `setup(model)` when given. Runs seeded (0) inside `torch.random.fork_rng`: the
    caller's RNG state is left as it was. Raises UsageError when CUDA is asked for and absent, TraceError (phase,
    module, the exception's type and first line; the exception chained as its cause) when the model's or the
    user's code raises during the real step."""
    from .tracer.building import quiet_transformers_logs, seeded

    _require_local(spec.device)
    with quiet_transformers_logs(), seeded(spec.device.value):  # dropout draws from seed 0, not the caller's RNG
        return _measure(spec, setup)


def _measure(spec: RunSpec, setup: Callable | None) -> Measurement:
    import torch

    from .tracer.checkpointing import apply_checkpointing, layer_stack
    from .tracer.profiling import run_profiled_steps, unique_storage_bytes
    from .tracer.optim import make_optimizer
    from .tracer.step import QuietObserver, StepContext, load_user_step, run_generation, run_inference, run_training

    device = spec.device.value
    loaded = real_model(spec, device)
    model, compute_dtype = loaded.model, loaded.compute_dtype
    train = spec.mode is Mode.TRAIN
    model.train(train)
    if setup is not None:
        setup(model)
    elif train:
        apply_checkpointing(model, spec.checkpointing, None, layer_stack(model))
    opt = make_optimizer(spec, [p for p in model.parameters() if p.requires_grad]) if train else None
    scaler = (torch.amp.GradScaler(device) if train and spec.step is None and loaded.precision.scales_loss
              else None)
    ctx = StepContext(model, loaded.args, loaded.inputs, loaded.loss, opt,
                      (lambda: torch.autocast(device, dtype=compute_dtype)) if compute_dtype else contextlib.nullcontext,
                      scaler, load_user_step(spec.step) if spec.step is not None else None)
    obs = QuietObserver()
    where = {"step": "warm-up"}

    def step():
        if train:
            run_training(ctx, spec, obs, literal=True, steps=1)
        elif spec.mode is Mode.GENERATE:
            run_generation(ctx, spec, obs)
        else:
            run_inference(ctx, obs)

    try:
        if device == "cuda":
            step()  # warm-up: the optimizer creates its state
            gc.collect()
            where["step"] = "measured"
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            step()
            torch.cuda.synchronize()
            return Measurement("cuda", torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved())
        base = unique_storage_bytes(alive_at_start(model, [*loaded.args, *loaded.inputs.values()], None))

        def measured():
            where["step"] = "measured"
            step()

        return Measurement("cpu", base + run_profiled_steps(step, measured))
    except VramtraceError:
        raise
    except Exception as e:  # the model's or the user's code failed on real tensors: one line, cause chained
        text = str(e).strip().splitlines()[0] if str(e).strip() else "(no message)"
        raise TraceError(f"the real {where['step']} step on {device} failed in phase {obs.phase_now}, module "
                         f"{innermost_module(e, model)}: {type(e).__name__}: {text}") from e


def innermost_module(error: BaseException, model) -> str:
    """The qualified name of the innermost submodule of `model` whose code is on `error`'s traceback (a frame
    whose `self` is that module: its forward, or torch's `Module._call_impl` calling it), else '(root)'."""
    names = {id(m): name for name, m in model.named_modules() if name}
    found = "(root)"
    tb = error.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if owner is not None and id(owner) in names:
            found = names[id(owner)]
        tb = tb.tb_next
    return found


def _require_local(device: Device) -> None:
    """Raise UsageError when the target device is not on this machine (CUDA without a GPU)."""
    import torch

    if device is Device.CUDA and not torch.cuda.is_available():
        raise UsageError("validate --device cuda needs a CUDA GPU here; use --device cpu")


def free_bytes(device: Device) -> int:
    """Free memory of the local device in bytes: CUDA `mem_get_info`, or the host's MemAvailable."""
    if device is Device.CUDA:
        import torch

        return torch.cuda.mem_get_info()[0]
    from .tracer.profiling import available_host_bytes

    return available_host_bytes()


def validate(spec: RunSpec, progress: Callable[[str], None] | None = None) -> dict:
    """Predict `spec`, then measure it for real. Returns predicted vs measured bytes and the relative errors.
    Raises UsageError when the target device is not here (checked first, before tracing), for a distributed step or
    a pipeline (--pp), or when the prediction does not fit the free memory (before allocating anything); TraceError
    when the real step fails."""
    from .pipeline import analyze
    from .units import format_bytes

    _require_local(spec.device)
    if spec.world is not None:
        raise UsageError("validate runs the step in this one process; a distributed step (--fsdp, --ddp, --tp) runs "
                         "on N ranks: launch it with torchrun and compare each rank's "
                         "torch.cuda.max_memory_allocated()")
    if spec.pp is not None:
        raise UsageError("validate runs the step in this one process; a pipeline (--pp) runs one stage per rank: "
                         "launch it with torchrun and compare each stage's torch.cuda.max_memory_allocated()")
    say = progress or (lambda _m: None)
    report = analyze(spec, say)
    needed = report.peak_reserved_bytes or report.peak_allocated_bytes
    free = free_bytes(spec.device)
    if needed > free:
        raise UsageError(f"the predicted step needs {format_bytes(needed)} but {spec.device.value} has "
                         f"{format_bytes(free)} free; validate a smaller config or a smaller --batch")
    say("running the step for real")
    measured = spec
    if spec.checkpointing.kind is CheckpointingKind.AUTO:  # the real run applies the plan the report chose
        measured = replace(spec, checkpointing=report.checkpointing.plan.chosen, memory_budget_bytes=None)
    m = measure_step(measured)
    out = {"device": m.device, "predicted_peak_allocated_bytes": report.peak_allocated_bytes,
           "measured_peak_allocated_bytes": m.peak_allocated_bytes,
           "allocated_error": (report.peak_allocated_bytes - m.peak_allocated_bytes) / m.peak_allocated_bytes}
    if m.peak_reserved_bytes is not None:
        out.update({"predicted_peak_reserved_bytes": report.peak_reserved_bytes,
                    "measured_peak_reserved_bytes": m.peak_reserved_bytes,
                    "reserved_error": (report.peak_reserved_bytes - m.peak_reserved_bytes) / m.peak_reserved_bytes})
    out["run"] = to_data(report.run)
    return out
