"""The report's `run`, `checkpointing` and `compiled` entries built from a RunSpec and traced reports (the JSON
report's fields: bytes are ints), for `vramtrace.pipeline.analyze` and `vramtrace.planner`."""

from __future__ import annotations

from .report.sections import (CheckpointingPlan, CheckpointingSummary, CompiledSummary, DdpInfo, FsdpInfo,
                              RecomputedOp, RunInfo, TpInfo)
from .spec import CheckpointingKind, Device, Mode, RunSpec


def compile_summary(report, graphs: dict, eager) -> CompiledSummary:
    """The report's `compiled` section: the compiled step's `report` against the same step run eagerly (`eager`), with
    `graphs` (`tracer.compiled_step.graphs_summary`: graph counts, the bytes the forward graphs save, the ops the
    partitioner recomputes in the backward), and the bytes of the zero gradients that the compiled backward
    materializes for outputs no loss depends on, alive at the peak (`tracer.records.ZERO_GRADIENT_NAME`)."""
    from .tracer.records import ZERO_GRADIENT_NAME

    return CompiledSummary(
        peak_allocated_bytes=report.peak_allocated_bytes,
        zero_gradient_bytes_at_peak=sum(t.bytes for t in report.tensors if t.name == ZERO_GRADIENT_NAME
                                        and t.birth <= report.peak_step <= t.death),
        peak_allocated_bytes_eager=eager.peak_allocated_bytes,
        activation_bytes=report.activation_bytes,
        activation_bytes_eager=eager.activation_bytes,
        peak_phase_eager=eager.peak_phase,
        forward_graphs=graphs["forward_graphs"], backward_graphs=graphs["backward_graphs"],
        saved_bytes=graphs["saved_bytes"], recomputed=tuple(RecomputedOp(**r) for r in graphs["recomputed"]))


def checkpointing_summary(report, base, snippet: str, plan: CheckpointingPlan | None = None) -> CheckpointingSummary:
    """The report's `checkpointing` section: `report` (with a policy) against `base` (the same step without);
    `plan`: `--checkpointing auto`'s (planner.py)."""
    notes = []
    if report.peak_allocated_bytes > base.peak_allocated_bytes:
        notes.append("this policy raises the peak: the recompute in the backward costs more than it saves")
    if report.activation_bytes > base.activation_bytes:
        notes.append("this policy keeps more activation bytes than none")
    return CheckpointingSummary(
        policy=str(report.run.checkpointing),
        peak_allocated_bytes=report.peak_allocated_bytes,
        peak_allocated_bytes_without=base.peak_allocated_bytes,
        activation_bytes=report.activation_bytes,
        activation_bytes_without=base.activation_bytes,
        recompute_flops=report.recompute_flops,
        recompute_overhead=report.recompute_overhead,
        checkpointed=checkpointed_modules(report.run),
        snippet=snippet,
        notes=tuple(notes),
        plan=plan)


def checkpointed_modules(run: RunInfo) -> str:
    """Which modules a policy checkpoints, e.g. 'model.layers.{0,4,8} (3 of 12 layers)'."""
    from .spec import Checkpointing

    ckpt, L, stack = Checkpointing.parse(run.checkpointing), run.num_layers, run.layer_stack
    if ckpt.kind is CheckpointingKind.NONE or not L:
        return ""
    if ckpt.kind is CheckpointingKind.NTH:
        idx = list(range(0, L, ckpt.k))
        return f"{stack}.{{{','.join(map(str, idx))}}} ({len(idx)} of {L} layers)"
    if ckpt.kind is CheckpointingKind.EVERY:
        return f"{stack}.{{0..{L - 1}}} in segments of {ckpt.k} layers ({-(-L // ckpt.k)} segments)"
    if ckpt.kind is CheckpointingKind.SELECTIVE:
        return f"{stack}.{{0..{L - 1}}}, saving the outputs of {', '.join(ckpt.save_ops)}"
    return f"{stack}.{{0..{L - 1}}} (all {L} layers)"


def adapters_summary(spec: RunSpec) -> str:
    """'LoRA r=8 (alpha 16) on q_proj,v_proj; frozen: model.embed_tokens.*' or ''."""
    parts = []
    if spec.lora_rank is not None:
        alpha = f", alpha {spec.lora_alpha:g}" if spec.lora_alpha is not None else ""
        alpha += f", dropout {spec.lora_dropout:g}" if spec.lora_dropout else ""
        targets = ",".join(spec.lora_targets) if spec.lora_targets else "peft's default targets"
        parts.append(f"peft LoRA r={spec.lora_rank}{alpha} on {targets}")
    if spec.freeze:
        parts.append("frozen: " + ", ".join(spec.freeze))
    return "; ".join(parts)


def moe_summary(spec: RunSpec, model) -> dict:
    """{'moe_layers', 'moe_experts_implementation', 'moe_routing'} for a mixture-of-experts model, else {}.
    Under transformers' grouped_mm experts (its default) memory does not depend on the routing."""
    from .tracer.hooks import experts_modules

    experts = experts_modules(model)
    if not experts:
        return {}
    impl = getattr(getattr(experts[0], "config", None), "_experts_implementation", None) or "grouped_mm"
    routing = spec.moe_routing.value if impl == "eager" else f"{spec.moe_routing.value} (no effect: {impl} sizes by tokens × top_k)"
    return {"moe_layers": len(experts), "moe_experts_implementation": impl, "moe_routing": routing}


def step_summary(spec: RunSpec, loop_peaks: dict[str, int], use_cache_false_peak: int | None = None) -> dict:
    """The report's `run` entries about the step: the loop (or the --step function), gradient accumulation
    (micro-batches, effective batch), zero_grad, clipping, the KV cache switch, each loop's peak bytes, and the
    peak bytes of the same step traced with use_cache false (when the config's KV cache is live at the peak)."""
    if spec.mode is Mode.GENERATE:
        return {"new_tokens": spec.new_tokens, "cache": spec.cache, "kv_dtype": spec.kv_dtype,
                "total_length": spec.seq + spec.new_tokens}
    if spec.mode is not Mode.TRAIN:
        return {}
    out = {"loop": (f"--pp {spec.pp_schedule.value} (one rank's schedule.step, then its optimizer)" if spec.pp
                    else spec.loop.value if spec.step is None else f"--step {spec.step}"),
           "grad_accum": spec.grad_accum, "effective_batch": spec.batch * spec.grad_accum,
           "zero_grad": spec.zero_grad, "clip_grad_norm": spec.clip_grad_norm}
    if spec.use_cache is not None:
        out["use_cache"] = spec.use_cache
    if loop_peaks:
        out["loop_peaks"] = loop_peaks
    if use_cache_false_peak is not None:
        out["use_cache_false_peak_bytes"] = use_cache_false_peak
    return out


def cuda_context_summary(spec: RunSpec) -> dict:
    """The report's `run` entries of the CUDA context a CUDA target's verdict assumes: {'cuda_version' (the CUDA
    major of the target's torch build), 'cuda_context_bytes', 'cuda_context_source' (`--cuda-context`, or the
    default for the GPU's family and CUDA version with its source, `analysis/device.py::cuda_context_default`)};
    {} on the CPU target."""
    if spec.device is not Device.CUDA:
        return {}
    figure = spec.cuda_context_figure
    return {"cuda_version": spec.cuda_major, "cuda_context_bytes": figure.nbytes,
            "cuda_context_source": figure.source}


def ranks_text(ranks: tuple[int, ...]) -> str:
    """'3' or '0-6' (consecutive ranks, as rank_classes groups them) or '1, 5'."""
    if len(ranks) > 1 and list(ranks) == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))


def sharding_summary(spec: RunSpec, rank_peaks: dict[str, int], host_peak: int | None = None) -> dict:
    """The report's `run` entries of a distributed step, by `RunInfo` field: {'fsdp': `FsdpInfo` (world,
    reshard_after_forward, plan (`FsdpPlan`), rank (the one reported), global_batch (per-rank batch × data-parallel
    ranks × gradient accumulation), rank_peaks (bytes per rank class traced, when every class was), host_peak_bytes
    (with --cpu-offload: the steady step's peak of the reported rank's storages in host memory)), 'tp': `TpInfo`
    (world (TP ranks), rank, global_batch, rank_peaks)} (with --fsdp M --tp N both, the fsdp entry's world is M and
    rank_peaks sit in it) or {'ddp': `DdpInfo` (world, global_batch)}; {} on one device."""
    if spec.ddp is not None:
        return {"ddp": DdpInfo(world=spec.ddp, global_batch=spec.batch * spec.ddp * spec.grad_accum)}
    if spec.world is None:
        return {}
    out: dict = {}
    global_batch = spec.batch * (spec.fsdp or 1) * spec.grad_accum
    peaks = rank_peaks or None
    if spec.tp is not None:
        out["tp"] = TpInfo(world=spec.tp, rank=spec.rank, global_batch=global_batch,
                           rank_peaks=peaks if spec.fsdp is None else None)
    if spec.fsdp is not None:
        out["fsdp"] = FsdpInfo(world=spec.fsdp, reshard_after_forward=spec.reshard_after_forward, rank=spec.rank,
                               global_batch=global_batch, plan=spec.fsdp_plan, rank_peaks=peaks,
                               host_peak_bytes=host_peak)
    return out


def zero_summary(spec: RunSpec, loaded, rank_peaks: dict[str, int], host_peak: int | None = None) -> dict:
    """The report's `run` entry of a --zero run: {'zero': `ZeroInfo`} (stage, dp, rank reported, global batch
    (micro-batch × dp × accumulation), offload devices, the ds_config file, each bucket size that applies with
    its source (sources/deepspeed.py `bucket_sources`), rank_peaks when every rank class was traced, the host peak
    of an offload on a CUDA target); {} without --zero. Raises UsageError for a ds_config `spec_config` refuses."""
    if spec.zero is None:
        return {}
    from .report.sections import ZeroBucket, ZeroInfo
    from .sources.deepspeed import bucket_sources, spec_config

    ds, resolved = spec_config(spec, loaded.model.config)
    buckets = bucket_sources(ds, resolved or {}, spec.zero)
    return {"zero": ZeroInfo(
        stage=spec.zero, dp=spec.dp, rank=spec.rank, global_batch=spec.batch * spec.dp * spec.grad_accum,
        offload_optimizer=spec.offload_optimizer.value if spec.offload_optimizer else None,
        offload_param=spec.offload_param.value if spec.offload_param else None,
        buckets=tuple(ZeroBucket(key=k, value=v["value"], source=v["source"].value) for k, v in buckets.items()),
        deepspeed_config=spec.deepspeed_config, rank_peaks=rank_peaks or None, host_peak_bytes=host_peak)}


def target_warnings(spec: RunSpec, precision: str) -> list[str]:
    """What the target GPU cannot do natively: bf16 below sm80 (V100, T4), where torch emulates it (slowly);
    `torch.cuda.is_bf16_supported()` still answers True there (torch/cuda/__init__.py, including_emulation). And
    what the trace does not model for this target: bitsandbytes' repacking of 4-bit weights for inference on an
    AVX512-BF16 CPU (bitsandbytes/nn/modules.py `Linear4bit.forward`, `_convert_weight_packed_for_cpu`), int8's
    data-dependent outlier columns (`quantization.INT8_OUTLIER_NOTE`)."""
    gpu = spec.gpu_preset
    if spec.device is Device.CUDA and "bf16" in precision and not gpu.native_bf16:
        return [f"{gpu.name} (sm{gpu.sm}) has no native bf16: torch emulates it, slowly; fp16-mixed (GradScaler) "
                "or fp32 is what runs well there (--precision)"]
    if spec.quantization is None:
        return []
    from .tracer.quantization import INT8_OUTLIER_NOTE, bitsandbytes_module

    if not spec.quantization.four_bit:  # a CPU's training step dequantizes the weight instead (MatMul8bitFp)
        return [INT8_OUTLIER_NOTE] if spec.device is Device.CUDA or spec.mode is not Mode.TRAIN else []
    if spec.device is Device.CPU and spec.mode is not Mode.TRAIN and bitsandbytes_module().functional.has_avx512bf16():
        return ["this CPU has AVX512-BF16: bitsandbytes repacks 4-bit weights for inference on it "
                "(_convert_weight_packed_for_cpu), which the trace does not model; the figure may differ"]
    return []
