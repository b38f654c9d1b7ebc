"""Real 2-process DeepSpeed ZeRO runs on the CPU (gloo), each rank measured as tests/oracle.py measures a step.

    DS_ACCELERATOR=cpu /work/venv-ds/bin/python docs/research/issue-42-zero/real_zero.py [--model llama] [CASE ...]

Per rank: torch.profiler's `[memory]` events (profile_memory=True) from BEFORE the model is built (so every
storage DeepSpeed makes in `initialize` is in the event stream, and nothing alive earlier matters), a warm-up step,
a marker allocation, the measured step. `start` = the running sum at the marker (bytes alive at the measured step's
start), `peak` = its maximum over the measured step, `increase` = peak - start. Writes JSON lines to stdout.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch
import torch.multiprocessing as mp

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import common  # noqa: E402

MARKER = 1_234_577


def levels(prof) -> tuple[int, int, int]:
    """(level at the marker, peak over the measured step, level at the end) from the profiler's memory events."""
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    before, after, measuring = [], [], False
    for e in events:
        if e.nbytes() == MARKER:
            measuring = True
        elif not (measuring and e.nbytes() == -MARKER):
            (after if measuring else before).append(e.nbytes())
    start = sum(before)
    run = list(itertools.accumulate(after, initial=start))
    return start, max(run), run[-1]


def rank_main(rank, world, port, model_name, case, out_q):
    common.set_env(rank, world, port)
    import deepspeed  # noqa: F401  (after the env: the accelerator is chosen at import)

    stage, precision, bucket, offload = case
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        model = common.build_model(model_name)
        ids, labels = common.inputs(model.config.vocab_size)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=common.ds_config(stage, precision, bucket, offload, world))
        del model
        common.step(engine, ids, labels)  # warm-up
        marker = torch.empty(MARKER, dtype=torch.uint8)
        del marker
        common.step(engine, ids, labels)
    start, peak, end = levels(prof)
    out_q.put({"rank": rank, "start": start, "peak": peak, "increase": peak - start, "end": end})
    import deepspeed.comm as dist
    dist.barrier()
    dist.destroy_process_group()


def run_case(model_name, case, world=2, port=29511):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, world, port, model_name, case, q)) for r in range(world)]
    for p in procs:
        p.start()
    res = sorted((q.get(timeout=900) for _ in procs), key=lambda r: r["rank"])
    for p in procs:
        p.join()
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama", choices=sorted(common.MODELS))
    ap.add_argument("cases", nargs="*", help="case names (default: all), e.g. zero2-bf16-1e6")
    a = ap.parse_args()
    for i, case in enumerate(common.CASES):
        name = common.case_name(*case)
        if a.cases and name not in a.cases:
            continue
        res = run_case(a.model, case, port=29511 + i)
        print(json.dumps({"model": a.model, "case": name, "ranks": res}), flush=True)


if __name__ == "__main__":
    main()
