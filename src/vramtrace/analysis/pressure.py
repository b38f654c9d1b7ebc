"""Whether a step fits a CUDA device: the caching-allocator replay with the device's real capacity.

Near capacity PyTorch's allocator does not fail at the first cudaMalloc that finds no memory: c10/cuda/
CUDACachingAllocator.cpp `DeviceCachingAllocator::malloc` calls `alloc_block`, and when cudaMalloc fails,
`release_available_cached_blocks` (only with max_split_size set) then `release_cached_blocks` (cudaFree of every
cached block that is a whole segment, after `synchronize_and_free_events`) and `alloc_block(..., isRetry=true)`,
which counts `num_alloc_retries`; only when that fails too is it an OutOfMemoryError. So a step whose unbounded
replay reserves more than the device holds may still run, its reserved bytes kept under the capacity by those
releases; and one whose allocated bytes fit may still fail, its free memory split across segments that hold a
live block. The criterion is the replay under the capacity (`analysis.allocator`, whose `_new_block` mirrors that
path): it fits iff the first and the steady step replay without an out-of-memory. Peak allocated above the capacity
is a certain failure (a lower bound on what the device must hold), checked first.
"""

from __future__ import annotations

from dataclasses import dataclass

from .allocator import ReplaySchedule, ReservedEstimate


@dataclass(frozen=True, slots=True)
class CapacityVerdict:
    """The replay of a first and a steady step under `capacity_bytes` (what cudaMalloc may take: the device's
    usable total less the CUDA context and any headroom kept). Bytes are ints.

    fits: neither step ran out of memory.
    peak_reserved_bytes, peak_allocated_bytes: the steady step's peaks under the capacity (up to the failure when
        it does not fit); reserved <= capacity always.
    headroom_bytes: capacity - peak_reserved_bytes, the device memory the step never touched (0 <= it when it fits).
    alloc_retries: cache releases the steady step needs (each a device synchronization and a cudaFree of every
        whole cached segment, then a retried cudaMalloc): what every step of a training loop pays.
    first_step_alloc_retries: those of the first step (once).
    estimate: the bounded replay (its `oom`, `oom_sid`, `oom_step`, `oom_state` name the failure).
    """

    fits: bool
    capacity_bytes: int
    peak_reserved_bytes: int
    peak_allocated_bytes: int
    headroom_bytes: int
    alloc_retries: int
    first_step_alloc_retries: int
    estimate: ReservedEstimate


def replay_at_capacity(first, steady, capacity_bytes: int, conf=None,
                       unbounded: ReservedEstimate | None = None) -> CapacityVerdict:
    """The verdict of a first then a steady step (`liveness.Timeline`s of one recording, CUDA block rounding
    applied) on a device whose allocator may reserve `capacity_bytes`, `conf` the `device.AllocConf`.

    `unbounded`, the same replay without a capacity (`allocator.replay_steps`), saves the work when it never
    reserves more than the capacity: reserved bytes only grow without a release, so no cudaMalloc failed and the
    bounded replay is the same. The first step's retries come from replaying it alone (the same events, so the
    same state)."""
    if unbounded is not None and unbounded.peak_reserved_bytes <= capacity_bytes:
        est = unbounded
    else:
        schedule = ReplaySchedule.of(first, steady)
        sizes = {lt.sid: lt.bytes for tl in (first, steady) for lt in tl.lifetimes}
        nbytes = [sizes[sid] for sid in schedule.sids]
        est = schedule.replay(nbytes, capacity_bytes, conf)
        if est.alloc_retries:
            alone = ReplaySchedule(schedule.sids, schedule.steps[:1], schedule.ends[:1])
            first_retries = alone.replay(nbytes, capacity_bytes, conf).alloc_retries
            return _verdict(est, capacity_bytes, first_retries)
    return _verdict(est, capacity_bytes, 0)


def _verdict(est: ReservedEstimate, capacity_bytes: int, first_retries: int) -> CapacityVerdict:
    steady_retries = est.alloc_retries - first_retries if est.oom_step != "first" else 0
    return CapacityVerdict(not est.oom, capacity_bytes, est.peak_reserved_bytes, est.peak_allocated_bytes,
                           capacity_bytes - est.peak_reserved_bytes, steady_retries, first_retries, est)
