"""Terminal rendering of the levers that make a run fit (the report's `levers`, `vramtrace.levers.find_levers`)."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from ..report.sections import LeversSummary, SkippedLever
from ..units import format_bytes


def render_levers(levers: LeversSummary, console: Console, who: str = "stage") -> None:
    """A table of the levers, cheapest first, each with its traced peak, what it saves and whether it fits, then
    one row per lever not traced (`skipped`: the extra that would add it, or why its trace failed); then the
    combination when no single lever fits. A lever decided by one pipeline stage (`decided_by_stage`) shows its
    figure as a lower bound, what it saves as an upper bound, and says so (`partial_note`; `who`: "rank" under
    interleaved-1f1b and zero-bubble, `pipeline_who`)."""
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
        at_least, at_most = ("≥ ", "≤ ") if lv.decided_by_stage is not None else ("", "")
        table.add_row(escape(lv.options), at_least + format_bytes(lv.compared_bytes),
                      at_most + format_bytes(lv.saves_bytes), "[bold green]yes[/]" if lv.fits else "no",
                      escape(lv.cost + partial_note(lv.decided_by_stage, "; ", who)))
    for sk in skipped:
        table.add_row(escape(sk.options), "", "", "[yellow]?[/]", escape(skipped_line(sk)))
    console.print(table)
    if not levers.levers:
        console.print(Text("No lever that could be traced lowers the peak of this run.", style="yellow"))
    combo = levers.combination
    if combo:
        at_least = "≥ " if combo.decided_by_stage is not None else ""
        over = format_bytes(combo.compared_bytes - levers.budget_bytes)
        verdict = "fits" if combo.fits else f"does not fit (over by {at_least}{over})"
        console.print(Text.assemble(("No single lever is enough; together: ", "bold"), (combo.options, "bold cyan"),
                                    f" peaks at {at_least}{format_bytes(combo.compared_bytes)} ({basis}) and "
                                    f"{verdict}{partial_note(combo.decided_by_stage, ': ', who)}"))


def pipeline_who(report) -> str:
    """What a --pp report's `decided_by_stage` counts: "rank" under interleaved-1f1b and zero-bubble (a rank holds
    several stages, `StagePeak.stage`), else "stage"."""
    pp = report.run.pp
    return "rank" if pp is not None and pp.schedule.multi_stage else "stage"


def partial_note(stage: int | None, sep: str, who: str = "stage") -> str:
    """What a lever row decided by one pipeline stage (`LeverRow.decided_by_stage`) adds after `sep`: that the
    stage (`who`: or rank) alone does not fit and the rest of the pipeline was not traced, so the figures are that
    stage's; '' for a row with every stage traced."""
    if stage is None:
        return ""
    return f"{sep}{who} {stage} alone does not fit (the other {who}s not traced; figures: {who} {stage}'s)"


def skipped_line(skipped: SkippedLever) -> str:
    """One line for a lever not traced: "LoRA r=16: needs peft (pip install 'vramtrace[lora]')"."""
    return f"{skipped.title}: {skipped.detail}"
