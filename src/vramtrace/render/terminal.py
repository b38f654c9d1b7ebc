"""Terminal renderer (rich): model and run, peak and where it happens, breakdown, waterfall, top storages, fit."""

from __future__ import annotations

from rich import box
from rich.console import Console, Group
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from ..analysis.aggregate import layer_totals, live_groups
from ..analysis.categories import OPTIONAL
from ..report.summary import MemoryReport
from ..report.data import UNSET
from ..report.sections import RunInfo
from ..units import format_bytes, format_count, format_flops
from ..spec import Device, Mode, ZeroGrad

_CATEGORY_LABELS = {
    "parameter": "parameters", "gradient": "gradients", "optimizer_state": "optimizer state",
    "activation": "activations (saved for backward)", "temporary": "temporaries", "input": "inputs / buffers",
    "autocast_weights": "autocast weight copies", "kv_cache": "KV cache (use_cache)",
    "outputs": "outputs held by the loop", "kept_across_steps": "kept across steps",
    "cublas_workspace": "cuBLAS workspaces", "unsharded_parameters": "unsharded parameters (FSDP)",
    "collective_buffers": "collective buffers (FSDP/DDP)", "quantized_weights": "quantized weights (bitsandbytes)",
    "quantization_constants": "quantization constants", "dequantized_weights": "dequantized weight temporaries",
    "paged_optimizer_state": "paged optimizer state (CUDA managed memory)",
    "allocator_remainder": "allocator: unsplit block remainders",
    "pipeline_buffers": "pipeline buffers (receive buffers, held sends)",
}
def sharding_line(r: RunInfo) -> str:
    """'FSDP2 over 8 ranks (reshard after forward), per rank: rank 0 shown (ranks 0-6 3.10 GiB, 7 2.90 GiB);
    global batch 32', or 'tensor parallel over 2 ranks (transformers' plan), ...', or both for a 2-D mesh, from
    the report's run entries."""
    f, tp = r.fsdp, r.tp
    parts = []
    if f:
        how = ("transformers' FSDP plan" if f.plan == "transformers"
               else f"{'reshard' if f.reshard_after_forward else 'no reshard'} after forward")
        if f.host_peak_bytes is not None:
            how += (f", CPU offload: shards, gradients and optimizer state in {format_bytes(f.host_peak_bytes)} "
                    "of pinned host memory at most, not in the peak")
        parts.append(f"FSDP2 over {f.world} ranks ({how})")
    if tp:
        parts.append(f"tensor parallel over {tp.world} ranks (transformers' plan)")
    shown = f or tp
    text = " × ".join(parts) + f"; per rank, rank {shown.rank} shown"
    if len(shown.rank_peaks or {}) > 1:
        text += " (" + ", ".join(f"ranks {k} {format_bytes(v)}" for k, v in shown.rank_peaks.items()) + ")"
    return text + f"; global batch {shown.global_batch}"


_LOOP_CODE = {"trainer": "output released before backward", "function": "outputs kept until train_step returns",
              "script": "outputs kept until the next forward returns"}


def step_line(r: RunInfo) -> str:
    """'loop trainer (output released before backward); grad-accum 4 (effective batch 16); ...' or ''."""
    if r.loop is None:
        return ""
    parts = [r.loop if r.loop.startswith("--") else f"loop {r.loop} ({_LOOP_CODE[r.loop]})"]
    if (r.grad_accum or 1) > 1:
        parts.append(f"grad-accum {r.grad_accum} (effective batch {r.effective_batch})")
    parts.append("zero_grad(set_to_none=" + ("True)" if r.zero_grad is ZeroGrad.NONE else "False)"))
    if r.clip_grad_norm is not None and r.clip_grad_norm is not UNSET:
        parts.append(f"clip_grad_norm_ {r.clip_grad_norm:g}")
    if r.use_cache is not None:
        parts.append(f"use_cache {r.use_cache}")
    return "; ".join(parts)


def loop_notes(r: RunInfo, peak: int) -> list[str]:
    """One line per other loop whose peak differs: '--loop script (...) peaks at X (+Y)'."""
    out = []
    for loop, other in (r.loop_peaks or {}).items():
        if loop != r.loop and other != peak:
            sign = "+" if other > peak else "-"
            out.append(f"--loop {loop} ({_LOOP_CODE[loop]}) peaks at {format_bytes(other)} "
                       f"({sign}{format_bytes(abs(other - peak))})")
    return out


def kv_cache_note(report: MemoryReport) -> str:
    """What the KV cache a training forward builds holds at the peak, and the peak of the same step traced with
    `--use-cache false` (`run.use_cache_false_peak_bytes`: a second trace, since with the cache off the
    attention's own key/value tensors live as long as its locals and saved tensors keep them, so the saving is
    not the cache's bytes); '' unless the config's cache is live at the peak."""
    kv = report.breakdown_at_peak.get("kv_cache", 0)
    off = report.run.use_cache_false_peak_bytes
    if off is None or report.run.use_cache is False:
        return ""
    diff = report.peak_allocated_bytes - off
    saves = (f"saves {format_bytes(diff)}" if diff > 0 else "saves nothing" if diff == 0
             else f"costs {format_bytes(-diff)}")
    return (f"KV cache built by the training forward (config use_cache on): {format_bytes(kv)} live at the peak; "
            f"--use-cache false peaks at {format_bytes(off)} ({saves})")


def _shape(shape) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ")"


def image_text(r: RunInfo) -> str:
    """', image H×W' of the run's images, ', N images H×W per sample' for a vision-language model, else ''."""
    if not r.image_size:
        return ""
    size = "×".join(map(str, r.image_size))
    n = r.images
    return f", {n} image{'s' * (n > 1)} {size} per sample" if n else f", image {size}"


def render(report: MemoryReport, console: Console) -> None:
    """Print the report to `console`: the header, the peak, the category tables, the largest storages, then
    the compiled, checkpointing, fit and lever sections where the report has them."""
    console.print(Panel(_header(report), title="vramtrace", border_style="cyan"))
    _render_peak(report, console)
    _render_tables(report, console)
    _render_groups(report, console)
    _render_top(report, console)
    _render_compiled(report, console)
    _render_checkpointing(report, console)
    if report.fit is not None:
        _render_verdict(report, console)
    if report.levers is not None:
        from .levers import pipeline_who, render_levers

        render_levers(report.levers, console, pipeline_who(report))


def sources_by_file(sources) -> dict[str, list[str]]:
    """The RunSpec fields each `--from` file set (`run.sources`), by file in the order they first appear."""
    out: dict[str, list[str]] = {}
    for entry in sources:
        out.setdefault(entry.file, []).append(entry.option)
    return out


def _header(report: MemoryReport) -> Table:
    """The header grid: model, parameters, checkpoint, dtypes, attention, the run, sharding, target, warnings."""
    m, r = report.model, report.run
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    source = "custom module" if m.config_source == "custom" else f"{m.config_source} config"
    head.add_row("model", f"{m.ref}  [dim]({source})[/]")
    for file, options in sources_by_file(r.sources).items():
        head.add_row("from", escape(f"{file}: {', '.join(options)}"))
    head.add_row("architecture", f"{m.architecture} ({m.model_type}, {m.task})")
    trainable = m.trainable_params
    head.add_row("parameters", format_count(report.params) + ("" if trainable == report.params else
                 f", trainable {format_count(trainable)} ({100 * trainable / max(report.params, 1):.2f}%), "
                 f"frozen {format_count(report.params - trainable)}"))
    ck = m.checkpoint
    if ck:
        dtypes = ", ".join(f"{k} {v:,}" for k, v in ck.dtypes.items())
        head.add_row("checkpoint", f"{ck.files} {ck.source} file(s): {dtypes}; "
                     + (ck.note if ck.matches else f"[bold red]{escape(ck.note)}[/]"))
    if r.adapters:
        head.add_row("adapters", r.adapters)
    if r.recipe is not None:
        name = {"axolotl": "axolotl 0.21.0", "llamafactory": "LLaMA-Factory 0.9.5"}.get(r.recipe.value, r.recipe.value)
        head.add_row("recipe", f"the model built as {name} builds it (--recipe {r.recipe.value})")
    if r.inputs:
        head.add_row("inputs", ", ".join(r.inputs))
    head.add_row("dtypes", f"weights {m.param_dtype}, compute {m.compute_dtype}"
                 + (f"; precision {r.precision.value}: {escape(r.precision_source)}" if r.precision_source else ""))
    sdpa = ", ".join(f"{k}×{v}" for k, v in m.sdpa_backends.items()) or "none"
    if m.attn_implementation == "flash_attention_2" and not m.sdpa_backends:  # tracer/flash_attn.py's stand-in
        head.add_row("attention", "flash_attention_2 (flash-attn 2.8.3's allocations)")
    else:
        head.add_row("attention", f"{m.attn_implementation} (SDPA backend: {sdpa})")
    if r.packing:
        head.add_row("packing", escape(r.packing))
    if r.mode is Mode.GENERATE:
        head.add_row("run", f"generate, {r.precision.value}, batch {r.batch} × prompt {r.seq} + {r.new_tokens} "
                            f"new tokens (greedy), {r.cache.value} cache" + image_text(r)
                            + (f" in {r.kv_dtype.value} (QuantizedCache)" if r.kv_dtype not in (None, "auto") else ""))
    else:
        optimizer = (f"optimizer {r.optimizer.value} ({r.optimizer_impl.value}), " if r.mode is Mode.TRAIN else "")
        head.add_row("run", f"{r.mode.value}, {r.precision.value}, {optimizer}"
                            f"batch {r.batch}" + (f" × seq {r.seq}" if r.seq else "")
                     + image_text(r)
                     + f", checkpointing {r.checkpointing}"
                     + (f" ({r.checkpointing_source})" if r.checkpointing_source else "")
                     + (f", MoE routing {r.moe_routing}" if r.moe_layers else ""))
    if step_line(r):
        head.add_row("step", escape(step_line(r)))
    if r.fsdp or r.tp:
        head.add_row("sharding", sharding_line(r))
    if r.pp:
        head.add_row("pipeline", pipeline_text(r))
    if r.ddp:
        head.add_row("sharding", f"DDP over {r.ddp.world} ranks (every rank holds the whole model and one "
                                 f"set of gradient buckets); per rank; global batch {r.ddp.global_batch}")
    if r.paged_optimizer_state_bytes:
        head.add_row("paged state", f"{format_bytes(r.paged_optimizer_state_bytes)} of optimizer state in CUDA "
                                    "managed memory (bitsandbytes' paged optimizer): outside the allocator, not in "
                                    "the peak; resident on the GPU while it has room, paged to host RAM when not")
    target = f"{r.device.value}" + (f" ({r.gpu}, 512 B blocks)" if r.device is Device.CUDA else " (no rounding)")
    head.add_row("target", target)
    if r.trace:
        head.add_row("trace", f"{r.num_ops:,} aten ops; {r.trace}")
    if r.cpu_kernels:
        c = r.cpu_kernels
        head.add_row("CPU kernels", f"measured on {c.cpu} ({c.cpu_flags or 'no AVX flags'}), oneDNN ISA "
                     f"{c.onednn_max_isa}, ATen {c.aten_capability}, {c.threads} threads, torch {c.torch}")
    for warning in r.warnings:
        head.add_row("warning", Text(warning, style="bold yellow"))
    return head


def _render_peak(report: MemoryReport, console: Console) -> None:
    """The peak panel: allocated (and reserved) bytes, where, the first-step or generation figures, notes."""
    peak = Text.assemble(("Peak allocated: ", "bold"), (format_bytes(report.peak_allocated_bytes), "bold magenta"),
                         f"  ({report.peak_allocated_bytes:,} bytes)")
    where = Text(f"at step {report.peak_step}/{report.num_steps} in {report.peak_phase}: {report.peak_op}"
                 f" in {report.peak_module or '(root)'}")
    if report.peak_reserved_bytes is not None:
        peak.append(f"   reserved: {format_bytes(report.peak_reserved_bytes)} (caching-allocator model)")
    first = (f"first step (optimizer state created lazily): {format_bytes(report.first_step_peak_allocated_bytes)}   "
             if report.run.mode is Mode.TRAIN else "")
    extra = Text(f"{first}graph-optimal (last-use freeing): {format_bytes(report.graph_optimal_peak_bytes)}",
                 style="dim")
    if (report.run.grad_accum or 1) > 1:
        where.append(f" (micro-step {report.peak_micro_step + 1} of {report.run.grad_accum})")
    if report.run.peak_in:
        r = report.run
        where.append(f" ({r.peak_in})")
        extra = Text(f"prefill peak {format_bytes(r.prefill_peak_bytes)}   decode peak "
                     f"{format_bytes(r.decode_peak_bytes)}   KV cache at the end {format_bytes(r.kv_cache_bytes_at_end)}"
                     f" ({r.batch} × {r.kv_tokens_per_request:,} tokens, {format_bytes(r.kv_bytes_per_token)} "
                     "per token per request" + (f"; cross-attention {format_bytes(r.kv_cross_attention_bytes)}, "
                                                f"{format_bytes(r.kv_cross_bytes_per_token)} per prompt token"
                                                if r.kv_cross_attention_bytes is not None else "") + ")", style="dim")
    loops = [Text(line, style="yellow") for line in loop_notes(report.run, report.peak_allocated_bytes)
             + [kv_cache_note(report)] if line]
    console.print(Panel(Group(peak, where, extra, *loops, Text(f"timeline {sparkline(report)}  (max per column, 0 "
                                                                f"to {format_bytes(report.peak_allocated_bytes)})",
                                                                style="dim")),
                        border_style="magenta"))


def _render_tables(report: MemoryReport, console: Console) -> None:
    """The bytes live at the peak by category, and the step waterfall."""
    bd = Table(title="Live at the peak, by category", title_justify="left")
    bd.add_column("category")
    bd.add_column("bytes", justify="right")
    bd.add_column("share", justify="right")
    total = max(report.peak_allocated_bytes, 1)
    for cat, b in sorted(report.breakdown_at_peak.items(), key=lambda kv: -kv[1]):
        if not b and (cat in OPTIONAL or report.run.mode is not Mode.TRAIN):  # no gradient, no optimizer state rows
            continue
        bd.add_row(_CATEGORY_LABELS.get(cat, cat), format_bytes(b), f"{100 * b / total:.1f}%")
    wf = Table(title="Step waterfall (predicted)", title_justify="left")
    wf.add_column("moment")
    wf.add_column("allocated", justify="right")
    wf.add_column("step", justify="right")
    for mark in report.phases:
        wf.add_row(mark.name, format_bytes(mark.bytes), str(mark.step))
    wf.add_row("first-step peak", format_bytes(report.first_step_peak_allocated_bytes), "", style="dim")
    console.print(bd)
    console.print(wf)


def _render_top(report: MemoryReport, console: Console) -> None:
    """The largest storages live at the peak (fewer columns below 140 characters of width)."""
    wide = console.width >= 140  # below, the columns a reader can spare go, and the rest keep their words whole
    top = Table(title="Largest storages live at the peak", title_justify="left",
                box=box.HEAVY_HEAD if wide else box.SIMPLE_HEAD)
    columns = ["module / tensor", "op", "category", "shape", "dtype", "bytes", "born", "dies"]
    if not wide:
        columns = ["module / tensor", "op", "shape", "bytes"]
    longest = max((len(t.name or t.module or "(root)") for t in report.top_tensors), default=0)
    for col in columns:
        top.add_column(col, justify="right" if col in ("bytes", "born", "dies") else "left", overflow="fold",
                       no_wrap=col in ("bytes", "category", "shape"), ratio=1 if col == "module / tensor" else None,
                       min_width=None if wide else min(longest, console.width - 48) if col == "module / tensor"
                       else 10 if col == "bytes" else None)
    for t in report.top_tensors:
        cells = {"module / tensor": t.name or t.module or "(root)",
                 "op": t.op.removeprefix("aten.").removesuffix(".default") or "(at start)",
                 "category": t.category, "shape": _shape(t.shape), "dtype": t.dtype, "bytes": format_bytes(t.bytes),
                 "born": str(t.birth), "dies": str(t.death)}
        top.add_row(*(cells[c] for c in columns))
    console.print(top)


def _render_verdict(report: MemoryReport, console: Console) -> None:
    """Fits or not, the device total and its headroom; on a CUDA target, the allocator replay under the capacity
    (cache releases per step, or the allocation that runs out of memory) and the CUDA context assumed, with why."""
    f = report.fit
    if f.device_total_bytes is None:  # the CPU target given a capacity
        word = "Fits" if f.fits else "Does not fit"
        amount = f"with {format_bytes(f.headroom_bytes)} spare" if f.fits else \
            f"over by {format_bytes(-f.headroom_bytes)}"
        console.print(Text(f"{word} on {f.gpu} ({format_bytes(f.capacity_bytes)}): {amount}",
                           style="bold green" if f.fits else "bold red"))
        console.print(Text(f"basis: {f.basis}", style="dim"))
        return
    reserved = f.device_total_bytes - f.cuda_context_bytes
    total = (f" device total {format_bytes(f.device_total_bytes)} (reserved {format_bytes(reserved)} + CUDA "
             f"context {format_bytes(f.cuda_context_bytes)})")
    if f.fits:
        console.print(Text(f"Fits on {f.gpu} ({format_bytes(f.capacity_bytes)}):{total} with "
                           f"{format_bytes(f.headroom_bytes)} spare", style="bold green"))
        if f.alloc_retries:
            n = f.alloc_retries
            console.print(Text(f"only by releasing the allocator's cache {'once' if n == 1 else f'{n} times'} per step "
                               f"(num_alloc_retries: a device sync and cudaFree each; the unbounded replay would "
                               f"reserve {format_bytes(report.peak_reserved_bytes)})", style="yellow"))
    else:
        console.print(Text(f"Does not fit on {f.gpu} ({format_bytes(f.capacity_bytes)}):{total} over by "
                           f"{format_bytes(max(-f.headroom_bytes, 0))}", style="bold red"))
        if f.oom:
            console.print(Text(f"replayed with the device's capacity: {f.oom}", style="red"))
    if f.cuda_context_source:
        console.print(Text(f"CUDA context {format_bytes(f.cuda_context_bytes)}: {f.cuda_context_source}",
                           style="dim"))
    console.print(Text(f"basis: {f.basis}", style="dim"))


GROUP_ROWS = 8  # rows of the by-layer table
LAYER_ROWS = 3  # whole-layer rows above them


def _render_groups(report: MemoryReport, console: Console) -> None:
    """What is live at the peak, by module pattern and category: identical layers folded into one row."""
    groups = live_groups(report.tensors, report.peak_step)
    if not groups:
        return
    table = Table(title="Live at the peak, by layer (identical layers folded)", title_justify="left",
                  box=box.SIMPLE_HEAD)
    table.add_column("modules", overflow="fold", ratio=1)
    table.add_column("category", no_wrap=True)
    table.add_column("each", justify="right", no_wrap=True)
    table.add_column("total", justify="right", no_wrap=True)
    for g in [t for t in layer_totals(groups) if t.instances > 1][:LAYER_ROWS]:  # whole layers first
        table.add_row(Text(f"{g.instances} × {g.pattern} (all)", style="bold"), g.category,
                      format_bytes(g.bytes_each), format_bytes(g.bytes))
    for g in groups[:GROUP_ROWS]:
        many = g.instances > 1
        table.add_row(f"{g.instances} × {g.pattern}" if many else (g.pattern or "(root)"), g.category,
                      format_bytes(g.bytes_each) if many else "", format_bytes(g.bytes))
    if len(groups) > GROUP_ROWS:
        rest = sum(g.bytes for g in groups[GROUP_ROWS:])
        table.add_row(f"{len(groups) - GROUP_ROWS} more groups", "", "", format_bytes(rest), style="dim")
    console.print(table)


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


COMPILED_ROWS = 5  # recomputed ops listed


def _render_compiled(report: MemoryReport, console: Console) -> None:
    """--compile: the compiled step against the eager one, and what the partitioner recomputes."""
    c = report.compiled
    if c is None:
        return
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    saved = c.peak_allocated_bytes_eager - c.peak_allocated_bytes
    grid.add_row("peak allocated", f"{format_bytes(c.peak_allocated_bytes)} compiled, "
                                   f"{format_bytes(c.peak_allocated_bytes_eager)} eager (peak in "
                                   f"{c.peak_phase_eager}): compile " + (f"saves {format_bytes(saved)}" if saved >= 0
                                                                             else f"costs {format_bytes(-saved)}"))
    grid.add_row("activations", f"{format_bytes(c.activation_bytes)} at the end of the forward (eager: "
                                f"{format_bytes(c.activation_bytes_eager)}); the forward graphs save "
                                f"{format_bytes(c.saved_bytes)} of what they compute")
    zeros = c.zero_gradient_bytes_at_peak
    if zeros:
        grid.add_row("zero gradients", f"{format_bytes(zeros)} at the peak: the compiled backward makes a zero "
                                       "gradient for each graph output no loss depends on (the logits a model returns "
                                       "beside its loss; with the KV cache on, its keys and values: --use-cache false "
                                       "drops those)")
    grid.add_row("graphs", f"{c.forward_graphs} forward, {c.backward_graphs} backward"
                           + (" (graph breaks: the code between them runs eagerly)" if c.forward_graphs > 1 else ""))
    rows = c.recomputed
    if rows:
        shown = ", ".join(f"{escape(r.op.removeprefix('aten.'))} ×{r.count} in {escape(r.module or '(root)')}"
                          for r in rows[:COMPILED_ROWS])
        more = f" and {len(rows) - COMPILED_ROWS} more" if len(rows) > COMPILED_ROWS else ""
        grid.add_row("recomputed", f"{sum(r.count for r in rows)} ops re-run in the backward by the partitioner "
                                   f"(largest outputs first): {shown}{more}")
    else:
        grid.add_row("recomputed", "nothing: the partitioner saves every activation the backward reads")
    console.print(Panel(grid, title="torch.compile (Inductor, CPU graphs)", border_style="blue"))


def _render_checkpointing(report: MemoryReport, console: Console) -> None:
    ck = report.checkpointing
    if ck is not None:
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold")
        grid.add_column()
        grid.add_row("policy", ck.policy + (f": {ck.checkpointed}" if ck.checkpointed else ""))
        grid.add_row("peak allocated", f"{format_bytes(ck.peak_allocated_bytes)} "
                                       f"(without: {format_bytes(ck.peak_allocated_bytes_without)})")
        grid.add_row("activations", f"{format_bytes(ck.activation_bytes)} at the end of the forward "
                                    f"(without: {format_bytes(ck.activation_bytes_without)})")
        grid.add_row("recompute", f"{format_flops(ck.recompute_flops)}, {_pct(ck.recompute_overhead)} of the "
                                  "step's forward + backward FLOPs")
        plan = ck.plan
        if plan:
            over = f", over by {format_bytes(plan.over_budget_bytes)}" if not plan.fits else ""
            basis = plan.basis
            grid.add_row("plan", f"budget {format_bytes(plan.budget_bytes)} of {basis}: {plan.verdict}{over}")
            tried = ", ".join(f"{e.policy} {format_bytes(e.compared_bytes)}"
                              for e in plan.evaluated)
            grid.add_row("traced", f"{tried} ({basis})")
        for note in ck.notes:
            grid.add_row("note", Text(note, style="yellow"))
        console.print(Panel(grid, title="Activation checkpointing", border_style="blue"))
        if ck.snippet:
            console.print(Text("Apply it in your training code (after building `model`):", style="bold"))
            console.print(ck.snippet, soft_wrap=True, markup=False, highlight=False)
    if report.comparison:
        cmp = Table(title="Checkpointing compared", title_justify="left")
        for col in ("policy", "peak allocated", "activations", "recompute"):
            cmp.add_column(col, justify="left" if col == "policy" else "right")
        for row in report.comparison:
            cmp.add_row(row.policy, format_bytes(row.peak_allocated_bytes), format_bytes(row.activation_bytes),
                        _pct(row.recompute_overhead))
        console.print(cmp)
    if report.unresolved:
        console.print(Panel("\n".join(escape(u) for u in report.unresolved),
                            title=f"Unresolved ({len(report.unresolved)}): sizes the trace could not determine exactly", title_align="left",
                            border_style="red"))


_BARS = "▁▂▃▄▅▆▇█"


def sparkline(report: MemoryReport, width: int = 48) -> str:
    """A one-line sketch of live bytes over the step: each character is the maximum of its column of steps."""
    n = report.num_steps
    if n == 0:
        return ""
    diff = [0] * (n + 1)
    for t in report.tensors:
        diff[t.birth] += t.bytes
        diff[t.death + 1] -= t.bytes
    live, acc = [], 0
    for i in range(n):
        acc += diff[i]
        live.append(acc)
    width = min(width, n)
    top = max(live) or 1
    cols = [max(live[c * n // width:max((c + 1) * n // width, c * n // width + 1)]) for c in range(width)]
    return "".join(_BARS[min(len(_BARS) - 1, v * len(_BARS) // (top + 1))] for v in cols)


def pipeline_text(r: RunInfo) -> str:
    """'1f1b over 4 stages, 4 micro-batches of 2 rows, split 1,1,1,1; stage 3 shown' and one line per stage:
    'stage 0  2.43 MiB at B0, in flight 0-3; receive buffers 64.00 KiB, held sends 0 B'. Under interleaved-1f1b
    and zero-bubble 'interleaved-1f1b over 2 ranks of 2 stages, ...; rank 1 shown' and one line per rank:
    'rank 0 (stages 0,2) ...'."""
    p = r.pp
    who = "rank" if p.virtual_stages else "stage"
    over = f"{p.stages} ranks of {p.virtual_stages} stages" if p.virtual_stages else f"{p.stages} stages"
    lines = [f"{p.schedule.value} over {over}, {p.micro_batches} micro-batches of {p.micro_batch_rows} "
             f"rows, split {','.join(map(str, p.split))}; {who} {p.stage} shown"]
    for s in p.stage_peaks:
        flight = ",".join(map(str, s.in_flight)) or "none"
        held = f" (stages {','.join(map(str, s.holds))})" if s.holds else ""
        lines.append(f"{who} {s.stage}{held}  {format_bytes(s.peak_bytes)} at {s.at}, in flight {flight}; receive "
                     f"buffers {format_bytes(s.recv_buffer_bytes)}, held sends {format_bytes(s.held_send_bytes)}"
                     + (f" (as stage {s.traced_as})" if s.traced_as != s.stage else ""))
    return "\n".join(lines)
