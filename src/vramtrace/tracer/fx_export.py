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
    builder = _GraphBuilder(traced.storages)
    for o in (o for o in traced.ops if o.step == step and o.index in traced.op_args):
        builder.add(o, *traced.op_args[o.index])
    builder.graph.output(None)
    gm = fx.GraphModule(torch.nn.Module(), builder.graph)
    try:
        FakeTensorProp(gm, builder.mode).propagate_dont_convert_inputs(*builder.inputs)
    except Exception as e:  # noqa: BLE001 - any op failing under fake tensors: name it
        raise TraceError(f"the step's graph does not run under FakeTensorMode: {type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''}") from e
    return gm


def _target(o) -> torch._ops.OpOverload:
    """The aten (or other namespace's) overload a recorded op names. Raises TraceError for a name torch does
    not know."""
    try:
        ns, op, overload = o.name.split(".")
        return getattr(getattr(getattr(torch.ops, ns), op), overload)
    except (ValueError, AttributeError):
        raise TraceError(f"unknown op {o.name} at step {o.index}") from None


class _GraphBuilder:
    """The FX graph of `to_fx_graph` as ops are added, with the fake inputs of its placeholders (`inputs`, in
    their order) made under `mode`."""

    def __init__(self, storages):
        self.storages = storages
        self.graph = fx.Graph()
        # `.item()` (an optimizer's step count) gives an unbacked symbol; its uses hold the recorded value
        self.mode = FakeTensorMode(shape_env=ShapeEnv(allow_scalar_outputs=True))
        self.inputs: list[torch.Tensor] = []
        self.by_view: dict[TensorArg, fx.Node] = {}  # a tensor layout -> the node computing it
        self.holder: dict[int, fx.Node] = {}  # storage -> a node computing a tensor of it
        self.dtype_of: dict[fx.Node, torch.dtype] = {}  # a node computing a tensor -> its dtype
        self.placeholders: list[fx.Node] = []

    def add(self, o, args, kwargs, out) -> None:
        """The node of recorded op `o`, called with its recorded arguments, and the nodes naming its outputs."""
        target = _target(o)
        if target is _ADD and args and out == args[0]:  # the engine's gradient accumulation into its input
            target = torch.ops.aten.add_.Tensor  # buffer, which the recorder runs in place (`_accumulates_in_place`)
        args, kwargs = tree_map(lambda a: self.resolve(a) if isinstance(a, TensorArg) else a, (args, kwargs))
        node = self.graph.call_function(target, tuple(args), dict(kwargs))
        node.meta.update({"phase": str(o.phase), "nn_module_stack": o.module, "step": o.index, "reads": o.reads,
                          "allocates": o.allocates})
        self.outputs(node, out)

    def placeholder(self, t: TensorArg) -> fx.Node:
        nbytes = self.storages[t.sid].nbytes
        itemsize = t.dtype.itemsize
        if nbytes % itemsize:
            raise TraceError(f"storage {t.sid} ({nbytes} B) is not a whole number of {t.dtype} elements")
        # after the last placeholder (the graph's start for the first): the order of `inputs`
        graph = self.graph
        with graph.inserting_after(self.placeholders[-1]) if self.placeholders else graph.inserting_before(None):
            node = graph.placeholder(f"s{t.sid}")
        self.placeholders.append(node)
        node.meta["storage"] = t.sid
        with self.mode:
            self.inputs.append(torch.empty(nbytes // itemsize, dtype=t.dtype, device="meta"))
        return node

    def resolve(self, t: TensorArg) -> fx.Node:
        """The node computing the tensor `t`: a placeholder of a storage alive at the start, or an
        `aten.as_strided` of a node holding its storage."""
        node = self.by_view.get(t)
        if node is not None:
            return node
        base = self.holder.get(t.sid)
        if base is None or self.dtype_of[base] != t.dtype:  # a storage alive at the start (or read as another dtype)
            base = self.holder[t.sid] = self.placeholder(t)
            self.dtype_of[base] = t.dtype
            flat = TensorArg(t.sid, (self.storages[t.sid].nbytes // t.dtype.itemsize,), (1,), 0, t.dtype)
            self.by_view[flat] = base
            if t == flat:
                return base
        node = self.graph.call_function(torch.ops.aten.as_strided.default,
                                        (base, list(t.shape), list(t.stride), t.offset))
        self.dtype_of[node] = t.dtype
        self.by_view[t] = node
        return node

    def outputs(self, node: fx.Node, out) -> None:
        """Register the tensors `out` (the op's recorded output: a TensorArg, or nested lists/tuples of them) as
        computed by `node`, through `operator.getitem` nodes for the items of a tuple or list."""
        if isinstance(out, TensorArg):
            self.dtype_of[node] = out.dtype
            self.by_view[out] = node
            if out.sid not in self.holder or self.dtype_of[self.holder[out.sid]] != out.dtype:
                self.holder[out.sid] = node
            return
        if isinstance(out, (list, tuple)) and any(isinstance(x, TensorArg) for x in tree_flatten(out)[0]):
            for i, item in enumerate(out):
                if isinstance(item, (TensorArg, list, tuple)):
                    self.outputs(self.graph.call_function(operator.getitem, (node, i)), item)


def fx_graph(spec, step: int | None = None) -> fx.GraphModule:
    """The step of `spec` (a RunSpec) traced on the meta device with every op's arguments kept, as a runnable FX
    graph (`to_fx_graph`). Raises what `vramtrace.analyze` raises for a bad spec, and TraceError."""
    from .building import load_model
    from .loading import resolve_config
    from .trace import trace_step

    return to_fx_graph(trace_step(spec, load_model(spec, resolve_config(spec.model)), keep_args=True), step)
