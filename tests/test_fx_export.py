"""The recorded step as a runnable FX graph (`tracer/fx_export.py`): one node per recorded op with the op's real
arguments, `meta["val"]` from running it under FakeTensorMode, and the same tensors as the recording."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.utils._pytree import tree_leaves

from conftest import FIXTURES
from seam import recording
from vramtrace import RunSpec
from vramtrace.errors import TraceError
from vramtrace.tracer.fx_export import to_fx_graph
from vramtrace.tracer.recorder import TensorArg

CASES = {  # (fixture, run options, the phases of the step)
    "llama-cpu-bf16-checkpointed": (
        "tiny-llama-gqa", dict(device="cpu", precision="bf16-mixed", checkpointing="layers"),
        {"forward", "backward", "optimizer"}),
    "gpt2-generate": ("tiny-gpt2", dict(mode="generate", new_tokens=4), {"forward"}),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request):
    name, extra, phases = CASES[request.param]
    spec = RunSpec(str(FIXTURES / f"{name}.json"), batch=2, seq=16, **extra)
    return recording(spec, keep_args=True), phases


def test_one_node_per_op_with_the_recorded_outputs(case):
    """Every op of the last step is a node, in order, and what it computes under FakeTensorMode from the graph's
    arguments has the recorded outputs' sizes, strides and dtypes, and shares its input's storage where the
    recorded output was a view of it or the op wrote in place."""
    traced, phases = case
    gm = to_fx_graph(traced)
    step = traced.steps - 1
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and "step" in n.meta]
    assert [n.meta["step"] for n in nodes] == [o.index for o in traced.ops if o.step == step and o.index in
                                               traced.op_args]
    # the ops without recorded arguments: a tensor made from host data (`torch.tensor(...)`), a placeholder
    assert {o.name for o in traced.ops if o.index not in traced.op_args} <= {"aten.lift_fresh.default"}
    assert phases <= {n.meta["phase"] for n in nodes}
    storage = {}  # the recorded storage -> the fake storage the graph computed it in
    views = 0
    for n in nodes:
        args, kwargs, out = traced.op_args[n.meta["step"]]
        recorded = [t for t in tree_leaves(out) if isinstance(t, TensorArg)]
        computed = [t for t in tree_leaves(n.meta["val"]) if isinstance(t, torch.Tensor)]
        assert [layout(t.shape, t.stride, t.dtype) for t in recorded] == [
            layout(tuple(c.shape), c.stride(), c.dtype) for c in computed], (n.format_node(), recorded)
        ins = {t.sid for t in tree_leaves((args, kwargs)) if isinstance(t, TensorArg)}
        for t, c in zip(recorded, computed):
            if t.sid in ins and t.sid in storage:
                assert c.untyped_storage()._cdata == storage[t.sid], n.format_node()
                views += 1
            storage.setdefault(t.sid, c.untyped_storage()._cdata)
    assert views > 10


def layout(shape, stride, dtype):
    """Sizes, strides (a dimension of size 1 has any stride: meta and fake kernels may differ there) and dtype."""
    return shape, tuple(st if n != 1 else None for n, st in zip(shape, stride)), dtype


def test_graph_module_runs_under_fake_tensors(case):
    """The generated code itself (not only the interpreter) runs on fresh fake inputs of the placeholders'
    layouts."""
    gm = to_fx_graph(case[0])
    holders = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    assert holders and all(h.dim() == 1 for h in holders)
    with FakeTensorMode(shape_env=ShapeEnv(allow_scalar_outputs=True)):
        gm(*[torch.empty(h.shape, dtype=h.dtype, device="meta") for h in holders])


def test_trace_without_arguments_is_refused():
    spec = RunSpec(str(FIXTURES / "tiny-gpt2.json"), batch=1, seq=8)
    with pytest.raises(TraceError, match="keep_args=True"):
        to_fx_graph(recording(spec))
