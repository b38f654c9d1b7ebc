"""torch.compile's graphs as vramtrace captures them (tracer/compiled.py) against a real compiled step on the CPU,
graph by graph.

Reproduce: HF_HUB_OFFLINE=1 python benchmarks/bench_compile_graphs.py   (CPU only; Inductor's C++ compile of each
model takes about 20-35 s on 2 cores with cold caches)

Cases: tiny-gpt2 and tiny-llama-gqa (fixtures/configs), fp32, batch 2 × seq 16, train mode, the loss computed by
the model (`labels=`, the same tensor as `input_ids`), transformers' defaults otherwise (use_cache on, so the KV
cache is an output of the forward); the model's outputs are held through the backward.

Per graph, in the order the step runs them (dynamo breaks GPT-2's forward before its loss: two forward graphs and
two backward graphs), bytes above what is alive when the graph starts, at its highest / when it returns:
- naive: `analysis/graph_liveness.py` over the graph's nodes (every node's output a buffer, freed after its last
  use), the forward's inputs kept, the backward's `primals_*` kept;
- scheduler: `CapturedGraph.memory`, the allocations read off Inductor's own scheduler (fusion, in-place reuse,
  the CPU kernel group's flushes: tracer/inductor_code.py `cpu_allocations`);
- real: `torch.compile(model)` (Inductor, default mode) run for real with torch.optim.AdamW; the second step under
  torch.profiler (profile_memory=True): the running sum of the allocator's `[memory]` events inside each
  `## Call CompiledFxGraph ... ##` range (the annotation Inductor's `CompiledFxGraph.__call__` makes while a
  profiler runs), above its value at the range's start. Written from public APIs only (and that annotation's name).
Below each table: what the real backward allocates outside the graphs (AOTAutograd's zero tangents, the loss's
root gradient), which belongs to the step runner, not to the graphs.
"""

from __future__ import annotations

import os
import time

import torch
import transformers

from vramtrace.analysis.graph_liveness import graph_memory
from vramtrace.tracer.compiled import capture

ROOT = os.path.join(os.path.dirname(__file__), "..", "fixtures", "configs")


def captured(cfg):
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.train()
    x = torch.randint(0, cfg.vocab_size, (2, 16), device="meta")
    t = time.time()
    graphs = capture(model, {"input_ids": x, "labels": x}, outputs_held=True)
    return graphs, time.time() - t


def real(cfg):
    """Per compiled-graph call of the measured step: (peak, end) above its start; and the bytes the backward
    allocates outside the graphs (net, and the largest single allocation)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.train()
    compiled = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, cfg.vocab_size, (2, 16))

    def step():
        out = compiled(input_ids=x, labels=x)
        with torch.profiler.record_function("## BACKWARD ##"):
            out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del out

    t = time.time()
    step()
    seconds = time.time() - t
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = list(prof.profiler.kineto_results.events())
    memory = sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns())
    ranges = sorted((e for e in events if e.name().startswith("## Call CompiledFxGraph")), key=lambda e: e.start_ns())
    backward = next(e for e in events if e.name() == "## BACKWARD ##")
    running, sums = 0, []
    for e in memory:
        running += e.nbytes()
        sums.append((e.start_ns(), e.nbytes(), running))
    per_graph = []
    for r in ranges:
        before = next((s for t, _, s in reversed(sums) if t < r.start_ns()), 0)
        inside = [s - before for t, _, s in sums if r.start_ns() <= t <= r.end_ns()]
        per_graph.append((max(inside, default=0), inside[-1] if inside else 0))
    outside = [nb for t, nb, _ in sums if backward.start_ns() <= t <= backward.end_ns()
               and not any(r.start_ns() <= t <= r.end_ns() for r in ranges) and nb > 0]
    return per_graph, outside, seconds


def main() -> None:
    for name in ("tiny-gpt2", "tiny-llama-gqa"):
        cfg = transformers.AutoConfig.from_pretrained(os.path.join(ROOT, f"{name}.json"))
        graphs, capture_s = captured(cfg)
        per_graph, outside, compile_s = real(cfg)
        print(f"\n{name}: capture {capture_s:.1f} s, the real first (compiling) step {compile_s:.1f} s")
        print("| graph | naive peak / end | scheduler peak / end | real peak / end |")
        print("|---|---:|---:|---:|")
        for i, g in enumerate(graphs):
            naive = graph_memory(g.gm, g.kept_inputs())
            real_text = f"{per_graph[i][0]:,} / {per_graph[i][1]:,}" if i < len(per_graph) else "-"
            print(f"| {i} {g.kind} | {naive.peak_bytes:,} / {naive.end_bytes:,} | {g.memory.peak_bytes:,} / "
                  f"{g.memory.end_bytes:,} | {real_text} |")
        print(f"backward allocations outside the graphs: {', '.join(f'{b:,}' for b in outside)} "
              f"(total {sum(outside):,} B)")


if __name__ == "__main__":
    main()
