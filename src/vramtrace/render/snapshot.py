"""The predicted step in the format of `torch.cuda.memory._snapshot()`, for PyTorch's memory_viz.

Mirrors what `torch/cuda/_memory_viz.py::_profile_to_snapshot` builds from a profile: `device_traces[0]` is the
list of allocator events (`alloc` at a storage's birth step, `free_requested` + `free_completed` after its
death step; storages alive at step start are allocated first), and `segments` holds one segment whose blocks
are the storages alive when the step ends plus one inactive block for the rest. Addresses are assigned by a
bump allocator in 512 B blocks (the prediction has no allocator addresses), so segment views show sizes, not
the caching allocator's placement.
"""

from __future__ import annotations

import pickle

from ..report.summary import MemoryReport
from .json_report import write_output

_BASE_ADDRESS = 0x7F0000000000
_ALIGN = 512  # c10/cuda/CUDACachingAllocator.cpp kMinBlockSize


def snapshot_of(report: MemoryReport) -> dict:
    """The snapshot dict (`segments`, `device_traces`) of the report's steady-state timeline."""
    addr, events, births, deaths, alive_at_end = _BASE_ADDRESS, [], {}, {}, []
    address = {}
    for t in report.tensors:
        address[t.id] = addr
        addr += -(-max(t.bytes, 1) // _ALIGN) * _ALIGN
        births.setdefault(t.birth, []).append(t)
        deaths.setdefault(t.death, []).append(t)

    def frames(t):
        return [{"filename": t.module or "(root)", "line": t.birth, "name": t.op or t.name or "exists at start"}]

    last = report.num_steps - 1
    for step in range(report.num_steps):
        for t in births.get(step, ()):
            events.append({"action": "alloc", "addr": address[t.id], "size": t.bytes, "stream": 0,
                           "frames": frames(t), "category": t.category, "time_us": step})
        for t in deaths.get(step, ()):
            if step == last:
                alive_at_end.append(t)
                continue
            for action in ("free_requested", "free_completed"):
                events.append({"action": action, "addr": address[t.id], "size": t.bytes, "stream": 0,
                               "frames": frames(t), "time_us": step})
    total = addr - _BASE_ADDRESS
    blocks = [{"address": address[t.id], "size": t.bytes, "requested_size": t.bytes, "state": "active_allocated",
               "frames": frames(t)} for t in alive_at_end]
    used = sum(b["size"] for b in blocks)
    if total > used:
        blocks.append({"address": addr, "size": total - used, "requested_size": 0, "state": "inactive", "frames": []})
    segment = {"device": 0, "address": _BASE_ADDRESS, "total_size": total, "allocated_size": used,
               "active_size": used, "requested_size": used, "stream": 0, "segment_type": "large", "blocks": blocks}
    return {"segments": [segment], "device_traces": [events]}


def write_snapshot(report: MemoryReport, path: str) -> None:
    """Pickle the snapshot to `path` ('-' for stdout), as `torch.cuda.memory._dump_snapshot` does. Raises
    ReportWriteError."""
    write_output(path, pickle.dumps(snapshot_of(report)), "--snapshot")
