"""Ground truth for pipeline parallelism: a REAL multi-process gloo run of torch.distributed.pipelining, per stage.

Like tests/oracle.py this module imports nothing from vramtrace (tests/test_oracle_independent.py checks it): the model,
the cut into stages, the loss, the schedule, the optimizer and the loop are all written out here from public APIs.

`measure_pp_peaks(config_path, pp=P, schedule="gpipe"|"1f1b", split=(...), micro_batches=M, batch=B, seq=S,
precision="fp32"|"bf16-mixed", checkpointing=False|True)` runs P CPU processes over gloo (forked from a fork
server that has imported torch, transformers and torch.distributed.pipelining once), one thread each, and returns
one dict per stage (index = stage = rank):

- the model: `AutoConfig.for_model` of the JSON, `AutoModelForCausalLM.from_config(config,
  attn_implementation="sdpa")` (seed 0, fp32 weights, `train()`), built whole on every rank and then cut by hand the
  way users of torch.distributed.pipelining cut HF models (torchtitan's manual `PipelineStage` per rank, `_Stage`):
  stage 0 = the embeddings (+ GPT-2's position embeddings and embedding dropout) + its decoder layers; a middle
  stage = its decoder layers; the last stage = its decoder layers + the final norm + `lm_head`. Llama-like models
  (Llama, Qwen2, Mistral: `model.model.layers`, `rotary_emb`) keep the rotary module on every stage, which computes
  (cos, sin) from `position_ids = arange(seq)` per micro-batch (as `LlamaModel.forward` does once per forward). No
  attention mask crosses stages, so transformers' sdpa runs `is_causal=True`. Tied embeddings (GPT-2) end up as one
  parameter per end: each rank keeps only its own stage of its own copy of the model.
- `split`: decoder layers per stage (0 allowed), else the even split with the remainder on the earliest stages.
- the loss: `model.loss_function` (ForCausalLMLoss, token mean) with `vocab_size`, given to the schedule as
  `loss_fn`; the labels are the input ids, passed as `target=` to the last stage.
- the schedule: `ScheduleGPipe` / `Schedule1F1B(stage, n_microbatches=M, loss_fn=loss_fn)` with their defaults
  (`scale_grads=True`, `return_outputs=True`), the stage `PipelineStage(module, rank, P, cpu)` with dynamic metadata
  inference (no `input_args`), `batch` rows per step split into M micro-batches. "interleaved-1f1b":
  `ScheduleInterleaved1F1B([stages], ...)` with V virtual stages per rank (P * V stages, rank r holding stages r,
  r + P, ..., torch's loop placement), one AdamW over the rank's parameters; figures are then per rank.
  "zero-bubble": `ScheduleInterleavedZeroBubble([stages], ...)`, the same placement, its backward split into the
  input gradient ("B<i>") and the weight gradient ("W<i>", `backward_weight_one_chunk`).
- precision "bf16-mixed": fp32 weights and `torch.autocast("cpu", dtype=torch.bfloat16)` around the body of each
  stage's forward (`_Stage.forward`): each rank autocasts its own piece of the model, as tests/oracle.py autocasts the
  whole model's forward for one process. The schedule calls `loss_fn` on the last stage's output outside that
  forward, so the loss runs outside autocast (ForCausalLMLoss upcasts the logits to fp32 itself).
- `checkpointing=True`: each decoder layer of a stage runs under `torch.utils.checkpoint.checkpoint(layer, h, ...,
  use_reentrant=False)` (its other defaults: the RNG state preserved, the default determinism check) in the stage's
  own forward (`_Stage._layer`), inside the stage's autocast: what a user who cuts the model by hand writes to
  checkpoint every layer of a stage.
- each stage its own `torch.optim.AdamW(stage parameters)` (a stage without parameters, a middle stage of 0 layers,
  has no optimizer); the loop on every rank: `out = schedule.step(ids)` (first) / `schedule.step(target=ids,
  losses=[])` (last) / `schedule.step()` (middle); `del out; opt.step(); opt.zero_grad()`.
- the measurement, as tests/oracle.py measures one process: the bytes of the storages alive before the first step
  (parameters, buffers, this rank's input ids) + the running sum of the profiler's `[memory]` events from the first
  warm-up on, maximised over the third (measured) step, which a marker allocation separates. Returned per stage:
  `peak_bytes`, `at_step_start` (bytes alive when the measured step starts), `at` (the micro-step running at the
  peak: "F<i>", "B<i>", "opt" or "loop"; the micro-steps are wrapped in `record_function`), `recv_buffer_bytes` (the
  stage's receive buffers, kept for its life) and `params_bytes`.
- clean check: a free made on a thread the profiler does not listen to has no event. Each rank walks what the loop
  keeps (stage module, receive buffers, schedule caches, optimizer state) after the steps: it must equal the bytes
  at start + the sum of every event, and the measured step must end where it started; else the steps run again
  (a warm step, the marker, the measured step) up to `attempts` times, every rank together.
"""

from __future__ import annotations

import functools
import gc
import itertools
import json
import os
import re
import sys
import warnings
from pathlib import Path

import torch

from oracle import run_rank_processes

MARKER_BYTES = 1_234_577  # a size no tiny case allocates: marks where the measured step starts
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")
MULTI_STAGE = ("interleaved-1f1b", "zero-bubble")  # schedules of V stages per rank
PRECISIONS = {"fp32": None, "bf16-mixed": torch.bfloat16}


def even_split(layers: int, pp: int) -> list[int]:
    """Decoder layers per stage: `layers // pp` each, the remainder on the earliest stages."""
    return [layers // pp + (1 if k < layers % pp else 0) for k in range(pp)]


def _config(path: str):
    import transformers

    cfg = json.loads(Path(path).read_text())
    return transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)


class _Stage(torch.nn.Module):
    """A contiguous piece of a causal LM: [embeddings] + decoder layers [lo, hi) + [final norm + lm_head]."""

    def __init__(self, model, lo: int, hi: int, first: bool, last: bool, autocast, checkpointing: bool = False):
        super().__init__()
        self.autocast, self.checkpointing = autocast, checkpointing
        self.gpt2 = hasattr(model, "transformer")
        base = model.transformer if self.gpt2 else model.model
        if self.gpt2:  # GPT2Model: wte + wpe, embedding dropout, blocks `h`, final `ln_f`
            self.embed_tokens = base.wte if first else None
            self.embed_positions = base.wpe if first else None
            self.drop = base.drop if first else None
            self.layers = torch.nn.ModuleList(base.h[lo:hi])
            self.norm = base.ln_f if last else None
            self.rotary_emb = None
        else:  # LlamaModel and its kin: embed_tokens, layers, rotary_emb, norm
            self.embed_tokens = base.embed_tokens if first else None
            self.layers = torch.nn.ModuleList(base.layers[lo:hi])
            self.rotary_emb = base.rotary_emb
            self.norm = base.norm if last else None
        self.lm_head = model.lm_head if last else None

    def forward(self, x):
        if self.autocast is None:
            return self._body(x)
        with torch.autocast("cpu", dtype=self.autocast):
            return self._body(x)

    def _body(self, x):
        h = self.embed_tokens(x) if self.embed_tokens is not None else x
        pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        if self.gpt2:  # GPT2Model.forward: inputs_embeds + wpe(position_ids), then dropout
            if self.embed_positions is not None:
                h = self.drop(h + self.embed_positions(pos))
            for layer in self.layers:
                h = self._layer(layer, h, None, None)  # no cache, no attention mask (sdpa: is_causal)
        else:  # LlamaModel.forward: (cos, sin) once, each decoder layer with them
            pe = self.rotary_emb(h, position_ids=pos)
            for layer in self.layers:
                h = self._layer(layer, h, attention_mask=None, position_ids=pos, position_embeddings=pe)
        if self.lm_head is not None:
            h = self.lm_head(self.norm(h))
        return h

    def _layer(self, layer, h, *args, **kwargs):
        """One decoder layer on `h`, under non-reentrant activation checkpointing when the case asks for it."""
        if not self.checkpointing:
            return layer(h, *args, **kwargs)
        from torch.utils.checkpoint import checkpoint

        return checkpoint(layer, h, *args, use_reentrant=False, **kwargs)


def _stage_indices(case, rank: int) -> list[int]:
    """The stages `rank` holds: itself, or with V virtual stages rank, rank + P, ..., rank + (V - 1) P (the
    interleaved schedules' loop placement, torch's `ScheduleInterleaved1F1B` stage_index = rank + i * P)."""
    return [rank + v * case.pp for v in range(case.virtual_stages)]


def _build(case, rank: int):
    """([stage module of each stage `rank` holds], loss_fn, input ids); the rest of the model dropped."""
    import transformers

    config = _config(case.config)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model.train()
    bounds = list(itertools.accumulate(case.split, initial=0))
    last = len(case.split) - 1
    subs = [_Stage(model, bounds[k], bounds[k + 1], k == 0, k == last, PRECISIONS[case.precision],
                   case.checkpointing) for k in _stage_indices(case, rank)]
    loss_fn = functools.partial(model.loss_function, vocab_size=config.vocab_size)
    torch.manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (case.batch, case.seq))
    del model
    gc.collect()
    return subs, loss_fn, ids


class _NoOptimizer:
    """A stage with no parameters: the user's loop has no optimizer to step."""

    state: dict = {}

    def step(self):
        pass

    def zero_grad(self):
        pass


def _instrument(stages, opt, virtual: bool) -> None:
    """`record_function` ranges around each micro-step ("F<i>", "B<i>", "W<i>"; with virtual stages
    "F<i>@<stage>") and the optimizer step (they allocate nothing)."""
    from torch.profiler import record_function

    for stage in stages:
        where = f"@{stage.stage_index}" if virtual else ""
        fwd, bwd = stage.forward_one_chunk, stage.backward_one_chunk

        def f(i, *a, _fwd=fwd, _where=where, **k):
            with record_function(f"F{i}{_where}"):
                return _fwd(i, *a, **k)

        def b(i, *a, _bwd=bwd, _where=where, **k):
            with record_function(f"B{i}{_where}"):
                return _bwd(i, *a, **k)

        wgt = stage.backward_weight_one_chunk

        def w(i, *a, _w=wgt, _where=where, **k):
            with record_function(f"W{i}{_where}"):
                return _w(i, *a, **k)

        stage.forward_one_chunk, stage.backward_one_chunk, stage.backward_weight_one_chunk = f, b, w
    ostep = opt.step

    def s(*a, **k):
        with record_function("opt"):
            return ostep(*a, **k)

    opt.step = s


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            s = t.untyped_storage()
            if s.nbytes() and s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                total += s.nbytes()
    return total


def _recv_buffers(stages):
    for stage in stages:
        for infos in list(stage.args_recv_info.values()) + list(getattr(stage, "grad_recv_info", {}).values()):
            for info in infos:
                if getattr(info, "buffer", None) is not None:
                    yield info.buffer


def _alive(subs, stages, opt, inputs):
    """Every tensor the rank's stages, their schedule caches, the optimizer and the loop keep between steps."""
    from torch.utils._pytree import tree_leaves

    for sub in subs:
        yield from sub.parameters()
        yield from sub.buffers()
        yield from (p.grad for p in sub.parameters())
    for st in opt.state.values():
        yield from st.values()
    yield from inputs
    for buffer in _recv_buffers(stages):
        yield buffer
        yield buffer.grad
    for stage in stages:
        yield from tree_leaves(list(stage.output_chunks))
        for out, ins in stage.fwd_cache.values():
            yield from tree_leaves(out)
            yield from tree_leaves(ins)
        yield from tree_leaves(list(stage.bwd_cache.values()))


def _profile(step, warm_steps: int):
    """`warm_steps` steps, the marker, one measured step under the profiler: ([memory] sizes in time order, split
    index of the marker, the (start, end, name) of the micro-step ranges, the events' times)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        for _ in range(warm_steps):
            step()
        marker = torch.empty(MARKER_BYTES, dtype=torch.uint8)
        del marker
        step()
    events = prof.profiler.kineto_results.events()
    memory = sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns())
    ranges = [(e.start_ns(), e.start_ns() + e.duration_ns(), e.name()) for e in events
              if re.fullmatch(r"[FBW]\d+(@\d+)?|opt", e.name())]
    return [(e.nbytes(), e.start_ns()) for e in memory], ranges


def _levels(memory) -> tuple[int, int, int, int, int]:
    """(total of all events, level at the marker, peak level over the measured step, its time, level at the end),
    the levels relative to the first event."""
    level, before, measuring, peak, peak_t, total = 0, 0, False, None, None, 0
    for n, t in memory:
        total += n
        if n == MARKER_BYTES and not measuring:
            measuring, before = True, level
            continue
        if measuring and n == -MARKER_BYTES:
            continue
        level += n
        if measuring and (peak is None or level > peak):
            peak, peak_t = level, t
    return total, before, before if peak is None else peak, peak_t, level


def _measure(subs, stages, opt, inputs, step, attempts: int) -> dict:
    """Profiled steps until clean on every rank (see the module docstring); the stage's figures."""
    import torch.distributed as dist

    warm_steps = 2
    for _ in range(attempts):
        start = _storage_bytes(_alive(subs, stages, opt, inputs))
        memory, ranges = _profile(step, warm_steps)
        total, before, peak, peak_t, end_level = _levels(memory)
        lost = start + total - _storage_bytes(_alive(subs, stages, opt, inputs))
        result = {"stage": dist.get_rank(), "peak_bytes": start + peak, "at_step_start": start + before,
                  "at": next((name for s, e, name in reversed(ranges) if s <= (peak_t or -1) <= e), "loop"),
                  "lost": lost, "steady": end_level - before,
                  "recv_buffer_bytes": _storage_bytes(_recv_buffers(stages)),
                  "params_bytes": _storage_bytes(p for sub in subs for p in sub.parameters()),
                  "stages": [stage.stage_index for stage in stages]}
        clean = torch.tensor([int(lost == 0 and result["steady"] == 0)])
        dist.all_reduce(clean, op=dist.ReduceOp.MIN)
        if clean.item():
            return result
        warm_steps = 1  # warm already: one step re-establishes the steady state before the marker
    raise RuntimeError(f"oracle: no clean pipeline measurement in {attempts} runs (last: {result})")


def user_step(sched, opt, ids, first: bool, last: bool):
    """The user's loop body on a rank (a function of no arguments): one pipeline step, then the optimizer."""

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

    return step


def _rank_main(rank: int, case, init_file: str, out_dir: str) -> None:
    """One stage (a child process): build, cut, schedule, measure; its figures or its traceback go to a file."""
    import traceback

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    try:
        import torch.distributed as dist
        from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                                  ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble)

        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=case.pp)
        try:
            subs, loss_fn, ids = _build(case, rank)
            n_stages = len(case.split)
            indices = _stage_indices(case, rank)
            first, last = 0 in indices, n_stages - 1 in indices
            stages = [PipelineStage(sub, k, n_stages, torch.device("cpu")) for sub, k in zip(subs, indices)]
            if case.schedule in MULTI_STAGE:
                cls = {"interleaved-1f1b": ScheduleInterleaved1F1B,
                       "zero-bubble": ScheduleInterleavedZeroBubble}[case.schedule]
                sched = cls(stages, n_microbatches=case.micro_batches, loss_fn=loss_fn)
            else:
                cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[case.schedule]
                sched = cls(stages[0], n_microbatches=case.micro_batches, loss_fn=loss_fn)
            # one optimizer over the rank's parameters (all its stages'), none when it holds none
            params = [p for sub in subs for p in sub.parameters()]
            opt = torch.optim.AdamW(params) if params else _NoOptimizer()
            _instrument(stages, opt, case.virtual_stages > 1)
            step = user_step(sched, opt, ids, first, last)
            result = _measure(subs, stages, opt, [ids] if first or last else [], step, case.attempts)
        finally:
            dist.destroy_process_group()
    except BaseException:
        result = {"error": traceback.format_exc()}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def _case(config_path, pp, schedule, split, micro_batches, batch, seq, precision, attempts, virtual_stages,
          checkpointing=False):
    import types

    if schedule not in SCHEDULES:
        raise ValueError(f"oracle: schedule {schedule!r} is not one of {SCHEDULES}")
    virtual_stages = virtual_stages or (2 if schedule in MULTI_STAGE else 1)
    if (virtual_stages > 1) != (schedule in MULTI_STAGE):
        raise ValueError(f"oracle: virtual stages (more than one stage per rank) go with {MULTI_STAGE} only")
    if precision not in PRECISIONS:
        raise ValueError(f"oracle: precision {precision!r} is not one of {tuple(PRECISIONS)}")
    cfg = json.loads(Path(config_path).read_text())
    layers = cfg.get("num_hidden_layers", cfg.get("n_layer"))
    n_stages = pp * virtual_stages
    split = list(split) if split is not None else even_split(layers, n_stages)
    if len(split) != n_stages or sum(split) != layers or min(split) < 0:
        raise ValueError(f"oracle: split {split} must give {n_stages} stages summing to the {layers} layers")
    if batch % micro_batches:
        raise ValueError(f"oracle: batch {batch} is not a multiple of micro_batches {micro_batches}")
    return types.SimpleNamespace(config=str(config_path), pp=pp, schedule=schedule, split=split,
                                 micro_batches=micro_batches, batch=batch, seq=seq, precision=precision,
                                 attempts=attempts, virtual_stages=virtual_stages, checkpointing=bool(checkpointing))


def measure_pp_peaks(config_path, *, pp: int, schedule: str = "1f1b", split=None, micro_batches: int | None = None,
                     batch: int = 8, seq: int = 32, precision: str = "fp32", virtual_stages: int | None = None,
                     checkpointing: bool = False, attempts: int = 5, timeout: float = 600.0) -> list[dict]:
    """Each stage's figures (index = stage = rank) of the pipeline step run for real on P gloo CPU ranks (module
    docstring). `micro_batches` None means M = P. "interleaved-1f1b": `ScheduleInterleaved1F1B` with
    `virtual_stages` V (default 2) stages per rank, rank r holding stages r, r + P, ...; `split` then gives the
    layers of each of the P * V stages, and each entry is a rank's (its `stages` listed); "zero-bubble" likewise
    (`ScheduleInterleavedZeroBubble`). `checkpointing`: each decoder layer of every stage under non-reentrant
    `torch.utils.checkpoint` (module docstring). Raises ValueError for a
    case it cannot run, RuntimeError when a rank fails or stays unclean, TimeoutError past `timeout` seconds."""
    import multiprocessing as mp
    import tempfile

    case = _case(config_path, pp, schedule, split, micro_batches or pp, batch, seq, precision, attempts,
                 virtual_stages, checkpointing)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__, "transformers.modeling_utils", "torch.distributed.pipelining",
                                "transformers.models.llama.modeling_llama", "transformers.models.gpt2.modeling_gpt2"])
    with tempfile.TemporaryDirectory(prefix="pp-oracle-") as tmp:
        results, _stopped, _codes = run_rank_processes(
            ctx, pp, lambda r: (_rank_main, (r, case, os.path.join(tmp, "store"), tmp), f"pp-oracle-rank{r}"),
            tmp, timeout, "pipeline case")
    errors = [f"stage {r}:\n{res['error']}" for r, res in enumerate(results) if "error" in res]
    if errors or not all("peak_bytes" in res for res in results):
        raise RuntimeError("oracle: a stage of the pipeline case failed\n" + "\n".join(errors))
    return results



if __name__ == "__main__":  # python tests/pp_oracle.py CONFIG PP SCHEDULE [SPLIT] [M] [PRECISION]
    a = sys.argv[1:]
    rows = measure_pp_peaks(a[0], pp=int(a[1]), schedule=a[2],
                            split=[int(x) for x in a[3].split(",")] if len(a) > 3 and a[3] != "-" else None,
                            micro_batches=int(a[4]) if len(a) > 4 else None,
                            precision=a[5] if len(a) > 5 else "fp32")
    for row in rows:
        print(json.dumps(row))
