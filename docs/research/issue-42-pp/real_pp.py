"""A REAL multi-process gloo CPU run of torch.distributed.pipelining on a tiny HF Llama, measured per rank.

Usage (from the repository root; one process per stage, one thread each):
    python docs/research/issue-42-pp/real_pp.py --pp 2 --schedule gpipe --micro-batches 4 [--split 2,2]
        [--layers 4] [--batch 8] [--seq 32] [--json out.json]

The model: fixtures/configs/tiny-llama-gqa.json with num_hidden_layers = --layers, built by
AutoModelForCausalLM.from_config (seed 0, sdpa, fp32) on every rank, then cut by hand as users of
torch.distributed.pipelining cut HF models (manual PipelineStage per rank, torchtitan's way):
  stage 0   = embed_tokens + its decoder layers,
  middle    = its decoder layers,
  last      = its decoder layers + final norm + lm_head,
each stage keeping its own copy of the rotary embedding module and computing (cos, sin) from position_ids =
arange(seq) for every micro-batch (the model's own LlamaModel.forward does the same once per forward); no attention
mask is passed, so sdpa runs is_causal=True (transformers integrations/sdpa_attention.py). The loss:
`model.loss_function` (ForCausalLMLoss, mean over tokens) given to the schedule as loss_fn, default scale_grads=True.
Each stage has its own torch.optim.AdamW over its parameters. The loop per step, the same on every rank:
    out = schedule.step(input_ids)  (stage 0) | schedule.step(target=labels, losses=[]) (last) | schedule.step()
    del out; optimizer.step(); optimizer.zero_grad()
Two warm-up steps then the measured step, as tests/oracle.py measures one process: the bytes of every storage alive
before the first step (parameters, buffers, this rank's inputs) plus the running sum of the profiler's [memory]
events from the first warm-up on, maximised over the measured step (split by a marker allocation). Each rank also
checks that it lost no event (a free made on a gloo worker thread has none): the storages alive at the end, found
by walking the stage, schedule and optimizer, must equal start + the sum of all events ("lost" column, bytes).
The forward/backward micro-steps and the optimizer are wrapped in record_function ranges (F<i>, B<i>, opt, zero)
so that the peak's event can be placed in the schedule.
"""
from __future__ import annotations

import argparse
import functools
import gc
import itertools
import json
import os
import socket
import sys
import tempfile
import threading
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[3]
MARKER = 1_234_577


class Stage(torch.nn.Module):
    """A contiguous piece of LlamaForCausalLM: [embed] + layers[lo:hi] + [norm + lm_head]."""

    def __init__(self, model, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        self.embed_tokens = model.model.embed_tokens if first else None
        self.layers = torch.nn.ModuleList(model.model.layers[lo:hi])
        self.rotary_emb = model.model.rotary_emb
        self.norm = model.model.norm if last else None
        self.lm_head = model.lm_head if last else None

    def forward(self, x):
        h = self.embed_tokens(x) if self.embed_tokens is not None else x
        pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        pe = self.rotary_emb(h, position_ids=pos)
        for layer in self.layers:
            h = layer(h, attention_mask=None, position_ids=pos, position_embeddings=pe)
        if self.lm_head is not None:
            h = self.lm_head(self.norm(h))
        return h


def even_split(layers: int, pp: int) -> list[int]:
    """Even split, the remainder on the earliest stages."""
    return [layers // pp + (1 if k < layers % pp else 0) for k in range(pp)]


def build(args, rank: int):
    """(stage module, loss_fn, input_ids, labels) for `rank`, the rest of the model dropped."""
    import transformers

    cfg = json.loads((ROOT / "fixtures/configs/tiny-llama-gqa.json").read_text())
    cfg["num_hidden_layers"] = args.layers
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    bounds = list(itertools.accumulate(args.split_list, initial=0))
    sub = Stage(model, bounds[rank], bounds[rank + 1], rank == 0, rank == args.pp - 1)
    loss_fn = functools.partial(model.loss_function, vocab_size=config.vocab_size)
    torch.manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq))
    del model
    gc.collect()
    return sub, loss_fn, ids


class NoOptimizer:
    """What a user's loop does for a stage with no parameters: nothing."""

    state: dict = {}

    def step(self):
        pass

    def zero_grad(self):
        pass


def instrument(stage, opt):
    """record_function ranges around each micro-step and the optimizer (no allocation of their own)."""
    from torch.profiler import record_function

    fwd, bwd, ostep, zero = stage.forward_one_chunk, stage.backward_one_chunk, opt.step, opt.zero_grad

    def f(i, *a, **k):
        with record_function(f"F{i}"):
            return fwd(i, *a, **k)

    def b(i, *a, **k):
        with record_function(f"B{i}"):
            return bwd(i, *a, **k)

    def s(*a, **k):
        with record_function("opt"):
            return ostep(*a, **k)

    def z(*a, **k):
        with record_function("zero"):
            return zero(*a, **k)

    stage.forward_one_chunk, stage.backward_one_chunk, opt.step, opt.zero_grad = f, b, s, z


def storages(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            s = t.untyped_storage()
            if s.data_ptr() not in seen and s.nbytes():
                seen.add(s.data_ptr())
                total += s.nbytes()
    return total


def alive_tensors(sub, stage, opt, inputs):
    """Every tensor the stage, its optimizer and the loop keep between steps."""
    yield from sub.parameters()
    yield from sub.buffers()
    yield from (p.grad for p in sub.parameters())
    for st in opt.state.values():
        yield from st.values()
    yield from inputs
    for infos in list(stage.args_recv_info.values()) + list(getattr(stage, "grad_recv_info", {}).values()):
        for info in infos:
            if getattr(info, "buffer", None) is not None:
                yield info.buffer
                yield info.buffer.grad
    yield from torch.utils._pytree.tree_leaves(list(stage.output_chunks))
    for out, ins in stage.fwd_cache.values():
        yield from out
        yield from ins
    yield from torch.utils._pytree.tree_leaves(list(stage.bwd_cache.values()))


def run_rank(rank, args, port, out_dir):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=args.pp)
    sub, loss_fn, ids = build(args, rank)
    first, last = rank == 0, rank == args.pp - 1
    stage = PipelineStage(sub, rank, args.pp, torch.device("cpu"))
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[args.schedule]
    sched = cls(stage, n_microbatches=args.micro_batches, loss_fn=loss_fn)
    # a stage of 0 decoder layers may have no parameters (a middle one): no optimizer then
    opt = torch.optim.AdamW(sub.parameters()) if list(sub.parameters()) else NoOptimizer()
    instrument(stage, opt)
    inputs = [ids] if first or last else []

    def step():
        if first:
            out = sched.step(ids)
        elif last:
            out = sched.step(target=ids, losses=[])
        else:
            out = sched.step()
        del out
        opt.step()
        opt.zero_grad()

    start = storages(alive_tensors(sub, stage, opt, inputs))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
        step()
        marker = torch.empty(MARKER, dtype=torch.uint8)
        del marker
        step()
    end = storages(alive_tensors(sub, stage, opt, inputs))
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    ranges = [(e.start_ns(), e.start_ns() + e.duration_ns(), e.name()) for e in prof.profiler.kineto_results.events()
              if e.name()[:1] in "FB" and e.name()[1:].isdigit() or e.name() in ("opt", "zero")]
    level, before, measured, peak, peak_t, total = 0, 0, False, None, None, 0
    small: dict[str, int] = {}  # the measured step's allocations under 4 KiB, by size, and their threads
    for e in events:
        n = e.nbytes()
        total += n
        if n == MARKER:
            measured, before = True, level
            continue
        if measured and n == -MARKER:
            continue
        level += n
        if measured and 0 < n < 4096:
            key = f"{n}@t{e.start_thread_id()}"
            small[key] = small.get(key, 0) + 1
        if measured and (peak is None or level > peak):
            peak, peak_t = level, e.start_ns()
    where = [name for s, t, name in ranges if s <= peak_t <= t]
    # the measured step's own ranges, to say which micro-steps ran before the peak
    result = {"rank": rank, "start": start, "at_step_start": start + before, "peak": start + peak,
              "where": where[-1] if where else "loop", "lost": start + total - end,
              "steady": level - before, "small_allocs": small,
              "params": storages(sub.parameters()),
              "recv_buffers": storages(info.buffer for infos in stage.args_recv_info.values() for info in infos
                                       if getattr(info, "buffer", None) is not None)
              + storages(info.buffer for infos in getattr(stage, "grad_recv_info", {}).values() for info in infos
                         if getattr(info, "buffer", None) is not None)}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--schedule", choices=("gpipe", "1f1b"), default="gpipe")
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--split", default=None, help="decoder layers per stage, e.g. 3,0,1")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.split_list = [int(x) for x in args.split.split(",")] if args.split else even_split(args.layers, args.pp)
    assert len(args.split_list) == args.pp and sum(args.split_list) == args.layers
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(run_rank, args=(args, port, out_dir), nprocs=args.pp)
        rows = [json.loads(Path(out_dir, f"rank{k}.json").read_text()) for k in range(args.pp)]
    case = {"schedule": args.schedule, "pp": args.pp, "split": args.split_list, "M": args.micro_batches,
            "batch": args.batch, "seq": args.seq, "layers": args.layers, "stages": rows}
    for r in rows:
        print(f"{args.schedule} pp={args.pp} split={args.split_list} stage {r['rank']}: peak {r['peak']} "
              f"(at step start {r['at_step_start']}, params {r['params']}, recv buffers {r['recv_buffers']}) "
              f"at {r['where']}; lost {r['lost']} steady {r['steady']}")
    if args.json:
        Path(args.json).write_text(json.dumps(case, indent=1))
    return case


if __name__ == "__main__":
    main(sys.argv[1:])
