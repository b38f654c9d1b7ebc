"""Time replication (prototype, issue 42: docs/research/issue-42-pp/time_replication.py; not in the suite, run it with
`PYTHONPATH=tests:docs/research/issue-42-pp python -m pytest docs/research/issue-42-pp/test_time_replication.py`,
several minutes on 2 cores): a pipeline stage traced with M' micro-batches
and its records for M rebuilt, against the same stage traced with all M. Tiny Llama, P = 4, an uneven split
(2, 2, 1, 1), GPipe and 1F1B, fp32 and bf16-mixed, M = 8 and 12, M' the smallest trace with a template and a check
of each kind (`time_plan`): every stage's live bytes at every op of the first and the steady step, its peak
allocated on the CPU target (liveness) and on a CUDA target (the caching-allocator replay), to the byte, and the
micro-step at the peak. Not wired into the default path (issue 42 docs/research/issue-42-pp-time-replication.md)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from conftest import deep_config
from vramtrace import RunSpec
from vramtrace.pipeline import trace_session
from vramtrace.tables import StepTables, cublas_workspaces
from vramtrace.analysis.liveness import CUDA_MIN_BLOCK_BYTES
from vramtrace.analysis.storages import storage_table
from vramtrace.spec import Device
from vramtrace.tracer.pipelining import StageTrace
from vramtrace.tracer.records import OpInfo, RecOp
from vramtrace.tracer.replication import NotPeriodic
from time_replication import KindPlan, block_sequence, replicate_micro_batches, time_plan

SPLIT, ROWS, SEQ = (2, 2, 1, 1), 2, 16  # ROWS rows per micro-batch


def _tables(spec: RunSpec, traced) -> StepTables:
    """`tables.step_tables` of an already traced (or rebuilt) recording."""
    loop = spec.loop.value
    table = storage_table(traced.ops, traced.storages, traced.marks, loop)
    if spec.device is not Device.CUDA:
        return StepTables(traced, table, loop, 1)
    return StepTables(traced, table + cublas_workspaces(traced.ops, table, spec.gpu_preset.sm, traced.steps), loop,
                      CUDA_MIN_BLOCK_BYTES, spec.alloc_conf)


def _rebuilt(traced, plan):
    """`traced` (M' micro-batches) with its records rebuilt for `plan.micro_batches`."""
    ops = [RecOp(o.index, o.name, str(o.phase), o.module, o.reads, o.allocates, o.frees, 0, o.flops, o.recompute,
                 o.step, o.micro) for o in traced.ops]
    new_ops, storages, labels = replicate_micro_batches(plan, ops, list(traced.storages), traced.pipeline.labels)
    return replace(traced, ops=tuple(OpInfo(o.index, o.name, o.phase, o.module, o.ins, o.outs, o.flops, o.recompute,
                                            o.step, o.micro, o.frees) for o in new_ops),
                   storages=tuple(storages), pipeline=StageTrace(labels))


def _figures(tables: StepTables, cuda: bool) -> dict:
    steady = tables.timeline()
    return {"first step": tables.timeline(step=0).live_bytes, "steady step": steady.live_bytes,
            "peak": tables.peaks(cuda=cuda), "at": tables.traced.pipeline.at(steady.steps[steady.peak_step]),
            "ops": len(tables.traced.ops), "micro-steps": tables.traced.pipeline.labels}


def _trace(path: str, schedule: str, precision: str, device: str, stage: int, m: int) -> tuple[RunSpec, object]:
    spec = RunSpec(path, batch=ROWS * m, seq=SEQ, device=device, precision=precision, pp=len(SPLIT),
                   pp_schedule=schedule, micro_batches=m, pp_split=SPLIT, stage=stage,
                   **({"gpu": "h100"} if device == "cuda" else {}))
    with trace_session(spec) as session:
        return session.spec, session.record(session.spec, session.load(session.spec))


def test_block_sequence_is_the_schedules():
    """1F1B's w = P - k warm-up forwards, (B_i, F_{i+w}) pairs, w cool-down backwards (torch's Schedule1F1B)."""
    assert block_sequence("1f1b", 4, 2, 4) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3),
                                               ("B", 2), ("B", 3)]
    assert block_sequence("gpipe", 4, 0, 2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_rebuilt_stage_equals_the_stage_traced_whole(tmp_path, schedule, precision, device):
    """Every stage, M = 8 and 12 from M': the rebuilt records give the fully traced stage's live bytes at every op
    of both steps, its peak (on a CUDA target the allocator replay's peak allocated and reserved), the micro-step
    at the peak, its op count and every micro-step's first op and micro-batches in flight (`StageTrace.labels`);
    a stage whose M' would not be fewer than M (1F1B stage 0 at M = 8) is traced whole."""
    path = deep_config(tmp_path, "tiny-llama-gqa", sum(SPLIT))
    rebuilt_any = False
    for stage in range(len(SPLIT)):
        small = {}  # M' -> its trace, made once for both M
        for m in (8, 12):
            plan = time_plan(schedule, len(SPLIT), stage, m)
            if plan is None:
                continue
            rebuilt_any = True
            _spec, full = _trace(path, schedule, precision, device, stage, m)
            if plan.traced not in small:
                small[plan.traced] = _trace(path, schedule, precision, device, stage, plan.traced)
            small_spec, traced = small[plan.traced]
            cuda = device == "cuda"
            want, got = _figures(full, cuda), _figures(_tables(small_spec, _rebuilt(traced.traced, plan)), cuda)
            for what in want:
                assert got[what] == want[what], (stage, m, plan.traced, what)
    assert rebuilt_any


def test_the_check_refuses_a_template_before_the_warm_up_send_is_released(tmp_path):
    """1F1B stage 1 of 4 (w = 3): F1's output is held by the warm-up's last `send_work` until after the steady
    phase (torch's Schedule1F1B), so B1 frees one storage fewer than B2: a plan taking B1 as the template (B head
    1, not `time_plan`'s w - 1 = 2) is refused by the check, not rebuilt wrong."""
    path = deep_config(tmp_path, "tiny-llama-gqa", sum(SPLIT))
    plan = time_plan("1f1b", len(SPLIT), 1, 12)
    assert plan.backward == KindPlan(2, 3)
    naive = replace(plan, traced=6, backward=KindPlan(1, 3))
    _spec, small = _trace(path, "1f1b", "fp32", "cpu", 1, naive.traced)
    with pytest.raises(NotPeriodic, match="B1 and B2"):
        _rebuilt(small.traced, naive)
