"""vramtrace: exact, static memory prediction of a training step from a meta-device trace.

Public API: `analyze(spec) -> MemoryReport`.
"""

from __future__ import annotations

from typing import Callable

from .errors import VramtraceError
from .spec import RunSpec

__version__ = "0.1.0"
__all__ = ["analyze", "RunSpec", "VramtraceError", "__version__"]


def analyze(spec: RunSpec, progress: Callable[[str], None] | None = None):
    """Resolve, build on meta, trace and analyse the step of `spec`. Returns a MemoryReport.

    Raises ModelLoadError (bad model reference or config), TraceError (the step could not run on meta),
    UsageError (bad spec values).
    """
    from .analysis.liveness import CUDA_MIN_BLOCK_BYTES, build_timeline
    from .analysis.summary import summarize
    from .spec import Device, Mode
    from .tracer.building import load_model
    from .tracer.loading import resolve_config
    from .tracer.trace import FIRST_STEP_PHASES, STEADY_PHASES, trace_step

    say = progress or (lambda _m: None)
    say("resolving config")
    resolved = resolve_config(spec.model)
    say("building model on meta")
    loaded = load_model(spec, resolved)
    traced = trace_step(spec, loaded, progress=say)
    say("liveness analysis")
    if spec.mode is Mode.INFERENCE:
        steady_phases = first_phases = ("forward",)
    elif traced.has_optimizer:
        steady_phases, first_phases = STEADY_PHASES, FIRST_STEP_PHASES
    else:
        steady_phases = first_phases = ("forward", "backward", "zero_grad")
    block = CUDA_MIN_BLOCK_BYTES if spec.device is Device.CUDA else 1

    def timeline(phases, optimal=False):
        return build_timeline(traced.ops, traced.storages, phases, traced.counted_devices, block, optimal)

    gpu = spec.gpu_preset
    model_info = {
        "ref": resolved.ref, "config_source": resolved.source, "config_location": resolved.location,
        "architecture": loaded.architecture, "model_type": loaded.model_type, "task": loaded.task,
        "params": loaded.params, "trainable_params": loaded.trainable_params,
        "param_dtype": str(loaded.param_dtype).removeprefix("torch."),
        "compute_dtype": str(loaded.compute_dtype or loaded.param_dtype).removeprefix("torch."),
        "attn_implementation": loaded.attn_implementation,
        "sdpa_backends": dict(traced.sdpa_backends),
    }
    run_info = {
        "mode": spec.mode.value, "precision": spec.effective_precision.value, "optimizer": spec.optimizer.value,
        "optimizer_impl": spec.optimizer_impl.value, "device": spec.device.value, "gpu": gpu.name,
        "batch": spec.batch, "seq": spec.seq, "checkpointing": spec.checkpointing,
        "allocator_block_bytes": block, "num_ops": len(traced.ops), "trace": traced.trace_note,
    }
    return summarize(
        model=model_info, run=run_info, params=loaded.params, ops=traced.ops, storages=traced.storages,
        steady=timeline(steady_phases), first=timeline(first_phases), graph_optimal=timeline(steady_phases, True),
        gpu={"name": gpu.name, "memory_bytes": gpu.memory_bytes} if spec.device is Device.CUDA else None)
