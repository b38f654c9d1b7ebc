"""The caching-allocator model against the rules of c10/cuda/CUDACachingAllocator.cpp, on hand-built traces."""

import gzip
import json
from pathlib import Path

import pytest

from conftest import FIXTURES
from seam import recording, step_tables
from vramtrace.analysis.allocator import (AllocatorOOM, CachingAllocatorModel, ExpandableSegmentsModel,
                                          allocation_size, replay_steps, round_size)
from vramtrace.analysis.categories import Category
from vramtrace.analysis.liveness import Lifetime, Timeline, build_timeline

MiB = 1 << 20
EVIDENCE = Path(__file__).parent / "fixtures" / "gpu_evidence"
# shared/gpu-evidence/README.md, first table (real H100 run, torch 2.11): real peak allocated and real peak reserved
# of the rows `gpt2 --batch 8 --seq 1024 --precision fp32`, `bert-base-uncased --task sequence-classification
# --batch 32 --seq 512 --precision fp16-mixed` and `mha_model.py:MHANet --batch 8 --seq 2048 --precision fp32`
REAL = {"gpt2": (15_777_756_672, 16_523_460_608), "bert": (8_231_135_744, 8_633_974_784),
        "mha": (777_609_728, 973_078_528), "vit": (8_883_683_840, 9_181_331_456),
        "t5": (9_809_859_584, 10_225_713_152)}


def timeline(lifetimes: list[Lifetime], steps: int) -> Timeline:
    """A Timeline of `steps` graph steps holding `lifetimes` (its live-bytes curve summed from them)."""
    live = [sum(lt.bytes for lt in lifetimes if lt.birth <= i <= lt.death) for i in range(steps)]
    peak = max(range(steps), key=lambda i: (live[i], -i))
    return Timeline(tuple(range(steps)), ("forward",) * steps, tuple(lifetimes), tuple(live), tuple(live),
                    sum(lt.bytes for lt in lifetimes if lt.at_start), live[peak], peak)


def test_round_size_and_segment_sizes():
    assert [round_size(n) for n in (1, 512, 513, 1000)] == [512, 512, 1024, 1024]
    assert allocation_size(512) == allocation_size(MiB) == 2 * MiB  # small pool: 2 MiB segments
    assert allocation_size(MiB + 512) == allocation_size(10 * MiB - 512) == 20 * MiB  # below 10 MiB: 20 MiB
    assert allocation_size(10 * MiB) == 10 * MiB and allocation_size(11 * MiB + 1) == 12 * MiB  # 2 MiB rounding


def test_small_requests_share_a_segment_until_it_is_full():
    a = CachingAllocatorModel()
    for i in range(4):
        a.malloc(i, 512 * 1024)  # four 512 KiB requests fill one 2 MiB small segment
    assert (a.reserved_bytes, a.num_segments, a.allocated_bytes) == (2 * MiB, 1, 2 * MiB)
    a.malloc("x", 100)
    assert (a.reserved_bytes, a.num_segments) == (4 * MiB, 2)


def test_mid_sized_requests_split_a_20mib_segment():
    a = CachingAllocatorModel()
    a.malloc("a", 3 * MiB)
    a.malloc("b", 5 * MiB)
    a.malloc("c", 10 * MiB)  # best fit: the 12 MiB left in the segment; 2 MiB > 1 MiB is split off again
    assert (a.reserved_bytes, a.num_segments, a.allocated_bytes) == (20 * MiB, 1, 18 * MiB)


def test_freed_neighbours_merge_and_are_reused_best_fit():
    a = CachingAllocatorModel()
    for k in "abc":
        a.malloc(k, 4 * MiB)
    a.free("a")
    a.free("b")  # merges with a: one free 8 MiB block, plus the 8 MiB tail of the segment after c
    a.malloc("d", 7 * MiB)
    assert a.reserved_bytes == 20 * MiB and a.num_segments == 1


def test_a_remainder_of_at_most_1mib_is_not_split_off():
    a = CachingAllocatorModel()
    a.malloc("a", 2 * MiB)
    a.free("a")  # the whole 20 MiB segment is free again
    a.malloc("b", 19 * MiB + 512 * 1024)  # 512 KiB would remain: not split, the block is handed out whole
    assert a.allocated_bytes == 20 * MiB and a.reserved_bytes == 20 * MiB


def test_a_full_device_releases_the_cache_then_ooms():
    a = CachingAllocatorModel(capacity_bytes=40 * MiB)
    a.malloc("a", 15 * MiB)  # a 16 MiB segment
    a.free("a")
    a.malloc("b", 30 * MiB)  # 16 + 30 > 40: release the free 16 MiB segment, retry
    assert a.num_alloc_retries == 1 and a.reserved_bytes == 30 * MiB and a.peak_reserved_bytes == 30 * MiB
    with pytest.raises(AllocatorOOM):
        a.malloc("c", 12 * MiB)


def test_max_split_size_keeps_oversize_blocks_for_large_requests():
    a = CachingAllocatorModel(max_split_size=8 * MiB)
    a.malloc("big", 30 * MiB)
    a.free("big")
    a.malloc("small", 2 * MiB)  # may not take the cached 30 MiB block
    assert a.num_segments == 2 and a.reserved_bytes == 50 * MiB


@pytest.mark.parametrize("config", ["tiny-gpt2", "tiny-llama-gqa", "tiny-bert"])
def test_replay_of_a_traced_step_reproduces_its_allocated_peak(config):
    from vramtrace import RunSpec
    from vramtrace.analysis.storages import storage_table

    spec = RunSpec(str(FIXTURES / f"{config}.json"), batch=4, seq=64)
    traced = recording(spec)
    rows = storage_table(traced.ops, traced.storages, traced.marks)
    first = build_timeline(traced.ops, rows, 0, traced.counted_devices, 512)
    steady = build_timeline(traced.ops, rows, 1, traced.counted_devices, 512)
    est = replay_steps(first, steady)
    assert est.oom == "" and est.peak_allocated_bytes == steady.peak_bytes
    assert steady.peak_bytes <= est.peak_reserved_bytes and est.peak_reserved_bytes % (2 * MiB) == 0


def test_an_unsplit_remainder_counts_as_allocated():
    """CUDACachingAllocator.cpp `should_split`: a large-pool block whose rest would be at most kSmallSize (1 MiB)
    is handed out whole, and `alloc_found_block` adds `block->size` to allocated_bytes: the GPT-2 snapshot's
    2,359,296 B weight in a 3 MiB block."""
    a = CachingAllocatorModel()
    a.malloc("a", 3 * MiB)
    a.malloc("b", 5 * MiB)  # one 20 MiB segment: a, b, 12 MiB free
    a.free("a")
    a.malloc("c", 2_359_296)  # best fit: a's free 3 MiB block; 786,432 B would remain: not split
    assert a.allocated_bytes == 8 * MiB and a.remainder_bytes == 3 * MiB - 2_359_296
    assert a.peak_allocated_bytes == 8 * MiB and a.peak_remainder_bytes == 0  # the peak was first reached by a, b
    a.malloc("d", 10 * MiB + 512)  # the 12 MiB free block: 2 MiB - 512 B > 1 MiB remains, split off
    assert a.remainder_bytes == 786_432 and a.allocated_bytes == 18 * MiB + 512
    assert a.peak_allocated_bytes == 18 * MiB + 512 and a.peak_remainder_bytes == 786_432
    a.free("c")
    assert a.remainder_bytes == 0 and a.allocated_bytes == 15 * MiB + 512
    small = CachingAllocatorModel()
    small.malloc("s", 1000)  # small pool: any rest of 512 B or more is split off
    assert small.allocated_bytes == 1024 and small.remainder_bytes == 0


def test_replay_peak_allocated_holds_the_remainders_and_their_step():
    """`replay_steps` on hand-built timelines: the steady step's peak allocated is the timeline's live bytes at
    the replay's peak step plus the unsplit remainders then (a 3 MiB block held by a 2.25 MiB storage)."""
    first = [Lifetime(1, 3 * MiB, 0, 0, Category.TEMPORARY), Lifetime(2, 5 * MiB, 0, 2, Category.TEMPORARY),
             Lifetime(3, 2_359_296, 1, 2, Category.OPTIMIZER_STATE, outlives_step=True)]
    steady = [Lifetime(3, 2_359_296, 0, 2, Category.OPTIMIZER_STATE, outlives_step=True, at_start=True),
              Lifetime(4, 4 * MiB, 1, 1, Category.TEMPORARY), Lifetime(5, 2 * MiB, 2, 2, Category.TEMPORARY)]
    t1, t2 = timeline(first, 3), timeline(steady, 3)
    est = replay_steps(t1, t2)
    # the first step: a 3 MiB then b 5 MiB in one 20 MiB segment; a freed; the state takes a's 3 MiB whole
    assert est.first_peak_allocated_bytes == 8 * MiB and t1.peak_bytes == 5 * MiB + 3 * MiB
    # steady: the state's 3 MiB block, then 4 MiB (step 1), then 2 MiB (step 2): peak at step 1
    assert (est.peak_allocated_bytes, est.peak_step, est.peak_remainder_bytes) == (7 * MiB, 1, 786_432)
    assert est.peak_allocated_bytes == t2.live_bytes[est.peak_step] + est.peak_remainder_bytes
    assert t2.peak_bytes == 7 * MiB - 786_432


def test_expandable_best_fit_takes_the_free_tail_last():
    """CUDACachingAllocator.cpp `get_free_block` with expandable segments: a block followed by unmapped address
    space counts as `expandable_size` (its size plus that space), so the segment's free tail is taken only when no
    other free block fits; the 5 MiB request then maps a new 20 MiB page."""
    a = ExpandableSegmentsModel()
    a.malloc("x", 6 * MiB)  # maps one 20 MiB page: x, 14 MiB free tail
    a.malloc("y", 10 * MiB)
    a.malloc("z", 2 * MiB)  # the tail: 2 MiB left
    a.free("x")  # free: x's 6 MiB, the 2 MiB tail
    a.malloc("w", 1536 * 1024)  # best fit would be the tail; it takes 1.5 MiB of x's block instead
    a.malloc("v", 5 * MiB)  # 4.5 MiB and the 2 MiB tail are free: grows the tail by a page
    assert a.reserved_bytes == 40 * MiB and a.num_segments == 1
    a.free("v")
    a.malloc("u", 2 * MiB)  # a 2 MiB free block before the tail fits: the tail stays
    assert a.reserved_bytes == 40 * MiB


@pytest.mark.parametrize("name", sorted(REAL))
def test_a_real_h100_step_replays_exactly(name):
    """The measured step of an H100 snapshot (tests/fixtures/gpu_evidence, extracted by its extract.py) replayed
    from the state the snapshot ends in (a steady step starts where the previous one ended): every allocation
    lands at the address the real allocator chose (best fit, splitting, merging as modelled), and the peaks are
    the run's max_memory_allocated() and max_memory_reserved(); the remainders are the peak's excess over the
    requests (the snapshot's `requested_size`s, block-rounded)."""
    data = json.loads(gzip.open(EVIDENCE / f"h100-{name}.json.gz", "rt").read())
    sim = CachingAllocatorModel.from_segments(data["segments"])
    requests = {s["address"] + sum(b[0] for b in s["blocks"][:i]): round_size(blk[2])
                for s in data["segments"] for i, blk in enumerate(s["blocks"]) if blk[1]}
    held = sum(requests.values())
    assert sim.remainder_bytes == 0  # from_segments has no requests: every block counts as requested whole
    start, rest_at_start = sim.allocated_bytes, sim.allocated_bytes - held
    peak_requests = held
    for action, addr, size in data["trace"]:
        if action == "alloc":
            sim.malloc(addr, size)
            assert sim.address(addr) == addr
            requests[addr] = round_size(size)
            held += requests[addr]
            if sim.allocated_bytes == sim.peak_allocated_bytes:
                peak_requests = held
        elif action == "free_completed":
            sim.free(addr)
            held -= requests.pop(addr)
    assert (sim.peak_allocated_bytes, sim.peak_reserved_bytes) == REAL[name]
    assert sim.allocated_bytes == start
    assert sim.peak_allocated_bytes - peak_requests == rest_at_start + sim.peak_remainder_bytes


# the fit boundary's runs (gpu_check --real-only on an H100 80GB HBM3, benchmarks/gpu_evidence/
# h100-2026-11-26-gpu_check.json): batch -> (max_memory_reserved() over the run, segments cudaFree'd by cache
# releases, as the snapshot's segment_free events count them); the capacity cudaMalloc had: the device's total less
# the CUDA context the runs measured
FIT_RUNS = {21: (81_319_165_952, 0), 22: (82_497_765_376, 3), 23: (82_443_239_424, 0)}
FIT_CAPACITY = 85_017_493_504 - 804_061_184


@pytest.mark.parametrize("batch", sorted(FIT_RUNS))
def test_the_fit_boundarys_real_runs_replay_exactly_under_the_capacity(batch):
    """The whole real run near capacity (Llama-2-7b dims, 4 layers, bf16-mixed AdamW, seq 2048: model build, three
    steps; its allocator history from the start, extracted by extract.py) replayed from an empty allocator with the
    real capacity (each new segment at the address cudaMalloc gave): every block at the real address, cudaMalloc
    failing where the real one did and the cache released (`release_cached_blocks`) as often, the segments held at
    the end the real ones; the peak reserved is the run's. Batch 22 needed a release (3 segments freed); 23, whose
    sizes fall otherwise, fit without one."""
    data = json.loads(gzip.open(EVIDENCE / f"h100-fit-{batch}.json.gz", "rt").read())
    sim = CachingAllocatorModel(capacity_bytes=FIT_CAPACITY)
    for action, addr, size in data["trace"]:
        if action == "segment_alloc":
            # cudaMalloc's address (the model places a new segment just below `_next_addr`): best fit breaks
            # ties between equal blocks by address
            sim._next_addr = addr + size
        elif action == "alloc":
            sim.malloc(addr, size)
            assert sim.address(addr) == addr
        elif action == "free_completed":
            sim.free(addr)
    reserved, released = FIT_RUNS[batch]
    assert sim.peak_reserved_bytes == reserved
    assert sim.num_alloc_retries == (1 if released else 0)
    assert sum(1 for a, *_ in data["trace"] if a == "segment_free") == released
    assert sim.reserved_bytes == sum(s["total_size"] for s in data["segments"])  # the snapshot's last segments
    assert sim.num_segments == len(data["segments"])


def test_peak_reserved_is_the_runs_when_the_cache_was_released():
    """The measurement's truth is max_memory_reserved() over the whole run (shared/gpu-evidence/README.md: "first
    steps included"); a first step that released the cache (`release_cached_blocks` after a failed cudaMalloc)
    reserved more than the steady step ever holds again."""
    first = [Lifetime(1, 35 * MiB, 0, 0, Category.TEMPORARY), Lifetime(2, 3 * MiB, 0, 0, Category.TEMPORARY),
             Lifetime(3, 38 * MiB, 1, 1, Category.TEMPORARY)]
    steady = [Lifetime(4, 38 * MiB, 0, 0, Category.TEMPORARY)]
    # 36 MiB and 20 MiB segments, freed; 38 MiB fits neither and 56 + 38 > 60 MiB: both released, then a 38 MiB
    # segment, which the steady step reuses
    est = replay_steps(timeline(first, 2), timeline(steady, 1), capacity_bytes=60 * MiB)
    assert est.alloc_retries == 1 and est.oom == ""
    assert est.peak_reserved_bytes == 56 * MiB and est.peak_allocated_bytes == 38 * MiB


def test_cublas_workspaces_are_born_at_their_threads_first_gemm():
    """CublasHandlePool.cpp: a (handle, stream)'s workspace is allocated on its first use, so through the caching
    allocator at the first GEMM of the forward thread and of autograd's thread in the first step (where a cached
    free block may hold it); in the steady step both are alive from the start."""
    from vramtrace import RunSpec
    from vramtrace.analysis.device import GEMM_OPS

    spec = RunSpec(str(FIXTURES / "tiny-llama-gqa.json"), batch=2, seq=32, gpu="H100-80GB")
    tables = step_tables(spec)
    ops = tables.traced.ops
    rows = [s for s in tables.table if s.category is Category.CUBLAS_WORKSPACE]
    assert [(ops[s.op_index].step, s.phase) for s in rows] == [(0, "forward"), (0, "backward")]
    for s in rows:
        assert ops[s.op_index].name.rsplit(".", 1)[0] in GEMM_OPS and s.free_after is None
        earlier = [o for o in ops[:s.op_index] if o.name.rsplit(".", 1)[0] in GEMM_OPS]
        assert all(str(o.phase) != s.phase for o in earlier)  # no GEMM of that thread before it
    steady = {lt.sid: lt for lt in tables.timeline().lifetimes}
    assert all(steady[s.sid].at_start and steady[s.sid].outlives_step for s in rows)


def test_a_reports_peak_allocated_holds_the_unsplit_remainders(tmp_path):
    """A CUDA target's peak allocated is the replay's: with a vocabulary of 47,200 × 64 fp32 (12,083,200 B, the
    embedding, its gradient and AdamW states, and the logits of 2 × 32 tokens), each such request gets a 12 MiB
    segment (`get_allocation_size`: 2 MiB rounding) whose 499,712 B rest, at most kSmallSize, is not split off
    (`should_split`) and counts as allocated. The breakdown, the JSON and the trace events say so."""
    from vramtrace import RunSpec, analyze
    from vramtrace.render.trace_events import trace_events_of

    cfg = json.loads((FIXTURES / "tiny-gpt2.json").read_text())
    path = tmp_path / "gpt2-47200.json"
    path.write_text(json.dumps({**cfg, "vocab_size": 47_200}))
    r = analyze(RunSpec(str(path), batch=2, seq=32, gpu="H100-80GB"), levers=False)
    rest = r.breakdown_at_peak[Category.ALLOCATOR_REMAINDER.value]
    assert rest > 0 and rest % 499_712 == 0 and rest == r.allocator.unsplit_remainder_bytes_at_peak
    assert sum(r.breakdown_at_peak.values()) == r.peak_allocated_bytes == r.allocator.peak_allocated_bytes
    live = sum(t.bytes for t in r.tensors if t.birth <= r.peak_step <= t.death)
    assert r.peak_allocated_bytes == live + rest >= r.allocator.rounded_requests_peak_bytes
    totals = [e["args"]["bytes"] for e in trace_events_of(r)["traceEvents"] if e.get("name") == "total allocated"]
    assert max(totals) == r.peak_allocated_bytes
    cpu = analyze(RunSpec(str(path), batch=2, seq=32, device="cpu"), levers=False)
    assert cpu.breakdown_at_peak[Category.ALLOCATOR_REMAINDER.value] == 0
