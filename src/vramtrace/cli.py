"""Command line: parse arguments, call `vramtrace.analyze`, render. Errors become one `Error: ...` line."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import traceback
from pathlib import Path
from typing import Optional

import typer

try:  # typer >= 0.2x vendors its own click
    from typer._click import exceptions as click_exceptions
except ImportError:  # pragma: no cover - older typer uses click itself
    from click import exceptions as click_exceptions
from rich.console import Console

from .errors import UsageError, VramtraceError
from .gpus import GPU_PRESETS
from .spec import (DEFAULT_CHOICES, TASK_ALIASES, AttnImplementation, CacheKind, Device, KvDtype, Mode, OptimizerImpl,
                   OptimizerKind, Precision, Task)

app = typer.Typer(add_completion=False, context_settings={"help_option_names": ["-h", "--help"]},
                  pretty_exceptions_enable=False)


def _choices(enum_cls) -> str:
    return "|".join(m.value for m in enum_cls)


@app.command()
def main_command(
    model: list[str] = typer.Argument(..., help="Hub id, bundled id (e.g. meta-llama/Llama-2-7b), local dir or "
                                            "config.json, custom module path/model.py:NAME or package.module:NAME; "
                                            "or saved --json reports to re-render (several: compared)"),
    batch: int = typer.Option(1, "--batch", "-b", help="batch size B of input_ids (B, S)"),
    seq: Optional[int] = typer.Option(None, "--seq", "-s", help="sequence length S (required for text models); "
                                      "Whisper-style models: the decoder's tokens; wav2vec2-style models: audio "
                                      "samples of input_values (B, S), 16,000 per second at 16 kHz"),
    inputs: list[str] = typer.Option([], "--input", help="custom module input NAME=DTYPE[DIMS][:LO..HI], repeatable; "
                                     "DIMS: ints, B, S; e.g. x=float32[B,3,224,224], ids=int64[B,S]:0..32000 "
                                     "(integers without a range: 0..2)"),
    image_size: Optional[int] = typer.Option(None, "--image-size", help="H = W of vision models' pixel_values (B, 3, H, W) "
                                             "[default: the config's image_size, else 224]; a vision-language "
                                             "model's images before its processor's resize"),
    images: Optional[int] = typer.Option(None, "--images", help="images per sample of a vision-language model "
                                         "(Qwen2-VL, Qwen2.5-VL, Gemma-3); --seq counts their image tokens "
                                         "[default: 1]"),
    task: Optional[str] = typer.Option(
        None, "--task", help=" | ".join(m.value for m in Task) + " (or transformers' names: " + ", ".join(TASK_ALIASES) + "): the head "
        "to build and its labels (default: the config's architectures)"),
    choices: Optional[int] = typer.Option(None, "--choices", help=f"C of a multiple-choice head's input_ids (B, C, S) "
                                          f"(default: {DEFAULT_CHOICES})"),
    attn_implementation: Optional[str] = typer.Option(
        None, "--attn-implementation", help=" | ".join(m.value for m in AttnImplementation) + ": transformers' attn_implementation= "
        "(default: the config's, else sdpa where the model has it); flash_attention_2 and flex_attention "
        "cannot be traced and are refused"),
    mode: str = typer.Option("train", help=_choices(Mode)),
    precision: Optional[str] = typer.Option(None, help=_choices(Precision) + " [default: bf16-mixed to train, bf16 for inference]"),
    optimizer: str = typer.Option("adamw", help=_choices(OptimizerKind) + " (adafactor: transformers' Adafactor as HF "
                                  "Trainer builds it); also HF Trainer's optim names: adamw_torch, adamw_torch_fused, ..."),
    optimizer_impl: str = typer.Option("default", help=_choices(OptimizerImpl) + " (default: foreach on CUDA, for-loop on "
                                       "CPU, as torch picks; fused: Adam, AdamW, SGD, Adagrad)"),
    device: str = typer.Option("cuda", help=_choices(Device) + ": the target whose kernels and allocator are modelled"),
    gpu: str = typer.Option("H100-80GB", help="target GPU preset: " + ", ".join(p.name for p in GPU_PRESETS.values())
                            + " (usable totals as torch.cuda.mem_get_info reports them)"),
    cuda_context: Optional[str] = typer.Option(None, "--cuda-context", help="the CUDA context's memory outside "
                                               "PyTorch's allocator, e.g. 600MiB (nvidia-smi used minus "
                                               "torch.cuda.memory_reserved()) [default: by GPU family and "
                                               "--cuda-version, 769MiB on an H100 with CUDA 13]"),
    cuda_version: Optional[int] = typer.Option(None, "--cuda-version", help="12 | 13: the CUDA major version of "
                                               "the target's torch build, for the default CUDA context [default: 13, "
                                               "torch 2.13's PyPI wheel; 12 below sm75]"),
    alloc_conf: str = typer.Option("", "--alloc-conf", help="PYTORCH_CUDA_ALLOC_CONF of the target, e.g. "
                                   "expandable_segments:True or max_split_size_mb:512"),
    checkpointing: Optional[str] = typer.Option(
        None, help="none | layers[:reentrant] | every:K (K layers per segment) | nth:N (every N-th layer) | selective"
                   "[:OP,OP] | modules:PATTERN (submodules whose name matches the glob) | auto (needs --memory-budget) "
                   "[default: none; with --quantization and --lora-rank layers:reentrant, as "
                   "prepare_model_for_kbit_training]"),
    memory_budget: Optional[str] = typer.Option(None, "--memory-budget", help="peak budget for auto, e.g. 40GiB, 42GB"),
    freeze: list[str] = typer.Option([], "--freeze", help="freeze parameters matching a glob, e.g. 'model.embed_tokens.*' "
                                     "(repeatable): no gradient, no optimizer state"),
    lora_rank: Optional[int] = typer.Option(None, "--lora-rank", help="add peft LoRA adapters of rank R (base weights frozen)"),
    lora_alpha: Optional[float] = typer.Option(None, "--lora-alpha", help="LoRA alpha [default: peft's]"),
    lora_dropout: Optional[float] = typer.Option(None, "--lora-dropout", help="peft's lora_dropout, e.g. 0.05 (a "
                                                 "dropout of each adapter's input) [default: peft's, 0]"),
    lora_targets: Optional[str] = typer.Option(None, "--lora-targets", help="LoRA target modules, e.g. q_proj,v_proj "
                                               "[default: peft's for the architecture]"),
    quantization: Optional[str] = typer.Option(None, "--quantization", help="nf4 | fp4 | int8: bitsandbytes weights as "
                                               "transformers' BitsAndBytesConfig(load_in_4bit=True / load_in_8bit="
                                               "True) loads them (with --lora-rank: QLoRA, "
                                               "prepare_model_for_kbit_training)"),
    double_quant: bool = typer.Option(False, "--double-quant", help="--quantization: bnb_4bit_use_double_quant"),
    bnb_compute_dtype: Optional[str] = typer.Option(None, "--bnb-compute-dtype", help="--quantization: bf16 | fp16 | "
                                                    "fp32 (bnb_4bit_compute_dtype; default fp32, as transformers')"),
    moe_routing: str = typer.Option("balanced", "--moe-routing", help="tokens per MoE expert: balanced (equal share) | "
                                    "worst (all tokens to the same top-k experts: the largest per-expert batches)"),
    loop: str = typer.Option(
        "trainer", "--loop", help="the training loop around the step: trainer (`loss = model(**batch).loss; "
        "loss.backward()`: the output released before backward; HF Trainer, Lightning) | function (`def "
        "train_step(batch): outputs = model(**batch); outputs.loss.backward(); opt.step(); opt.zero_grad()`: outputs "
        "live until it returns) | script (the tutorials' top-level `for batch in loader: outputs = model(**batch); "
        "...`: the previous outputs live until the next forward returns)"),
    step: Optional[str] = typer.Option(None, "--step", help="your own step function, path/to/file.py:FUNC, called "
                                       "as FUNC(model, batch, optimizer) for two steps and traced as written"),
    grad_accum: int = typer.Option(1, "--grad-accum", help="gradient accumulation: N micro-batches per optimizer "
                                   "step (loss / N, backward each, one step), as HF Trainer's gradient_accumulation_steps"),
    zero_grad: str = typer.Option("none", "--zero-grad", help="none (zero_grad(set_to_none=True), torch >= 2.0) | "
                                  "zeros (set_to_none=False: gradients stay allocated across steps)"),
    clip_grad_norm: Optional[float] = typer.Option(None, "--clip-grad-norm", help="torch.nn.utils.clip_grad_norm_ "
                                                   "with this max norm between backward and the optimizer step"),
    use_cache: Optional[str] = typer.Option(None, "--use-cache", help="true | false: the config's use_cache (false: "
                                            "no KV cache in the training forward) [default: the config's]"),
    new_tokens: Optional[int] = typer.Option(None, "--new-tokens", help="--mode generate: N new tokens after the --seq "
                                             "prompt (model.generate(max_new_tokens=N, min_new_tokens=N, greedy))"),
    cache: str = typer.Option("dynamic", "--cache", help="--mode generate: " + _choices(CacheKind) + " (transformers' "
                              "DynamicCache grows by torch.cat; StaticCache is preallocated to prompt + new tokens)"),
    kv_dtype: str = typer.Option("auto", "--kv-dtype", help="--mode generate: " + _choices(KvDtype) + " (auto: the "
                                 "compute dtype; fp8: transformers' QuantizedCache(backend='fp8'), float8_e4m3fn keys "
                                 "and values, dequantized every decode step)"),
    fsdp: Optional[int] = typer.Option(None, "--fsdp", help="N ranks of PyTorch FSDP2: fully_shard on each layer and "
                                       "the root, traced on fake ranks; --batch is the per-rank micro-batch"),
    reshard_after_forward: str = typer.Option("true", "--reshard-after-forward", help="--fsdp: true | false "
                                              "(false keeps each layer's parameters unsharded until its backward, "
                                              "ZeRO-2 style)"),
    cpu_offload: bool = typer.Option(False, "--cpu-offload", help="--fsdp: FSDP2's CPUOffloadPolicy (sharded "
                                     "parameters, gradients and optimizer state in pinned host memory; the optimizer "
                                     "steps on the CPU)"),
    compile_model: bool = typer.Option(False, "--compile", help="the model is torch.compile(model) (Inductor, default "
                                       "mode; the optimizer eager): its graphs as Inductor compiles them, beside the "
                                       "eager step; --device cpu training only"),
    compile_mode: str = typer.Option("default", "--compile-mode", help="--compile: torch.compile's mode, default | "
                                     "max-autotune-no-cudagraphs (its Inductor options set while the graphs compile)"),
    fsdp_plan: str = typer.Option("layers", "--fsdp-plan", help="--fsdp: layers (fully_shard each layer, then the "
                                  "root: torchtitan, accelerate) | transformers (the model's own FSDP plan, as "
                                  "DistributedConfig(fsdp_size=N) applies it)"),
    ddp: Optional[int] = typer.Option(None, "--ddp", help="N ranks of PyTorch DistributedDataParallel (its default "
                                      "gradient buckets), traced on a fake rank; --batch is the per-rank micro-batch"),
    tp: Optional[int] = typer.Option(None, "--tp", help="N ranks of tensor parallelism with the model's own plan "
                                     "(transformers' base_model_tp_plan); with --fsdp M, a 2-D mesh of M x N ranks"),
    rank: Optional[int] = typer.Option(None, "--rank", help="--fsdp/--tp: trace this rank only [default: every "
                                       "distinct rank, the largest reported]"),
    strict: bool = typer.Option(False, "--strict", help="an op without a meta kernel is an error, not an unresolved entry"),
    compare_policies: bool = typer.Option(False, "--compare", help="compare checkpointing none, layers and selective"),
    json_path: Optional[str] = typer.Option(None, "--json", help="write the JSON report to PATH, or '-' for stdout"),
    html_path: Optional[str] = typer.Option(None, "--html", help="write the self-contained HTML liveness report to "
                                            "PATH ('-': stdout)"),
    snapshot_path: Optional[str] = typer.Option(
        None, "--snapshot", help="write the predicted timeline as a torch.cuda.memory._snapshot() pickle ('-': "
        "stdout)"),
    trace_events_path: Optional[str] = typer.Option(
        None, "--trace-events", help="write the predicted timeline as Chrome trace events (JSON) for ui.perfetto.dev: "
        "a counter track per category, the ops as slices (one step = 1 us of synthetic time); '-': stdout"),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code", help="allow configs that need remote code"),
    trace_every_layer: bool = typer.Option(
        False, "--trace-every-layer", help="trace all layers instead of 4 and replicating the repeated one (slower)"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no terminal report (with --json)"),
    debug: bool = typer.Option(False, "--debug", help="on an error, also print the traceback with its causes "
                               "(or set VRAMTRACE_DEBUG=1)"),
    gpu_memory: Optional[str] = typer.Option(None, "--gpu-memory", help="the device capacity the verdict checks, e.g. "
                                             "48GiB, for a GPU without a preset [default: the --gpu preset's; "
                                             "with --device cpu: no verdict (fit needs one)]"),
    no_levers: bool = typer.Option(False, "--no-levers", help="when the step does not fit, do not trace the levers "
                                   "that would make it fit (faster)"),
    headroom: Optional[str] = typer.Option(None, "--headroom", help="`vramtrace fit`: keep this share of the "
                                           "capacity free, e.g. 5% [default: 0%]"),
    validate_run: bool = typer.Option(False, "--validate", hidden=True, help="set by `vramtrace validate ...`"),
    sweep_grid: Optional[str] = typer.Option(None, "--sweep", help="`vramtrace fit`: the peak over a grid of "
                                             "batches x sequences, e.g. 1,2,4,8x512,1024,2048"),
    fit_axis: Optional[str] = typer.Option(None, "--fit", hidden=True, help="set by `vramtrace fit ...`"),
) -> None:
    """Predict the peak memory of one training step (or inference forward) from a meta-device trace.

    `vramtrace validate MODEL --seq S ...` also runs the step for real on this machine and compares.
    `vramtrace fit MODEL --seq S [--gpu G | --gpu-memory 48GiB] [--headroom 5%]` finds the largest micro-batch
    that fits (with `--batch B` instead of `--seq`: the longest sequence).
    `vramtrace REPORT.json [...] --html PATH` (or --snapshot, --trace-events) re-renders saved reports.
    `vramtrace models` lists the bundled ids.
    """
    del debug  # read by main() from the arguments, so that it also covers errors raised while parsing them
    from .pipeline import COMPARED_POLICIES, analyze, compare_reports, with_comparison
    from .reports.json_report import check_writable, read_json_report, write_json
    from .reports.terminal import render
    from .spec import RunSpec
    from .units import parse_bytes

    if compare_policies and checkpointing is not None and checkpointing.strip().lower() != "none":
        raise UsageError("--compare traces none, layers and selective itself; drop --checkpointing, or drop --compare")
    for option, given in (("--headroom", headroom), ("--sweep", sweep_grid)):
        if fit_axis is None and given is not None:
            raise UsageError(f"{option} applies to `vramtrace fit MODEL ...`")
    if fit_axis is not None and (compare_policies or snapshot_path or validate_run
                                 or (html_path and fit_axis == "sweep")):
        raise UsageError("fit writes no --compare or --snapshot (and --sweep no --html); run `vramtrace MODEL ...` "
                         "for those")
    if trace_events_path is not None and (fit_axis is not None or validate_run):
        raise UsageError("fit and validate write no --trace-events; run `vramtrace MODEL ...` for those")
    if compile_model and (fit_axis is not None or validate_run or compare_policies):
        raise UsageError("--compile is traced for `vramtrace MODEL ...` only (not fit, validate or --compare yet); "
                         "drop --compile there")
    if compile_mode != "default" and not compile_model:
        raise UsageError("--compile-mode sets torch.compile's mode: add --compile")
    if validate_run and (compare_policies or html_path or snapshot_path):
        raise UsageError("validate writes no --compare, --html or --snapshot; run `vramtrace MODEL ...` for those")
    outputs = (("--json", json_path), ("--html", html_path), ("--snapshot", snapshot_path),
               ("--trace-events", trace_events_path))
    to_stdout = [option for option, path in outputs if path == "-"]
    if len(to_stdout) > 1:
        raise UsageError(f"{' and '.join(to_stdout)} both write to stdout ('-'); give all but one a file path")
    quiet = quiet or bool(to_stdout)  # stdout carries that output alone, not the terminal report
    for option, path in outputs:
        if path is not None:
            check_writable(path, option)
    saved = [read_json_report(m) for m in model]
    if all(r is not None for r in saved):  # re-render saved reports, no trace
        reports, labels = saved, [Path(m).name for m in model]
    elif len(model) > 1:
        raise UsageError("give one model to trace, or only saved --json reports to re-render")
    else:
        targets = tuple(t.strip() for t in lora_targets.split(",") if t.strip()) if lora_targets else None
        spec = RunSpec(model=model[0], batch=batch, seq=seq, mode=mode, precision=precision, optimizer=optimizer,
                       optimizer_impl=optimizer_impl, device=device, gpu=gpu, checkpointing=checkpointing,
                       trust_remote_code=trust_remote_code, replicate_layers=not trace_every_layer,
                       inputs=tuple(inputs), image_size=image_size, images=images, freeze=tuple(freeze), lora_rank=lora_rank,
                       lora_alpha=lora_alpha, lora_dropout=lora_dropout, lora_targets=targets,
                       moe_routing=moe_routing, strict=strict,
                       quantization=quantization, double_quant=double_quant, bnb_compute_dtype=bnb_compute_dtype,
                       memory_budget_bytes=(parse_bytes(memory_budget, "--memory-budget")
                                            if memory_budget is not None else None),
                       task=task, choices=choices, attn_implementation=attn_implementation, loop=loop, step=step,
                       grad_accum=grad_accum, zero_grad=zero_grad, clip_grad_norm=clip_grad_norm,
                       use_cache=_bool_option(use_cache, "--use-cache"),
                       gpu_memory_bytes=parse_bytes(gpu_memory, "--gpu-memory") if gpu_memory is not None else None,
                       cuda_context_bytes=(parse_bytes(cuda_context, "--cuda-context")
                                           if cuda_context is not None else None), cuda_version=cuda_version,
                       alloc_conf=alloc_conf, new_tokens=new_tokens, cache=cache, kv_dtype=kv_dtype,
                       fsdp=fsdp, reshard_after_forward=_bool_option(reshard_after_forward, "--reshard-after-forward"),
                       rank=rank, ddp=ddp, tp=tp, fsdp_plan=fsdp_plan, cpu_offload=cpu_offload,
                       compile=compile_model, compile_mode=compile_mode)
        err = Console(stderr=True)
        if fit_axis == "sweep":
            _sweep(spec, sweep_grid, headroom, json_path, quiet, err)
            return
        if fit_axis is not None:
            _fit(spec, fit_axis, headroom, json_path, quiet, err, levers=not no_levers, html_path=html_path)
            return
        if validate_run:
            _validate(spec, json_path, quiet, err)
            return
        with _progress(err, "tracing") as say:
            if compare_policies:
                labels = list(COMPARED_POLICIES)
                reports = compare_reports(spec, labels, progress=say)
                reports[0] = with_comparison(reports, labels)
            else:
                reports, labels = analyze(spec, progress=say, levers=not no_levers).html_pages()
    report = reports[0]
    if not quiet and json_path != "-":
        render(report, Console())
    if json_path is not None:
        write_json(report, json_path)
    if html_path is not None:
        from .reports.html import write_html

        write_html(reports, html_path, labels if len(reports) > 1 else None)
    if snapshot_path is not None:
        from .reports.snapshot import write_snapshot

        write_snapshot(report, snapshot_path)
    if trace_events_path is not None:
        from .reports.trace_events import write_trace_events

        write_trace_events(report, trace_events_path)


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

    from .reports.json_report import write_json
    from .units import format_bytes
    from .validate import validate

    with err.status("validating", spinner="dots") as status:
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
    from .fit import fit
    from .reports.fit import render_fit
    from .units import parse_fraction

    share = parse_fraction(headroom, "--headroom") if headroom is not None else 0.0
    with _progress(err, "fit") as say:
        result = fit(spec, axis, headroom=share, progress=say, levers=levers)
    target = spec.capacity[0] if spec.capacity is not None else "the CPU"
    _emit(spec, result, target, render_fit, json_path, quiet)
    if html_path is not None:
        from .errors import ReportWriteError
        from .reports.fit import render_fit_html

        try:
            Path(html_path).expanduser().write_text(render_fit_html(result, spec.model, target), encoding="utf-8")
        except OSError as e:
            raise ReportWriteError(f"cannot write --html {html_path}: {e.strerror}") from e


def _sweep(spec, grid: str, headroom: str | None, json_path: str | None, quiet: bool, err: Console) -> None:
    """`vramtrace fit MODEL --sweep BxS ...`: the peak over a grid (vramtrace.sweep)."""
    from .reports.fit import render_sweep
    from .sweep import parse_grid, sweep
    from .units import parse_fraction

    batches, seqs = parse_grid(grid)
    share = parse_fraction(headroom, "--headroom") if headroom is not None else 0.0
    with err.status("sweep", spinner="dots") as status:
        result = sweep(spec, batches, seqs, share, progress=lambda msg: status.update(f"sweep: {msg}"))
    target = spec.capacity[0] if spec.capacity is not None else "the CPU (no --gpu-memory: no verdict)"
    _emit(spec, result, target, render_sweep, json_path, quiet)


def _emit(spec, result, target: str, render, json_path: str | None, quiet: bool) -> None:
    """A fit or sweep result: `render(result, console, model, target)` on the terminal (unless --quiet or the JSON
    goes to stdout), and the JSON report with the model, device and target."""
    from .reports.json_report import write_json

    if not quiet and json_path != "-":
        render(result, Console(), spec.model, target)
    if json_path is not None:
        write_json({"model": spec.model, "device": spec.device.value, "target": target, **result.to_dict()},
                   json_path)


serve_app = typer.Typer(add_completion=False, context_settings={"help_option_names": ["-h", "--help"]},
                        pretty_exceptions_enable=False)


@serve_app.command()
def serve_command(
    model: str = typer.Argument(..., help="Hub id, bundled id, local directory or config.json of a causal LM"),
    gpu: str = typer.Option("H100-80GB", "--gpu", help=f"target GPU: {'|'.join(p.name for p in GPU_PRESETS.values())}"),
    gpu_memory: Optional[str] = typer.Option(None, "--gpu-memory", help="any device's total instead, e.g. 48GiB"),
    max_model_len: Optional[int] = typer.Option(None, "--max-model-len", help="tokens per request (default: the "
                                                "config's max_position_embeddings, as vLLM derives it)"),
    utilization: float = typer.Option(0.92, "--gpu-memory-utilization", help="vLLM's share of the GPU (0.92 in "
                                      "vLLM 0.33; 0.9 before 0.28)"),
    tp: int = typer.Option(1, "--tp", help="tensor-parallel size: the figures are per rank (the profile run traced "
                           "under the model's own TP plan)"),
    kv_cache_dtype: str = typer.Option("auto", "--kv-cache-dtype", help="auto (the weights' dtype) | fp8"),
    block_size: int = typer.Option(16, "--block-size", help="tokens per KV block"),
    max_num_batched_tokens: Optional[int] = typer.Option(None, "--max-num-batched-tokens",
                                                         help="default: vLLM's for the GPU's memory"),
    max_num_seqs: Optional[int] = typer.Option(None, "--max-num-seqs", help="default: vLLM's for the GPU's memory"),
    enforce_eager: bool = typer.Option(False, "--enforce-eager", help="no CUDA graphs (no graph memory estimate)"),
    non_torch: str = typer.Option("256MiB", "--non-torch-memory", help="non-PyTorch memory growth vLLM measures "
                                  "(NCCL, attention workspaces)"),
    cudagraph: str = typer.Option("512MiB", "--cudagraph-memory", help="vLLM's CUDA graph memory estimate"),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code", help="allow the model's own code"),
    json_path: Optional[str] = typer.Option(None, "--json", help="write the JSON answer here ('-': stdout)"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no terminal report"),
    debug: bool = typer.Option(False, "--debug", help="show the traceback of an error"),
) -> None:
    """`vramtrace serve MODEL --gpu G --max-model-len L`: the KV blocks and the maximum concurrency a
    paged-attention server (vLLM 0.33) finds on that GPU, each term of its computation shown."""
    from .reports.json_report import write_json
    from .reports.serve import render_serve
    from .serve import ServeSpec, analyze_serve
    from .units import parse_bytes

    spec = ServeSpec(model, gpu=gpu, max_model_len=max_model_len, gpu_memory_utilization=utilization, tp=tp,
                     kv_cache_dtype=kv_cache_dtype, block_size=block_size,
                     max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                     enforce_eager=enforce_eager, non_torch_bytes=parse_bytes(non_torch, "--non-torch-memory"),
                     cudagraph_bytes=parse_bytes(cudagraph, "--cudagraph-memory"),
                     gpu_memory_bytes=parse_bytes(gpu_memory, "--gpu-memory") if gpu_memory else None,
                     trust_remote_code=trust_remote_code)
    err = Console(stderr=True)
    with err.status("serve", spinner="dots") as status:
        result = analyze_serve(spec, progress=lambda msg: status.update(f"serve: {msg}"))
    if not quiet and json_path != "-":
        render_serve(result, Console(), model)
    if json_path is not None:
        write_json({"model": model, **result}, json_path)


def _fit_axis(argv: list[str]) -> str:
    """`vramtrace fit`'s search axis from the options given: the batch at a given --seq (or with neither, for
    models without a sequence), the sequence at a given --batch, the fewest FSDP ranks at both. Raises
    UsageError for --sweep with either."""
    def given(*names: str) -> bool:
        return any(a in names or a.split("=", 1)[0] in names for a in argv)

    has_seq, has_batch = given("--seq", "-s"), given("--batch", "-b")
    if given("--sweep"):
        if has_seq or has_batch:
            raise UsageError("--sweep gives the batches and sequences itself; drop --batch and --seq")
        return "sweep"
    if has_seq and has_batch:
        return "fsdp"  # both sizes fixed: the fewest FSDP ranks that fit
    return "seq" if has_batch else "batch"


def _models(argv: list[str]) -> int:
    """`vramtrace models`: the bundled ids (answer offline, at once), one a line with their model_type."""
    from .tracer.loading import bundled_models

    if argv and argv[0] in ("-h", "--help"):
        print("Usage: vramtrace models\n\n  List the bundled model ids (no network needed) and their model_type.")
        return 0
    if argv:
        raise UsageError(f"`vramtrace models` takes no arguments, got {' '.join(argv)!r}")
    models = bundled_models()
    width = max(len(ref) for ref, _ in models)
    for ref, model_type in models:
        print(f"{ref:<{width}}  {model_type}")
    return 0


def _error(e: BaseException, debug: bool, text: str | None = None) -> None:
    """Print `Error: ...` (one line) on stderr; with `debug`, the traceback with its chained causes first."""
    if debug:
        traceback.print_exception(e, file=sys.stderr)
    print(f"Error: {text or e}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Entry point. Exit status: 0 ok, 1 error, 2 usage error. `vramtrace validate ...` predicts, then runs the
    step for real on the local device; `vramtrace models` lists the bundled ids. `--debug` (or VRAMTRACE_DEBUG=1)
    adds the traceback, with its chained causes, to an error's line. `vramtrace fit ...` searches the largest batch
    (or sequence) that fits."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # read before parsing, so that an error anywhere (parsing included) can honour it
    debug = "--debug" in argv or os.environ.get("VRAMTRACE_DEBUG", "").strip().lower() in ("1", "true", "yes")
    if argv[:1] == ["validate"]:
        argv = argv[1:] + ["--validate"]
    log_handler = _debug_log(debug)
    try:
        if argv[:1] == ["fit"]:
            argv = argv[1:] + ([] if {"-h", "--help"} & set(argv) else ["--fit", _fit_axis(argv[1:])])
        if argv[:1] == ["models"]:
            return _models([a for a in argv[1:] if a != "--debug"])
        if argv[:1] == ["serve"]:
            rv = serve_app(args=argv[1:], standalone_mode=False, prog_name="vramtrace serve")
            return rv if isinstance(rv, int) else 0
        rv = app(args=argv, standalone_mode=False, prog_name="vramtrace")
        if isinstance(rv, int):  # --help and similar return an exit code in non-standalone mode
            return rv
    except click_exceptions.ClickException as e:  # bad option, missing argument, not a number
        _error(e, debug, f"{e.format_message()} (see vramtrace --help)")
        return 2
    except KeyboardInterrupt as e:
        _error(e, debug, "interrupted")
        return 1
    except UsageError as e:
        _error(e, debug)
        return 2
    except VramtraceError as e:
        _error(e, debug)
        return 1
    except Exception as e:  # a bug in vramtrace itself: still one line, the traceback with --debug
        text = str(e).strip().splitlines()[0] if str(e).strip() else "(no message)"
        _error(e, debug, f"internal error {type(e).__name__}: {text} (rerun with --debug for the traceback, and "
                         "please report it)")
        return 1
    finally:
        if log_handler is not None:  # the logger as it was (main() is also called in-process)
            handler, level = log_handler
            logging.getLogger("vramtrace").removeHandler(handler)
            logging.getLogger("vramtrace").setLevel(level)
    return 0


def _debug_log(debug: bool):
    """With --debug, the library's DEBUG records on stderr (e.g. the traceback of a lever whose trace failed, which
    the report lists as "could not be traced"); returns (the handler added, the logger's level before), or None."""
    if not debug:
        return None
    handler = logging.StreamHandler(sys.stderr)
    log = logging.getLogger("vramtrace")
    before = log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    return handler, before


if __name__ == "__main__":
    sys.exit(main())


def _entry() -> None:
    sys.exit(main())
