"""The orchestration of `vramtrace.analyze`: resolve the config, build the model on meta, trace the step (every
rank class of a distributed one, the use_cache false variant, the eager side of a compiled step), analyse it and
assemble the MemoryReport; the checkpointing baseline and planner, the lever search, the policy comparison."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

from .report.sections import ComparisonRow, CpuKernels, LeversSummary, ModelInfo, RunInfo
from .search import Trace, TraceSession, frozen_session
from .spec import KBIT_TRAINING_CHECKPOINTING, RECIPE_CHECKPOINTING, CheckpointingKind, Device, Mode, RunSpec
from .summaries import (adapters_summary, checkpointing_summary, compile_summary, cuda_context_summary, moe_summary,
                        ranks_text, sharding_summary, step_summary, target_warnings, zero_summary)


def analyze(spec: RunSpec | None = None, progress: Callable[[str], None] | None = None, levers: bool = True, *,
            model=None, inputs=None, loss: Callable | None = None, **options):
    """Resolve, build on meta, trace and analyse the step of `spec`. Returns a MemoryReport.

    Without a spec: `analyze(model=..., **options)` with `RunSpec`'s fields as keywords (batch=8, seq=2048,
    device="cpu", checkpointing="layers", ...). `model` is a model reference (a Hub or bundled id, a config path,
    "path/model.py:NAME") or an `nn.Module` built on the meta device, traced as a custom module: `inputs` its
    forward's arguments (a dict of keyword arguments, a tuple of positional ones or one tensor: meta tensors or
    shape specs such as "int64[B,S]:0..32000") and `loss(output, *inputs)` its training loss (default:
    `output.loss`, else the mean of the first output tensor); the module is deep-copied, never changed.

    With a checkpointing policy the step is also analysed without it, and the report's `checkpointing` holds
    the baseline (peak and activation bytes without the policy) and a note when the policy costs memory.
    `auto` runs the planner (`vramtrace.planner`). When the step does not fit the target GPU and `levers` is
    true, the report's `levers` lists what makes it fit, each lever traced (`vramtrace.levers`). Raises
    ModelLoadError (bad model reference or config), TraceError (the step could not run on meta), UsageError (bad
    spec values).

    Not thread-safe: a trace installs process-wide state while it runs (the bridges' patches into transformers and
    torch, a TorchDispatchMode and a TorchFunctionMode, the intra-op thread count of a sharded CPU step, the garbage
    collector frozen), all restored when it returns. Run one `analyze` at a time per process; use processes for
    parallel runs.
    """
    from dataclasses import replace

    if spec is None or model is not None:
        return _analyze_model(spec, progress, levers, model, inputs, loss, options)
    if options or inputs is not None or loss is not None:
        from .errors import UsageError

        raise UsageError("analyze(spec) takes no other run options: put them in the RunSpec, or call "
                         "analyze(model=..., batch=..., ...) without a spec")
    say = progress or (lambda _m: None)
    ckpt = spec.checkpointing
    if ckpt.kind is CheckpointingKind.AUTO:
        from .planner import plan_checkpointing

        return plan_checkpointing(spec, _analyze_one, say)
    with _eager_beside(spec) as eager_job:
        with trace_session(spec, say) as session:
            done = _analyze_one_frozen(session)
            report = done.report
            if levers and report.fit is not None and not report.fit.fits:
                report = replace(report, levers=_levers(done))
        if spec.compile:
            eager = _eager_report(spec, eager_job, say)
            compiled = done.session.traces[done.spec].tables.traced.compiled
            report = replace(report, eager=eager, compiled=compile_summary(report, compiled, eager))
    if ckpt.kind is CheckpointingKind.NONE:
        return report
    from .tracer.checkpointing import paste_snippet  # imports torch: after the config is resolved

    say("the same step without checkpointing")
    base = _analyze_one(replace(spec, checkpointing="none"), say)
    return replace(report, checkpointing=checkpointing_summary(report, base, paste_snippet(ckpt)))


def _analyze_model(spec, progress, levers, model, inputs, loss, options):
    """`analyze(model=..., **options)`: the RunSpec from keywords; an nn.Module travels in it as an
    `InProcessModel` (`tracer.custom.in_process_model`), which the report names by its class. Raises UsageError."""
    from .errors import UsageError

    if spec is not None:
        raise UsageError("pass either a RunSpec or model=..., not both")
    if model is None:
        raise UsageError("analyze() needs a RunSpec or model=: a model reference string or an nn.Module")
    if isinstance(model, str):
        if inputs is not None or loss is not None:
            raise UsageError("inputs= and loss= go with an nn.Module; for a reference use RunSpec's inputs "
                             "(shape specs) or a file's example_inputs()/loss()")
        return analyze(_spec_from(model, options), progress, levers)
    from .tracer.custom import in_process_model

    return analyze(_spec_from(in_process_model(model, inputs, loss), options), progress, levers)


def _spec_from(model, options: dict) -> RunSpec:
    try:
        return RunSpec(model, **{"seq": None, **options})  # seq: needed by text models only
    except TypeError as e:
        from .errors import UsageError

        raise UsageError(f"analyze(): {e}; the options are RunSpec's fields") from None


def _eager_beside(spec: RunSpec):
    """A context: for a `--compile` spec on a machine with two or more cores, the `SecondProcess` computing the
    eager step's report (`analyze_eager`) while this process traces the compiled one; else None. A model passed
    as an nn.Module lives in this process only, so its eager step is traced here."""
    import contextlib
    import pickle

    from .second_process import SecondProcess, cores

    if not spec.compile or cores() < 2 or spec.in_process is not None:
        return contextlib.nullcontext()
    try:
        return SecondProcess(analyze_eager, spec)
    except (OSError, ValueError, pickle.PicklingError):  # no process can be started here (ValueError: no pass_fds
        return contextlib.nullcontext()  # off POSIX), or the spec holds an object of this process only: traced here


def analyze_eager(spec: RunSpec):
    """The MemoryReport of `spec`'s step without torch.compile (the `compiled` comparison's eager side). Only its
    timeline and figures are shown (`compile_summary`, the HTML report's second page), so the step is not traced a
    second time with `--use-cache false` (`run.use_cache_false_peak_bytes` is None)."""
    from dataclasses import replace

    with trace_session(replace(spec, compile=False)) as session:
        return _analyze_one_frozen(session, use_cache_variant=False).report


def _eager_report(spec: RunSpec, job, say: Callable[[str], None]):
    """`analyze_eager(spec)`: the second process's answer when `job` runs it, else traced here (also when the
    second process ended without an answer)."""
    if job is not None:
        say("the same step without torch.compile (in a second process)")
        try:
            return job.result()
        except ChildProcessError:
            pass
    say("the same step without torch.compile")
    return analyze_eager(spec)


COMPARED_POLICIES = ("none", "layers", "selective")


def compare_reports(spec: RunSpec, policies=COMPARED_POLICIES, progress: Callable[[str], None] | None = None) -> list:
    """`spec` analysed under each checkpointing policy: one MemoryReport per policy, in order."""
    from dataclasses import replace

    say = progress or (lambda _m: None)
    reports = []
    for policy in policies:
        say(f"checkpointing {policy}")
        reports.append(_analyze_one(replace(spec, checkpointing=policy, memory_budget_bytes=None), say))
    return reports


def with_comparison(reports: list, policies) -> object:
    """The first report with `comparison` rows (policy, peak_allocated_bytes, activation_bytes, recompute_flops,
    recompute_overhead), one per report."""
    from dataclasses import replace

    rows = [ComparisonRow(policy=str(p), peak_allocated_bytes=r.peak_allocated_bytes,
                          activation_bytes=r.activation_bytes, recompute_flops=r.recompute_flops,
                          recompute_overhead=r.recompute_overhead)
            for p, r in zip(policies, reports)]
    return replace(reports[0], comparison=tuple(rows))


def compare(spec: RunSpec, policies=COMPARED_POLICIES, progress: Callable[[str], None] | None = None):
    """`spec` analysed under each checkpointing policy: the first policy's report with `comparison` rows."""
    return with_comparison(compare_reports(spec, policies, progress), policies)




@contextmanager
def trace_session(spec: RunSpec, progress: Callable[[str], None] | None = None) -> Iterator[TraceSession]:
    """A context holding the `search.TraceSession` of `spec` with the garbage collector's heap frozen
    (`search.FrozenHeap`, restored on exit): `spec.model`'s config resolved (before torch is imported, saying
    "resolving config" to `progress` first) and the run's precision resolved into `session.spec`. Every
    `analyze` opens one; so do the tests that need more than a MemoryReport (the seam they use, issue 40):
    `session.load(spec)` builds the model on meta (`tracer.building.LoadedModel`), `session.record(spec, loaded)`
    traces its step (`tables.StepTables`: the recording's ops and storages, the storage table, its timelines),
    `session.trace(spec)` both, kept per spec; a variant of the trace (`tracer.trace.trace_step`'s
    `replay_steady`, `rebuild_decode`, `keep_args`) is `trace_step(spec, session.load(spec), ...)`. Raises
    ModelLoadError (bad model reference or config)."""
    say = progress or (lambda _m: None)
    say("resolving config")
    with frozen_session(spec, say) as session:
        yield session


@dataclass(frozen=True, slots=True)
class Analysed:
    """What `_analyze_one_frozen` made: the MemoryReport, the spec it reports (precision resolved; the worst rank
    class's rank when every class was traced) and the session holding the resolved config and the traces made
    (`TraceSession.traces`, `found`), which a lever search starts from."""

    report: object
    spec: RunSpec
    session: TraceSession


def _levers(done: Analysed) -> LeversSummary:
    """The report's `levers` (`levers.find_levers`) of a run that does not fit, against the capacity less the CUDA
    context, seeded with the outcomes of the traces the report made (not traced again). Those traces then leave
    the session, all but the one reported (its tables are read after: a --compile report's graphs), so that their
    tables are not held beside each lever's trace."""
    from .levers import Evaluator, find_levers, whole_pipeline

    cuda = done.spec.device is Device.CUDA
    ev = Evaluator(done.session, cuda)
    for traced_spec, found in done.session.outcomes(cuda).items():
        ev.seed(traced_spec, found)
        if traced_spec != done.spec:  # the use_cache false variant: for the next run's report too
            ev.disk.put(traced_spec, found)
    for traced_spec in [s for s in done.session.traces if s != done.spec]:
        del done.session.traces[traced_spec]
    spec = done.spec
    if spec.pp is not None and done.session.spec.stage is None:  # no --stage: the levers size every stage
        spec = whole_pipeline(ev, spec)
    fit = done.report.fit
    return find_levers(spec, ev, fit.capacity_bytes - (fit.cuda_context_bytes or 0))


def _use_cache_false_peak(session: TraceSession, spec: RunSpec) -> int:
    """The steady step's peak allocated bytes of `spec` with use_cache false: the outcome an earlier lever search
    cached on disk for that spec (`levers.LeverDiskCache`: the same trace's, keyed by everything that changes it)
    when there, put in `session.found`; else traced, put in `session.traces`."""
    from dataclasses import replace

    from .levers import LeverDiskCache

    off = replace(spec, use_cache=False)
    found = LeverDiskCache.from_environment(session.resolved).get(off)
    if found is not None:
        session.found[off] = found
        return found.peak_allocated_bytes
    off_loaded = session.load(off)
    off_tables = session.record(off, off_loaded)
    session.traces[off] = Trace(off_tables, off_loaded.num_layers)
    return off_tables.peaks()[0]


def _analyze_one(spec: RunSpec, say: Callable[[str], None]):
    with trace_session(spec, say) as session:
        return _analyze_one_frozen(session).report


def _trace_worst_rank(session: TraceSession, spec: RunSpec, loaded) -> tuple[RunSpec, object, dict]:
    """(the spec traced, its StepTables, {ranks text: peak allocated} of each rank class): for a distributed run
    without --rank, every distinct rank class traced and the one with the largest peak reported; else `spec`. The
    peaks are the report's own figure (`StepTables.peaks`: the allocator replay's on a CUDA target, the liveness
    peak on the CPU), so the rank reported is the one whose report shows the most. A --pp run: every distinct
    stage traced and the one that fails first reported (pp_stages.py `trace_stages`, `failing_stage`)."""
    from dataclasses import replace

    say = session.say
    if spec.pp is not None:  # every distinct pipeline stage (pp_stages.py)
        from .pp_stages import trace_stages

        return trace_stages(session, spec, loaded)
    if spec.zero is not None and spec.rank is None:  # DeepSpeed ZeRO's rank classes (tracer/zero.py)
        from .tracer.zero import rank_classes as zero_classes

        classes = zero_classes(spec)
        if len(classes) == 1:
            return replace(spec, rank=0), session.record(replace(spec, rank=0), loaded, progress=say), {}
    elif spec.world is None or spec.ddp is not None or spec.rank is not None:
        return spec, session.record(spec, loaded, progress=say), {}
    else:
        from .tracer.sharding import rank_classes

        classes = rank_classes(loaded.model, spec)
    tables, rank_peaks = {}, {}
    for ranks in classes:
        say(f"rank {ranks[0]} (for ranks {ranks_text(ranks)})")
        tables[ranks] = session.record(replace(spec, rank=ranks[0]), loaded, progress=say)
        # on the report's basis: the allocator replay's peak allocated on a CUDA target (as pp_stages.py does)
        rank_peaks[ranks_text(ranks)] = tables[ranks].peaks(cuda=spec.device is Device.CUDA)[0]
    worst = max(classes, key=lambda g: (rank_peaks[ranks_text(g)], -g[0]))
    return replace(spec, rank=worst[0]), tables[worst], rank_peaks


def _analyze_one_frozen(session: TraceSession, use_cache_variant: bool = True) -> Analysed:
    """The MemoryReport of the session's spec (`trace_session`), with the spec it reports and the session of its
    traces (`Analysed`). `use_cache_variant`: when the config's KV cache is live at the peak, the step is traced
    again with use_cache false (`run.use_cache_false_peak_bytes`; `_use_cache_false_peak`)."""
    from .analysis.storages import loop_peaks as loops_peaks
    from .report.summary import summarize

    say = session.say
    say("building model on meta")
    loaded = session.load(session.spec)
    session.heap.refreeze()  # torch, transformers and the model are built: out of the collector's way
    spec, main, rank_peaks = _trace_worst_rank(session, session.spec, loaded)
    say("liveness analysis")
    traced, steady = main.traced, main.timeline()
    loop_peaks = {}
    if spec.mode is Mode.TRAIN and spec.step is None and spec.pp is None:  # a --pp stage runs its schedule's loop
        loop_peaks = loops_peaks(steady, traced.ops, traced.storages, traced.marks, main.loop,
                                 traced.counted_devices, main.block)
    cache_off_peak = None
    session.traces[spec] = Trace(main, loaded.num_layers)
    if use_cache_variant and spec.mode is Mode.TRAIN and spec.use_cache is None and any(
            lt.category == "kv_cache" and lt.birth <= steady.peak_step <= lt.death for lt in steady.lifetimes):
        # the config's KV cache is live at the peak: what --use-cache false saves, traced (not derived: without
        # the cache the attention's own key/value tensors live as long as its locals and saved tensors keep them)
        say("the same step with use_cache false")
        cache_off_peak = _use_cache_false_peak(session, spec)
    run_info = _run_info(spec, session.precision_source, loaded, main, steady,
                         step_summary(spec, loop_peaks, cache_off_peak), {**sharding_summary(spec, rank_peaks,
                                                                                           _host_peak(spec, main)),
                                                                          **zero_summary(spec, loaded, rank_peaks,
                                                                                         _host_peak(spec, main))})
    if spec.pp is not None:
        from dataclasses import replace

        from .pp_stages import pipeline_summary

        run_info = replace(run_info, pp=pipeline_summary(session, spec, loaded))
    report = summarize(
        model=_model_info(session.resolved, loaded, traced), run=run_info, params=loaded.params, ops=traced.ops,
        storages=main.table, steady=steady, first=main.timeline(step=0), graph_optimal=main.timeline(optimal=True),
        gpu=_gpu_info(spec), unresolved=traced.unresolved, replay=main.replay)
    return Analysed(report, spec, session)


def _host_peak(spec: RunSpec, main) -> int | None:
    """FSDP2's CPUOffloadPolicy: the peak of what lives in host memory, outside the GPU's figures (else None)."""
    if not spec.cpu_offload and not (spec.zero is not None and spec.device is Device.CUDA
                                     and (spec.offload_optimizer or spec.offload_param)):
        return None
    from .analysis.liveness import build_timeline
    from .tracer.recorder import HOST_DEVICE

    traced = main.traced
    return build_timeline(traced.ops, main.table, traced.steps - 1, (HOST_DEVICE,)).peak_bytes


def _model_info(resolved, loaded, traced) -> ModelInfo:
    """The report's `model` section: the reference, the config's source, the built model's figures."""
    checkpoint = None
    if resolved.checkpoint is not None:
        from .tracer.checkpoint_headers import cross_check

        checkpoint = cross_check(resolved.checkpoint, loaded.params)
    return ModelInfo(
        ref=resolved.ref, config_source=resolved.source, config_location=resolved.location,
        architecture=loaded.architecture, model_type=loaded.model_type, task=loaded.task,
        params=loaded.params, trainable_params=loaded.trainable_params,
        param_dtype=str(loaded.param_dtype).removeprefix("torch."),
        compute_dtype=str(loaded.compute_dtype or loaded.param_dtype).removeprefix("torch."),
        attn_implementation=loaded.attn_implementation, sdpa_backends=dict(traced.sdpa_backends),
        checkpoint=checkpoint)


def _run_info(spec: RunSpec, precision_source: str, loaded, main, steady, step: dict, sharding: dict) -> RunInfo:
    """The report's `run` section: the run's settings and the figures of its traced step (`step`:
    `step_summary`'s, `sharding`: `sharding_summary`'s entries)."""
    traced, table = main.traced, main.table
    generation = {}
    if spec.mode is Mode.GENERATE:
        from .report.summary import generation_summary

        generation = generation_summary(traced.ops, table, steady, spec.batch, spec.seq, spec.new_tokens,
                                        loaded.task == "seq2seq-lm")
    # CUDA managed memory (a paged bitsandbytes optimizer): outside the allocated and reserved bytes
    paged = sum(st.nbytes for st in traced.storages if st.category == "paged_optimizer_state")
    from .tracer.packing import describe as packing_summary

    return RunInfo(
        mode=spec.mode, precision=loaded.precision, precision_source=precision_source, optimizer=spec.optimizer,
        optimizer_impl=spec.optimizer_impl, device=spec.device, gpu=spec.gpu_preset.name,
        batch=spec.batch, seq=spec.seq, checkpointing=str(spec.checkpointing),
        checkpointing_source=_checkpointing_source(spec),
        num_layers=loaded.num_layers, layer_stack=loaded.layer_stack_path,
        allocator_block_bytes=main.block, num_ops=len(traced.ops), trace=traced.trace_note,
        inputs=tuple(f"{n}={d}{list(s)}" for n, d, s in loaded.input_summary()) if loaded.task == "custom" else (),
        **step, **sharding,
        adapters=adapters_summary(spec), images=loaded.images or None,
        image_size=None if loaded.image_size is None else tuple(loaded.image_size),
        **moe_summary(spec, loaded.model),
        compile=spec.compile, compile_mode=spec.compile_mode if spec.compile else None,
        **cuda_context_summary(spec), **generation, paged_optimizer_state_bytes=paged or None,
        packing=packing_summary(spec, loaded.attn_implementation),
        cpu_kernels=CpuKernels(**dict(traced.cpu_environment)) if traced.cpu_environment else None,
        sources=spec.sources, warnings=tuple(target_warnings(spec, loaded.precision.value)) + spec.source_warnings,
        recipe=spec.recipe)


def _checkpointing_source(spec: RunSpec) -> str:
    """Where the run's checkpointing came from when a file or a default set it: a `--from` file's key, peft's kbit
    default or the recipe's."""
    given = [e for e in spec.sources if e.option == "checkpointing"]
    if given:
        return f"--from {given[-1].file} ({given[-1].key})"
    if spec.recipe is not None:
        default = str(spec.checkpointing) == RECIPE_CHECKPOINTING[spec.recipe]
        return f"--recipe {spec.recipe.value}'s default" if default else ""
    kbit = spec.quantization is not None and spec.lora_rank is not None
    return "prepare_model_for_kbit_training's default" if kbit and str(spec.checkpointing) == \
        KBIT_TRAINING_CHECKPOINTING else ""


def _gpu_info(spec: RunSpec) -> dict | None:
    """The report's `gpu` section (None without a capacity)."""
    if spec.capacity is None:
        return None
    return {"name": spec.capacity[0], "memory_bytes": spec.capacity[1], "cuda": spec.device is Device.CUDA,
            "cuda_context_bytes": spec.cuda_context, "alloc_conf": spec.alloc_conf,
            "cuda_context_source": cuda_context_summary(spec).get("cuda_context_source", "")}
