"""torch.compile's graphs as vramtrace captures them (tracer/compiled.py) against a real compiled step on the CPU.

Reproduce: HF_HUB_OFFLINE=1 python benchmarks/bench_compile_graphs.py   (CPU only; Inductor's C++ compile of each
model takes about 35 s on 2 cores with cold caches)

Cases: tiny-gpt2 and tiny-llama-gqa (fixtures/configs), fp32, batch 2 × seq 16, train mode, the loss computed by
the model (`labels=`), transformers' defaults otherwise (use_cache on, so the KV cache is an output of the
forward).

Columns (bytes):
- captured: the graphs' liveness (analysis/graph_liveness.py): the forward's residue (every forward graph's
  `end_bytes`, summed: the activations saved for the backward and the user outputs) and the backward's highest
  point above the residue (each backward graph's `peak_bytes` over the bytes the earlier ones left).
- real: `torch.compile(model)` (Inductor, default mode) run for real on the CPU with torch.optim.AdamW, the
  second step measured with torch.profiler (profile_memory=True): the running sum of allocator events from the
  step's start, read at a marker allocation made after the forward returns (the residue) and maximised over the
  backward (above the residue). Written from public APIs only.
- The residue is exact. The backward figure counts the intermediates Inductor fuses (graph_liveness.py says what
  is not modelled) and misses what the backward allocates outside the graphs (AOTAutograd's zero tangents for the
  KV cache, and more): docs/compile.md has the figures.
"""

from __future__ import annotations

import os
import time

import torch
import transformers

from vramtrace.analysis.graph_liveness import graph_memory
from vramtrace.tracer.compiled import capture

ROOT = os.path.join(os.path.dirname(__file__), "..", "fixtures", "configs")
MARK = 64 * 7919  # a marker allocation's size in bytes (a multiple of 64: the CPU allocator's alignment)


def captured(cfg) -> tuple[int, int]:
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.train()
    x = torch.randint(0, cfg.vocab_size, (2, 16), device="meta")
    graphs = capture(model, {"input_ids": x, "labels": x})
    residue = sum(graph_memory(g.gm).end_bytes for g in graphs if g.kind == "forward")
    live, peak = 0, 0
    for g in graphs:
        if g.kind == "backward":
            m = graph_memory(g.gm, g.kept_inputs())
            peak, live = max(peak, live + m.peak_bytes), live + m.end_bytes
    return residue, peak


def real(cfg) -> tuple[int, int, float]:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.train()
    compiled = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, cfg.vocab_size, (2, 16))

    def step(mark):
        out = compiled(input_ids=x, labels=x)
        marker = torch.empty(MARK, dtype=torch.uint8) if mark else None
        out.loss.backward()
        del marker
        opt.step()
        opt.zero_grad(set_to_none=True)
        del out

    t = time.time()
    step(False)
    compile_s = time.time() - t
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        step(True)
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    running, at_mark, peak_after = 0, None, 0
    for e in events:
        size = e.nbytes()
        if at_mark is None and size == MARK:
            at_mark = running
            continue
        if at_mark is not None and size == -MARK:
            break
        running += size
        if at_mark is not None:
            peak_after = max(peak_after, running - at_mark)
    return at_mark, peak_after, compile_s


def main() -> None:
    print("| model | forward residue: captured | real | backward above it: captured | real | compile s |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in ("tiny-gpt2", "tiny-llama-gqa"):
        cfg = transformers.AutoConfig.from_pretrained(os.path.join(ROOT, f"{name}.json"))
        residue, bw = captured(cfg)
        real_residue, real_bw, seconds = real(cfg)
        print(f"| {name} | {residue:,} | {real_residue:,} | {bw:,} | {real_bw:,} | {seconds:.1f} |", flush=True)


if __name__ == "__main__":
    main()
