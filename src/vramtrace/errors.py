"""One error hierarchy. The library raises these; only the CLI turns them into `Error: ...` lines."""


class VramtraceError(Exception):
    """Base class of every error vramtrace raises on purpose. `str(err)` is one line for the user."""


class UsageError(VramtraceError):
    """A bad option value (unknown precision, batch <= 0, ...). The CLI exits with status 2."""


class ModelLoadError(VramtraceError):
    """The model reference could not be resolved to a config, or the config could not be built."""


class TraceError(VramtraceError):
    """Running the step on the meta device failed; the message names the op or module."""


class UnsupportedOpError(TraceError):
    """An op has no meta kernel or an aliasing behaviour we cannot model."""


class BridgeError(VramtraceError):
    """A transformers or torch symbol that a bridge (`vramtrace.bridges`) patches is missing in the installed
    version; the message names the symbol, the installed version and the versions the bridge was written for."""


class ReportWriteError(VramtraceError):
    """A report file could not be written."""
