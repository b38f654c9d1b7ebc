"""One exact trace of a RunSpec as the analysis consumes it, and the peaks of a storage table.

Shared by `analyze` (its main trace and the `--use-cache false` trace) and `fit` (its exact points), so that every
figure comes from the same path: `trace_step` → `storage_table` under the spec's loop → `build_timeline` of the
steady step (and, on a CUDA target, the caching-allocator replay of the first and steady steps).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from .analysis.allocator import replay_steps
from .analysis.liveness import CUDA_MIN_BLOCK_BYTES, Timeline, build_timeline
from .analysis.categories import Category
from .analysis.storages import StorageInfo, storage_table
from .spec import Device, RunSpec


@dataclass(frozen=True, slots=True)
class StepTables:
    """An exact trace (`traced`: a `tracer.trace.TracedGraph`), its storage table under `loop`, and the allocator
    block the target rounds to (512 B on CUDA, 1 on the CPU)."""

    traced: object
    table: tuple[StorageInfo, ...]
    loop: str
    block: int
    alloc_conf: object = None  # the target's `analysis.device.AllocConf` (CUDA), for the allocator replay
    # this table's timelines by (step, optimal): a recording of one step (inference, a generation) has its first
    # step as its steady one, and a generation's million ops cost seconds per timeline
    _timelines: dict = field(default_factory=dict, compare=False, repr=False)
    # the allocator replay of this table (`replay`): a --pp stage's is asked for its verdict, its figures and its
    # levers' outcome, and on a 70B stage it costs seconds
    _replay: list = field(default_factory=list, compare=False, repr=False)

    def timeline(self, rows: tuple[StorageInfo, ...] | None = None, step: int | None = None,
                 optimal: bool = False) -> Timeline:
        """The timeline of `step` (default: the steady one) over `rows` (default: this table)."""
        t = self.traced
        step = t.steps - 1 if step is None else step
        if rows is not None:
            return build_timeline(t.ops, rows, step, t.counted_devices, self.block, optimal)
        key = (step, optimal)
        if key not in self._timelines:
            self._timelines[key] = build_timeline(t.ops, self.table, step, t.counted_devices, self.block, optimal)
        return self._timelines[key]

    def peaks(self, rows: tuple[StorageInfo, ...] | None = None, cuda: bool = False) -> tuple[int, int | None]:
        """(peak allocated bytes of the steady step, peak reserved bytes by the caching-allocator model on a CUDA
        target else None) over `rows` (default: this table; rows of the same recording with other sizes, as
        `fit` interpolates them). On a CUDA target both come from the allocator replay (`replay_steps`): peak
        allocated as `max_memory_allocated()` counts it, unsplit block remainders included."""
        if not cuda:
            return self.timeline(rows).peak_bytes, None
        est = self.replay(rows)
        return est.peak_allocated_bytes, est.peak_reserved_bytes

    def replay(self, rows: tuple[StorageInfo, ...] | None = None):
        """The caching-allocator replay (`replay_steps`, no capacity) of the first then the steady step over `rows`;
        over this table (rows None) made once and kept, with the steady step's reserved bytes per graph step
        (`curve`), so that the report's allocator section (report/summary.py `summarize`) reuses it. A
        `ReservedEstimate`."""
        if rows is not None:
            return replay_steps(self.timeline(rows, 0), self.timeline(rows), conf=self.alloc_conf)
        if not self._replay:
            self._replay.append(replay_steps(self.timeline(step=0), self.timeline(), conf=self.alloc_conf, curve=True))
        return self._replay[0]


def step_tables(spec: RunSpec, loaded, progress: Callable[[str], None] | None = None) -> StepTables:
    """Trace `spec` on `loaded` (a `tracer.building.LoadedModel` built for it) and make its storage table. Raises
    what `trace_step` raises."""
    from .tracer.trace import trace_step

    if spec.compile:
        from .tracer.compiled_step import trace_compiled

        traced = trace_compiled(spec, loaded, progress)
    elif spec.zero is not None:  # DeepSpeed's engine (tracer/zero.py)
        from .tracer.zero import trace_zero

        traced = trace_zero(spec, loaded, progress or (lambda _msg: None))
    else:
        traced = trace_step(spec, loaded, progress=progress)
    loop = spec.loop.value if spec.step is None else "trainer"  # a --step function is traced as written
    table = storage_table(traced.ops, traced.storages, traced.marks, loop)
    if spec.device is not Device.CUDA:
        return StepTables(traced, table, loop, 1)
    return StepTables(traced, table + cublas_workspaces(traced.ops, table, spec.gpu_preset.sm, traced.steps), loop,
                      CUDA_MIN_BLOCK_BYTES, spec.alloc_conf)


def cublas_workspaces(ops, table: tuple[StorageInfo, ...], sm: int, steps: int = 1) -> tuple[StorageInfo, ...]:
    """One row per thread that runs GEMMs in the recording (`analysis/device.py::gemm_threads`), each the cuBLAS
    workspace of a GPU of compute capability `sm` (`cublas_workspace_bytes`), never freed, with storage ids after
    the table's. It is allocated through the caching allocator at the first GEMM its thread runs
    (aten/src/ATen/cuda/CublasHandlePool.cpp `getCurrentCUDABlasHandle`: the workspace of a new (handle, stream)
    is made on first use), so in a recording of `steps` >= 2 steps it is born at that op of the first step, where
    the allocator may place it in a cached free block (the H100 snapshots of BERT, GPT-2 and T5 hold it inside a
    larger segment); a recording of one step (inference, a generation) has it from the start. The same for each
    thread's cuBLASLt workspace (`cublaslt_workspace_bytes`), born at its first addmm with a bias
    (`first_lt_gemms`), after the cuBLAS ones."""
    from .analysis.device import cublas_workspace_bytes, cublaslt_workspace_bytes, first_gemms, first_lt_gemms

    sid = max((s.sid for s in table), default=0) + 1
    first_step = [o.index for o in ops if o.step == 0]
    by_sid = {s.sid: s for s in table}
    rows = []
    for label, nbytes, find in (("cuBLAS", cublas_workspace_bytes(sm), lambda at: first_gemms(ops, at)),
                                ("cuBLASLt", cublaslt_workspace_bytes(sm),
                                 lambda at: first_lt_gemms(ops, at, by_sid))):
        births = find(first_step) if steps > 1 else {}
        for thread in find(range(len(ops))):
            op = births.get(thread)
            born, phase = (-1, "start") if op is None else (op.index, str(op.phase))  # a thread's, not a module's
            rows.append(StorageInfo(sid=sid + len(rows), nbytes=nbytes, dtype="uint8", shape=(nbytes,), device="meta",
                                    category=Category.CUBLAS_WORKSPACE, op_index=born, op=f"{label} workspace",
                                    module="", phase=phase, name=f"{label} workspace ({thread} thread)",
                                    free_after=None, last_use=-1))
    return tuple(rows)


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a lever search needs of one exact trace (a full `MemoryReport` is not built): the steady step's peak
    allocated bytes (on a CUDA target the allocator replay's, as `StepTables.peaks`), the caching-allocator model's
    peak reserved bytes (CUDA target, else None), the KV cache bytes live at the peak, the forward + backward and
    the recompute FLOPs, the phase of the peak, and the number of layers in the model's checkpointable stack. The
    attribute names are the report's, so `search.compared_bytes` reads either."""

    peak_allocated_bytes: int
    peak_reserved_bytes: int | None
    kv_cache_bytes_at_peak: int
    step_flops: int
    recompute_flops: int
    peak_phase: str
    num_layers: int

    @property
    def recompute_overhead(self) -> float:
        return self.recompute_flops / self.step_flops if self.step_flops else 0.0


def outcome(tables: StepTables, num_layers: int, cuda: bool) -> Outcome:
    """The `Outcome` of an exact trace (`step_tables`) of a model whose stack has `num_layers` layers."""
    from .report.summary import flops

    steady = tables.timeline()
    allocated, reserved, at = steady.peak_bytes, None, steady.peak_step
    if cuda:  # the allocator replay's peak (unsplit block remainders included) and its step
        est = tables.replay()
        allocated, reserved, at = est.peak_allocated_bytes, est.peak_reserved_bytes, est.peak_step
    kv = sum(lt.bytes for lt in steady.lifetimes if lt.category is Category.KV_CACHE and lt.birth <= at <= lt.death)
    step_flops, recompute_flops = flops(tables.traced.ops, steady)
    phase = str(tables.traced.ops[steady.steps[at]].phase) if steady.steps else ""
    return Outcome(allocated, reserved, kv, step_flops, recompute_flops, phase, num_layers)
