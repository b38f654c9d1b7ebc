"""Running real CPU kernels under torch.profiler's allocator events, and what their memory depends on.

`run_profiled` / `run_profiled_steps`: the peak of the running allocation sum of torch.profiler's `[memory]`
events (`profile_memory=True`); `cpu_environment`: what a CPU target's kernel workspaces depend on (CPU model and
flags, oneDNN ISA cap, ATen's vectorisation, threads, torch version); `rank_threads`: the thread count one rank of
a CPU job runs with; `available_host_bytes`: /proc/meminfo's MemAvailable. Used by the CPU workspace probe
(`probe.py`) and by `vramtrace validate`.
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch
from torch.multiprocessing.reductions import StorageWeakRef


@contextlib.contextmanager
def _quiet_native_stderr():
    """Silence file descriptor 2 (kineto writes a 'profiler_start/stop' line per profiler run from C++)."""
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        sys.stderr.flush()
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def cpu_zeros_like(tree):
    """`tree` with every tensor replaced by CPU zeros of its sizes, strides and dtype (a real stand-in for a
    meta tensor); other leaves unchanged."""
    return torch.utils._pytree.tree_map(
        lambda x: torch.empty_strided(tuple(x.shape), x.stride(), dtype=x.dtype).zero_()
        if isinstance(x, torch.Tensor) else x, tree)


def unique_storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views and aliases counted once)."""
    seen, total = set(), 0
    for t in tensors:
        st = t.untyped_storage()
        if (key := StorageWeakRef(st)) not in seen:
            seen.add(key)
            total += st.nbytes()
    return total


def run_profiled(fn):
    """(fn(), peak bytes): the running maximum of the allocation sum over torch.profiler's `[memory]` allocator
    events (`profile_memory=True`) while `fn` runs, relative to its start."""
    with _quiet_native_stderr(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                        profile_memory=True) as prof:
        out = fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    cur = peak = 0
    for e in events:
        cur += e.nbytes()
        peak = max(peak, cur)
    return out, peak


STEP_MARK_BYTES = 7_654_321  # an odd-sized allocation between the two steps: where the measured one starts


def run_profiled_steps(first, second) -> int:
    """Peak bytes of the allocator while `second()` runs, counted from before `first()`: the running sum of
    torch.profiler's `[memory]` events over both calls (so what `first` left alive is counted, and its frees
    during `second` are seen: the profiler reports no free of an allocation made before it started, c10's
    ProfiledCPUMemoryReporter keeps sizes only while profiling), maximised over the events of `second`. The
    boundary is a sentinel allocation of `STEP_MARK_BYTES` in the same event stream (timestamps of different
    event kinds are not comparable)."""
    with _quiet_native_stderr(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                        profile_memory=True) as prof:
        first()
        mark = torch.empty(STEP_MARK_BYTES, dtype=torch.uint8)
        del mark
        second()
    cur, peak, measuring = 0, None, False
    for e in sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns()):
        if abs(e.nbytes()) == STEP_MARK_BYTES:
            measuring = True
            continue
        cur += e.nbytes()
        if measuring:
            peak = cur if peak is None else max(peak, cur)
    return cur if peak is None else peak


def cpu_environment() -> dict[str, str | int]:
    """What a CPU target's kernel workspaces depend on, as plain data: the CPU model, its flags that change
    oneDNN's kernels (avx512_bf16, avx512_fp16, amx_*), the oneDNN ISA cap in effect (`ONEDNN_MAX_CPU_ISA`,
    else every ISA the CPU has), ATen's vectorisation level (`torch.backends.cpu.get_cpu_capability()`), the
    intra-op thread count (`torch.get_num_threads()`) and the torch version."""
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not model:
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    wanted = sorted(f for f in flags if f in ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni")
                    or f.startswith("amx"))
    return {"cpu": model or "unknown", "cpu_flags": " ".join(wanted),
            "onednn_max_isa": os.environ.get("ONEDNN_MAX_CPU_ISA") or "(all the CPU has)",
            "aten_capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
            "torch": torch.__version__}


@contextlib.contextmanager
def rank_threads(world: int | None):
    """This process's intra-op thread count set, while the block runs, to what one rank of a `world`-rank CPU job
    runs with, and restored after: torchrun starts each of more than one local rank with `OMP_NUM_THREADS=1`
    unless the variable is set (torch/distributed/run.py `config_from_args`), so 1 for `world` > 1 without
    `OMP_NUM_THREADS` (with it, this process already runs with that many). The CPU kernels' workspaces depend on
    the thread count (oneDNN's per-thread scratchpads of bf16 matmuls on an AVX-512-BF16 CPU), and the probe's
    cache keys and `cpu_environment()` read it, so a sharded trace is probed as its ranks run."""
    before = torch.get_num_threads()
    if world is None or world <= 1 or "OMP_NUM_THREADS" in os.environ or before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def available_host_bytes() -> int:
    """MemAvailable of /proc/meminfo (bytes), else the free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
