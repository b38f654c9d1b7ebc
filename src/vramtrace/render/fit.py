"""Terminal rendering of `vramtrace fit`'s answer (a `vramtrace.fit.FitResult`)."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..units import format_bytes

_AXIS = {"batch": "micro-batch", "seq": "sequence length", "fsdp": "FSDP ranks (GPUs)", "zero": "ZeRO stage",
         "pp": "pipeline depth (stages)"}


def render_fit(result, console: Console, model: str, target: str) -> None:
    """Print the answer, the first size that does not fit, how it was found, and the curve."""
    r = result
    other = (f" at seq {r.fixed}" if r.axis == "batch" and r.fixed else f" at batch {r.fixed}" if r.axis == "seq"
             else f" at per-rank batch {r.fixed}" if r.axis in ("fsdp", "zero")
             else f" at batch {r.fixed} per pipeline step" if r.axis == "pp" else "")
    budget = (f"{format_bytes(r.budget_bytes)} of {format_bytes(r.capacity_bytes)}" if r.budget_bytes != r.capacity_bytes
              else format_bytes(r.capacity_bytes))
    console.print(f"[bold]{escape(model)}[/] on {escape(target)} ({budget}){other}")
    basis = "reserved" if (r.best or r.next).peak_reserved_bytes is not None else "allocated"
    if r.axis == "fsdp":
        _render_ranks(r, console, basis)
    elif r.axis == "zero":
        _render_stage(r, console)
    elif r.axis == "pp":
        _render_depth(r, console)
    elif r.best is None:
        console.print(f"[bold red]Does not fit even at {_AXIS[r.axis]} {r.next.x}[/]: {_why_not(r, r.next)}")
    else:
        console.print(f"Largest {_AXIS[r.axis]} that fits: [bold magenta]{r.best.x}[/] ({_why(r, r.best)})")
        if r.next is None:
            console.print(f"{_AXIS[r.axis].capitalize()} {r.best.x} is the model's limit (max_position_embeddings)")
        else:
            console.print(f"{_AXIS[r.axis].capitalize()} {r.next.x} does not fit: {_why_not(r, r.next)}")
    if r.allocated_bound is not None and r.best is not None and basis == "reserved" \
            and r.allocated_bound > r.best.x:
        console.print(f"[dim]peak allocated alone fits up to {_AXIS[r.axis]} {r.allocated_bound:,}: no larger size "
                      f"can run; between the two a real run fits only where the allocator's layout is kinder than "
                      f"the replay's[/]")
    if r.cuda_context_source:
        console.print(f"[dim]CUDA context {format_bytes(r.cuda_context_bytes)}: {escape(r.cuda_context_source)}[/]")
    console.print(f"[dim]fits: {escape(r.basis)}; {escape(r.method)}; {r.traces} exact traces[/]")
    table = Table(title=f"Peak over the {_AXIS[r.axis]}", title_justify="left")
    table.add_column(r.axis, justify="right")
    table.add_column("peak allocated", justify="right")
    if basis == "reserved":
        table.add_column("peak reserved", justify="right")
    if basis == "reserved":
        table.add_column("under the budget", justify="right")
    table.add_column("fits")
    table.add_column("how")
    for p in r.curve:
        cells = [f"{p.x:,}", format_bytes(p.peak_allocated_bytes)]
        if basis == "reserved":
            cells.append(format_bytes(p.peak_reserved_bytes))
            cells.append("" if p.reserved_at_capacity is None else format_bytes(p.reserved_at_capacity) + (
                f", {p.alloc_retries} release{'s' if p.alloc_retries != 1 else ''}" if p.alloc_retries else ""))
        cells += ["yes" if p.fits else "[red]no[/]", "traced" if p.exact else "interpolated"]
        table.add_row(*cells)
    console.print(table)
    if r.levers is not None:
        from .levers import render_levers

        render_levers(r.levers, console)


def _why(r, p) -> str:
    """Why point `p` fits: on a CUDA target the replay under the budget (its peak reserved, the headroom it leaves,
    the cache releases a step needs), else the peak allocated."""
    if p.reserved_at_capacity is None:
        return f"peak allocated {format_bytes(p.peak_allocated_bytes)}"
    releases = (f"; {p.alloc_retries} cache release{'s' if p.alloc_retries != 1 else ''} per step "
                f"(cudaMalloc retries)" if p.alloc_retries else "")
    return (f"peak reserved {format_bytes(p.reserved_at_capacity)} of the {format_bytes(r.budget_bytes)} budget, "
            f"{format_bytes(r.budget_bytes - p.reserved_at_capacity)} headroom, allocated "
            f"{format_bytes(p.peak_allocated_bytes)}{releases}")


def _why_not(r, p) -> str:
    """Why point `p` does not fit: peak allocated over the budget, or the replay under it runs out of memory."""
    if p.peak_reserved_bytes is None or p.peak_allocated_bytes > r.budget_bytes:
        return (f"peak allocated {format_bytes(p.peak_allocated_bytes)} (over by "
                f"{format_bytes(p.peak_allocated_bytes - r.budget_bytes)})")
    return (f"the allocator replay under the {format_bytes(r.budget_bytes)} budget runs out of memory (peak "
            f"allocated {format_bytes(p.peak_allocated_bytes)}; unbounded it would reserve "
            f"{format_bytes(p.peak_reserved_bytes)})")


def _render_ranks(r, console: Console, basis: str) -> None:
    """The fewest FSDP ranks that fit, and the next power of two down that does not."""
    if r.best is None:
        console.print(f"[bold red]Does not fit even on {r.next.x} GPUs with FSDP2[/]: per rank, "
                      f"{_why_not(r, r.next)}")
        return
    console.print(f"Fewest GPUs that fit (FSDP2, --fsdp): [bold magenta]{r.best.x}[/] (per rank, {_why(r, r.best)})")
    if r.next is not None:
        console.print(f"{r.next.x} GPUs do not fit: per rank, {_why_not(r, r.next)}")


def _render_stage(r, console: Console) -> None:
    """The smallest ZeRO stage that fits at the run's ranks, and the stage below it that does not."""
    if r.best is None:
        console.print(f"[bold red]Does not fit even with ZeRO-{r.next.x}[/]: per rank, {_why_not(r, r.next)}")
        return
    console.print(f"Smallest ZeRO stage that fits (--zero): [bold magenta]{r.best.x}[/] (per rank, {_why(r, r.best)})")
    if r.next is not None:
        console.print(f"ZeRO-{r.next.x} does not fit: per rank, {_why_not(r, r.next)}")


def _render_depth(r, console: Console) -> None:
    """The smallest pipeline depth that fits (its largest stage), and the depth below it that does not."""
    if r.best is None:
        console.print(f"[bold red]Does not fit even with --pp {r.next.x}[/]: its largest stage, "
                      f"{_why_not(r, r.next)}")
        console.print(f"[dim]depths searched up to --pp {r.limit} (the decoder layers, one per stage at least, or "
                      "the search's cap of stage traces: the method says which)[/]")
        return
    console.print(f"Smallest pipeline depth that fits (--pp): [bold magenta]{r.best.x}[/] (its largest stage, "
                  f"{_why(r, r.best)})")
    if r.next is not None:
        console.print(f"--pp {r.next.x} does not fit: its largest stage, {_why_not(r, r.next)}")


def _peak(p) -> int:
    return p.peak_reserved_bytes if p.peak_reserved_bytes is not None else p.peak_allocated_bytes


def render_sweep(result, console: Console, model: str, target: str) -> None:
    """The grid: one row per batch, one column per sequence length; each cell the peak the verdict compares (peak
    reserved on a CUDA target where the allocated bytes fit, else peak allocated), red when it does not fit."""
    r = result
    budget = f" (budget {format_bytes(r.budget_bytes)})" if r.budget_bytes is not None else ""
    console.print(f"[bold]{escape(model)}[/] on {escape(target)}{budget}: peak over batch × sequence")
    console.print(f"[dim]{escape(r.method)}; {r.traces} exact traces; reserved where the allocated bytes fit, "
                  "else allocated (marked a)[/]")
    table = Table(title_justify="left")
    table.add_column("batch \\ seq", justify="right")
    for s in r.seqs:
        table.add_column(f"{s:,}", justify="right")
    cells = {(p.batch, p.seq): p for p in r.points}
    for b in r.batches:
        row = [f"{b:,}"]
        for s in r.seqs:
            p = cells[(b, s)]
            text = (format_bytes(p.peak_reserved_bytes) if p.peak_reserved_bytes is not None
                    else format_bytes(p.peak_allocated_bytes) + (" a" if r.budget_bytes is not None and
                                                                 p.fits is False else ""))
            row.append(f"[red]{text}[/]" if p.fits is False else f"[green]{text}[/]" if p.fits else text)
        table.add_row(*row)
    console.print(table)


def render_fit_html(result, model: str, target: str) -> str:
    """A self-contained page (inline SVG, no script, no network) with the curve of `vramtrace fit`: the peak the
    verdict compares over the size, exact and interpolated points marked, the budget as a line; and the table."""
    import jinja2
    from importlib import resources

    from .._version import __version__

    r = result
    reserved = r.curve and r.curve[0].peak_reserved_bytes is not None
    w, h, left, right, top, bottom = 900, 420, 80, 20, 20, 50
    xs = [p.x for p in r.curve]
    ys = [_peak(p) for p in r.curve] + [p.peak_allocated_bytes for p in r.curve] + [r.budget_bytes]
    x0, x1 = min(xs), max(xs)
    y1 = max(ys) * 1.05 or 1

    def sx(x: int) -> float:
        return round(left + (x - x0) / ((x1 - x0) or 1) * (w - left - right), 1)

    def sy(y: int) -> float:
        return round(top + (1 - y / y1) * (h - top - bottom), 1)

    lines = [{"name": "compared", "color": "#4c78a8", "points": " ".join(f"{sx(p.x)},{sy(_peak(p))}" for p in r.curve)}]
    if reserved:
        lines.append({"name": "allocated", "color": "#aaa",
                      "points": " ".join(f"{sx(p.x)},{sy(p.peak_allocated_bytes)}" for p in r.curve)})
    dots = [{"x": sx(p.x), "y": sy(_peak(p)), "fill": "#4c78a8" if p.exact else "#fff",
             "tip": f"{r.axis} {p.x}: {format_bytes(_peak(p))} ({'traced' if p.exact else 'interpolated'})"}
            for p in r.curve]
    yticks = [{"y": sy(y1 * k / 5), "label": format_bytes(int(y1 * k / 5))} for k in range(6)]
    xticks = [{"x": sx(x), "label": f"{x:,}"} for x in xs] if len(xs) <= 16 else \
        [{"x": sx(x), "label": f"{x:,}"} for x in xs[::max(1, len(xs) // 12)]]
    if r.best is None:
        answer = f"Does not fit even at {_AXIS[r.axis]} {r.next.x}."
    else:
        which = "Smallest" if r.axis in ("fsdp", "zero", "pp") else "Largest"  # the hardware axes: the fewest
        answer = f"{which} {_AXIS[r.axis]} that fits: {r.best.x} (peak {format_bytes(_peak(r.best))})."
    other = f" at seq {r.fixed}" if r.axis == "batch" and r.fixed else f" at batch {r.fixed}" if r.axis == "seq" else ""
    rows = [{"x": f"{p.x:,}", "allocated": format_bytes(p.peak_allocated_bytes),
             "reserved": format_bytes(p.peak_reserved_bytes) if p.peak_reserved_bytes is not None else "",
             "fits": p.fits, "how": "traced" if p.exact else "interpolated"} for p in r.curve]
    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    template = env.from_string((resources.files("vramtrace.render") / "templates" / "fit.html.j2")
                               .read_text(encoding="utf-8"))
    return template.render(
        title=f"{model} on {target}{other}", answer=answer, method=f"fits: {r.basis}; {r.method}; {r.traces} exact "
        "traces", w=w, h=h, left=left, right=right, top=top, bottom=bottom, yticks=yticks, xticks=xticks,
        axis=r.axis, budget_y=sy(r.budget_bytes), budget=format_bytes(r.budget_bytes), lines=lines, dots=dots,
        basis_label="peak reserved" if reserved else "peak allocated", has_allocated_line=bool(reserved),
        has_reserved=bool(reserved), rows=rows, version=__version__)
