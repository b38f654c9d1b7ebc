"""torch.compile's graphs captured on fake CPU tensors (tracer/compiled.py) and the liveness over one FX graph
(analysis/graph_liveness.py). The comparison with a real compiled step is benchmarks/bench_compile_graphs.py
(Inductor's C++ compile takes about 35 s per model here)."""

from __future__ import annotations

from collections import Counter

import torch
import transformers
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from conftest import FIXTURES
from vramtrace.analysis.graph_liveness import graph_memory
from vramtrace.tracer.compiled import capture, compiled_twin


def _graph(fn, *shapes) -> fx.GraphModule:
    gm = fx.symbolic_trace(fn)
    mode = FakeTensorMode()
    FakeTensorProp(gm, mode).propagate(*(mode.from_tensor(torch.empty(s)) for s in shapes))
    return gm


def test_liveness_frees_after_last_use_and_keeps_outputs():
    """fp32 (8, 8) tensors of 256 B: a = x + 1, b = a * 2 (a dies), c = b.t() (a view of b), d = b + c (b dies
    after d, c is its view), out (d, c). Peak: b, d alive with a just freed -> a + b at b's birth (512), then b + d
    (512); at the end d and b (c's storage) remain: 512; the outputs made: d and b."""
    def f(x):
        a = x + 1
        b = a * 2
        c = b.t()
        d = b + c
        return d, c

    m = graph_memory(_graph(f, (8, 8)))
    assert (m.peak_bytes, m.end_bytes, m.output_bytes) == (512, 512, 512)


def test_inputs_not_kept_are_freed_after_their_last_use():
    """A backward-like graph: saved (index 0) is read once and freed, weight (index 1) is kept; the output
    e = saved @ weight (256 B) is all it makes; at e's birth the graph holds 256 B more than at its start, at its end
    as much as at its start (e in, saved out)."""
    def f(saved, weight):
        e = saved @ weight
        return (e,)

    gm = _graph(f, (8, 8), (8, 8))
    m = graph_memory(gm, kept_inputs={1})
    assert (m.peak_bytes, m.end_bytes) == (256, 0)  # + e, then - saved
    assert graph_memory(gm).end_bytes == 256  # every input kept


def test_gpt2_graphs_as_inductor_compiles_them():
    """Tiny GPT-2 with labels: dynamo breaks the graph before the loss (two forward graphs, two backward graphs,
    the loss's first); the backward graphs give a gradient of each parameter's shape; everything the forward
    graphs keep is their outputs, and each saved tensor is an input of a backward graph; the meta model is left
    as it was."""
    cfg = transformers.AutoConfig.from_pretrained(FIXTURES / "tiny-gpt2.json")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.train()
    x = torch.randint(0, cfg.vocab_size, (2, 16), device="meta")
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    # another test in this worker may have compiled GPT-2's forward for real first (generate's static-cache
    # auto-compile); the capture then leaves its entries on that code (docs/compile.md, a known limitation)
    compiled_before = bool(_debug_get_cache_entry_list(type(model).forward.__code__))
    graphs = capture(model, {"input_ids": x, "labels": x})
    assert [g.kind for g in graphs] == ["forward", "forward", "backward", "backward"]
    assert all(p.device.type == "meta" and p.grad is None for p in model.parameters())
    if not compiled_before:  # nothing compiled is left in dynamo's caches (compiled first here)
        assert _debug_get_cache_entry_list(type(model).forward.__code__) == []
    grads = Counter(tuple(n.meta["val"].shape) for g in graphs if g.kind == "backward"
                    for n in next(n for n in g.gm.graph.nodes if n.op == "output").all_input_nodes
                    if isinstance(n.meta.get("val"), torch.Tensor))
    # besides: the logits' gradient (the loss graph's input) and the tied lm_head's own (autograd sums the two)
    assert not Counter(tuple(p.shape) for p in model.parameters()) - grads
    # Inductor's scheduler: fusion and in-place reuse only lower what the graph's nodes would hold; the forward
    # keeps the same residue; the loss's log-softmax over (32, 512) fp32 logits (65,536 B; the graph's nodes hold
    # two such) is fused away, as the real generated code never allocates it (benchmarks/bench_compile_graphs.py)
    for g in graphs:
        naive = graph_memory(g.gm, g.kept_inputs())
        assert g.memory.peak_bytes <= naive.peak_bytes
        if g.kind == "forward":
            assert g.memory.end_bytes == naive.end_bytes
    loss_forward = graphs[1]
    assert graph_memory(loss_forward.gm).peak_bytes > 2 * 32 * 512 * 4 > 32 * 512 * 4 > loss_forward.memory.peak_bytes
    main_forward, main_backward = graphs[0], graphs[3]
    m = graph_memory(main_forward.gm)
    assert m.end_bytes == m.output_bytes > 0
    saved = {n.name for n in main_backward.gm.graph.nodes if n.op == "placeholder"
             and not n.name.startswith(("primals", "tangents"))}
    outputs = {n.name for n in next(n for n in main_forward.gm.graph.nodes if n.op == "output").all_input_nodes}
    assert saved and saved <= outputs


def test_two_compiles_in_one_process_are_static_and_hold_the_matmul_workspaces():
    """Tiny Llama-GQA under bf16 autocast, compiled twice in one process, at sequence lengths 16 and 24.

    Inductor's `extern_kernels.mm` runs aten.mm.out for the graph's aten.mm.default: the workspace its CPU kernel
    holds (oneDNN's scratchpad of a bf16 matmul on an AVX-512 CPU; none on an AVX2 one) is asked of the probe for
    that op and held while the kernel runs. The probe here reports an odd-sized workspace for every mm, as a CPU
    with scratchpads would; before the overload packets were matched, no graph held one.

    dynamo's automatic dynamic shapes remember the sizes each code object was compiled with
    (torch/_dynamo/pgo.py `update_automatic_dynamic`), so the second compile had symbolic sizes and failed (the
    backward saved SymInts). The twin compiles with static shapes, as a fresh process's first compile does."""
    odd = 3_000_017
    asked = []

    def workspace(func, args, kwargs, out):
        asked.append(str(func))
        return (odd if func is torch.ops.aten.mm.default else 0), out

    cfg = transformers.AutoConfig.from_pretrained(FIXTURES / "tiny-llama-gqa.json")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.train()
    for seq in (16, 24):
        x = torch.randint(0, cfg.vocab_size, (2, seq), device="meta")
        with compiled_twin(model, (), {"input_ids": x, "labels": x, "use_cache": False}, lambda out: out["loss"],
                           torch.bfloat16, workspace=workspace) as twin:
            held = [e for g in twin.graphs for e in g.memory.program.events if e[0] == "workspace"]
            sizes = [s for g in twin.graphs for n in g.gm.graph.nodes if n.op == "placeholder"
                     and isinstance(n.meta.get("val"), torch.Tensor) for s in n.meta["val"].shape]
        # one per matmul: 7 per layer and the lm_head in the forward, twice that in the backward
        assert len(held) == 3 * (2 * 7 + 1) and all(e[1] == odd and e[3] == "aten.mm.default" for e in held)
        assert asked.count("aten.mm.default") == len(held)
        assert 2 * seq in sizes and all(type(s) is int for s in sizes)  # the tokens, flattened, as an int
        asked.clear()
