"""The CPU workspace probe's results (`Probed`): in this process (`PROBED`) and on disk for the next process on
this machine (`ProbeDiskCache`, its file named by `PROBE_RULES_VERSION` and the CPU environment).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import NamedTuple

import torch

from .profiling import cpu_environment


class Probed(NamedTuple):
    """What the CPU probe found for one op signature: its workspace (bytes), the outputs to lay out as the CPU
    kernel does ((leaf index, shape, stride, dtype), ...), and what the report says of it (or None): why it could
    not be measured, how its outputs differ from the meta kernel's, how it was extrapolated."""
    workspace: int
    layouts: tuple
    failure: str | None = None
    note: str | None = None
    extrapolated: str | None = None


# The probe's results in this process, shared by every `CpuWorkspaceProbe` (the compiled trace and the eager one
# it is compared with run the same large kernels): key (op, argument layouts, autocast dtype, thread count, the
# probe's thresholds, whether its memory limit applies) -> Probed. A memo of measurements of this process's CPU
# kernels, which do not change in it.
PROBED: dict[tuple, Probed] = {}


# The probe's results on disk, for the next process on this machine: a directory, or "off". Default:
# $XDG_CACHE_HOME/vramtrace (else ~/.cache/vramtrace).
PROBE_CACHE_ENV = "VRAMTRACE_CPU_PROBE_CACHE"
# The version of the probe's rules, part of the disk cache's file name (`ProbeDiskCache`). Bump it with any change
# to what the probe stores for an op signature or to how it reaches it: the key (`CpuWorkspaceProbe`'s signature),
# the measurement (the profiled run, oneDNN's scratchpad queries in onednn.py), the extrapolation and reduction
# rules, the stored layouts or notes. A stale file is then never read; a change elsewhere keeps the cache.
PROBE_RULES_VERSION = 1


class ProbeDiskCache:
    """The probe's results (`Probed`) on disk, one JSON line per op signature, in a file named by a digest of
    `cpu_environment()` (CPU model and flags, oneDNN ISA cap, ATen's vectorisation, threads, torch version) and of
    `PROBE_RULES_VERSION` (a change to the probe's rules bumps it and starts a new file). A measurement is a fact
    about this machine's kernels, so a later run finds it instead of running the kernel again (Llama-2-7b's probes
    take tens of seconds on two cores), and a process running beside it finds what the other measured since (`get`).
    Failures are not kept (they may depend on the memory free at the time). Best effort:
    a file it cannot read or write is a cache that finds nothing. Where: `path`; off: `VRAMTRACE_CPU_PROBE_CACHE=off`;
    to clear it, delete the directory."""

    def __init__(self, path: Path | None):
        self.path = path
        self._found: dict[str, Probed] = {}
        self._read_to = 0  # bytes of the file read so far (whole lines)

    @classmethod
    def for_this_machine(cls) -> "ProbeDiskCache":
        where = os.environ.get(PROBE_CACHE_ENV, "")
        if where.lower() == "off":
            return cls(None)
        try:
            base = Path(where) if where else (
                Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vramtrace")
            keyed = {"environment": cpu_environment(), "probe_rules": PROBE_RULES_VERSION}
            digest = hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()[:16]
        except RuntimeError:  # no home directory: no cache
            return cls(None)
        return cls(base / f"cpu-kernels-{digest}.jsonl")

    def _read_new(self) -> None:
        """Read the whole lines written to the file since the last read (by any process)."""
        if self.path is None:
            return
        try:
            with open(self.path, "rb") as f:
                f.seek(self._read_to)
                data = f.read()
        except OSError:
            return
        whole = data[:data.rfind(b"\n") + 1]  # a line still being written is read next time
        self._read_to += len(whole)
        for line in whole.decode("utf-8", errors="replace").splitlines():
            try:
                k, (ws, layouts, note, extrapolated) = json.loads(line)
                self._found[k] = Probed(ws, tuple((i, tuple(shape), tuple(stride), getattr(torch, dtype))
                                                  for i, shape, stride, dtype in layouts),
                                        note=note, extrapolated=extrapolated)
            except (ValueError, TypeError, AttributeError):
                continue  # a line cut short by a process that stopped while writing it

    def get(self, key: tuple) -> Probed | None:
        """The result stored for `key`, or None. A miss reads the file again: another process on this machine may
        have measured it since (`--compile`'s eager comparison runs in a second process, and both trace the
        optimizer's and the loss's ops, and matmuls of the same layouts)."""
        if repr(key) not in self._found:
            self._read_new()
        return self._found.get(repr(key))

    def put(self, key: tuple, found: Probed) -> None:
        if self.path is None or found.failure is not None:
            return
        layouts = [(i, list(shape), list(stride), str(dtype).removeprefix("torch."))
                   for i, shape, stride, dtype in found.layouts]
        line = json.dumps([repr(key), [found.workspace, layouts, found.note, found.extrapolated]])
        self._found[repr(key)] = found
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line + "\n")
        except OSError:
            pass


DISK: dict[str, ProbeDiskCache] = {}  # by (cache setting, thread count)


def disk_cache() -> ProbeDiskCache:
    """This machine's `ProbeDiskCache` under the current `VRAMTRACE_CPU_PROBE_CACHE` and thread count."""
    key = f"{os.environ.get(PROBE_CACHE_ENV, '')}|{torch.get_num_threads()}"
    if key not in DISK:
        DISK[key] = ProbeDiskCache.for_this_machine()
    return DISK[key]
