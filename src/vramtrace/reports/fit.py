"""Terminal rendering of `vramtrace fit`'s answer (a `vramtrace.fit.FitResult`)."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..units import format_bytes

_AXIS = {"batch": "micro-batch", "seq": "sequence length"}


def render_fit(result, console: Console, model: str, target: str) -> None:
    """Print the answer, the first size that does not fit, how it was found, and the curve."""
    r = result
    other = (f" at seq {r.fixed}" if r.axis == "batch" and r.fixed else f" at batch {r.fixed}" if r.axis == "seq"
             else "")
    budget = (f"{format_bytes(r.budget_bytes)} of {format_bytes(r.capacity_bytes)}" if r.budget_bytes != r.capacity_bytes
              else format_bytes(r.capacity_bytes))
    console.print(f"[bold]{escape(model)}[/] on {escape(target)} ({budget}){other}")
    basis = "reserved" if (r.best or r.next).peak_reserved_bytes is not None else "allocated"
    if r.best is None:
        first = r.next
        console.print(f"[bold red]Does not fit even at {_AXIS[r.axis]} {first.x}[/]: peak {basis} "
                      f"{format_bytes(_peak(first))} (over by {format_bytes(_peak(first) - r.budget_bytes)})")
    else:
        console.print(f"Largest {_AXIS[r.axis]} that fits: [bold magenta]{r.best.x}[/] (peak {basis} "
                      f"{format_bytes(_peak(r.best))}, allocated {format_bytes(r.best.peak_allocated_bytes)})")
        if r.next is None:
            console.print(f"{_AXIS[r.axis].capitalize()} {r.best.x} is the model's limit (max_position_embeddings)")
        else:
            console.print(f"{_AXIS[r.axis].capitalize()} {r.next.x} does not fit: peak {basis} "
                          f"{format_bytes(_peak(r.next))} (over by {format_bytes(_peak(r.next) - r.budget_bytes)})")
    console.print(f"[dim]fits: {escape(r.basis)}; {escape(r.method)}; {r.traces} exact traces[/]")
    table = Table(title=f"Peak over the {_AXIS[r.axis]}", title_justify="left")
    table.add_column(r.axis, justify="right")
    table.add_column("peak allocated", justify="right")
    if basis == "reserved":
        table.add_column("peak reserved", justify="right")
    table.add_column("fits")
    table.add_column("how")
    for p in r.curve:
        cells = [f"{p.x:,}", format_bytes(p.peak_allocated_bytes)]
        if basis == "reserved":
            cells.append(format_bytes(p.peak_reserved_bytes))
        cells += ["yes" if p.fits else "[red]no[/]", "traced" if p.exact else "interpolated"]
        table.add_row(*cells)
    console.print(table)
    if r.levers is not None:
        from .levers import render_levers

        render_levers(r.levers, console)


def _peak(p) -> int:
    return p.peak_reserved_bytes if p.peak_reserved_bytes is not None else p.peak_allocated_bytes
