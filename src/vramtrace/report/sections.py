"""The sections of a MemoryReport as frozen dataclasses, in the JSON's key order (`report.data`). All bytes are
ints; FLOPs are ints; `recompute_overhead`s are floats (recompute FLOPs / forward + backward FLOPs).

A field made with `omittable()` is absent from the JSON on the paths that do not produce it (see each class)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .data import UNSET, Omit, omittable
from ..spec import (CacheKind, Device, FsdpPlan, KvDtype, Mode, OptimizerImpl, OptimizerKind, Precision, Recipe,
                    ZeroGrad)
from ..sources.base import SourceEntry
from ..choices import PipelineSchedule

_FROZEN = dict(frozen=True, slots=True, kw_only=True)


@dataclass(**_FROZEN)
class CheckpointCheck:
    """The model's `checkpoint` entry (tracer/checkpoint_headers.py `cross_check`): the checkpoint's safetensors
    headers against the built model's parameter count. `dtypes`: elements per stored dtype."""

    source: str
    files: int
    elements: int
    dtypes: dict[str, int]
    matches: bool
    note: str


@dataclass(**_FROZEN)
class ModelInfo:
    """The report's `model` section (pipeline.py `_model_info`): the reference as given, the config's source and
    location, the built model's figures. `sdpa_backends`: SDPA calls per backend chosen; `checkpoint`: only when
    the reference has a checkpoint whose headers could be read."""

    ref: str
    config_source: str
    config_location: str
    architecture: str
    model_type: str
    task: str
    params: int
    trainable_params: int
    param_dtype: str
    compute_dtype: str
    attn_implementation: str
    sdpa_backends: dict[str, int]
    checkpoint: CheckpointCheck | None = omittable()


@dataclass(**_FROZEN)
class FitVerdict:
    """The report's `fit` section (report/summary.py `_cuda_fit`; on the CPU target given a capacity, the verdict
    on peak allocated bytes, without the CUDA-only fields). `headroom_bytes` is negative when it does not fit;
    `oom`: PyTorch's out-of-memory message for the allocation that finds no memory, or ''."""

    gpu: str
    capacity_bytes: int
    cuda_context_bytes: int | None = omittable()
    cuda_context_source: str | None = omittable()
    device_total_bytes: int | None = omittable()
    headroom_bytes: int
    fits: bool
    peak_reserved_bytes_at_capacity: int | None = omittable()
    alloc_retries: int | None = omittable()
    first_step_alloc_retries: int | None = omittable()
    oom: str | None = omittable()
    basis: str


@dataclass(**_FROZEN)
class AllocatorSummary:
    """The report's `allocator` section on a CUDA target (report/summary.py `_cuda_summary`): the caching-allocator
    model and its figures. `reserved_steps`: (graph step, reserved bytes) where the steady step's reserved bytes
    change; `note`: only for an allocator setting that is not modelled."""

    model: str
    segments: int
    peak_reserved_bytes: int
    peak_allocated_bytes: int
    unsplit_remainder_bytes_at_peak: int
    rounded_requests_peak_bytes: int
    reserved_steps: tuple[tuple[int, int], ...]
    note: str | None = omittable()


@dataclass(**_FROZEN)
class PlanCandidate:
    """A checkpointing policy the planner traced (planner.py `plan_checkpointing`). `peak_reserved_bytes`: None off
    a CUDA target; `compared_bytes`: what the budget is compared with (search.py `compared_bytes`)."""

    policy: str
    peak_allocated_bytes: int
    peak_reserved_bytes: int | None
    compared_bytes: int
    recompute_flops: int
    recompute_overhead: float


@dataclass(**_FROZEN)
class CheckpointingPlan:
    """`--checkpointing auto`'s plan (planner.py `plan_checkpointing`): the policy chosen for the budget and every
    candidate evaluated."""

    budget_bytes: int
    fits: bool
    chosen: str
    verdict: str
    basis: str
    over_budget_bytes: int
    algorithm: str
    evaluated: tuple[PlanCandidate, ...]


@dataclass(**_FROZEN)
class CheckpointingSummary:
    """The report's `checkpointing` section (summaries.py `checkpointing_summary`): the policy's step against the
    same step without it; `plan` only under `--checkpointing auto`."""

    policy: str
    peak_allocated_bytes: int
    peak_allocated_bytes_without: int
    activation_bytes: int
    activation_bytes_without: int
    recompute_flops: int
    recompute_overhead: float
    checkpointed: str
    snippet: str
    notes: tuple[str, ...]
    plan: CheckpointingPlan | None = omittable()


@dataclass(**_FROZEN)
class RecomputedOp:
    """Ops of one module pattern the compiled backward recomputes (tracer/compiled_step.py `graphs_summary`)."""

    module: str
    op: str
    count: int
    bytes: int


@dataclass(**_FROZEN)
class CompiledSummary:
    """The report's `compiled` section under `--compile` (summaries.py `compile_summary`): the compiled step against
    the same step run eagerly, the graphs' counts, the bytes the forward graphs save, the recomputed ops."""

    peak_allocated_bytes: int
    zero_gradient_bytes_at_peak: int
    peak_allocated_bytes_eager: int
    activation_bytes: int
    activation_bytes_eager: int
    peak_phase_eager: str
    forward_graphs: int
    backward_graphs: int
    saved_bytes: int
    recomputed: tuple[RecomputedOp, ...]


@dataclass(**_FROZEN)
class ComparisonRow:
    """One `--compare` row (pipeline.py `with_comparison`): a checkpointing policy's figures."""

    policy: str
    peak_allocated_bytes: int
    activation_bytes: int
    recompute_flops: int
    recompute_overhead: float


@dataclass(**_FROZEN)
class LeverRow:
    """One lever, traced (levers.py `Lever`): its family, the options that apply it, its cost in words and its
    figures; `saves_bytes`: compared bytes saved against the run as given. `decided_by_stage` (a --pp run's lever
    on the whole pipeline that does not fit, levers.py `pipeline_outcome`): the stage that alone does not fit, at
    which the tracing stopped, the pipeline's other stages not all traced: the figures are that stage's, a lower
    bound of the pipeline's largest stage, and `saves_bytes` an upper bound of what the pipeline saves (a rank
    under interleaved-1f1b and zero-bubble, as `StagePeak.stage`); absent when every stage was traced."""

    family: str
    options: str
    cost: str
    peak_allocated_bytes: int
    peak_reserved_bytes: int | None
    compared_bytes: int
    saves_bytes: int
    fits: bool
    recompute_overhead: float
    decided_by_stage: int | None = omittable()


@dataclass(**_FROZEN)
class LeverCombination:
    """The levers combined when none fits alone (levers.py `_combine`): their options and families, the figures;
    `decided_by_stage` as `LeverRow`'s (a --pp run's combination that does not fit, decided by that stage alone)."""

    options: str
    levers: tuple[str, ...]
    peak_allocated_bytes: int
    peak_reserved_bytes: int | None
    compared_bytes: int
    fits: bool
    decided_by_stage: int | None = omittable()


class SkipReason(str, enum.Enum):
    """Why a lever is listed without a figure."""

    NEEDS_EXTRA = "needs_extra"  # an optional extra is not installed
    FAILED = "failed"  # its trace raised
    NOT_MODELLED = "not_modelled"  # vramtrace does not trace it for this run yet (levers under --pp)


@dataclass(**_FROZEN)
class SkippedLever:
    """A lever family not traced (levers.py `NotTraced`): an extra missing, its trace failed, or not modelled."""

    family: str
    title: str
    options: str
    reason: SkipReason
    detail: str


@dataclass(**_FROZEN)
class LeversSummary:
    """The report's `levers` section when the step does not fit (levers.py `find_levers`): the levers ranked
    cheapest first, the combination when none fits alone (else None), the traces made; `skipped` only when a family
    was not traced, `cached` only when outcomes came from the disk cache (their count)."""

    budget_bytes: int
    base_bytes: int
    basis: str
    levers: tuple[LeverRow, ...]
    combination: LeverCombination | None
    traces: int
    skipped: tuple[SkippedLever, ...] = omittable(Omit.EMPTY, ())
    cached: int | None = omittable()


@dataclass(**_FROZEN)
class DdpInfo:
    """The run's `ddp` entry (summaries.py `sharding_summary`): DDP's ranks; `global_batch`: per-rank batch ×
    ranks × gradient accumulation."""

    world: int
    global_batch: int


@dataclass(**_FROZEN)
class TpInfo:
    """The run's `tp` entry (summaries.py `sharding_summary`): the tensor-parallel ranks, the rank reported, the
    global batch; `rank_peaks`: peak bytes per rank class traced (here when there is no FSDP)."""

    world: int
    rank: int | None
    global_batch: int
    rank_peaks: dict[str, int] | None = omittable()


@dataclass(**_FROZEN)
class FsdpInfo:
    """The run's `fsdp` entry (summaries.py `sharding_summary`): FSDP2's data-parallel ranks and plan, the rank
    reported, the global batch; `rank_peaks`: peak bytes per rank class traced, when every class was;
    `host_peak_bytes`: with --cpu-offload, the steady step's peak of the rank's storages in host memory."""

    world: int
    reshard_after_forward: bool
    rank: int | None
    global_batch: int
    plan: FsdpPlan
    rank_peaks: dict[str, int] | None = omittable()
    host_peak_bytes: int | None = omittable()


@dataclass(**_FROZEN)
class StagePeak:
    """One pipeline stage's figures (pp_stages.py `pipeline_summary`): the steady step's peak allocated bytes
    (`peak_bytes`), the micro-step running at it (`at`: 'F<i>' or 'B<i>', forward or backward of micro-batch i,
    'opt' in `optimizer.step()`, or 'loop' elsewhere, e.g. between micro-steps), the micro-batches in flight then
    (`in_flight`: in the stage's `fwd_cache`, or running), and the bytes at the peak of its receive buffers
    (`recv_buffer_bytes`) and of the input gradients its send Works hold (`held_send_bytes`). Stages that run the
    same program share one trace (`traced_as`). Under interleaved-1f1b and zero-bubble an entry is a rank's
    (`stage` = the rank, `traced_as` too, though a rank holds V of the P × V stages `PipelineInfo.split` names),
    `holds` the stages it holds (rank, rank + P, ...), `at` 'F<i>@<k>'/'B<i>@<k>'/'W<i>@<k>' (micro-batch i on
    stage k; W: zero-bubble's weight gradient) and `in_flight` the micro-batches in any of its stages' `fwd_cache`
    or waiting for their weight-gradient step (zero-bubble's `backward_state`); `holds` is absent otherwise."""

    stage: int
    peak_bytes: int
    at: str
    in_flight: tuple[int, ...]
    recv_buffer_bytes: int
    held_send_bytes: int
    traced_as: int
    holds: tuple[int, ...] | None = omittable()


@dataclass(**_FROZEN)
class PipelineInfo:
    """The run's `pp` entry (`--pp`): `stages` (P), the `schedule`, `micro_batches` (M) of `micro_batch_rows` rows
    each, `split` (decoder layers per stage), the `stage` reported (the largest peak unless --stage K) and each
    stage's figures (`stage_peaks`, by stage). Under interleaved-1f1b and zero-bubble: `virtual_stages` V (absent
    otherwise); `stages` is then still P, the ranks, while `split` names the P × V stages; `stage` and
    `stage_peaks` (their `stage` field included) are by rank."""

    stages: int
    schedule: PipelineSchedule
    micro_batches: int
    micro_batch_rows: int
    split: tuple[int, ...]
    stage: int
    stage_peaks: tuple[StagePeak, ...]
    virtual_stages: int | None = omittable()


@dataclass(**_FROZEN)
class CpuKernels:
    """The run's `cpu_kernels` entry on the CPU target (tracer/trace.py `_cpu_kernels`, tracer/profiling.py
    `cpu_environment`): what its kernel workspaces depend on; `relaid_outputs`, `extrapolated_workspaces`: only
    when some op's output was laid out as the CPU kernel does, or its workspace extrapolated."""

    cpu: str
    cpu_flags: str
    onednn_max_isa: str
    aten_capability: str
    threads: int
    torch: str
    relaid_outputs: str | None = omittable()
    extrapolated_workspaces: str | None = omittable()


@dataclass(**_FROZEN)
class ZeroBucket:
    """One DeepSpeed bucket size of a --zero run (elements; `stage3_param_persistence_threshold`: parameters) and
    where it came from: 'file' (the --deepspeed ds_config), 'HF auto' (its "auto", filled as transformers'
    integration fills it) or 'DeepSpeed default' (deepspeed/runtime/zero/config.py)."""

    key: str
    value: int
    source: str


@dataclass(**_FROZEN)
class ZeroInfo:
    """The run's `zero` entry (tracer/zero.py `zero_summary`): DeepSpeed ZeRO's stage, data-parallel ranks, the
    rank reported, the global batch, the offload devices, the ds_config file, the bucket sizes with their
    sources; `rank_peaks`: peak bytes per rank class traced, when every class was; `host_peak_bytes`: on a CUDA
    target with an offload, the steady step's peak of the rank's storages in host memory (outside the device's
    figures)."""

    stage: int
    dp: int
    rank: int | None
    global_batch: int
    offload_optimizer: str | None
    offload_param: str | None
    buckets: tuple[ZeroBucket, ...]
    deepspeed_config: str | None = omittable()
    rank_peaks: dict[str, int] | None = omittable()
    host_peak_bytes: int | None = omittable()


@dataclass(**_FROZEN)
class RunInfo:
    """The report's `run` section (pipeline.py `_run_info`): the run's settings and its traced step's figures.
    Enum-valued settings hold the spec's enums (str enums: format them by `.value`). Paths that do not produce an
    entry leave it out: the train step's entries (summaries.py `step_summary`; `clip_grad_norm` is written, null or not, in train runs
    only), a generation's (`new_tokens` .. `total_length`, and report/summary.py `generation_summary`'s figures),
    the sharding entries (`sharding_summary`), the mixture-of-experts ones (`moe_summary`), the CUDA context's
    (`cuda_context_summary`), `images` (a vision-language model's per sample), `paged_optimizer_state_bytes` (a
    paged bitsandbytes optimizer's state in CUDA managed memory), `cpu_kernels` (CPU target), `sources` (the
    fields set by `--from` files, vramtrace.sources), `warnings`."""

    mode: Mode
    precision: Precision
    precision_source: str
    optimizer: OptimizerKind
    optimizer_impl: OptimizerImpl
    device: Device
    gpu: str
    batch: int
    seq: int | None
    checkpointing: str
    checkpointing_source: str
    num_layers: int
    layer_stack: str
    allocator_block_bytes: int
    num_ops: int
    trace: str
    inputs: tuple[str, ...]
    loop: str | None = omittable()  # a `Loop` value, or '--step FILE:FUNCTION'
    grad_accum: int | None = omittable()
    effective_batch: int | None = omittable()
    zero_grad: ZeroGrad | None = omittable()
    clip_grad_norm: float | None = omittable(Omit.UNSET, UNSET)
    use_cache: bool | None = omittable()
    loop_peaks: dict[str, int] | None = omittable(Omit.EMPTY)
    use_cache_false_peak_bytes: int | None = omittable()
    new_tokens: int | None = omittable()
    cache: CacheKind | None = omittable()
    kv_dtype: KvDtype | None = omittable()
    total_length: int | None = omittable()
    ddp: DdpInfo | None = omittable()
    tp: TpInfo | None = omittable()
    fsdp: FsdpInfo | None = omittable()
    adapters: str
    image_size: tuple[int, ...] | None
    images: int | None = omittable()
    moe_layers: int | None = omittable()
    moe_experts_implementation: str | None = omittable()
    moe_routing: str | None = omittable()
    compile: bool
    compile_mode: str | None
    cuda_version: int | None = omittable()
    cuda_context_bytes: int | None = omittable()
    cuda_context_source: str | None = omittable()
    peak_in: str | None = omittable()  # 'prefill' or 'decode step k of N - 1'
    prefill_peak_bytes: int | None = omittable()
    decode_peak_bytes: int | None = omittable()
    kv_cache_bytes_at_end: int | None = omittable()
    kv_tokens_per_request: int | None = omittable()
    kv_bytes_per_token: int | None = omittable()
    kv_cross_attention_bytes: int | None = omittable()
    kv_cross_bytes_per_token: int | None = omittable()
    paged_optimizer_state_bytes: int | None = omittable()
    packing: str | None = omittable()  # how --packing's sequences reach the model (tracer/packing.py `describe`)
    cpu_kernels: CpuKernels | None = omittable()
    sources: tuple[SourceEntry, ...] = omittable(Omit.EMPTY, ())  # the fields --from files set (RunSpec.sources)
    warnings: tuple[str, ...] = omittable(Omit.EMPTY, ())
    recipe: Recipe | None = omittable()  # --recipe: the framework whose model build was mirrored (tracer/recipes.py)
    pp: PipelineInfo | None = omittable()  # --pp: the pipeline's stages (pp_stages.py `pipeline_summary`)
    zero: ZeroInfo | None = omittable()  # --zero: DeepSpeed ZeRO (tracer/zero.py `zero_summary`)
