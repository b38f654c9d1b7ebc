"""The caching-allocator model against the real H100 allocator (../shared/gpu-evidence/README.md, issue 39).

Each snapshot (`torch.cuda.memory._snapshot()` of the measured step, copied into tests/fixtures/gpu_evidence/) holds
the step's requests in order (`device_traces[0]`: alloc / free_completed, requested sizes, addresses) and the
segments at its end. The step made no segment (no `segment_alloc` event) and is a steady one, so its start has the
same segments, with the blocks no event touched allocated and the rest free. Replayed from there, the model must put
every request at the address the real allocator gave it, and reach the README's peak allocated (whole blocks, an
unsplit remainder included) and peak reserved. So a prediction's allocated and reserved figures differ from the real
ones only where its request stream does (sizes, order inside an op, order of the frees), not in the allocator."""

from __future__ import annotations

import gzip
import pickle
from pathlib import Path

import pytest

from vramtrace.analysis.allocator import CachingAllocatorModel, _Block

EVIDENCE = Path(__file__).resolve().parent / "fixtures" / "gpu_evidence"

# README table: real peak allocated (max_memory_allocated) and peak reserved (max_memory_reserved)
REAL = {
    "mha": (777_609_728, 973_078_528),
    "vit": (8_883_683_840, 9_181_331_456),
    "bert": (8_231_135_744, 8_633_974_784),
    "t5": (9_809_859_584, 10_225_713_152),
    "gpt2": (15_777_756_672, 16_523_460_608),
}


def _start_of_step(snapshot) -> CachingAllocatorModel:
    """The model holding the snapshot's segments as the step found them (module docstring)."""
    touched = {e["addr"] for e in snapshot["device_traces"][0]}
    model = CachingAllocatorModel()
    for seg in snapshot["segments"]:
        small, prev = seg["segment_type"] == "small", None
        for b in sorted(seg["blocks"], key=lambda b: b["address"]):
            kept = b["state"] == "active_allocated" and b["address"] not in touched
            block = _Block(b["address"], b["size"], small, allocated=kept, prev=prev)
            if prev is not None:
                if not kept and not prev.allocated:  # free neighbours are one free block
                    prev.size += b["size"]
                    continue
                prev.next = block
            if kept:
                model._live[("before the step", b["address"])] = block
                model.allocated_bytes += b["size"]
            prev = block
        while prev is not None:
            if not prev.allocated:
                model._insert(prev)
            prev = prev.prev
        model.reserved_bytes += seg["total_size"]
        model.num_segments += 1
    model.reset_peaks()
    return model


@pytest.mark.parametrize("case", sorted(REAL))
def test_the_model_replays_the_real_step_at_the_real_addresses(case):
    snapshot = pickle.loads(gzip.decompress((EVIDENCE / f"h100-{case}.pickle.gz").read_bytes()))
    trace = snapshot["device_traces"][0]
    assert not any(e["action"] == "segment_alloc" for e in trace)
    model = _start_of_step(snapshot)
    moved = 0
    for e in trace:
        if e["action"] == "alloc":
            model.malloc(e["addr"], e["size"])
            moved += model._live[e["addr"]].addr != e["addr"]
        elif e["action"] == "free_completed":
            model.free(e["addr"])
    assert moved == 0
    assert (model.peak_allocated_bytes, model.peak_reserved_bytes) == REAL[case]
