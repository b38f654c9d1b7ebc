"""Terminal rendering of the levers that make a run fit (the report's `levers`, `vramtrace.levers.find_levers`)."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from ..report.sections import LeversSummary, SkippedLever
from ..units import format_bytes


def render_levers(levers: LeversSummary, console: Console) -> None:
    """A table of the levers, cheapest first, each with its traced peak, what it saves and whether it fits, then
    one row per lever not traced (`skipped`: the extra that would add it, or why its trace failed); then the
    combination when no single lever fits."""
    basis = levers.basis
    skipped = levers.skipped
    if not levers.levers and not skipped:
        console.print(Text("No lever vramtrace knows lowers the peak of this run.", style="yellow"))
        return
    table = Table(title=f"What makes it fit (each lever traced; {basis} vs {format_bytes(levers.budget_bytes)})",
                  title_justify="left")
    table.add_column("lever", overflow="fold")
    table.add_column(basis.removeprefix("peak "), justify="right")
    table.add_column("saves", justify="right")
    table.add_column("fits")
    table.add_column("cost", overflow="fold")
    for lv in levers.levers:
        table.add_row(escape(lv.options), format_bytes(lv.compared_bytes), format_bytes(lv.saves_bytes),
                      "[bold green]yes[/]" if lv.fits else "no", escape(lv.cost))
    for sk in skipped:
        table.add_row(escape(sk.options), "", "", "[yellow]?[/]", escape(skipped_line(sk)))
    console.print(table)
    if not levers.levers:
        console.print(Text("No lever that could be traced lowers the peak of this run.", style="yellow"))
    combo = levers.combination
    if combo:
        verdict = "fits" if combo.fits else f"does not fit (over by {format_bytes(combo.compared_bytes - levers.budget_bytes)})"
        console.print(Text.assemble(("No single lever is enough; together: ", "bold"), (combo.options, "bold cyan"),
                                    f" peaks at {format_bytes(combo.compared_bytes)} ({basis}) and {verdict}"))


def skipped_line(skipped: SkippedLever) -> str:
    """One line for a lever not traced: "LoRA r=16: needs peft (pip install 'vramtrace[lora]')"."""
    return f"{skipped.title}: {skipped.detail}"
