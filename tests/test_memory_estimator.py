"""The "graph-optimal" peak (every non-persistent storage freed at its last use) against PyTorch's own estimator
of the same thing: `torch/_inductor/fx_passes/memory_estimator.py`'s `build_memory_profile`, run over the
recorded step written as an FX graph of storages.

The graph is built here from the trace's records with torch.fx only: one placeholder per storage alive at the
step's start, then per op a node allocating its new storages (their FakeTensor stand-ins, one uint8 tensor of
the storage's bytes each, as `meta["val"]`) followed by one node per storage handing it on, so that an op's
arguments are exactly the storages it reads (the estimator's `GraphAliasTracker` counts every output of an
argument node as used). A storage the step leaves alive for the next one is an argument of the output node.
What the estimator releases and when is its own code: last use by its reverse walk, fresh allocations by
storage identity, persistent storages (parameters, optimizer states, inputs) not releasable.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch._inductor.fx_passes.memory_estimator import build_memory_profile
from torch._subclasses.fake_tensor import FakeTensorMode

from conftest import FIXTURES
from seam import step_tables
from vramtrace import RunSpec
from vramtrace.analysis.categories import PERSISTENT
from vramtrace.analysis.liveness import interval, round_block


def _op(*reads):
    """Stands for a recorded op in the graph (never run)."""


def _hand_on(allocator):
    """Hands one storage of its allocating op to the ops that read it (never run)."""


def storage_graph(tables) -> tuple[fx.Graph, set[fx.Node]]:
    """The steady step of `tables` (a `vramtrace.tables.StepTables`) as an FX graph of storages, and the nodes
    whose storages the estimator may release."""
    traced, step = tables.traced, tables.traced.steps - 1
    ops = [o for o in traced.ops if o.step == step]
    first, last = ops[0].index, ops[-1].index
    rows = {}
    for r in tables.table:
        size = round_block(r.nbytes, tables.block)
        if r.device in traced.counted_devices and size and interval(r.op_index, r.free_after, first, last):
            rows[r.sid] = (r, size)
    graph, holder, releasable = fx.Graph(), {}, set()
    with FakeTensorMode():
        stand_in = {sid: torch.empty(size, dtype=torch.uint8, device="meta") for sid, (_, size) in rows.items()}
    for sid, (r, _) in rows.items():
        if r.op_index < first:
            node = holder[sid] = graph.placeholder(f"s{sid}")
            node.meta["val"] = stand_in[sid]
            if r.category not in PERSISTENT:
                releasable.add(node)
    for o in ops:
        node = graph.call_function(_op, tuple(holder[s] for s in dict.fromkeys(o.reads) if s in holder))
        born = [s for s in o.allocates if s in rows and rows[s][0].op_index == o.index]
        node.meta["val"] = tuple(stand_in[s] for s in born)
        for s in born:
            holder[s] = graph.call_function(_hand_on, (node,))
            holder[s].meta["val"] = stand_in[s]
        kinds = {rows[s][0].category in PERSISTENT for s in born}
        assert len(kinds) <= 1, f"{o.name} allocates persistent and other storages: one allocator node cannot say"
        if kinds == {False}:
            releasable.add(node)
    # alive after the step: persistent, freed after it, or used after it
    kept = [holder[s] for s, (r, _) in rows.items() if s in holder and (
        r.category in PERSISTENT or r.free_after is None or r.free_after > last or r.last_use > last)]
    graph.output(tuple(kept))
    return graph, releasable


@pytest.mark.parametrize("fixture,device,precision,checkpointing", [
    ("tiny-gpt2.json", "cuda", "fp32", "none"),
    ("tiny-llama-gqa.json", "cuda", "bf16-mixed", "layers"),
    ("tiny-llama-gqa.json", "cpu", "bf16-mixed", "none"),
    ("tiny-bert.json", "cuda", "fp32", "none"),
])
def test_graph_optimal_peak_equals_pytorchs_memory_estimator(fixture, device, precision, checkpointing):
    spec = RunSpec(str(FIXTURES / fixture), batch=2, seq=32, device=device, precision=precision,
                   checkpointing=checkpointing)
    tables = step_tables(spec)
    graph, releasable = storage_graph(tables)
    profile = build_memory_profile(graph, lambda n: n in releasable)
    optimal = tables.timeline(optimal=True)
    assert max(profile) == optimal.peak_bytes
    assert profile[0] == optimal.start_bytes  # what is alive when the step starts
    # and the eager peak is above it: eager frees later than the last use
    assert tables.timeline().peak_bytes >= optimal.peak_bytes
