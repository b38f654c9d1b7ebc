"""`vramtrace MODEL ...` (the default command), `vramtrace fit MODEL ...` and `vramtrace validate MODEL ...`: one
function with the same options, registered under the three names; `ctx.command.name` says which ran. The work is
four steps: check the options (`_check_usage`), build the RunSpec (`_run_spec`), run (`_execute`), render
(`_render`)."""

from __future__ import annotations

import contextlib
import sys
from enum import Enum
from pathlib import Path
from types import SimpleNamespace

import typer
from rich.console import Console

from ..errors import UsageError
from . import options as o
from .from_files import apply_deepspeed_config, apply_sources


class Command(str, Enum):
    """The commands that share `main_command`'s options (the click command names they are registered under)."""

    RUN = "run"  # the default: `vramtrace MODEL ...`
    FIT = "fit"
    VALIDATE = "validate"


def main_command(
    ctx: typer.Context,
    model: o.ModelArg = None, batch: o.BatchOpt = 1, seq: o.SeqOpt = None, inputs: o.InputsOpt = (),
    image_size: o.ImageSizeOpt = None, images: o.ImagesOpt = None, task: o.TaskOpt = None,
    choices: o.ChoicesOpt = None, attn_implementation: o.AttnImplementationOpt = None, mode: o.ModeOpt = "train",
    precision: o.PrecisionOpt = None, optimizer: o.OptimizerOpt = "adamw",
    optimizer_impl: o.OptimizerImplOpt = "default", device: o.DeviceOpt = "cuda", gpu: o.GpuOpt = "H100-80GB",
    cuda_context: o.CudaContextOpt = None, cuda_version: o.CudaVersionOpt = None, alloc_conf: o.AllocConfOpt = "",
    checkpointing: o.CheckpointingOpt = None, memory_budget: o.MemoryBudgetOpt = None, freeze: o.FreezeOpt = (),
    lora_rank: o.LoraRankOpt = None, lora_alpha: o.LoraAlphaOpt = None, lora_dropout: o.LoraDropoutOpt = None,
    lora_targets: o.LoraTargetsOpt = None, quantization: o.QuantizationOpt = None,
    double_quant: o.DoubleQuantOpt = False, bnb_compute_dtype: o.BnbComputeDtypeOpt = None,
    moe_routing: o.MoeRoutingOpt = "balanced", loop: o.LoopOpt = "trainer", step: o.StepOpt = None,
    grad_accum: o.GradAccumOpt = 1, zero_grad: o.ZeroGradOpt = "none", clip_grad_norm: o.ClipGradNormOpt = None,
    use_cache: o.UseCacheOpt = None, new_tokens: o.NewTokensOpt = None, cache: o.CacheOpt = "dynamic",
    kv_dtype: o.KvDtypeOpt = "auto", fsdp: o.FsdpOpt = None, reshard_after_forward: o.ReshardAfterForwardOpt = "true",
    cpu_offload: o.CpuOffloadOpt = False, compile_model: o.CompileModelOpt = False,
    compile_mode: o.CompileModeOpt = "default", fsdp_plan: o.FsdpPlanOpt = "layers", ddp: o.DdpOpt = None,
    tp: o.TpOpt = None, rank: o.RankOpt = None, strict: o.StrictOpt = False,
    compare_policies: o.ComparePoliciesOpt = False, json_path: o.JsonPathOpt = None, html_path: o.HtmlPathOpt = None,
    snapshot_path: o.SnapshotPathOpt = None, trace_events_path: o.TraceEventsPathOpt = None,
    trust_remote_code: o.TrustRemoteCodeOpt = False, trace_every_layer: o.TraceEveryLayerOpt = False,
    quiet: o.QuietOpt = False, debug: o.DebugOpt = False, gpu_memory: o.GpuMemoryOpt = None,
    no_levers: o.NoLeversOpt = False, headroom: o.HeadroomOpt = None, sweep_grid: o.SweepGridOpt = None,
    packing: o.PackingOpt = False, recipe: o.RecipeOpt = None, from_files: o.FromOpt = (),
    pp: o.PpOpt = None, pp_schedule: o.PpScheduleOpt = "1f1b", micro_batches: o.MicroBatchesOpt = None,
    virtual_stages: o.VirtualStagesOpt = None, pp_split: o.PpSplitOpt = None, stage: o.StageOpt = None,
    zero: o.ZeroOpt = None, dp: o.DpOpt = None, offload_optimizer: o.OffloadOptimizerOpt = None,
    offload_param: o.OffloadParamOpt = None, deepspeed: o.DeepspeedOpt = None,
) -> None:
    """Predict the peak memory of one training step (or inference forward) from a meta-device trace.

    `vramtrace validate MODEL --seq S ...` also runs the step for real on this machine and compares.
    `vramtrace fit MODEL --seq S [--gpu G | --gpu-memory 48GiB] [--headroom 5%]` finds the largest micro-batch
    that fits (with `--batch B` instead of `--seq`: the longest sequence).
    `vramtrace REPORT.json [...] --html PATH` (or --snapshot, --trace-events) re-renders saved reports.
    `vramtrace models` lists the bundled ids.
    """
    del debug  # read by main() from the arguments, so that it also covers errors raised while parsing them
    opts = SimpleNamespace(**{k: v for k, v in locals().items() if k != "ctx"})
    apply_sources(ctx, opts)
    apply_deepspeed_config(ctx, opts)
    command = next((c for c in Command if c.value == ctx.command.name), Command.RUN)
    fit_axis = _fit_axis(ctx, opts) if command is Command.FIT else None
    opts.quiet = _check_usage(opts, fit_axis, validate_run=command is Command.VALIDATE)
    _execute(opts, fit_axis, validate_run=command is Command.VALIDATE)


def _fit_axis(ctx: typer.Context, opts: SimpleNamespace) -> str:
    """`vramtrace fit`'s search axis from the options given on the command line (click's parameter source): the
    batch at a given --seq (or with neither, for models without a sequence), the sequence at a given --batch, the
    fewest FSDP ranks at both (with --zero: the smallest ZeRO stage; with --pp: the smallest pipeline depth); "sweep"
    with --sweep. Raises UsageError for --sweep with either."""
    def given(name: str) -> bool:
        # click's ParameterSource enum, by member name: typer >= 0.2x vendors click in a private module
        return getattr(ctx.get_parameter_source(name), "name", None) == "COMMANDLINE"

    has_seq, has_batch = given("seq"), given("batch")
    if opts.pp is not None:
        if opts.sweep_grid is not None or not (has_seq and has_batch):
            raise UsageError("`vramtrace fit --pp P` searches the smallest pipeline depth from P that fits at a "
                             "given --batch and --seq: give both (and no --sweep)")
        return "pp"  # both sizes fixed, --pp given: the smallest pipeline depth that fits
    if opts.sweep_grid is not None:
        if has_seq or has_batch:
            raise UsageError("--sweep gives the batches and sequences itself; drop --batch and --seq")
        return "sweep"
    if has_seq and has_batch and opts.zero is not None:
        return "zero"  # both sizes fixed, --zero --dp given: the smallest ZeRO stage that fits
    if has_seq and has_batch:
        return "fsdp"  # both sizes fixed: the fewest FSDP ranks that fit
    return "seq" if has_batch else "batch"


def _check_usage(opts: SimpleNamespace, fit_axis: str | None, validate_run: bool) -> bool:
    """The combinations of options no command accepts, as UsageError; checks the output paths are writable.
    Returns `quiet` (also true when an output goes to stdout, which then carries that output alone)."""
    from ..render.json_report import check_writable

    if opts.compare_policies and opts.checkpointing is not None and opts.checkpointing.strip().lower() != "none":
        raise UsageError("--compare traces none, layers and selective itself; drop --checkpointing, or drop --compare")
    for option, given in (("--headroom", opts.headroom), ("--sweep", opts.sweep_grid)):
        if fit_axis is None and given is not None:
            raise UsageError(f"{option} applies to `vramtrace fit MODEL ...`")
    if fit_axis is not None and (opts.compare_policies or opts.snapshot_path or validate_run
                                 or (opts.html_path and fit_axis == "sweep")):
        raise UsageError("fit writes no --compare or --snapshot (and --sweep no --html); run `vramtrace MODEL ...` "
                         "for those")
    if opts.trace_events_path is not None and (fit_axis is not None or validate_run):
        raise UsageError("fit and validate write no --trace-events; run `vramtrace MODEL ...` for those")
    if opts.compile_model and (fit_axis is not None or validate_run or opts.compare_policies):
        raise UsageError("--compile is traced for `vramtrace MODEL ...` only (not fit, validate or --compare yet); "
                         "drop --compile there")
    if opts.compile_mode != "default" and not opts.compile_model:
        raise UsageError("--compile-mode sets torch.compile's mode: add --compile")
    if validate_run and (opts.compare_policies or opts.html_path or opts.snapshot_path):
        raise UsageError("validate writes no --compare, --html or --snapshot; run `vramtrace MODEL ...` for those")
    outputs = _outputs(opts)
    to_stdout = [option for option, path in outputs if path == "-"]
    if len(to_stdout) > 1:
        raise UsageError(f"{' and '.join(to_stdout)} both write to stdout ('-'); give all but one a file path")
    for option, path in outputs:
        if path is not None:
            check_writable(path, option)
    return opts.quiet or bool(to_stdout)


def _outputs(opts: SimpleNamespace) -> tuple[tuple[str, str | None], ...]:
    """(option, PATH or None) of each file output."""
    return (("--json", opts.json_path), ("--html", opts.html_path), ("--snapshot", opts.snapshot_path),
            ("--trace-events", opts.trace_events_path))


def _run_spec(opts: SimpleNamespace):
    """The RunSpec of the options (vramtrace.spec.RunSpec validates them). Raises UsageError."""
    from ..spec import RunSpec
    from ..units import parse_bytes

    def size(text: str | None, option: str) -> int | None:
        return parse_bytes(text, option) if text is not None else None

    targets = tuple(t.strip() for t in opts.lora_targets.split(",") if t.strip()) if opts.lora_targets else None
    return RunSpec(
        model=opts.model[0], batch=opts.batch, seq=opts.seq, mode=opts.mode, precision=opts.precision,
        optimizer=opts.optimizer, optimizer_impl=opts.optimizer_impl, device=opts.device, gpu=opts.gpu,
        checkpointing=opts.checkpointing, trust_remote_code=opts.trust_remote_code,
        replicate_layers=not opts.trace_every_layer, inputs=tuple(opts.inputs), image_size=opts.image_size,
        images=opts.images, freeze=tuple(opts.freeze), lora_rank=opts.lora_rank, lora_alpha=opts.lora_alpha,
        lora_dropout=opts.lora_dropout, lora_targets=targets, moe_routing=opts.moe_routing, strict=opts.strict,
        quantization=opts.quantization, double_quant=opts.double_quant, bnb_compute_dtype=opts.bnb_compute_dtype,
        memory_budget_bytes=size(opts.memory_budget, "--memory-budget"), task=opts.task, choices=opts.choices,
        attn_implementation=opts.attn_implementation, loop=opts.loop, step=opts.step, grad_accum=opts.grad_accum,
        zero_grad=opts.zero_grad, clip_grad_norm=opts.clip_grad_norm,
        use_cache=_bool_option(opts.use_cache, "--use-cache"),
        gpu_memory_bytes=size(opts.gpu_memory, "--gpu-memory"),
        cuda_context_bytes=size(opts.cuda_context, "--cuda-context"), cuda_version=opts.cuda_version,
        alloc_conf=opts.alloc_conf, new_tokens=opts.new_tokens, cache=opts.cache, kv_dtype=opts.kv_dtype,
        fsdp=opts.fsdp, reshard_after_forward=_bool_option(opts.reshard_after_forward, "--reshard-after-forward"),
        rank=opts.rank, ddp=opts.ddp, tp=opts.tp, fsdp_plan=opts.fsdp_plan, cpu_offload=opts.cpu_offload,
        compile=opts.compile_model, compile_mode=opts.compile_mode, packing=opts.packing, recipe=opts.recipe,
        sources=opts.sources, source_warnings=opts.source_warnings, pp=opts.pp, pp_schedule=opts.pp_schedule,
        micro_batches=opts.micro_batches, virtual_stages=opts.virtual_stages, pp_split=opts.pp_split,
        stage=opts.stage, zero=opts.zero, dp=opts.dp, offload_optimizer=opts.offload_optimizer,
        offload_param=opts.offload_param, deepspeed_config=opts.deepspeed, **opts.source_fields)


def _execute(opts: SimpleNamespace, fit_axis: str | None, validate_run: bool) -> None:
    """Re-render saved reports, or trace: sweep, fit, validate, or the main run (with --compare: three policies)."""
    from ..pipeline import COMPARED_POLICIES, analyze, compare_reports, with_comparison
    from ..render.json_report import read_json_report

    saved = [read_json_report(m) for m in opts.model]
    if all(r is not None for r in saved):  # re-render saved reports, no trace
        _render(saved, [Path(m).name for m in opts.model], opts)
        return
    if len(opts.model) > 1:
        raise UsageError("give one model to trace, or only saved --json reports to re-render")
    spec = _run_spec(opts)
    err = Console(stderr=True)
    if fit_axis == "sweep":
        _sweep(spec, opts.sweep_grid, opts.headroom, opts.json_path, opts.quiet, err)
    elif fit_axis is not None:
        _fit(spec, fit_axis, opts.headroom, opts.json_path, opts.quiet, err, levers=not opts.no_levers,
             html_path=opts.html_path)
    elif validate_run:
        _validate(spec, opts.json_path, opts.quiet, err)
    else:
        with _report_only_on_stdout(), _progress(err, "tracing") as say:
            if opts.compare_policies:
                labels = list(COMPARED_POLICIES)
                reports = compare_reports(spec, labels, progress=say)
                reports[0] = with_comparison(reports, labels)
            else:
                reports, labels = analyze(spec, progress=say, levers=not opts.no_levers).html_pages()
        _render(reports, labels, opts)


def _render(reports: list, labels: list[str], opts: SimpleNamespace) -> None:
    """Every output of a run: the terminal report (unless quiet), then --json, --html, --snapshot, --trace-events.
    The one place the CLI calls the renderers of a MemoryReport."""
    from ..render.json_report import write_json
    from ..render.terminal import render

    report = reports[0]
    if not opts.quiet and opts.json_path != "-":
        render(report, Console())
    if opts.json_path is not None:
        write_json(report, opts.json_path)
    if opts.html_path is not None:
        from ..render.html import write_html

        write_html(reports, opts.html_path, labels if len(reports) > 1 else None)
    if opts.snapshot_path is not None:
        from ..render.snapshot import write_snapshot

        write_snapshot(report, opts.snapshot_path)
    if opts.trace_events_path is not None:
        from ..render.trace_events import write_trace_events

        write_trace_events(report, opts.trace_events_path)


@contextlib.contextmanager
def _report_only_on_stdout():
    """While a run traces, what a library prints to stdout goes to stderr, so that stdout holds the report alone
    (`--json -` stays JSON): DeepSpeed's logger writes to the stdout of its import (deepspeed/utils/logging.py
    `LoggerFactory.create_logger`: a StreamHandler on `sys.stdout`, bound then), and its import warns there
    (deepspeed/accelerator/real_accelerator.py `get_accelerator`: 'Setting accelerator to CPU')."""
    with contextlib.redirect_stdout(sys.stderr):
        yield


@contextlib.contextmanager
def _progress(err: Console, what: str):
    """A progress line on stderr while the work runs: a spinner, `what: ` the stage the library reports, and the
    time elapsed; gone when done. Yields the `progress` callback. Shown only when stderr is a terminal (rich draws
    nothing live otherwise), so logs and `--json -` output get no progress text."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    if not err.is_terminal:
        yield lambda _msg: None
        return
    with Progress(SpinnerColumn("dots"), TextColumn("{task.description}"), TimeElapsedColumn(), console=err,
                  transient=True) as progress:
        task = progress.add_task(what, total=None)
        yield lambda msg: progress.update(task, description=f"{what}: {msg}")


def _bool_option(value: str | None, option: str) -> bool | None:
    """'true'/'false' (also 1/0, yes/no) of an option, None when not given. Raises UsageError."""
    if value is None:
        return None
    text = value.strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    raise UsageError(f"{option} takes true or false, got {value!r}")


def _validate(spec, json_path: str | None, quiet: bool, err: Console) -> None:
    """`vramtrace validate MODEL ...`: predicted vs measured on the local device (vramtrace.validate)."""
    from rich.table import Table

    from ..render.json_report import write_json
    from ..units import format_bytes
    from ..validate import validate

    with _report_only_on_stdout(), err.status("validating", spinner="dots") as status:
        result = validate(spec, progress=lambda msg: status.update(f"validate: {msg}"))
    if not quiet and json_path != "-":
        table = Table(title=f"Predicted vs measured on {result['device']} (steady-state step)", title_justify="left")
        for col in ("", "predicted", "measured", "error"):
            table.add_column(col, justify="right" if col else "left")
        for key in ("allocated", "reserved"):
            if f"measured_peak_{key}_bytes" in result:
                table.add_row(f"peak {key}", format_bytes(result[f"predicted_peak_{key}_bytes"]),
                              format_bytes(result[f"measured_peak_{key}_bytes"]), f"{100 * result[f'{key}_error']:+.3f}%")
        Console().print(table)
    if json_path is not None:
        write_json(result, json_path)


def _fit(spec, axis: str, headroom: str | None, json_path: str | None, quiet: bool, err: Console,
         levers: bool = True, html_path: str | None = None) -> None:
    """`vramtrace fit MODEL ...`: the largest batch (or sequence) that fits (vramtrace.fit)."""
    from ..fit import fit
    from ..render.fit import render_fit
    from ..units import parse_fraction

    share = parse_fraction(headroom, "--headroom") if headroom is not None else 0.0
    with _report_only_on_stdout(), _progress(err, "fit") as say:
        result = fit(spec, axis, headroom=share, progress=say, levers=levers)
    target = spec.capacity[0] if spec.capacity is not None else "the CPU"
    _emit(spec, result, target, render_fit, json_path, quiet)
    if html_path is not None:
        from ..errors import ReportWriteError
        from ..render.fit import render_fit_html

        try:
            Path(html_path).expanduser().write_text(render_fit_html(result, spec.model, target), encoding="utf-8")
        except OSError as e:
            raise ReportWriteError(f"cannot write --html {html_path}: {e.strerror}") from e


def _sweep(spec, grid: str, headroom: str | None, json_path: str | None, quiet: bool, err: Console) -> None:
    """`vramtrace fit MODEL --sweep BxS ...`: the peak over a grid (vramtrace.sweep)."""
    from ..render.fit import render_sweep
    from ..sweep import parse_grid, sweep
    from ..units import parse_fraction

    batches, seqs = parse_grid(grid)
    share = parse_fraction(headroom, "--headroom") if headroom is not None else 0.0
    with _report_only_on_stdout(), err.status("sweep", spinner="dots") as status:
        result = sweep(spec, batches, seqs, share, progress=lambda msg: status.update(f"sweep: {msg}"))
    target = spec.capacity[0] if spec.capacity is not None else "the CPU (no --gpu-memory: no verdict)"
    _emit(spec, result, target, render_sweep, json_path, quiet)


def _emit(spec, result, target: str, render, json_path: str | None, quiet: bool) -> None:
    """A fit or sweep result: `render(result, console, model, target)` on the terminal (unless --quiet or the JSON
    goes to stdout), and the JSON report with the model, device and target."""
    from ..render.json_report import write_json

    if not quiet and json_path != "-":
        render(result, Console(), spec.model, target)
    if json_path is not None:
        write_json({"model": spec.model, "device": spec.device.value, "target": target, **result.to_dict()},
                   json_path)


