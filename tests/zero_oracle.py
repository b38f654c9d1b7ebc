"""Ground truth for DeepSpeed ZeRO: real N-process DeepSpeed runs on the CPU (gloo), each rank's steady step measured.

Imports nothing from vramtrace (tests/test_oracle_independent.py asserts it); its helpers come from tests/oracle.py,
which imports nothing from vramtrace either. Needs deepspeed (the optional extra `vramtrace[deepspeed]`) and
`DS_ACCELERATOR=cpu` in the environment (DeepSpeed picks its accelerator when it is imported).

A case: a transformers config (`hf_config`: a config.json path or directory), built with `AutoModelFor...from_config`
in fp32, random weights (seed 0), as a user builds it; the ds_config of `zero_ds_config` (micro batch `batch` per
rank, gradient accumulation 1, `torch.optim.AdamW` through the optimizer block's `"torch_adam": true`,
`zero_optimization.stage`, optional `reduce_bucket_size` and `offload_optimizer {device, pin_memory: false}`,
`bf16.enabled` for precision bf16); the step as the DeepSpeed tutorial and HF Trainer run it
(`loss = engine(**inputs).loss; engine.backward(loss); engine.step()`), the inputs tests/oracle.py `hf_batch` feeds
the head (a causal LM: input_ids (batch, seq) and labels, the same tensor).

Each rank is a process forked from a fork server that has imported torch, transformers and deepspeed once; the
ranks meet over gloo (`deepspeed.initialize` initialises torch.distributed from RANK/WORLD_SIZE/MASTER_ADDR/...).

The measurement: torch.profiler's `[memory]` allocator events (`profile_memory=True`) from BEFORE the model is built,
so every storage DeepSpeed makes in `initialize` (flat fp32 partitions, buckets, ZeRO-3's partitions) is in the event
stream and nothing alive earlier matters; warm-up steps, then a marker allocation (`MARKER_BYTES`) before each
measured step. `start` = the running sum of the events at the marker (bytes alive at the measured step's start),
`peak` = its maximum over the measured step.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import os
import socket
import tempfile
import threading
import time
import warnings
from pathlib import Path

import torch

from oracle import _GlooThreadsSettle, _quiet_fd2, _thread_ids, hf_batch, hf_config, hf_model, run_rank_processes

MARKER_BYTES = 1_234_577  # as tests/oracle.py: a size no tiny case allocates
PRECISIONS = ("fp32", "bf16")


def zero_ds_config(*, stage: int, dp: int, precision: str = "fp32", batch: int = 2,
                   reduce_bucket_size: int | None = None, offload_optimizer: str | None = None) -> dict:
    """The ds_config a user writes for the case (DeepSpeed's documented keys; everything else its defaults)."""
    if precision not in PRECISIONS:
        raise ValueError(f"zero oracle: precision {precision!r}, expected one of {PRECISIONS}")
    zero: dict = {"stage": stage}
    if reduce_bucket_size is not None:
        zero["reduce_bucket_size"] = int(reduce_bucket_size)
    if offload_optimizer is not None:
        zero["offload_optimizer"] = {"device": offload_optimizer, "pin_memory": False}
    cfg = {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1, "train_batch_size": batch * dp,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
           "zero_optimization": zero, "steps_per_print": 10**9, "wall_clock_breakdown": False}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _set_env(rank: int, world: int, port: int) -> None:
    """What DeepSpeed's CPU accelerator and `init_distributed` read (without LOCAL_RANK it tries MPI discovery)."""
    os.environ.update(DS_ACCELERATOR="cpu", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), CROSS_RANK="0", CROSS_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")


def _levels(prof, markers: int) -> list[tuple[int, int, int]]:
    """(level at the marker, peak until the next marker or the end, level there) for each marker, from the events."""
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    segments: list[list[int]] = [[]]
    for e in events:
        if e.nbytes() == MARKER_BYTES:
            segments.append([])
        elif e.nbytes() != -MARKER_BYTES:
            segments[-1].append(e.nbytes())
    assert len(segments) == markers + 1, (len(segments), markers)
    level, out = sum(segments[0]), []
    for seg in segments[1:]:
        run = list(itertools.accumulate(seg, initial=level))
        out.append((level, max(run), run[-1]))
        level = run[-1]
    return out


def _rank_main(rank: int, world: int, case: dict, out_dir: str) -> None:
    """One rank (a forked child): build, `deepspeed.initialize`, warm-up steps, measured steps; per measured step
    (bytes alive at its start as `_gc_bytes` counts them, the event level there, the events' running sum's maximum
    and their total), or the traceback, to OUT_DIR/rankR.json."""
    import traceback

    result: dict = {}
    times = [("fork", time.monotonic())]
    try:
        _set_env(rank, world, case["port"])
        torch.set_num_threads(1)  # the ranks share the machine's cores
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]})  # inherited by gloo's threads (tests/oracle.py)
        import deepspeed
        from deepspeed.accelerator import get_accelerator

        if get_accelerator().device_name() != "cpu":
            raise RuntimeError("zero oracle: DeepSpeed's accelerator is not the CPU; set DS_ACCELERATOR=cpu")
        # The shared-memory comm op (deepspeed/comm/torch.py `build_shm_op`) serves only `inference_all_reduce`
        # and is JIT-compiled on first use (minutes); its buffers are shared memory, not the allocator's. The
        # probed-ops dict is DeepSpeed's own switch for it (deepspeed/ops/__init__.py: "edits to it persist").
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        times.append(("import", time.monotonic()))
        config = hf_config(case["model"])
        settle, starts = _AllThreadsSettle(), []
        base = _gc_bytes()
        with _quiet_fd2(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                  profile_memory=True) as prof:
            model = hf_model(config, torch.float32)
            inputs = hf_batch(model, config, case["batch"], case["seq"], True, None, torch.float32)
            with settle:
                engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                  config=case["ds_config"])
            del model
            times.append(("build+initialize", time.monotonic()))
            for _ in range(case["warmup"]):
                with settle:
                    _step(engine, inputs)
            for _ in range(case["measured"]):
                starts.append(_gc_bytes() - base)
                marker = torch.empty(MARKER_BYTES, dtype=torch.uint8)  # a sentinel in the same event stream
                del marker
                with settle:
                    _step(engine, inputs)
        times.append(("steps", time.monotonic()))
        result["seconds"] = {name: round(t - times[i][1], 1) for i, (name, t) in enumerate(times[1:])}
        result["steps"] = [dict(start=start, event_start=level, increase=peak - level, net=end - level)
                           for start, (level, peak, end) in zip(starts, _levels(prof, case["measured"]))]
        import deepspeed.comm as dist

        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        result = {"error": traceback.format_exc()}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


class _AllThreadsSettle(_GlooThreadsSettle):
    """tests/oracle.py's `_GlooThreadsSettle` over every thread of the process but the calling one, listed at each
    wait: DeepSpeed makes process groups (and so gloo worker threads) inside `deepspeed.initialize`."""

    def __init__(self):
        super().__init__(set())
        self.main = threading.get_native_id()

    def _runnable(self) -> bool:
        self.stats = [f"/proc/self/task/{tid}/stat" for tid in sorted(_thread_ids() - {self.main})]
        return super()._runnable()


def _gc_bytes() -> int:
    """Bytes of the unique CPU storages of every tensor Python's garbage collector tracks, and of the leaves'
    `.grad` (which may have no Python object of its own), by storage address."""
    seen: dict[int, int] = {}
    with warnings.catch_warnings():  # isinstance on torch.distributed's deprecated `reduce_op` object warns
        warnings.simplefilter("ignore")
        objects = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for o in objects:
        if not (isinstance(o, torch.Tensor) and o.device.type == "cpu"):
            continue
        leaves = [o, o.grad] if o.is_leaf and o.requires_grad else [o]
        for t in leaves:
            if t is not None:
                st = t.untyped_storage()
                seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
    seen.pop(0, None)  # empty storages (ZeRO-3's released parameters)
    return sum(seen.values())


def measure_zero_peaks(model_config, *, stage: int, dp: int = 2, precision: str = "fp32", batch: int = 2,
                       seq: int = 32, reduce_bucket_size: int | None = None, offload_optimizer: str | None = None,
                       ds_config: dict | None = None, warmup: int = 1, measured: int = 3,
                       timeout: float = 600.0) -> list[dict]:
    """Each rank's (index = rank) steady training step of the case run for real by `dp` DeepSpeed processes over
    gloo: {"start": bytes alive at the measured step's start, "increase": the step's peak over it, "peak": start +
    increase, "event_start": the events' running sum there, "seconds": the rank's phases}. `ds_config` (else
    `zero_ds_config(...)` of the other arguments) is DeepSpeed's config dict.

    The measured step is the first of `measured` after `warmup` whose allocator events add up to zero (a steady
    step ends where it started; a free that a gloo worker thread makes has no event and leaves the sum above zero,
    tests/oracle.py `_measure_clean`); `start` is `_gc_bytes` at its marker, not the events' running sum, which
    such lost frees in `initialize` and the warm-up leave too high (by 0 to 500 KB in ZeRO-3, run to run).
    Raises RuntimeError when a rank fails, has no clean step, or its start moves between measured steps."""
    cfg = ds_config or zero_ds_config(stage=stage, dp=dp, precision=precision, batch=batch,
                                      reduce_bucket_size=reduce_bucket_size, offload_optimizer=offload_optimizer)
    case = dict(model=str(model_config), batch=batch, seq=seq, ds_config=cfg, warmup=warmup, measured=measured)
    out = []
    for rank, res in enumerate(run_ranks(case, dp, timeout)):
        steps = res["steps"]
        if len({s["start"] for s in steps}) != 1:
            raise RuntimeError(f"zero oracle: rank {rank}'s start moves between steps: {steps}")
        clean = [s for s in steps if s["net"] == 0]
        if not clean:
            raise RuntimeError(f"zero oracle: rank {rank} has no clean step (events not summing to 0): {steps}")
        s = clean[0]
        out.append(dict(rank=rank, start=s["start"], increase=s["increase"], peak=s["start"] + s["increase"],
                        event_start=s["event_start"], seconds=res["seconds"]))
    return out


def _step(engine, inputs: dict) -> None:
    """One DeepSpeed training step as the DeepSpeed tutorial and HF Trainer run it."""
    loss = engine(**inputs).loss
    engine.backward(loss)
    engine.step()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(case: dict, world: int, timeout: float = 600.0) -> list[dict]:
    """Run `_rank_main` on `world` forked ranks; each rank's result dict, by rank."""
    import multiprocessing as mp

    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # the fork server imports deepspeed with it
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["oracle", "zero_oracle", "transformers.modeling_utils", "deepspeed"])
    case = dict(case, port=_free_port())
    with tempfile.TemporaryDirectory(prefix="zero-oracle-") as tmp:
        results, _stopped, _codes = run_rank_processes(
            ctx, world, lambda r: (_rank_main, (r, world, case, tmp), f"zero-oracle-rank{r}"), tmp, timeout,
            "ZeRO case")
    errors = [f"rank {r}:\n{res.get('error', 'no result')}" for r, res in enumerate(results) if "steps" not in res]
    if errors:
        raise RuntimeError("zero oracle: a rank failed\n" + "\n".join(errors))
    return results
