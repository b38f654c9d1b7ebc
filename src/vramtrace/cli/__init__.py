"""Command line: parse arguments, call the library, render. Errors become one `Error: ...` line.

Subcommands are real click commands of one typer app, `cli`: `fit`, `validate` (both `main_command` with the
options of the main run, in cli/run.py), `serve` (cli/serve.py), `models` (cli/models.py). The main run takes no
command word (`vramtrace MODEL [options]`, the README's first command), which typer cannot declare beside named
subcommands: `_DefaultGroup` is the documented click way, a `TyperGroup` subclass (`typer.Typer(cls=...)`) whose
`parse_args` puts the hidden default command `run` first when the first argument is no command's name (a model, a
report, an option, or nothing). So a model named `fit`, `validate`, `serve` or `models` needs `vramtrace run NAME`.

`app` and `serve_app` hold the main run and serve alone, for scripts/gen_cli_reference.py (docs/cli.md).
"""

from __future__ import annotations

import logging
import os
import sys
import traceback

import typer
from typer.core import TyperCommand, TyperGroup

try:  # typer >= 0.2x vendors its own click, whose errors derive from the public typer.TyperException
    from typer import TyperException as ParseError
except ImportError:  # pragma: no cover - older typer raises click's own errors
    from click import ClickException as ParseError

from ..errors import SpecError, UsageError, VramtraceError
from .models import models_command
from .options import flag_of
from .run import Command, main_command
from .serve import serve_command

_SETTINGS = {"help_option_names": ["-h", "--help"]}


class _DefaultGroup(TyperGroup):
    """A command group whose first argument, when it names no command, belongs to the default command `run`."""

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        if not args or args[0] not in self.commands:
            args = [Command.RUN.value, *args]
        return super().parse_args(ctx, args)

    def resolve_command(self, ctx, args: list[str]):
        name, command, rest = super().resolve_command(ctx, args)
        # the default command's usage line reads `vramtrace [OPTIONS] ...`, as it is typed (see _DefaultContext)
        return (None if name == Command.RUN.value else name), command, rest


class _DefaultContext(typer.Context):
    """The default command's context: its command path is the program's alone (click joins the parent's path and a
    command name, here none, with a space)."""

    @property
    def command_path(self) -> str:
        return super().command_path.rstrip()


class _DefaultCommand(TyperCommand):
    context_class = _DefaultContext


def _typer() -> typer.Typer:
    return typer.Typer(add_completion=False, context_settings=_SETTINGS, pretty_exceptions_enable=False)


cli = typer.Typer(cls=_DefaultGroup, add_completion=False, context_settings=_SETTINGS, pretty_exceptions_enable=False)
cli.command(Command.RUN.value, cls=_DefaultCommand, hidden=True)(main_command)
cli.command(Command.FIT.value, help="Find the largest batch (or sequence) that fits; the options of `vramtrace "
            "MODEL ...` and --headroom, --sweep.")(main_command)
cli.command(Command.VALIDATE.value, help="Predict, then run the step for real on this machine and compare; the "
            "options of `vramtrace MODEL ...`.")(main_command)
cli.command("serve")(serve_command)
cli.command("models", add_help_option=False)(models_command)

app = _typer()
app.command()(main_command)
serve_app = _typer()
serve_app.command()(serve_command)


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
    log_handler = _debug_log(debug)
    try:
        rv = cli(args=argv, standalone_mode=False, prog_name="vramtrace")
        return rv if isinstance(rv, int) else 0  # --help returns its exit code in non-standalone mode
    except ParseError as e:  # bad option, missing argument, not a number
        _error(e, debug, f"{e.format_message()} (see vramtrace --help)")
        return 2
    except KeyboardInterrupt as e:
        _error(e, debug, "interrupted")
        return 1
    except SpecError as e:  # a RunSpec field: worded as the option that sets it
        _error(e, debug, e.worded(flag_of))
        return 2
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


def _entry() -> None:
    sys.exit(main())
