"""Liveness over one FX graph of aten ops whose nodes carry `meta["val"]` (a torch.compile graph captured by
`tracer/compiled.py`): every storage is born with the first node that makes it and freed after the last node
that reads it, as Inductor's generated code frees a buffer after its last use (`del buf3`:
torch/_inductor/scheduler.py `compute_last_usage`, `free_buffers`; codegen/wrapper.py `codegen_free`).

This is the graph's own view, before Inductor's code generation; `tracer/inductor_code.py` `cpu_allocations` reads
what the generated CPU code allocates off Inductor's scheduler. What this does not model (an over-estimate of
transient bytes, never of what a graph keeps): pointwise and
reduction chains that Inductor fuses into one kernel never materialize their intermediates; a kernel may write its
output into an input that dies there (`inplace_buffers`); freed buffers are reused by later ones of the same size
(`allow_buffer_reuse`: neutral for live bytes); the scheduler reorders nodes (`reorder_for_peak_memory`). Kernel
workspaces (GEMM, fallback kernels) are not graph nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef


@dataclass(frozen=True, slots=True)
class GraphMemory:
    """Bytes (ints) a graph allocates above what is alive when it starts: `peak_bytes` at its highest,
    `end_bytes` when it returns (its outputs that are not its inputs' storages, minus the inputs it freed), and
    `output_bytes`, the storages of its outputs that it made (for a forward graph: the user outputs and the
    tensors saved for the backward)."""

    peak_bytes: int
    end_bytes: int
    output_bytes: int


def storage_key(node: fx.Node):
    """The storage of a node's `meta["val"]` as a hashable key (views share their base's); None without a tensor."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return StorageWeakRef(val.untyped_storage()) if isinstance(val, torch.Tensor) else None


def graph_memory(gm: fx.GraphModule, kept_inputs: set[int] | None = None) -> GraphMemory:
    """Liveness of `gm` (see the module docstring). Inputs (placeholders) are alive at the start; those whose
    index is not in `kept_inputs` are freed after their last use (a backward graph's saved tensors and
    tangents: AOTAutograd clears them and Inductor deletes its arguments as it goes); `kept_inputs` None keeps
    every input (a forward graph's parameters and inputs, which the caller holds). Views share their base's
    storage (keyed by `StorageWeakRef`); a node without a tensor `meta["val"]` holds nothing."""
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    inputs = {storage_key(n) for n in placeholders} - {None}
    kept = inputs if kept_inputs is None else {storage_key(n) for i, n in enumerate(placeholders) if i in kept_inputs}
    freeable = inputs - kept  # an input storage also held as a kept input (a view of a parameter) stays
    size: dict = {}
    last: dict = {}
    for i, n in enumerate(nodes):
        key = storage_key(n)
        if key is not None:
            size.setdefault(key, n.meta["val"].untyped_storage().nbytes())
        for a in n.all_input_nodes:
            k = storage_key(a)
            if k is not None:
                last[k] = i
    output = next(n for n in reversed(nodes) if n.op == "output")
    outs = {storage_key(a) for a in output.all_input_nodes} - {None}
    # an input no node reads is released when the graph starts (the boxed call clears its argument list)
    live = -sum(size.get(k, 0) for k in freeable if k not in last and k not in outs)
    peak = 0
    born: set = set()
    for i, n in enumerate(nodes):
        key = storage_key(n)
        if n.op == "call_function" and key is not None and key not in inputs and key not in born:
            born.add(key)
            live += size[key]
            peak = max(peak, live)
        for key in {storage_key(a) for a in n.all_input_nodes} - {None}:
            if last.get(key) == i and key not in outs and (key in born or key in freeable):
                live -= size[key]
    return GraphMemory(peak, live, sum(size[k] for k in outs if k in born))
