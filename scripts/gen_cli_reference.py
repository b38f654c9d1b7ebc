"""Write docs/cli.md, the CLI reference, from the typer apps' own help (`typer.main.get_command`, then click's
plain-text help formatter at 100 columns, so the page does not depend on the terminal or on rich).

    python scripts/gen_cli_reference.py           # rewrite docs/cli.md
    python scripts/gen_cli_reference.py --check   # exit 1 when docs/cli.md is out of date (tests/test_docs.py)

Run it after adding or changing an option of `vramtrace`, `vramtrace serve` or `vramtrace models`.
"""

from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "cli.md"
WIDTH = 100


def plain_help(app, prog: str) -> str:
    """`prog --help` of the typer app `app`, formatted by click's own Command.format_help (not typer's rich panels).
    """
    import typer.main

    cmd = typer.main.get_command(app)
    # typer's TyperCommand overrides format_help with rich panels; click's Command (typer vendors click) has the
    # plain formatter
    click_command = next(c for c in type(cmd).__mro__ if c.__name__ == "Command" and c.__module__.endswith("click.core"))
    ctx = cmd.make_context(prog, [], resilient_parsing=True, terminal_width=WIDTH, max_content_width=WIDTH)
    formatter = ctx.make_formatter()
    click_command.format_help(cmd, ctx, formatter)
    return formatter.getvalue().rstrip() + "\n"


def models_help() -> str:
    """`vramtrace models --help` (a plain function, not a typer app)."""
    from vramtrace.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["models", "--help"])
    return out.getvalue().rstrip() + "\n"


def reference() -> str:
    """The whole of docs/cli.md."""
    from vramtrace.cli import app, serve_app

    parts = [
        "# CLI reference\n",
        "Generated from the CLI's own help by `python scripts/gen_cli_reference.py`; do not edit by hand "
        "(`tests/test_docs.py` checks it is up to date). How-to pages: [usage/](usage/).\n",
        "`vramtrace validate MODEL ...` and `vramtrace fit MODEL ...` take the options of `vramtrace MODEL ...` "
        "below (fit adds `--headroom` and `--sweep`; validate runs the step for real and compares).\n",
        "## vramtrace\n", "```\n" + plain_help(app, "vramtrace") + "```\n",
        "## vramtrace serve\n", "```\n" + plain_help(serve_app, "vramtrace serve") + "```\n",
        "## vramtrace models\n", "```\n" + models_help() + "```\n",
    ]
    return "\n".join(parts)


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(ROOT / "src"))
    text = reference()
    if "--check" in argv:
        if not OUT.is_file() or OUT.read_text(encoding="utf-8") != text:
            print(f"{OUT.relative_to(ROOT)} is out of date: run python scripts/gen_cli_reference.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUT.relative_to(ROOT)} ({len(text):,} characters)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
