"""The recorded step as an FX graph of aten ops."""

from __future__ import annotations

import torch
import torch.fx as fx

from ..errors import TraceError


def to_fx_graph(traced, step: int | None = None) -> fx.GraphModule:
    """Recorded step `step` of a `TracedGraph` (default: the last, the steady state) as an FX graph of aten ops,
    one `call_function` node per op, in execution order.

    Edges are storage dataflow: a node's args are the nodes that allocated the storages it reads (placeholders
    for every storage it reads that was born before the step), so the graph carries exactly what liveness needs, not the ops' scalar
    arguments. `node.meta` holds 'phase', 'nn_module_stack' (module path), 'step' (op index), 'reads' and
    'allocates' (storage ids). Raises TraceError for an op name torch does not know.
    """
    step = traced.steps - 1 if step is None else step
    ops = [o for o in traced.ops if o.step == step]
    graph = fx.Graph()
    producer: dict[int, fx.Node] = {}
    first = ops[0].index if ops else 0
    for sid in dict.fromkeys(s for o in ops for s in o.reads):  # alive at step start: params, inputs, state
        if traced.storages[sid].op_index < first:
            node = graph.placeholder(f"s{sid}")
            node.meta["storage"] = sid
            producer[sid] = node
    for o in ops:
        try:
            ns, op, overload = o.name.split(".")
            target = getattr(getattr(getattr(torch.ops, ns), op), overload)
        except (ValueError, AttributeError):
            raise TraceError(f"unknown op {o.name} at step {o.index}") from None
        args = tuple(dict.fromkeys(producer[s] for s in o.reads if s in producer))
        node = graph.call_function(target, args)
        node.meta.update({"phase": str(o.phase), "nn_module_stack": o.module, "step": o.index, "reads": o.reads,
                          "allocates": o.allocates})
        for s in o.allocates:
            producer[s] = node
    graph.output(None)
    return fx.GraphModule(torch.nn.Module(), graph)
