"""The caching-allocator model against the rules of c10/cuda/CUDACachingAllocator.cpp, on hand-built traces."""

import pytest

from conftest import FIXTURES
from vramtrace.analysis.allocator import (AllocatorOOM, CachingAllocatorModel, allocation_size, replay_steps,
                                          round_size)
from vramtrace.analysis.liveness import build_timeline

MiB = 1 << 20


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
    from vramtrace.tracer.building import load_model
    from vramtrace.tracer.loading import resolve_config
    from vramtrace.analysis.storages import storage_table
    from vramtrace.tracer.trace import trace_step

    spec = RunSpec(str(FIXTURES / f"{config}.json"), batch=4, seq=64)
    traced = trace_step(spec, load_model(spec, resolve_config(spec.model)))
    rows = storage_table(traced.ops, traced.storages, traced.marks)
    first = build_timeline(traced.ops, rows, 0, traced.counted_devices, 512)
    steady = build_timeline(traced.ops, rows, 1, traced.counted_devices, 512)
    est = replay_steps(first, steady)
    assert est.oom == "" and est.peak_allocated_bytes == steady.peak_bytes
    assert steady.peak_bytes <= est.peak_reserved_bytes and est.peak_reserved_bytes % (2 * MiB) == 0
