"""One error hierarchy. The library raises these; only the CLI turns them into `Error: ...` lines."""

from __future__ import annotations

import re
from typing import Callable

_FIELD = re.compile(r"\{([a-z][a-z0-9_]*)\}")


class VramtraceError(Exception):
    """Base class of every error vramtrace raises on purpose. `str(err)` is one line for the user."""


class UsageError(VramtraceError):
    """A bad option value (unknown precision, batch <= 0, ...). The CLI exits with status 2."""


class SpecError(UsageError):
    """A `RunSpec` field given a bad value, or fields that do not go together (spec.py). The message names each
    field as `{field}` (`template`); `str()` words it in the Python API's terms, the field's name (`batch must
    be ...`), and `worded(name)` with `name(field)` instead: the CLI's option (`--batch must be ...`,
    cli/options.py `flag_of`). A `{word}` that is not one of `fields` is left as it is."""

    def __init__(self, template: str, fields: frozenset[str]) -> None:
        self.template, self.fields = template, fields
        super().__init__(self.worded(lambda field: field))

    def worded(self, name: Callable[[str], str]) -> str:
        """The message with each `{field}` replaced by `name(field)`."""
        return _FIELD.sub(lambda m: name(m[1]) if m[1] in self.fields else m[0], self.template)


class ModelLoadError(VramtraceError):
    """The model reference could not be resolved to a config, or the config could not be built."""


class TraceError(VramtraceError):
    """Running the step on the meta device failed; the message names the op or module."""


class UnsupportedOpError(TraceError):
    """An op has no meta kernel or an aliasing behaviour we cannot model."""


class BridgeError(VramtraceError):
    """A transformers or torch symbol that a bridge (`vramtrace.bridges`) patches is missing in the installed
    version; the message names the symbol, the installed version and the versions the bridge was written for."""


class WouldNotFit(VramtraceError):
    """The predicted step does not fit the device (`integrations.transformers`, on_oom_risk='raise'); the message
    names the levers that make it fit."""


class ReportWriteError(VramtraceError):
    """A report file could not be written."""


class MissingExtraError(VramtraceError):
    """An option needs an optional extra that is not installed (DeepSpeed for `--zero`); the message is the one
    install line. The CLI exits with status 1."""
