"""A `--pp` run's traces and report entry: every distinct stage traced (tracer/pipelining.py `distinct_stages`), the
one that fails first reported unless `--stage K` (`failing_stage`: on a CUDA target a stage whose allocator replay
runs out of memory comes before a larger one that fits; else the largest), and the `run.pp` entry (`PipelineInfo`:
each stage's peak, the micro-step at it, the micro-batches in flight, its receive buffers and held sends). Under
interleaved-1f1b every rank (its stages together) is traced and listed instead of every stage."""

from __future__ import annotations

from dataclasses import dataclass, replace

from .analysis.categories import Category
from .choices import Device
from .report.sections import PipelineInfo, StagePeak
from .spec import RunSpec


def _stages(spec: RunSpec, loaded) -> tuple[tuple[int, ...], list[tuple[int, ...]]]:
    """(the split, the stage classes of `spec`'s pipeline; only the class of `spec.stage` when given)."""
    from .tracer.pipelining import distinct_stages, stage_split

    split = stage_split(spec, loaded.num_layers)
    classes = distinct_stages(split, spec.pp_schedule, spec.pp_micro_batches, spec.pp)
    return split, classes


def trace_classes(session, spec: RunSpec, loaded, order=None, stop=None) -> None:
    """Trace one stage of each class (`spec.stage`'s only, when given), putting each trace in `session.traces`
    under its spec (`stage` set). The classes in order of their first stage, or by `order(k)` of it when given;
    `stop(k, trace, left)` (`search.Trace`; `left`: the classes not traced yet), called after each trace, ends the
    loop when it returns True (a lever's pipeline that a stage alone shows does not fit: levers.py
    `pipeline_outcome`). No stage's tables are held here past its `stop`, so that `stop` can drop them."""
    from .search import Trace

    _split, classes = _stages(spec, loaded)
    if spec.stage is not None:
        classes = [g for g in classes if spec.stage in g]
    if order is not None:
        classes = sorted(classes, key=lambda g: order(g[0]))
    for i, group in enumerate(classes):
        k = spec.stage if spec.stage is not None else group[0]
        stage_spec = replace(spec, stage=k)
        others = [s for s in group if s != k]
        who = "rank" if spec.pp_schedule.multi_stage else "stage"  # a rank of its V stages under interleaved
        session.say(f"{who} {k}" + (f" (for {who}s {', '.join(map(str, group))})" if others else ""))
        session.traces[stage_spec] = Trace(session.record(stage_spec, loaded, progress=session.say),
                                           loaded.num_layers)
        if stop is not None and stop(k, session.traces[stage_spec], len(classes) - 1 - i):
            break


@dataclass(frozen=True, slots=True)
class StageDigest:
    """What the report and the lever search read of a stage trace that is not the one reported, once its tables
    are dropped (`trace_stages`): its `run.pp` figures (`_stage_figures`) and its lever outcome (`tables.outcome`),
    both on the run's basis (the allocator replay's on a CUDA target)."""

    figures: tuple[int, str, tuple[int, ...], int, int]
    outcome: object


def trace_stages(session, spec: RunSpec, loaded) -> tuple[RunSpec, object, dict]:
    """Trace one stage of each class (`trace_classes`). Returns (the spec reported, its StepTables, {} for the
    ranks' peaks, which a pipeline reports per stage instead). The stage reported: `spec.stage` when given; on a
    CUDA target the one that fails first (`failing_stage`: one whose allocator replay under the capacity less the
    CUDA context runs out of memory before one that fits, then the larger replay's peak allocated), so that the
    report's verdict is the whole pipeline's; on the CPU target the largest peak allocated, then the lower stage.
    Only the reported stage keeps its tables: each other stage's trace is replaced by its `StageDigest` as soon as
    a stage traced shows it is not the one reported."""
    from .search import evaluate

    cuda = spec.device is Device.CUDA
    points: dict[int, object] = {}  # a CUDA target's FitPoints; the CPU target's peaks allocated

    def worst() -> int:
        if cuda:  # the report's verdict: the allocator replay under the capacity less the context
            return failing_stage(points)
        return max(points, key=lambda k: (points[k], -k))  # no replay: the largest is the first to outgrow any capacity

    def judged(k: int, trace, _left: int) -> bool:
        points[k] = (evaluate(trace.tables, k, True, spec.capacity[1] - spec.cuda_context, True) if cuda
                     else trace.tables.peaks(cuda=False)[0])
        reported = worst()
        for j in points:
            if j != reported:
                _digest(session, replace(spec, stage=j), cuda)
        return False

    trace_classes(session, spec, loaded, stop=judged)
    return replace(spec, stage=worst()), session.traces[replace(spec, stage=worst())].tables, {}


def _digest(session, stage_spec: RunSpec, cuda: bool) -> None:
    """Replace the trace of `stage_spec` in `session.traces` by its `StageDigest` (no-op when it has one)."""
    from .search import Trace
    from .tables import outcome

    trace = session.traces[stage_spec]
    if trace.tables is not None:
        digest = StageDigest(_stage_figures(trace.tables, cuda), outcome(trace.tables, trace.num_layers, cuda))
        session.traces[stage_spec] = Trace(None, trace.num_layers, digest)


def failing_stage(points: dict) -> int:
    """The stage of a pipeline that decides its verdict, from its stages' `search.FitPoint`s ({stage k: point}, each
    judged by `search.evaluate`): a stage that does not fit before one that fits, then the larger peak allocated,
    then the lower k. So a pipeline fits exactly when the stage picked fits, and the stage picked is its largest
    when every stage fits or the largest does not. Used by `trace_stages` (the stage a --pp report shows) and
    `vramtrace fit --pp` (fit.py `_worst_stage`). Raises ValueError when `points` is empty."""
    if not points:
        raise ValueError("a pipeline has at least one stage")
    return min(points, key=lambda k: (points[k].fits, -points[k].peak_allocated_bytes, k))


def _stage_figures(tables, cuda: bool) -> tuple[int, str, tuple[int, ...], int, int]:
    """(peak bytes, micro-step at the peak, in flight, receive-buffer bytes and held-send bytes alive then) of one
    traced stage's steady step. The peak bytes on the report's basis (`StepTables.peaks`: the allocator replay's
    peak allocated on a CUDA target); the rest at the liveness peak."""
    from .tracer.pipelining import HELD_SEND, RECV_BUFFER

    steady = tables.timeline()
    at, in_flight = tables.traced.pipeline.at(steady.steps[steady.peak_step])
    names = {row.sid: row.name for row in tables.table if row.category is Category.PIPELINE_BUFFERS}
    recv = held = 0
    for lt in steady.lifetimes:
        if lt.sid in names and lt.birth <= steady.peak_step <= lt.death:
            if names[lt.sid].startswith(RECV_BUFFER):
                recv += lt.bytes
            elif names[lt.sid] == HELD_SEND:
                held += lt.bytes
    return tables.peaks(cuda=cuda)[0], at, in_flight, recv, held


def pipeline_summary(session, spec: RunSpec, loaded) -> PipelineInfo:
    """The report's `run.pp` entry of `spec` (the stage reported in `spec.stage`), from the stage traces
    `trace_stages` kept in `session.traces`; every stage listed, a stage not traced itself (one of a class) with
    its class's figures."""
    from .tracer.pipelining import rank_stages

    split, classes = _stages(spec, loaded)
    v = spec.pp_virtual_stages
    rows = []
    for group in classes:
        traced = [k for k in group if replace(spec, stage=k) in session.traces]
        if not traced:
            continue
        trace = session.traces[replace(spec, stage=traced[0])]
        peak, at, in_flight, recv, held = (trace.digest.figures if trace.tables is None
                                           else _stage_figures(trace.tables, spec.device is Device.CUDA))
        rows += [StagePeak(stage=k, peak_bytes=peak, at=at, in_flight=in_flight, recv_buffer_bytes=recv,
                           held_send_bytes=held, traced_as=traced[0],
                           holds=rank_stages(k, spec.pp, v) if v > 1 else None) for k in group]
    m = spec.pp_micro_batches
    return PipelineInfo(stages=spec.pp, schedule=spec.pp_schedule, micro_batches=m, micro_batch_rows=spec.batch // m,
                        split=split, stage=spec.stage, stage_peaks=tuple(sorted(rows, key=lambda r: r.stage)),
                        virtual_stages=v if v > 1 else None)


def stage_traces(session, spec: RunSpec, keep: bool = True, order=None, stop=None) -> dict[int, object]:
    """Every distinct stage of the pipeline `spec` (`stage` None; `spec.stage`'s only when given) built and traced
    by `trace_classes` (in `order`, until `stop`: see there). With `keep`: {stage k: its `search.Trace`} for the
    stage traced for each class, kept in `session.traces` (under `replace(spec, stage=k)`). Without: {}, each
    trace taken out of `session.traces` again as soon as `stop` has read it (a lever keeps only its outcome; what
    was there before is put back), so that one stage's tables are held at a time. The heap refrozen after, also
    when a trace raises. Used by `vramtrace fit`'s pp axis and the levers under --pp (fit.py, levers.py), which
    size the whole pipeline: it fits when its largest stage does. (No stage is picked for a report:
    `trace_stages`' allocator replays under the capacity are not made.)"""
    before = dict(session.traces)
    found = {}

    def judged(k: int, trace, left: int) -> bool:
        done = stop is not None and stop(k, trace, left)
        stage_spec = replace(spec, stage=k)
        if keep:
            found[k] = trace
        elif stage_spec in before:
            session.traces[stage_spec] = before[stage_spec]
        else:
            del session.traces[stage_spec]
        return done

    try:
        loaded = session.load(spec)
        trace_classes(session, spec, loaded, order, judged)
    finally:
        session.heap.refreeze()
    return found
