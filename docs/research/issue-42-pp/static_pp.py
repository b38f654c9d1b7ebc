"""Prototype: predict one pipeline stage's peak in ONE process, without the other ranks.

Usage (from the repository root):
    python docs/research/issue-42-pp/static_pp.py --pp 2 --schedule gpipe --micro-batches 4 [--split 2,2]
        [--mode meta|cpu] [--stage K] [--json out.json]

For stage k (every stage when --stage is not given) it builds the same stage module as the real run
(tests/pp_oracle.py, which real_pp.py runs: same cut, same loss_fn, same AdamW, same loop), makes a PipelineStage
and the REAL schedule class (ScheduleGPipe / Schedule1F1B / ScheduleInterleaved1F1B, their defaults), and runs two warm-up steps then the measured step with torch's fake process group
(torch.testing._internal.distributed.fake_pg: `init_process_group("fake", rank=k, world_size=P)`): every isend /
irecv is a no-op that completes at once, so the schedule's own order of forward and backward micro-steps runs, and
the receive buffers are the ones the stage allocates itself (`_make_tensor_from_meta` in stage.py
`_setup_forward_recv_info` / `_create_grad_recv_info`), left as allocated. The stage is built in static metadata
mode (input_args / output_args / output_grads / input_grads given as micro-batch-shaped tensors), since dynamic
inference exchanges pickled metadata over the process group, which the fake group cannot carry.

--mode meta: everything on the meta device; a TorchDispatchMode (`Tracker`) counts the bytes of live storages
  (a storage is born when an op's output has an unseen storage, and dies when its StorageWeakRef expires; expired
  refs are swept before each op), starting from the parameters, buffers and inputs alive before the first step;
  the peak is the maximum over the measured step, and the micro-step running at it is recorded.
--mode cpu: real CPU tensors, measured with the profiler exactly as the real run is (checks the fake group alone).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

HERE = Path(__file__).resolve().parent
# tests/pp_oracle.py, the real run's code: the same cut (Llama-like models and GPT-2), loss, loop, bf16-mixed
# (autocast inside each stage's forward), so the prototype and the real run build the very same stage
_spec = importlib.util.spec_from_file_location("pp_oracle", HERE.parents[2] / "tests" / "pp_oracle.py")
pp_oracle = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pp_oracle)


class Tracker(TorchDispatchMode):
    """Live storage bytes, op by op: births at op outputs, deaths when the storage's weak ref expires."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.level = 0
        self.peak, self.peak_at, self.label = 0, None, "loop"
        self.measuring = False

    def add(self, t):
        if isinstance(t, torch.Tensor):
            ref = StorageWeakRef(t.untyped_storage())
            if ref.cdata not in self.live:
                n = t.untyped_storage().nbytes()
                self.live[ref.cdata] = (ref, n)
                self.level += n

    def sweep(self):
        for key in [k for k, (r, _) in self.live.items() if r.expired()]:
            self.level -= self.live.pop(key)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.sweep()
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            self.add(t)
        if self.measuring and self.level > self.peak:
            self.peak, self.peak_at = self.level, self.label
        return out


class CpuSdpa(TorchFunctionMode):
    """On meta, F.scaled_dot_product_attention would take the math path (the attention matrix materialised); the
    CPU run takes `_scaled_dot_product_flash_attention_for_cpu` (its choice for this case: is_causal, no mask, GQA
    through enable_gqa). Call that op on meta instead, as vramtrace's tracer does (src/vramtrace/tracer/kernels.py
    `_sdpa`, which asks `torch._fused_sdp_choice` on tiny CPU stand-ins; this prototype assumes flash)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and args[0].device.type == "meta":
            q, k, v = args[:3]
            assert kwargs.get("attn_mask") is None
            dropout = kwargs.get("dropout_p", 0.0)
            tiny = [torch.empty(t.shape[:-2] + (2, t.shape[-1]), dtype=t.dtype) for t in (q, k, v)]
            # the CPU's own choice (flash, or math when dropout is on: 0 = MATH, 1 = FLASH_ATTENTION)
            if torch._fused_sdp_choice(*tiny, None, dropout, kwargs.get("is_causal", False),
                                       scale=kwargs.get("scale"), enable_gqa=kwargs.get("enable_gqa", False)) == 1:
                return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    q, k, v, dropout, kwargs.get("is_causal", False), scale=kwargs.get("scale"))[0]
        return func(*args, **kwargs)


class Held:
    """A completed Work that keeps its ops' tensors, as ProcessGroupGloo's send/recv Works do."""

    def __init__(self, ops):
        self.tensors = [op.tensor for op in ops]

    def wait(self):
        return True


def static_vote(stages, has_backward, p2p_done):
    """What schedules.py `_warmup_p2p`'s vote decides when every stage was given its metadata (STATIC), without
    the vote's round trip (the fake group returns no value, and `.item()` on meta fails)."""
    from torch.distributed.pipelining.stage import InferenceMode

    for stage in stages:
        stage._inference_mode = InferenceMode.STATIC


def make_stage(args, k, device):
    """([stage modules], [PipelineStages], schedule, optimizer, input ids) of rank k on `device`, static metadata:
    one stage, or with --virtual-stages V the stages k, k + P, ... under ScheduleInterleaved1F1B."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    if args.virtual_stages > 1:
        with torch.device(device):
            subs, loss_fn, ids = pp_oracle._build(args, k)
        ids = ids.to(device)
        n_stages = len(args.split_list)
        stages = [_static_stage(args, sub, s, n_stages, ids, device)
                  for sub, s in zip(subs, pp_oracle._stage_indices(args, k))]
        sched = ScheduleInterleaved1F1B(stages, n_microbatches=args.micro_batches, loss_fn=loss_fn)
        sched._warmup_p2p = static_vote
        params = [p for sub in subs for p in sub.parameters()]
        opt = torch.optim.AdamW(params) if params else pp_oracle._NoOptimizer()
        return subs, stages, sched, opt, ids
    with torch.device(device):
        subs, loss_fn, ids = pp_oracle._build(args, k)
        sub = subs[0]
    ids = ids.to(device)
    stage = _static_stage(args, sub, k, args.pp, ids, device)
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[args.schedule]
    sched = cls(stage, n_microbatches=args.micro_batches, loss_fn=loss_fn)
    sched._warmup_p2p = static_vote
    opt = torch.optim.AdamW(sub.parameters()) if list(sub.parameters()) else pp_oracle._NoOptimizer()
    return [sub], [stage], sched, opt, ids


def _static_stage(args, sub, k, n_stages, ids, device):
    """PipelineStage k of n_stages with static metadata (micro-batch-shaped inputs/outputs/gradients)."""
    from torch.distributed.pipelining import PipelineStage

    mb = args.batch // args.micro_batches
    config = pp_oracle._config(args.config)
    hidden = torch.empty(mb, args.seq, config.hidden_size, device=device)
    first, last = k == 0, k == n_stages - 1
    # the activation received requires grad (the previous stage's output does): dynamic inference records that,
    # and with a tensor_meta of requires_grad=False the stage would run no input-gradient backward and send zeros
    received = hidden.detach().requires_grad_(True)
    # the logits' dtype: the autocast dtype under bf16-mixed (lm_head runs under autocast), the hidden states'
    # stay fp32 (the residual stream: fp32 + bf16 promotes)
    logits_dtype = pp_oracle.PRECISIONS.get(getattr(args, "precision", "fp32")) or torch.float32
    return PipelineStage(sub, k, n_stages, torch.device(device),
                          input_args=ids[:mb] if first else received,
                          output_args=torch.empty(mb, args.seq, config.vocab_size, device=device, dtype=logits_dtype)
                          if last else hidden,
                          output_grads=None if last else hidden, input_grads=None if first else hidden)


def label(stages, opt, tracker, virtual=False):
    """Name the running micro-step in the tracker (the same places the real run wraps in record_function)."""
    for stage in stages:
        _label_stage(stage, tracker, f"@{stage.stage_index}" if virtual else "")
    ostep = opt.step

    def s(*a, **kw):
        tracker.label = "opt"
        out = ostep(*a, **kw)
        tracker.label = "loop"
        return out

    opt.step = s


def _label_stage(stage, tracker, where):
    fwd, bwd = stage.forward_one_chunk, stage.backward_one_chunk

    def f(i, *a, **kw):
        tracker.label = f"F{i}{where}"
        out = fwd(i, *a, **kw)
        tracker.label = "loop"
        return out

    def b(i, *a, **kw):
        tracker.label = f"B{i}{where}"
        out = bwd(i, *a, **kw)
        tracker.label = "loop"
        return out

    stage.forward_one_chunk, stage.backward_one_chunk = f, b


def predict_stage(args, k) -> dict:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from torch.distributed.pipelining import schedules

    dist.init_process_group("fake", store=FakeStore(), rank=k, world_size=args.pp)
    # the fake group's isend/irecv are no-ops, but batch_isend_irecv looks a backend up by the tensors' device,
    # which meta has none of: skip the batching too (schedules.py `_batch_p2p`, `_sorted_batch_p2p`)
    saved = schedules._batch_p2p, schedules._sorted_batch_p2p
    # The Works it returns are kept: a gloo Work holds its tensors until it is dropped, and the schedule keeps
    # waited Works in variables (Schedule1F1B's `send_work` keeps the first forward sends until the 1B1F loop
    # ends), so each stand-in Work holds the op's tensors the same way.
    schedules._batch_p2p = lambda ops, desc=None: [Held(ops)] if ops else []
    schedules._sorted_batch_p2p = lambda ops, desc=None: {0: [Held(ops)]} if ops else {}
    try:
        device = "meta" if args.mode == "meta" else "cpu"
        subs, stages, sched, opt, ids = make_stage(args, k, device)
        indices = [stage.stage_index for stage in stages]
        first, last = 0 in indices, len(args.split_list) - 1 in indices

        step = pp_oracle.user_step(sched, opt, ids, first, last)
        inputs = [ids] if first or last else []
        if args.mode == "cpu":
            return measure_cpu(step, pp_oracle._storage_bytes(pp_oracle._alive(subs, stages, opt, inputs)), k)
        tracker = Tracker()
        for t in pp_oracle._alive(subs, stages, opt, inputs):
            tracker.add(t)
        start = tracker.level
        label(stages, opt, tracker, args.virtual_stages > 1)
        with CpuSdpa(), tracker:
            step()
            step()
            tracker.sweep()
            at_start = tracker.level
            tracker.peak, tracker.measuring = at_start, True
            step()
            tracker.sweep()
        return {"rank": k, "start": start, "at_step_start": at_start, "peak": tracker.peak, "where": tracker.peak_at,
                "steady": tracker.level - at_start}
    finally:
        schedules._batch_p2p, schedules._sorted_batch_p2p = saved
        dist.destroy_process_group()


def measure_cpu(step, start, k) -> dict:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
        step()
        marker = torch.empty(pp_oracle.MARKER_BYTES, dtype=torch.uint8)
        del marker
        step()
    level, before, measuring, peak = 0, 0, False, None
    for e in sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns()):
        n = e.nbytes()
        if n == pp_oracle.MARKER_BYTES:
            measuring, before = True, level
            continue
        if measuring and n == -pp_oracle.MARKER_BYTES:
            continue
        level += n
        if measuring:
            peak = max(peak or level, level)
    return {"rank": k, "start": start, "at_step_start": start + before, "peak": start + peak, "where": None,
            "steady": level - before}


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--schedule", choices=("gpipe", "1f1b", "interleaved-1f1b"), default="gpipe")
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--virtual-stages", type=int, default=1, help="stages per rank (interleaved-1f1b)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--split", default=None)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--mode", choices=("meta", "cpu"), default="meta")
    p.add_argument("--config", default=None, help="a config JSON (tests/pp_oracle.py's cut); else tiny-llama-gqa")
    p.add_argument("--precision", choices=tuple(pp_oracle.PRECISIONS), default="fp32")
    p.add_argument("--stage", type=int, default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if not args.config:  # the research's model: tiny-llama-gqa with --layers layers
        cfg = json.loads((HERE.parents[2] / "fixtures/configs/tiny-llama-gqa.json").read_text())
        cfg["num_hidden_layers"] = args.layers
        args.config = str(Path(tempfile.mkdtemp(), "tiny-llama-gqa.json"))
        Path(args.config).write_text(json.dumps(cfg))
    cfg = json.loads(Path(args.config).read_text())
    args.layers = cfg.get("num_hidden_layers", cfg.get("n_layer"))
    args.split_list = ([int(x) for x in args.split.split(",")] if args.split
                       else pp_oracle.even_split(args.layers, args.pp * args.virtual_stages))
    args.split = args.split_list  # pp_oracle._build reads `split`
    stages = [args.stage] if args.stage is not None else range(args.pp)
    rows = [predict_stage(args, k) for k in stages]
    for r in rows:
        print(f"{args.mode} {args.schedule} pp={args.pp} split={args.split_list} stage {r['rank']}: peak {r['peak']} "
              f"(at step start {r['at_step_start']}) at {r['where']}; steady {r['steady']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"mode": args.mode, "stages": rows}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
