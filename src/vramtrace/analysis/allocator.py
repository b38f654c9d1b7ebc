"""A model of PyTorch's CUDA caching allocator, for peak *reserved* memory (what `max_memory_reserved()` and,
plus the CUDA context, nvidia-smi show; what an OOM is about).

Mirrors `c10/cuda/CUDACachingAllocator.cpp` (DeviceCachingAllocator), default configuration:

- `round_size`: requests round up to a multiple of kMinBlockSize = 512 B (at least 512 B).
- `get_pool`: requests of at most kSmallSize = 1 MiB go to the small pool, larger ones to the large pool.
- `get_allocation_size`: a new segment (cudaMalloc) is kSmallBuffer = 2 MiB for the small pool,
  kLargeBuffer = 20 MiB for requests below kMinLargeAlloc = 10 MiB, else the request rounded up to
  kRoundLarge = 2 MiB.
- `get_free_block`: best fit, the smallest cached block of the pool at least as large (ties: lowest address);
  with `max_split_size`, blocks at least that large are not used for smaller requests, and a large request
  takes an oversize block only if it wastes less than kLargeBuffer.
- `should_split`: the found block is split when the rest is at least 512 B (small pool) or more than 1 MiB
  (large pool, and the request below `max_split_size`); the request takes the block's front. Unsplit, the
  request holds the whole block, and `memory_allocated()` counts it whole (`alloc_found_block`: `allocated_bytes`
  grows by `block->size`, not by the request): the model keeps these unsplit remainders apart
  (`remainder_bytes`), so that a report can show them as their own line.
- `free_block` / `try_merge_blocks`: a freed block merges with free neighbours of its segment.
- `malloc`: when no cached block fits and cudaMalloc fails (the device is full), `release_cached_blocks`
  frees every fully free segment and the allocation is retried once; then it is an OOM.

With `expandable_segments:True` (`ExpandableSegmentsModel`, from the same file's ExpandableSegment and Note
[Expandable Segments]): each pool is one segment that grows by mapping pages (2 MiB for the small pool, 20 MiB
for the large one) after its free tail, only the bytes missing, rounded up to whole pages; any remainder of at
least 512 B is split off (`should_split`); pages stay mapped until `empty_cache()`. Best fit counts the segment's
free tail as large as it can grow (`get_free_block`, `expandable_size`): the tail is taken only when no other free
block of the pool fits.

Not modelled: with max_split_size, `release_available_cached_blocks` (freeing oversize cached blocks before all
of them); what the real run allocates before its first step (the model built on the GPU); streams other than
the default one, garbage-collection threshold (it acts only under a per-process memory fraction below 1), CUDA
graphs' private pools, the addresses cudaMalloc really returns (each new segment is placed below the previous
ones, as the H100 mostly placed them), and, with expandable segments, the unmapping of free pages on the retry
after a failed allocation (the model fails there instead: an over-estimate, never an under-estimate).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

K_MIN_BLOCK_SIZE = 512  # kMinBlockSize
K_SMALL_SIZE = 1 << 20  # kSmallSize: largest "small" allocation, 1 MiB
K_SMALL_BUFFER = 2 << 20  # kSmallBuffer: small-pool segment size, 2 MiB
K_LARGE_BUFFER = 20 << 20  # kLargeBuffer: segment size for requests below kMinLargeAlloc, 20 MiB
K_MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc: 10 MiB
K_ROUND_LARGE = 2 << 20  # kRoundLarge: larger segments round up to 2 MiB


def round_size(nbytes: int) -> int:
    """CUDACachingAllocator.cpp `round_size` (no roundup_power2_divisions)."""
    if nbytes < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    return K_MIN_BLOCK_SIZE * ((nbytes + K_MIN_BLOCK_SIZE - 1) // K_MIN_BLOCK_SIZE)


def allocation_size(size: int) -> int:
    """CUDACachingAllocator.cpp `get_allocation_size`: the cudaMalloc size for a rounded request."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return K_ROUND_LARGE * ((size + K_ROUND_LARGE - 1) // K_ROUND_LARGE)


class AllocatorOOM(Exception):
    """The modelled device ran out of memory: str(e) says for which request; `key` is the request's key,
    `nbytes` its size, `reserved_bytes`/`allocated_bytes` the allocator's state when it failed."""

    def __init__(self, key, nbytes: int, reserved_bytes: int, allocated_bytes: int, capacity_bytes: int | None):
        super().__init__(f"{nbytes} B requested; {reserved_bytes} B reserved, {allocated_bytes} B allocated of "
                         f"{capacity_bytes} B")
        self.key, self.nbytes = key, nbytes
        self.reserved_bytes, self.allocated_bytes = reserved_bytes, allocated_bytes


@dataclass(eq=False)
class _Block:
    addr: int
    size: int
    small: bool
    allocated: bool = False
    prev: "_Block | None" = None
    next: "_Block | None" = None


@dataclass
class CachingAllocatorModel:
    """Replay allocations and frees. `capacity_bytes`: device memory cudaMalloc may use (None: unlimited).
    `max_split_size`: PYTORCH_CUDA_ALLOC_CONF max_split_size_mb, in bytes (None: unlimited, the default)."""

    capacity_bytes: int | None = None
    max_split_size: int | None = None
    allocated_bytes: int = 0
    reserved_bytes: int = 0
    peak_allocated_bytes: int = 0
    peak_reserved_bytes: int = 0
    num_segments: int = 0
    num_alloc_retries: int = 0
    remainder_bytes: int = 0  # of allocated_bytes: unsplit block remainders (block size less the rounded request)
    peak_remainder_bytes: int = 0  # remainder_bytes when allocated_bytes last reached its peak
    _rest: dict = field(default_factory=dict)  # key -> its block's unsplit remainder
    _pools: dict = field(default_factory=lambda: {True: [], False: []})  # small? -> sorted [(size, addr, block)]
    _live: dict = field(default_factory=dict)  # key -> block
    # the address of the last segment: each new segment goes below it. cudaMalloc's addresses decide best fit's
    # ties (equal free blocks: the lowest address wins); on the H100 of issue 39 most new segments came below the
    # earlier ones (258 of 297 in a generation, 115 of 123 in a training run: gpu_check --snapshot), and the
    # replay of those runs' requests gives their reserved bytes exactly (or within 0.08%) this way, not upwards
    _next_addr: int = 1 << 48

    @classmethod
    def from_segments(cls, segments, **kw) -> "CachingAllocatorModel":
        """The allocator holding `segments`, as a memory snapshot lists them (`torch.cuda.memory._snapshot()`
        'segments': address, total_size, segment_type 'small' or 'large', blocks in address order); each block
        given as (size, allocated?, ...). An allocated block's key is its address. Peaks start at the current
        state."""
        sim = cls(**kw)
        for seg in segments:
            addr, prev, small = seg["address"], None, seg["segment_type"] == "small"
            sim.reserved_bytes += seg["total_size"]
            sim.num_segments += 1
            for size, allocated, *_ in seg["blocks"]:
                block = _Block(addr, size, small, allocated, prev)
                if prev is not None:
                    prev.next = block
                if allocated:
                    sim._live[addr] = block
                    sim.allocated_bytes += size
                else:
                    sim._insert(block)
                prev, addr = block, addr + size
        sim.reset_peaks()
        return sim

    def address(self, key) -> int:
        """The address of `key`'s block."""
        return self._live[key].addr

    def reset_peaks(self) -> None:
        """As `torch.cuda.reset_peak_memory_stats()`."""
        self.peak_allocated_bytes, self.peak_reserved_bytes = self.allocated_bytes, self.reserved_bytes
        self.peak_remainder_bytes = self.remainder_bytes

    def malloc(self, key, nbytes: int) -> None:
        """Allocate `nbytes` for `key`. Raises AllocatorOOM."""
        size = round_size(nbytes)
        small = size <= K_SMALL_SIZE
        block = self._find(small, size)
        if block is None:
            block = self._new_block(key, nbytes, small, size)
        if self._should_split(block, size):
            self._split(block, size)
        block.allocated = True
        self._live[key] = block
        self.allocated_bytes += block.size
        if block.size > size:
            self._rest[key] = block.size - size
            self.remainder_bytes += block.size - size
        if self.allocated_bytes > self.peak_allocated_bytes:
            self.peak_allocated_bytes, self.peak_remainder_bytes = self.allocated_bytes, self.remainder_bytes

    def _new_block(self, key, nbytes: int, small: bool, size: int) -> _Block:
        """A new segment (cudaMalloc of `get_allocation_size`), after releasing the cache once when the device is
        full (`alloc_block`, then `release_cached_blocks` and retry). Raises AllocatorOOM."""
        seg = allocation_size(size)
        if not self._cuda_malloc(seg):
            self.num_alloc_retries += 1
            self._release_cached()
            if not self._cuda_malloc(seg):
                raise AllocatorOOM(key, nbytes, self.reserved_bytes, self.allocated_bytes, self.capacity_bytes)
        self._next_addr -= seg  # below the previous segments: see `_next_addr`
        block = _Block(self._next_addr, seg, small)
        self.num_segments += 1
        return block

    def _split(self, block: _Block, size: int) -> _Block:
        """Split `block` after its first `size` bytes; the free rest joins the pool. Returns the rest."""
        rest = _Block(block.addr + size, block.size - size, block.small, prev=block, next=block.next)
        if block.next is not None:
            block.next.prev = rest
        block.next, block.size = rest, size
        self._insert(rest)
        return rest

    def free(self, key) -> None:
        """Free `key`'s block back to its pool, merging it with free neighbours (`free_block`)."""
        block = self._live.pop(key)
        block.allocated = False
        self.allocated_bytes -= block.size
        self.remainder_bytes -= self._rest.pop(key, 0)
        for other in (block.prev, block.next):
            if other is not None and not other.allocated:
                self._remove(other)
                if other is block.prev:
                    block.addr, block.prev = other.addr, other.prev
                    if other.prev is not None:
                        other.prev.next = block
                else:
                    block.next = other.next
                    if other.next is not None:
                        other.next.prev = block
                block.size += other.size
        self._insert(block)

    # -- internals ---------------------------------------------------------------------------------------
    def _cuda_malloc(self, seg: int) -> bool:
        if self.capacity_bytes is not None and self.reserved_bytes + seg > self.capacity_bytes:
            return False
        self.reserved_bytes += seg
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)
        return True

    def _find(self, small: bool, size: int) -> _Block | None:
        pool = self._pools[small]
        i = self._best(pool, size)
        if i == len(pool):
            return None
        block = pool[i][2]
        mss = self.max_split_size
        if mss is not None and ((size < mss <= block.size) or (size >= mss and block.size >= size + K_LARGE_BUFFER)):
            return None
        del pool[i]
        return block

    def _best(self, pool: list, size: int) -> int:
        """`get_free_block`'s `lower_bound`: the index in `pool` of the smallest free block of at least `size`
        bytes (ties: lowest address), len(pool) when none."""
        return bisect.bisect_left(pool, (size, -1))

    def _should_split(self, block: _Block, size: int) -> bool:
        remaining = block.size - size
        if block.small:
            return remaining >= K_MIN_BLOCK_SIZE
        return (self.max_split_size is None or size < self.max_split_size) and remaining > K_SMALL_SIZE

    def _insert(self, block: _Block) -> None:
        bisect.insort(self._pools[block.small], (block.size, block.addr, block))

    def _remove(self, block: _Block) -> None:
        pool = self._pools[block.small]
        i = bisect.bisect_left(pool, (block.size, block.addr))
        assert pool[i][2] is block
        del pool[i]

    def _release_cached(self) -> None:
        """`release_cached_blocks`: cudaFree every cached block that is a whole segment."""
        for small, pool in self._pools.items():
            keep = []
            for size, addr, block in pool:
                if block.prev is None and block.next is None:
                    self.reserved_bytes -= size
                    self.num_segments -= 1
                else:
                    keep.append((size, addr, block))
            self._pools[small] = keep


@dataclass
class ExpandableSegmentsModel(CachingAllocatorModel):
    """`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`: one growing segment per pool (see the module
    docstring). Same interface as `CachingAllocatorModel`."""

    _tail: dict = field(default_factory=lambda: {True: None, False: None})  # small? -> last block of the segment

    def _should_split(self, block: _Block, size: int) -> bool:
        return block.size - size >= K_MIN_BLOCK_SIZE  # should_split with expandable segments

    def _best(self, pool: list, size: int) -> int:
        """`get_free_block` with expandable segments: best fit, where the segment's free tail counts as the size it
        can expand to (`expandable_size`: its size plus the unmapped address space after it, 1.125 × the device's
        memory), so a request takes the next larger free block when there is one, the tail only when none fits."""
        i = bisect.bisect_left(pool, (size, -1))
        if i + 1 < len(pool) and pool[i][2] is self._tail[pool[i][2].small]:
            i += 1
        return i

    def _split(self, block: _Block, size: int) -> _Block:
        rest = super()._split(block, size)
        if self._tail[block.small] is block:
            self._tail[block.small] = rest
        return rest

    def free(self, key) -> None:
        block = self._live[key]
        super().free(key)  # merges free neighbours into `block`: the last block of the segment when next is None
        if block.next is None:
            self._tail[block.small] = block

    def _new_block(self, key, nbytes: int, small: bool, size: int) -> _Block:
        """Map the pages the request misses after the segment's free tail (try_allocate_expandable_block)."""
        page = K_SMALL_BUFFER if small else K_LARGE_BUFFER
        tail = self._tail[small]
        free_tail = tail if tail is not None and not tail.allocated else None
        need = size - (free_tail.size if free_tail is not None else 0)
        mapped = -(-need // page) * page
        if not self._cuda_malloc(mapped):
            raise AllocatorOOM(key, nbytes, self.reserved_bytes, self.allocated_bytes, self.capacity_bytes)
        if free_tail is not None:
            self._remove(free_tail)
            free_tail.size += mapped
            return free_tail
        if tail is None:
            self.num_segments += 1
            block = _Block(self._next_addr, mapped, small)
            self._next_addr += 1 << 50  # the segment's reserved virtual range
        else:
            block = _Block(tail.addr + tail.size, mapped, small, prev=tail)
            tail.next = block
        self._tail[small] = block
        return block


@dataclass(frozen=True, slots=True)
class ReservedEstimate:
    """The caching-allocator replay of a steady-state step. Bytes are ints."""

    peak_reserved_bytes: int
    # the steady step's peak of memory_allocated(): blocks as handed out, unsplit remainders included; the
    # timeline's peak (sum of rounded requests) or more
    peak_allocated_bytes: int
    segments: int  # cudaMalloc segments held at the end of the step
    alloc_retries: int  # cudaMalloc failures that released the cache and retried
    oom: str  # '' or the request that found no memory
    oom_sid: int | None = None  # the storage whose allocation failed
    oom_step: str = ""  # 'first' or 'steady': the step it failed in
    oom_state: tuple[int, int] = (0, 0)  # (reserved, allocated) bytes when it failed
    # with `curve`: the steady step's reserved bytes after each graph step's events, change points only:
    # ((step, bytes), ...), the first at step 0; reserved at step s is the last entry at or before s
    reserved_steps: tuple[tuple[int, int], ...] = ()
    peak_step: int = 0  # the steady step's graph step where peak_allocated_bytes is first reached
    peak_remainder_bytes: int = 0  # of peak_allocated_bytes: unsplit block remainders (`should_split`)
    first_peak_allocated_bytes: int = 0  # the first step's peak of memory_allocated()


def replay_steps(first, steady, capacity_bytes: int | None = None, conf=None, curve: bool = False) -> ReservedEstimate:
    """Replay a first step then a steady-state step (two `liveness.Timeline`s of the same recording, CUDA block
    rounding applied) through `CachingAllocatorModel` (`ExpandableSegmentsModel` when `conf`, a
    `device.AllocConf`, says expandable_segments; its max_split_size applies), as a training loop runs them. Peak
    allocated (unsplit block remainders included, `peak_step` where it is first reached) is the steady step's
    (`reset_peak_memory_stats()` between the steps, as the measurement does), peak reserved the run's
    (`max_memory_reserved()` from the first step on: the same unless the steady step released the cache). With
    `capacity_bytes`, an allocation that finds no memory stops the replay: `oom`, `oom_sid` and `oom_step` name it.
    The order of events is `ReplaySchedule`'s. With `curve`, `reserved_steps` holds the steady step's reserved
    bytes per graph step (change points)."""
    schedule = ReplaySchedule.of(first, steady)
    nbytes = {lt.sid: lt.bytes for tl in (first, steady) for lt in tl.lifetimes}
    return schedule.replay([nbytes[sid] for sid in schedule.sids], capacity_bytes, conf, curve)


@dataclass(frozen=True, slots=True)
class ReplaySchedule:
    """The allocator events of a first step then a steady-state step of one recording, independent of the
    storages' sizes, so that `fit --sweep` replays the same recording at many sizes.

    Per step: storages alive at its start are allocated first (parameters, buffers, inputs; in the steady step
    the optimizer state already is), then at each graph step the storages born there are allocated (in the order
    the op made them) and those dying there are freed in the order they died (`Lifetime.free_rank`: the order
    in which the eager step dropped their last references); whatever the first step leaves that is not
    persistent is freed before the second.

    sids: the storage of each index; steps: per step ('first', 'steady'), its events (malloc?, key, index) in
    order, a key being ('persistent' | step, sid); ends: per step, the number of its events done when each of
    its graph steps is done.
    """

    sids: tuple[int, ...]
    steps: tuple[tuple[str, tuple[tuple[bool, tuple, int], ...]], ...]
    ends: tuple[tuple[int, ...], ...] = ()

    @classmethod
    def of(cls, first, steady) -> ReplaySchedule:
        index: dict[int, int] = {}
        steps, ends = [], []
        for tag, tl in (("first", first), ("steady", steady)):
            events: list[tuple[bool, tuple, int]] = []
            births: dict[int, list] = {}
            deaths: dict[int, list] = {}
            rank = {lt.sid: lt.free_rank for lt in tl.lifetimes}
            for lt in tl.lifetimes:
                key = ("persistent", lt.sid) if lt.at_start or lt.outlives_step else (tag, lt.sid)
                i = index.setdefault(lt.sid, len(index))
                if lt.at_start:
                    events.append((True, key, i))
                else:
                    births.setdefault(lt.birth, []).append((True, key, i))
                if not lt.outlives_step:
                    deaths.setdefault(lt.death, []).append((False, key, i))
            done = []
            for step in range(len(tl.steps)):
                events += births.get(step, ())
                events += sorted(deaths.get(step, ()), key=lambda e: rank[e[1][1]])
                done.append(len(events))
            steps.append((tag, tuple(events)))
            ends.append(tuple(done))
        return cls(tuple(index), tuple(steps), tuple(ends))

    def replay(self, nbytes, capacity_bytes: int | None = None, conf=None, curve: bool = False) -> ReservedEstimate:
        """The replay with `nbytes[i]` (block-rounded) the bytes of storage `sids[i]`; one of 0 bytes is neither
        allocated nor freed (PyTorch returns a null pointer for it). See `replay_steps`; `curve` records the
        steady step's reserved bytes per graph step (`ReservedEstimate.reserved_steps`)."""
        mss = conf.max_split_size if conf is not None else None
        expandable = conf is not None and conf.expandable_segments
        sim = (ExpandableSegmentsModel if expandable else CachingAllocatorModel)(capacity_bytes, mss)
        oom, failed, tag = "", None, ""
        live = sim._live
        points: list[tuple[int, int]] = []

        def record(ends: tuple[int, ...], step: int, done: int) -> int:
            """Record the reserved bytes of every graph step done after `done` events; the next step."""
            while step < len(ends) and ends[step] <= done:
                if not points or points[-1][1] != sim.reserved_bytes:
                    points.append((step, sim.reserved_bytes))
                step += 1
            return step

        first_peak, first_reserved, peak_event = 0, 0, -1
        try:
            for n, (tag, events) in enumerate(self.steps):
                if tag == "steady":
                    for key in [k for k in live if k[0] == "first"]:
                        sim.free(key)
                    first_peak, first_reserved = sim.peak_allocated_bytes, sim.peak_reserved_bytes
                    sim.reset_peaks()
                ends = self.ends[n] if curve and tag == "steady" else ()
                step = record(ends, 0, 0)
                for j, (is_malloc, key, i) in enumerate(events):
                    if is_malloc:
                        if key not in live and nbytes[i]:
                            peak = sim.peak_allocated_bytes
                            sim.malloc(key, nbytes[i])
                            if tag == "steady" and sim.peak_allocated_bytes > peak:
                                peak_event = j
                    elif key in live:
                        sim.free(key)
                    if ends:
                        step = record(ends, step, j + 1)
        except AllocatorOOM as e:
            oom, failed = str(e), e
        steady_ends = self.ends[-1] if self.ends else ()
        # max_memory_reserved() over the run: the first step's too, above the steady step's after a cache release
        reserved = max(first_reserved, sim.peak_reserved_bytes)
        return ReservedEstimate(reserved, sim.peak_allocated_bytes, sim.num_segments, sim.num_alloc_retries, oom,
                                failed.key[1] if failed else None, tag if failed else "",
                                (failed.reserved_bytes, failed.allocated_bytes) if failed else (0, 0), tuple(points),
                                min(bisect.bisect_right(steady_ends, peak_event), max(len(steady_ends) - 1, 0)),
                                sim.peak_remainder_bytes, first_peak)
