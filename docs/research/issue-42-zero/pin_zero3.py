"""Pin mismatch 2 (ZeRO-3 fp32 increase, llama): the real rank's allocator events around the measured step's peak,
each with the innermost op on its thread, next to the fake prototype's per-op births around its peak.

    DS_ACCELERATOR=cpu /work/venv-ds/bin/python docs/research/issue-42-zero/pin_zero3.py real [CASE] [--model M]
    DS_ACCELERATOR=cpu /work/venv-ds/bin/python docs/research/issue-42-zero/pin_zero3.py fake [CASE] [--model M]

CASE defaults to zero3-fp32-1e6. Prints the WINDOW events before the peak (level, bytes, thread, op) as text.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.multiprocessing as mp

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import common  # noqa: E402

WINDOW = int(os.environ.get("PIN_WINDOW", "40"))  # events shown before the peak
MARKER = 1_234_577


def real_rank(rank, world, port, model_name, case):
    common.set_env(rank, world, port)
    import deepspeed
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    stage, precision, bucket, offload = case
    model = common.build_model(model_name)
    ids, labels = common.inputs(model.config.vocab_size)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=common.ds_config(stage, precision, bucket, offload, world))
    del model
    common.step(engine, ids, labels)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True,
                                with_stack=True) as prof:
        common.step(engine, ids, labels)
    if rank == 0:
        report_real(prof)
    import deepspeed.comm as dist
    dist.barrier()


def report_real(prof):
    events = list(prof.profiler.kineto_results.events())
    mem = sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns())
    ops = [e for e in events if e.name() != "[memory]" and e.duration_ns() > 0]
    level, levels = 0, []
    for e in mem:
        level += e.nbytes()
        levels.append(level)
    peak_i = max(range(len(levels)), key=levels.__getitem__)
    print(f"REAL increase {levels[peak_i]} (events {len(mem)}, peak at #{peak_i}, end {levels[-1]})")
    for i in range(max(0, peak_i - WINDOW), min(len(mem), peak_i + 6)):
        e = mem[i]
        t = e.start_ns()
        inner = [o for o in ops if o.start_thread_id() == e.start_thread_id() and o.start_ns() <= t <= o.end_ns()]
        inner.sort(key=lambda o: o.duration_ns())
        names = " < ".join(o.name() for o in inner[:3])
        stack = [s for o in inner for s in o.stack() if "deepspeed" in s][:2]
        mark = "*" if i == peak_i else " "
        print(f"{mark}{i:5d} {levels[i]:>10,} {e.nbytes():>+10,} tid={e.start_thread_id()} {names} | {stack}")


def fake_run(model_name, case):
    import fake_zero
    import torch.distributed as tdist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore
    import traceback
    common.set_env(0, 2, 29600)
    tdist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    import deepspeed
    for p in fake_zero.PATCHES:
        p()
    stage, precision, bucket, offload = case

    class Logged(fake_zero.StorageTracker):
        log = None

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            before = self.level
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if self.log is not None:
                st = [f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}:{f.name}" for f in traceback.extract_stack()
                      if "deepspeed" in f.filename][-2:]
                self.log.append((self.level, self.level - before, str(func), st))
            return out
    tracker = Logged()
    with FakeTensorMode(allow_non_fake_inputs=True), tracker:
        model = common.build_model(model_name)
        ids, labels = common.inputs(model.config.vocab_size)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=common.ds_config(stage, precision, bucket, offload, 2))
        del model
        common.step(engine, ids, labels)
        start = tracker.level
        tracker.log = []
        common.step(engine, ids, labels)
    log = tracker.log
    peak_i = max(range(len(log)), key=lambda i: log[i][0])
    print(f"FAKE increase {log[peak_i][0] - start} (ops {len(log)}, peak at #{peak_i})")
    for i in range(max(0, peak_i - WINDOW), min(len(log), peak_i + 6)):
        lv, d, f, st = log[i]
        if d or i == peak_i:
            print(f"{'*' if i == peak_i else ' '}{i:5d} {lv - start:>10,} {d:>+10,} {f} | {st}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=("real", "fake"))
    ap.add_argument("case", nargs="?", default="zero3-fp32-1e6")
    ap.add_argument("--model", default="llama")
    a = ap.parse_args()
    case = next(c for c in common.CASES if common.case_name(*c) == a.case)
    if a.mode == "fake":
        fake_run(a.model, case)
        return
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=real_rank, args=(r, 2, 29655, a.model, case)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()


if __name__ == "__main__":
    main()
