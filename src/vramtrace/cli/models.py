"""`vramtrace models`: the bundled model ids, answered offline."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from ..errors import UsageError

MODELS_HELP = "Usage: vramtrace models\n\n  List the bundled model ids (no network needed) and their model_type."


def models_command(
    extra: Annotated[Optional[list[str]], typer.Argument(hidden=True)] = None,
    show_help: Annotated[bool, typer.Option("--help", "-h", hidden=True)] = False,
    debug: Annotated[bool, typer.Option("--debug", hidden=True)] = False,
) -> None:
    """List the bundled model ids (no network needed) and their model_type.

    Registered with click's own help option off: `--help` prints MODELS_HELP (as docs/cli.md shows it), and any
    argument is refused with one `Error:` line (UsageError) rather than click's "unexpected extra argument"."""
    from ..tracer.loading import bundled_models

    del debug  # read by main()
    if show_help:
        print(MODELS_HELP)
        return
    if extra:
        raise UsageError(f"`vramtrace models` takes no arguments, got {' '.join(extra)!r}")
    models = bundled_models()
    width = max(len(ref) for ref, _ in models)
    for ref, model_type in models:
        print(f"{ref:<{width}}  {model_type}")
