"""The recorded step as a runnable FX graph of aten ops (`to_fx_graph`)."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.utils._pytree import tree_flatten, tree_map

from ..errors import TraceError
from .recorder import TensorArg

_ADD = torch.ops.aten.add.Tensor


def to_fx_graph(traced, step: int | None = None) -> fx.GraphModule:
    """Recorded step `step` of a `TracedGraph` (default: the last, the steady state) as an FX graph of aten ops:
    one `call_function` node per op, in execution order, with the op's real arguments (sizes, scalars, dtypes,
    the tensors it was given); `gm.graph` runs under FakeTensorMode, and every node's `meta["val"]` is the fake
    tensor (or tuple) it computes there (torch/fx/passes/fake_tensor_prop.py `FakeTensorProp`).

    `traced` must be made with `trace_step(..., keep_args=True)` (every layer and step traced: a rebuilt layer
    has no recorded arguments). A storage alive when the step starts (a parameter, an input, an optimizer state,
    a gradient) is a placeholder `s<sid>`: a flat tensor of the storage's bytes in the dtype it is first read as,
    whose views the ops read are `aten.as_strided` nodes of it; a tensor the recorder saw with a layout no op
    produced (autograd unpacking a saved output as a new tensor of the same storage) is an `aten.as_strided` of a
    node holding its storage. The allocation the recorder adds for a tensor made from host data
    (`torch.tensor(x, device=...)`: recorder.py `host_data`) has no node: that tensor is a placeholder too. The
    autograd engine's accumulation of a gradient into its input buffer, which the recorder runs in place
    (recorder.py `_accumulates_in_place`), is `aten.add_`. Node meta also has 'phase', 'nn_module_stack' (module
    path), 'step' (op index), 'reads' and 'allocates' (storage ids).

    Raises TraceError: `traced` has no recorded arguments, an op name torch does not know, or the graph does not
    run under FakeTensorMode (the failing op named)."""
    if traced.op_args is None:
        raise TraceError("the trace kept no op arguments; trace it with trace_step(spec, loaded, keep_args=True)")
    step = traced.steps - 1 if step is None else step
    ops = [o for o in traced.ops if o.step == step and o.index in traced.op_args]
    graph = fx.Graph()
    # `.item()` (an optimizer's step count) gives an unbacked symbol; its uses hold the recorded value
    mode = FakeTensorMode(shape_env=ShapeEnv(allow_scalar_outputs=True))
    inputs: list[torch.Tensor] = []
    by_view: dict[TensorArg, fx.Node] = {}  # a tensor layout -> the node computing it
    holder: dict[int, fx.Node] = {}  # storage -> a node computing a tensor of it
    dtype_of: dict[fx.Node, torch.dtype] = {}  # a node computing a tensor -> its dtype
    placeholders: list[fx.Node] = []

    def placeholder(t: TensorArg) -> fx.Node:
        nbytes = traced.storages[t.sid].nbytes
        itemsize = t.dtype.itemsize
        if nbytes % itemsize:
            raise TraceError(f"storage {t.sid} ({nbytes} B) is not a whole number of {t.dtype} elements")
        # after the last placeholder (the graph's start for the first): the order of `inputs`
        with graph.inserting_after(placeholders[-1]) if placeholders else graph.inserting_before(None):
            node = graph.placeholder(f"s{t.sid}")
        placeholders.append(node)
        node.meta["storage"] = t.sid
        with mode:
            inputs.append(torch.empty(nbytes // itemsize, dtype=t.dtype, device="meta"))
        return node

    def resolve(t: TensorArg) -> fx.Node:
        node = by_view.get(t)
        if node is not None:
            return node
        base = holder.get(t.sid)
        if base is None or dtype_of[base] != t.dtype:  # a storage alive at the start (or read as another dtype)
            base = holder[t.sid] = placeholder(t)
            dtype_of[base] = t.dtype
            flat = TensorArg(t.sid, (traced.storages[t.sid].nbytes // t.dtype.itemsize,), (1,), 0, t.dtype)
            by_view[flat] = base
            if t == flat:
                return base
        node = graph.call_function(torch.ops.aten.as_strided.default, (base, list(t.shape), list(t.stride), t.offset))
        dtype_of[node] = t.dtype
        by_view[t] = node
        return node

    for o in ops:
        try:
            ns, op, overload = o.name.split(".")
            target = getattr(getattr(getattr(torch.ops, ns), op), overload)
        except (ValueError, AttributeError):
            raise TraceError(f"unknown op {o.name} at step {o.index}") from None
        args, kwargs, out = traced.op_args[o.index]
        if target is _ADD and args and out == args[0]:  # the engine's gradient accumulation into its input
            target = torch.ops.aten.add_.Tensor  # buffer, which the recorder runs in place (`_accumulates_in_place`)
        args, kwargs = tree_map(lambda a: resolve(a) if isinstance(a, TensorArg) else a, (args, kwargs))
        node = graph.call_function(target, tuple(args), dict(kwargs))
        node.meta.update({"phase": str(o.phase), "nn_module_stack": o.module, "step": o.index, "reads": o.reads,
                          "allocates": o.allocates})
        _outputs(graph, node, out, by_view, holder, dtype_of)
    graph.output(None)
    gm = fx.GraphModule(torch.nn.Module(), graph)
    try:
        FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*inputs)
    except Exception as e:  # noqa: BLE001 - any op failing under fake tensors: name it
        raise TraceError(f"the step's graph does not run under FakeTensorMode: {type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''}") from e
    return gm


def _outputs(graph: fx.Graph, node: fx.Node, out, by_view: dict, holder: dict, dtype_of: dict) -> None:
    """Register the tensors `out` (the op's recorded output: a TensorArg, or nested lists/tuples of them) as
    computed by `node`, through `operator.getitem` nodes for the items of a tuple or list."""
    if isinstance(out, TensorArg):
        dtype_of[node] = out.dtype
        by_view[out] = node
        if out.sid not in holder or dtype_of[holder[out.sid]] != out.dtype:
            holder[out.sid] = node
        return
    if isinstance(out, (list, tuple)) and any(isinstance(x, TensorArg) for x in tree_flatten(out)[0]):
        for i, item in enumerate(out):
            if isinstance(item, (TensorArg, list, tuple)):
                _outputs(graph, graph.call_function(operator.getitem, (node, i)), item, by_view, holder, dtype_of)


def fx_graph(spec, step: int | None = None) -> fx.GraphModule:
    """The step of `spec` (a RunSpec) traced on the meta device with every op's arguments kept, as a runnable FX
    graph (`to_fx_graph`). Raises what `vramtrace.analyze` raises for a bad spec, and TraceError."""
    from .building import load_model
    from .loading import resolve_config
    from .trace import trace_step

    return to_fx_graph(trace_step(spec, load_model(spec, resolve_config(spec.model)), keep_args=True), step)
