"""`--compile` (tracer/compiled_step.py): the compiled training step against a real `torch.compile(model)` step on
the CPU (Inductor's C++ backend; tests/oracle.py, public APIs only). The full matrix (GPT-2, Llama-GQA, BERT, the
ConvNet; fp32 and bf16-mixed; with and without checkpointing) is benchmarks/bench_compile_accuracy.py: a real
compile takes 20-35 s on 2 cores, so the suite runs the case that covers the most of the tracer (checkpointing's
recompute, Inductor's buffer reuse, fallback kernels with workspaces)."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
import torch

from conftest import FIXTURES, deep_config
from oracle import measure_cpu_peak
from tolerance import assert_within
from vramtrace import RunSpec, analyze
from vramtrace.errors import UsageError
from vramtrace.render.html import render_html
from vramtrace.tracer import compiled
from vramtrace.tracer.compiled import GraphProgram, run_program
from vramtrace.tracer.probe import CpuWorkspaceProbe
from vramtrace.tracer.records import ZERO_GRADIENT_NAME


def test_compiled_step_matches_real_compiled_cpu_step(monkeypatch):
    """Tiny Llama-GQA, fp32, per-layer checkpointing: the recompute runs inside the backward graph (dropout's RNG
    state saved), where Inductor's memory planning holds freed buffers for reuse, and the CPU flash attention's
    fallback kernels hold their outputs and a workspace. use_cache off, as in training with checkpointing: no
    second step traced without the KV cache (suite time). The eager step the report sets beside it is checked
    against a real eager step too; it is traced in this process (as on a one-core machine: no second Python to
    start, suite time), so the caller's state checked after is also what that trace left; the second-process
    path gives the same `compiled` summary (test_replicated_compiled_step_equals_every_layer_compiled)."""
    monkeypatch.setattr("vramtrace.second_process.cores", lambda: 1)
    spec = RunSpec(str(FIXTURES / "tiny-llama-gqa.json"), batch=8, seq=128, device="cpu", precision="fp32",
                   checkpointing="layers", use_cache=False, compile=True)
    torch.manual_seed(1234)
    rng, dynamo_config = torch.get_rng_state(), torch._dynamo.config.get_config_copy()
    report = analyze(spec, levers=False)
    # the library left the caller's RNG, dynamo's configuration and grad mode as they were
    assert torch.equal(torch.get_rng_state(), rng) and torch._dynamo.config.get_config_copy() == dynamo_config
    assert torch.is_grad_enabled()
    measured = measure_cpu_peak(spec)
    assert_within(report.peak_allocated_bytes, measured, 0.001)
    c = report.compiled
    eager = measure_cpu_peak(replace(spec, compile=False))
    assert_within(c.peak_allocated_bytes_eager, eager, 0.001)
    assert c.forward_graphs == c.backward_graphs >= 1  # AOTAutograd pairs each forward graph with a backward
    assert all(r.count > 0 and r.op for r in c.recomputed)
    # the checkpointed layers' forward runs again in the backward graph
    assert any(r.module.startswith("model.layers.*") for r in c.recomputed)
    # the HTML draws the compiled and the eager timelines side by side; the eager step stays out of the JSON
    data = re.search(r'<script type="application/json" id="vramtrace-data">(.*?)</script>',
                     render_html(*report.html_pages()), re.S)
    pages = json.loads(data.group(1))["reports"]
    assert [p["label"] for p in pages] == ["torch.compile", "eager"]
    assert [p["peak_bytes"] for p in pages] == [report.peak_allocated_bytes, c.peak_allocated_bytes_eager]
    assert "eager" not in report.to_dict() and report.eager.compiled is None


def test_run_program_repeats_allocations_reuse_aliases_and_frees():
    """A program over a (4,) fp32 input `x`: buf0 (16 B) allocated, buf1 takes over buf0's storage (a reuse),
    buf2 views buf1, x is deleted, buf1 is deleted (buf2 still holds the storage); the output views buf2's storage
    at offset 1, and the caller's input list is emptied."""
    program = GraphProgram(("x",), (
        ("alloc", "buf0", (4,), (1,), torch.float32, "m", "aten.mul.Tensor"),
        ("reuse", "buf1", "buf0", "n", "aten.add.Tensor", (2, 2), (2, 1)), ("alias", "buf2", "buf1"), ("free", "x"),
        ("free", "buf1")),
        (("buf2", (3,), (1,), 1, torch.float32), None, 7))
    seen = []
    with torch._subclasses.fake_tensor.FakeTensorMode():
        x = torch.empty(4)
        inputs = [x]
        out = run_program(program, inputs, lambda t, module, op, reused: seen.append((tuple(t.shape), module, op,
                                                                                     reused)))
    # the reuse reports the dying buffer's tensor and the new buffer's sizes
    assert inputs == [] and seen == [((4,), "m", "aten.mul.Tensor", None), ((4,), "n", "aten.add.Tensor", (2, 2))]
    assert out[1:] == [None, 7]
    assert out[0].shape == (3,) and out[0].storage_offset() == 1
    assert out[0].untyped_storage()._cdata != x.untyped_storage()._cdata


def test_a_repeated_compile_finds_its_lowered_graphs_and_reports_the_same(tmp_path, monkeypatch):
    """With the probe's disk cache on, a second analysis of the same compiled step lowers no graph: each graph's
    memory comes from `LoweredGraphCache` (keyed by Inductor's FX-graph cache key), and the report is the first's."""
    monkeypatch.setenv("VRAMTRACE_CPU_PROBE_CACHE", str(tmp_path))
    monkeypatch.setattr("vramtrace.second_process.cores", lambda: 1)  # the eager comparison here: no second process
    spec = RunSpec(str(FIXTURES / "tiny-gpt2.json"), batch=2, seq=32, device="cpu", precision="bf16-mixed",
                   use_cache=False, compile=True)
    first = analyze(spec, levers=False)
    graphs = first.compiled.forward_graphs + first.compiled.backward_graphs
    assert graphs >= 2 and len(list((tmp_path / "inductor-graphs").glob("*.pkl"))) == graphs  # one per graph

    def lowered_again(*args, **kwargs):
        raise AssertionError("a graph was lowered again")

    monkeypatch.setattr(compiled, "_lower_and_generate", lowered_again)
    again = analyze(spec, levers=False)
    # the number of recorded ops included: dynamo's guards read the fake parameters' `.device` (`prim.device`)
    # once more after a graph was lowered in this process than after a hit, and such reads are not recorded
    assert again.to_dict() == first.to_dict()


def test_lowered_graph_cache_keeps_the_probe_records_and_no_failure(tmp_path):
    """An entry carries what the workspace probe recorded while the graph was lowered (notes, extrapolations),
    applied to the probe of the run that finds it; a graph whose probe failed is not kept."""
    memory = compiled.InductorMemory(5, 1, ("buf1",), (), GraphProgram(("x",), (("free", "x"),), ()))
    cache = compiled.LoweredGraphCache(lambda kept: tmp_path / f"{sorted(kept or ())}.pkl")
    probe = CpuWorkspaceProbe()
    probe.extrapolated["aten.mm.default"] = "before the graph"
    before = cache.probe_records(probe)
    probe.notes["aten.native_layer_norm.default"] = "bf16 mean"
    probe.extrapolated["aten.addmm.default"] = "sizes cut"
    cache.put(None, memory, before, probe)
    probe.failures["aten.bmm.default"] = "out of memory"
    cache.put({"primals_1"}, memory, before, probe)
    fresh = CpuWorkspaceProbe()
    assert cache.get({"primals_1"}, fresh) is None
    assert cache.get(None, fresh) == memory
    assert fresh.notes == {"aten.native_layer_norm.default": "bf16 mean"}
    assert fresh.extrapolated == {"aten.addmm.default": "sizes cut"} and fresh.failures == {}


@pytest.mark.parametrize("extra,message", [
    ({"device": "cuda"}, "compile is traced for device cpu only"),
    ({"device": "cpu", "mode": "inference"}, "compile models a training step"),
    ({"device": "cpu", "lora_rank": 8}, "compile with lora_rank is not traced yet"),
    ({"device": "cpu", "optimizer": "adamw-8bit"}, "compile with bitsandbytes' optimizer adamw-8bit"),
    ({"device": "cpu", "compile_mode": "reduce-overhead"}, "unknown compile_mode 'reduce-overhead'"),
])
def test_compile_refuses_what_it_does_not_trace(extra, message):
    with pytest.raises(UsageError, match=message):
        RunSpec(str(FIXTURES / "tiny-gpt2.json"), batch=1, seq=8, compile=True, **extra)


def test_replicated_compiled_step_equals_every_layer_compiled(tmp_path, monkeypatch):
    """A 6-layer tiny Llama: the compiled step traced on 5 layers with layer 2 replicated (`LayerPlan.head` 2,
    Inductor's reused buffers as new records, interchangeable buffers freed first born first) has the peak, the
    activations and the compiled-graph summary of the step traced on all 6 compiled layers. With the KV cache on
    (the harder case, and the only one in the suite: each analysis compiles twice), the backward first makes a zero
    gradient for every layer's cached keys and values (outside the layers' modules), each reused by its layer's
    backward graph. The first analysis traces the eager comparison in a second process, the second in this one (as
    on a one-core machine): the `compiled` summaries, eager figures included, are equal."""
    spec = RunSpec(deep_config(tmp_path, "tiny-llama-gqa", 6), batch=2, seq=64, device="cpu", precision="fp32",
                   use_cache=True, compile=True)
    said: list[str] = []
    replicated = analyze(spec, said.append, levers=False)
    assert "compiled and traced 5 of 6 layers; layer 2 replicated" in replicated.run.trace
    assert "the same step without torch.compile (in a second process)" in said
    monkeypatch.setattr("vramtrace.second_process.cores", lambda: 1)
    said.clear()
    full = analyze(replace(spec, replicate_layers=False), said.append, levers=False)
    assert "the same step without torch.compile" in said
    assert replicated.peak_allocated_bytes == full.peak_allocated_bytes
    assert replicated.compiled == full.compiled
    assert replicated.breakdown_at_peak == full.breakdown_at_peak
    # the zero gradients the compiled backward materializes: the logits (batch, seq, vocab) the model returns beside
    # its loss, and each layer's cached keys and values (batch, kv heads, seq, head dim)
    for report in (replicated, full):
        zeros = sorted(t.shape for t in report.tensors if t.name == ZERO_GRADIENT_NAME)
        assert zeros == sorted([(2, 64, 512)] + [(2, 2, 64, 16)] * 12), zeros


def test_a_compile_mode_sets_its_inductor_options_while_the_graphs_compile():
    """`--compile-mode max-autotune-no-cudagraphs`: while the graphs compile, Inductor's config holds that mode's
    options (torch._inductor.list_mode_options, as torch.compile's `apply_mode` sets them) and the FX-graph cache is
    off; after, the caller's config is back. The real step under that mode against a real `torch.compile(model,
    mode=...)` run is benchmarks/bench_compile_accuracy.py's last row (its autotuning compiles take minutes)."""
    import contextlib

    from torch._inductor import config as inductor_config

    options = torch._inductor.list_mode_options("max-autotune-no-cudagraphs")
    assert options and all(isinstance(v, bool) for v in options.values())
    before = inductor_config.get_config_copy()
    with contextlib.ExitStack() as stack:
        compiled._compile_settings(stack, "max-autotune-no-cudagraphs")
        assert all(getattr(inductor_config, k) == v for k, v in options.items())
        assert inductor_config.fx_graph_cache is False
    assert inductor_config.get_config_copy() == before
