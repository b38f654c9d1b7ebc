"""Summarize timelines into a MemoryReport: plain, JSON-serialisable data for the renderers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ..analysis.categories import Category
from ..analysis.allocator import replay_steps
from ..analysis.liveness import Timeline, round_block
from ..report.data import SCHEMA_TYPE, from_data, not_serialized, to_data
from ..report.sections import (AllocatorSummary, CheckpointingSummary, ComparisonRow, CompiledSummary, FitVerdict,
                               LeversSummary, ModelInfo, RunInfo)
from ..units import format_bytes
from ..spec import Mode

SCHEMA_VERSION = 1


@dataclass(frozen=True, slots=True)
class TensorRow:
    """One storage on the steady-state timeline. Bytes after allocator rounding; birth/death are graph steps;
    `category` a `Category` value, `phase` the phase of its birth."""

    id: int
    bytes: int
    category: str = field(metadata={SCHEMA_TYPE: Category})
    dtype: str
    shape: tuple[int, ...]
    module: str
    op: str
    phase: str
    birth: int
    death: int
    name: str


@dataclass(frozen=True, slots=True)
class PhaseMark:
    """One point of the waterfall: its name (e.g. 'after forward', 'peak in backward'), live bytes, graph step."""

    name: str
    bytes: int
    step: int


@dataclass(frozen=True, slots=True, kw_only=True, repr=False)
class MemoryReport:
    """The result of `vramtrace.analyze`. All bytes are ints; GiB in renderers means 2**30. Fields in the JSON
    report's key order (`report.data.to_data`); `eager` is not in the JSON."""

    model: ModelInfo
    run: RunInfo
    params: int
    peak_allocated_bytes: int
    first_step_peak_allocated_bytes: int
    graph_optimal_peak_bytes: int
    peak_step: int
    peak_phase: str
    peak_op: str
    peak_module: str
    breakdown_at_peak: dict[str, int] = field(metadata={SCHEMA_TYPE: dict[Category, int]})  # bytes live at the
    # peak by `Category` value
    num_steps: int
    fit: FitVerdict | None
    activation_bytes: int = 0  # activations (saved or kept for the backward) live when the forward ends
    step_flops: int = 0  # forward + backward FLOPs without recompute (torch.utils.flop_counter formulas)
    recompute_flops: int = 0  # FLOPs of checkpointed forward ops re-run in the backward
    checkpointing: CheckpointingSummary | None = None  # policy, baseline without it, plan; see vramtrace.analyze
    comparison: tuple[ComparisonRow, ...] = ()  # --compare: one row per policy
    steps: tuple[tuple[str, str, str], ...] = ()  # per timeline step: (op, module path, phase)
    peak_reserved_bytes: int | None = None  # CUDA target: the caching-allocator model's peak reserved
    allocator: AllocatorSummary | None = None  # CUDA target: the allocator model and its segments
    unresolved: tuple[str, ...] = ()
    peak_micro_step: int = 0  # gradient accumulation: the micro-step (0-based) of the peak
    levers: LeversSummary | None = None  # when it does not fit: what makes it fit (vramtrace.levers.find_levers)
    compiled: CompiledSummary | None = None  # --compile: the compiled step against eager (summaries.compile_summary)
    schema_version: int = SCHEMA_VERSION
    phases: tuple[PhaseMark, ...]
    top_tensors: tuple[TensorRow, ...]
    tensors: tuple[TensorRow, ...]
    eager: "MemoryReport | None" = not_serialized()  # --compile: the same step traced eagerly (the HTML draws it)

    def __repr__(self) -> str:
        fit = "" if self.fit is None else f", {'fits' if self.fit.fits else 'does not fit'} {self.fit.gpu}"
        return (f"<MemoryReport {self.model.ref}: peak allocated {format_bytes(self.peak_allocated_bytes)}"
                f" ({self.peak_allocated_bytes:,} B) in {self.peak_phase}{fit}; {len(self.tensors):,} storages>")

    def html_pages(self) -> tuple[list["MemoryReport"], list[str] | None]:
        """(reports, labels) the HTML report draws: this one, and beside it on one scale the eager step of a
        `--compile` report."""
        if self.eager is None:
            return [self], None
        return [self, self.eager], ["torch.compile", "eager"]

    @property
    def recompute_overhead(self) -> float:
        """Recompute FLOPs as a fraction of the step's forward + backward FLOPs (0.0 without a policy)."""
        return self.recompute_flops / self.step_flops if self.step_flops else 0.0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "MemoryReport":
        """The report back from `to_dict`'s data (a saved JSON report; `report.data.from_data`). Raises TypeError
        (an unknown or missing key in a section) or ValueError (a value out of its enum) on bad data."""
        return from_data(cls, d)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data in the JSON report's key order (`report.data.to_data`)."""
        return to_data(self)


def _phase_marks(tl: Timeline, ops: tuple, generate: bool, remainder: tuple[int, int] = (0, 0)
                 ) -> tuple[PhaseMark, ...]:
    """The waterfall: the start, then each phase's peak and its end. A generation's phases are its prefill (the
    model's first forward, micro-step 0, with what generate does before it) and its decode steps (the rest).
    `remainder`: (step, bytes) a CUDA target's unsplit block remainders add at the peak step."""
    live = list(tl.live_bytes)
    if remainder[1]:
        live[remainder[0]] += remainder[1]
    marks = [PhaseMark("start of step", tl.start_bytes, 0)]
    by_phase: dict[str, list[int]] = {}
    for i, ph in enumerate(tl.phases):
        if generate:
            ph = "prefill" if ops[tl.steps[i]].micro == 0 else "decode"
        by_phase.setdefault(ph, []).append(i)
    labels = {"forward": "forward", "backward": "backward", "clip_grad_norm": "clip_grad_norm",
              "optimizer": "optimizer step", "zero_grad": "zero_grad", "step": "your step function",
              "prefill": "prefill", "decode": "decode steps"}
    for ph, idx in by_phase.items():
        peak_i = max(idx, key=lambda i: live[i])
        if ph != "zero_grad":
            marks.append(PhaseMark(f"peak in {labels[ph]}", live[peak_i], peak_i))
        marks.append(PhaseMark(f"after {labels[ph]}", tl.after_bytes[idx[-1]], idx[-1]))
    return tuple(marks)


def _cuda_fit(first: Timeline, steady: Timeline, gpu: dict, est, storages) -> FitVerdict:
    """The verdict on a CUDA target: the allocator replayed with the device's capacity less the CUDA context
    (`pressure.replay_at_capacity`, CUDACachingAllocator.cpp `malloc`'s release-and-retry path); it fits iff
    neither step runs out of memory. `est` is the unbounded replay. headroom_bytes: the capacity the replay never
    reserved when it fits, else minus what the unbounded replay needs beyond the device."""
    from ..analysis.pressure import replay_at_capacity

    context = gpu.get("cuda_context_bytes", 0)
    verdict = replay_at_capacity(first, steady, gpu["memory_bytes"] - context, gpu.get("alloc_conf"), est)
    reserved = verdict.peak_reserved_bytes if verdict.fits else est.peak_reserved_bytes
    return FitVerdict(
        gpu=gpu["name"], capacity_bytes=gpu["memory_bytes"], cuda_context_bytes=context,
        cuda_context_source=gpu.get("cuda_context_source", ""), device_total_bytes=reserved + context,
        headroom_bytes=verdict.headroom_bytes if verdict.fits else gpu["memory_bytes"] - context - est.peak_reserved_bytes,
        fits=verdict.fits, peak_reserved_bytes_at_capacity=verdict.peak_reserved_bytes,
        alloc_retries=verdict.alloc_retries, first_step_alloc_retries=verdict.first_step_alloc_retries,
        oom=_oom(verdict.estimate, storages),
        basis=f"the caching-allocator replay of the first and steady steps with the device's capacity less "
              f"the CUDA context ({format_bytes(context)}) for cudaMalloc, releasing the cache and retrying "
              f"as CUDACachingAllocator.cpp malloc does: fits iff no allocation runs out of memory")


def _oom(est, storages) -> str:
    """A message naming the allocation that finds no memory in the bounded replay `est`, as PyTorch's
    OutOfMemoryError does, or ''."""
    if est.oom_sid is None:
        return ""
    s = next(x for x in storages if x.sid == est.oom_sid)
    reserved, allocated = est.oom_state
    what = s.name or f"{s.op} in {s.module or '(root)'}"
    where = "at the start of" if s.op_index < 0 else f"in the {s.phase} of"
    return (f"CUDA out of memory. Tried to allocate {format_bytes(round_block(s.nbytes, 512))} ({what}, "
            f"{s.dtype}{list(s.shape)}, {where} the {est.oom_step} step). Of the allocated memory "
            f"{format_bytes(allocated)} is allocated by PyTorch, and {format_bytes(reserved - allocated)} is "
            "reserved by PyTorch but unallocated.")


def generation_summary(ops: tuple, storages: tuple, steady: Timeline, batch: int, prompt: int,
                       new_tokens: int, encoder_decoder: bool = False) -> dict:
    """The report's `run` entries of a generation (`--mode generate`): where its peak is (the prefill, or decode
    step k of N - 1: the N-th token needs no forward), the peak of the prefill and of the decode steps, and the
    KV cache it ends with: its bytes, the tokens its self-attention cache holds per request, and the bytes of
    keys and values (floating-point cache tensors, before the allocator's block rounding; a StaticCache's
    per-layer int64 length counters and a QuantizedCache's scalar fp32 scales left out) per token per request.
    Bytes are ints.

    Tokens per request: a decoder-only model's cache holds prompt + N - 1 (the last token's keys and values are
    never computed, and generate sizes a StaticCache to max_length - 1, transformers/generation/utils.py
    `GenerationMixin.generate`). An encoder-decoder (`encoder_decoder`, T5) has the prompt in its encoder: its
    decoder's self-attention cache holds N tokens (the decoder start token and N - 1 generated ones; a
    StaticCache sized to max_length = N + 1), and its cross-attention cache the encoder's keys and values, the
    prompt's tokens once (`kv_cross_attention_bytes`, per prompt token `kv_cross_bytes_per_token`)."""
    micro = [ops[i].micro for i in steady.steps]
    at = micro[steady.peak_step]
    prefill = max((b for b, m in zip(steady.live_bytes, micro) if m == 0), default=0)
    decode = max((b for b, m in zip(steady.live_bytes, micro) if m > 0), default=0)
    end = len(steady.steps) - 1
    by_sid = {s.sid: s for s in storages}
    cache = [lt for lt in steady.lifetimes if lt.category is Category.KV_CACHE and lt.birth <= end <= lt.death]
    kv = sum(lt.bytes for lt in cache)
    # keys and values: floating-point tensors with a token axis (a QuantizedCache's fp8 states; its per-layer
    # scalar scales and a StaticCache's int64 counters left out)
    floats = [by_sid[lt.sid] for lt in cache if "float" in by_sid[lt.sid].dtype and by_sid[lt.sid].shape]
    cross = sum(s.nbytes for s in floats if "cross-attention" in s.name)  # not block-rounded
    keys_values = sum(s.nbytes for s in floats) - cross
    tokens = new_tokens if encoder_decoder else prompt + new_tokens - 1
    out = {"peak_in": "prefill" if at == 0 else f"decode step {at} of {new_tokens - 1}",
           "prefill_peak_bytes": prefill, "decode_peak_bytes": decode, "kv_cache_bytes_at_end": kv,
           "kv_tokens_per_request": tokens, "kv_bytes_per_token": keys_values // (batch * tokens)}
    if encoder_decoder:
        out.update(kv_cross_attention_bytes=cross, kv_cross_bytes_per_token=cross // (batch * prompt))
    return out


def flops(ops: tuple, steady: Timeline) -> tuple[int, int]:
    """(forward + backward FLOPs without recompute, FLOPs of checkpointed forward ops re-run in the backward) of
    the steady step (`torch.utils.flop_counter` formulas, counted per op by the recorder)."""
    steady_ops = [ops[i] for i in steady.steps]
    return (sum(o.flops for o in steady_ops if o.phase in ("forward", "backward") and not o.recompute),
            sum(o.flops for o in steady_ops if o.recompute))


def _cuda_summary(first: Timeline, steady: Timeline, gpu: dict[str, Any], storages,
                  replay: Callable[[], Any] | None = None) -> tuple:
    """The caching-allocator replay of a CUDA target's first and steady steps (`replay_steps` with its curve, or
    `replay()` when the caller keeps that same replay): (its `ReservedEstimate`, the report's `allocator` entry, its
    `fit` entry: the verdict of the replay under the device's capacity, `_cuda_fit`)."""
    conf = gpu.get("alloc_conf")
    est = replay() if replay is not None else replay_steps(first, steady, conf=conf, curve=True)
    reserved = est.peak_reserved_bytes
    note = None
    if conf is not None and conf.garbage_collection_threshold is not None:
        note = ("garbage_collection_threshold acts only under a per-process memory fraction below "
                "1 (CUDACachingAllocator.cpp garbage_collect_cached_blocks): no effect modelled")
    allocator = AllocatorSummary(
        model="c10/cuda/CUDACachingAllocator.cpp " + (
            f"with PYTORCH_CUDA_ALLOC_CONF={conf}" if conf is not None and str(conf) else
            "defaults (512 B blocks, 2 MiB small and 20 MiB large segments, best fit, splitting)"),
        segments=est.segments, peak_reserved_bytes=reserved,
        # memory_allocated() counts a whole block when it does not split off a remainder <= 1 MiB
        peak_allocated_bytes=est.peak_allocated_bytes,
        unsplit_remainder_bytes_at_peak=est.peak_remainder_bytes,
        rounded_requests_peak_bytes=steady.peak_bytes,  # the timeline's peak: no remainders
        # the steady step's reserved bytes where they change: ((graph step, bytes), ...)
        reserved_steps=est.reserved_steps, note=note)
    fit = _cuda_fit(first, steady, gpu, est, storages)
    return est, allocator, fit


def summarize(*, model: ModelInfo, run: RunInfo, params: int, ops: tuple, storages: tuple,
              steady: Timeline, first: Timeline, graph_optimal: Timeline, gpu: dict[str, Any] | None,
              top_n: int = 10, unresolved: tuple[str, ...] = (),
              replay: Callable[[], Any] | None = None) -> MemoryReport:
    """Build the MemoryReport from the steady-state, first-step and graph-optimal timelines. With a `gpu`
    (a CUDA target) the two steps are replayed through the caching-allocator model for peak reserved bytes,
    the fit verdict is on reserved memory, and peak allocated (first step and steady) is the replay's, as
    `max_memory_allocated()` counts it: at the replay's peak the breakdown holds the blocks' unsplit remainders
    as `Category.ALLOCATOR_REMAINDER`.

    `ops`/`storages` are the recorder's OpInfo/StorageInfo rows; `gpu` is {'name', 'memory_bytes', 'cuda'} or None
    (no verdict); with 'cuda' False (the CPU target given a capacity) the verdict is on peak allocated bytes.
    `replay`: gives the unbounded replay of `first` and `steady` with its curve under the gpu's alloc_conf, when the
    caller keeps one (tables.py `StepTables.replay`: a --pp stage's was made for its verdict); else it is made here.
    """
    by_sid = {s.sid: s for s in storages}
    peak, peak_bytes, first_peak, remainder = steady.peak_step, steady.peak_bytes, first.peak_bytes, 0
    fit = reserved = allocator = None
    if gpu is not None and gpu.get("cuda", True):
        est, allocator, fit = _cuda_summary(first, steady, gpu, storages, replay)
        reserved, peak, peak_bytes = est.peak_reserved_bytes, est.peak_step, est.peak_allocated_bytes
        first_peak, remainder = est.first_peak_allocated_bytes, est.peak_remainder_bytes
    elif gpu is not None:
        headroom = gpu["memory_bytes"] - steady.peak_bytes
        fit = FitVerdict(gpu=gpu["name"], capacity_bytes=gpu["memory_bytes"], headroom_bytes=headroom,
                         fits=headroom >= 0, basis="peak allocated (CPU target)")
    peak_op = ops[steady.steps[peak]]
    rows = []
    for lt in steady.lifetimes:
        s = by_sid[lt.sid]
        rows.append(TensorRow(lt.sid, lt.bytes, lt.category.value, s.dtype, tuple(s.shape), s.module, s.op,
                              s.phase, lt.birth, lt.death, s.name))
    live = [r for r in rows if r.birth <= peak <= r.death]
    breakdown = {c.value: 0 for c in Category}
    for r in live:
        breakdown[r.category] += r.bytes
    breakdown[Category.ALLOCATOR_REMAINDER.value] = remainder
    if not breakdown[Category.PIPELINE_BUFFERS.value]:  # a --pp run's only: other reports keep their keys
        del breakdown[Category.PIPELINE_BUFFERS.value]
    top = tuple(sorted(live, key=lambda r: (-r.bytes, r.id))[:top_n])
    forward = [i for i, ph in enumerate(steady.phases) if ph == "forward"]
    end_fwd = forward[-1] if forward else -1
    activation = sum(lt.bytes for lt in steady.lifetimes
                     if lt.category is Category.ACTIVATION and lt.birth <= end_fwd < lt.death)
    step_flops, recompute_flops = flops(ops, steady)
    return MemoryReport(
        model=model, run=run, params=params,
        peak_allocated_bytes=peak_bytes,
        first_step_peak_allocated_bytes=first_peak,
        graph_optimal_peak_bytes=graph_optimal.peak_bytes,
        peak_step=peak, peak_phase=str(peak_op.phase), peak_op=peak_op.name, peak_module=peak_op.module,
        peak_micro_step=peak_op.micro,
        breakdown_at_peak=breakdown, phases=_phase_marks(steady, ops, run.mode is Mode.GENERATE, (peak, remainder)),
        top_tensors=top, tensors=tuple(rows),
        num_steps=len(steady.steps), fit=fit, activation_bytes=activation, step_flops=step_flops,
        recompute_flops=recompute_flops, peak_reserved_bytes=reserved, allocator=allocator,
        steps=tuple((ops[i].name, ops[i].module, str(ops[i].phase)) for i in steady.steps), unresolved=unresolved)
