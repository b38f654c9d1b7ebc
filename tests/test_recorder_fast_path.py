"""The recorder's fast paths. The flatten (`recorder.tensor_leaves`): the tensors of an op's arguments and outputs,
in the order of `torch.utils._pytree.tree_flatten`, which decides the records' `ins`, `outs` and numbering. Truth:
`tree_flatten` itself, on plain containers, on the containers it flattens its own way (namedtuples, structseqs,
OrderedDicts, registered classes), and on leaves it does not open (a tuple subclass that is no namedtuple).
The cache of meta kernels' results (`recorder.MetaResultCache`): truth is the kernel run again, and the reports of
whole traces without the cache."""

import collections
import dataclasses

import pytest
import torch
import torch.utils._pytree as pytree

from conftest import FIXTURES
from vramtrace import RunSpec, analyze, report_json
from vramtrace.tracer import recorder
from vramtrace.tracer.recorder import MetaResultCache, tensor_leaves


def _meta(*shape):
    return torch.empty(shape, device="meta")


Pair = collections.namedtuple("Pair", "first second")


class Plain(tuple):
    """A tuple subclass that is no namedtuple: a pytree leaf, not a tensor."""


@dataclasses.dataclass
class Registered:
    a: object
    b: object


a, b, c, d, e = (_meta(i + 1) for i in range(5))
p = torch.nn.Parameter(_meta(2, 2))
TREES = {
    "op args": ((a, [b, c], 2, None), {"dim": 1, "out": d}),
    "dict in insertion order": {"z": a, "a": b, "m": [c, {"y": d, "b": e}]},
    "namedtuple": (a, Pair(b, [c, d]), e),
    "namedtuple at the root": Pair(a, (b, c)),
    "structseq": (a, torch.return_types.max((b, c)), d),
    "OrderedDict": [a, collections.OrderedDict([("y", b), ("x", c)]), d],
    "defaultdict": [collections.defaultdict(list, {"k": [a, b]}), c],
    "tuple subclass leaf": (a, Plain((b, c)), d),
    "scalars and devices": (1, 2.5, True, "s", torch.float32, torch.device("meta"), slice(1, 2), a),
    "a parameter": ([p, a], {"w": p}),
    "one tensor": a,
    "empty": ((), [], {}),
    "nested": ((((a,),),), [[[b]]], {"x": {"y": {"z": c}}}),
}


@pytest.mark.parametrize("name", sorted(TREES))
def test_tensor_leaves_are_tree_flattens_tensors_in_order(name):
    tree = TREES[name]
    expected = [t for t in pytree.tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]
    got = tensor_leaves(tree)
    assert len(got) == len(expected)
    assert all(g is x for g, x in zip(got, expected))


def test_tensor_leaves_follows_a_class_registered_later():
    """A class registered as a pytree node after the recorder is imported is opened as tree_flatten opens it."""
    tree = (a, Registered(b, [c, d]))
    assert [id(t) for t in tensor_leaves(tree)] == [id(a)]  # a leaf while unregistered, as tree_flatten says
    pytree.register_pytree_node(Registered, lambda r: ([r.b, r.a], None), lambda v, _: Registered(v[1], v[0]))
    try:
        got = tensor_leaves(tree)
        expected = [t for t in pytree.tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]
    finally:
        pytree._deregister_pytree_node(Registered)
    assert [id(t) for t in got] == [id(t) for t in expected] == [id(a), id(c), id(d), id(b)]  # its children's order


# -- the meta kernels' results cache ---------------------------------------------------------------------------------
aten = torch.ops.aten


def _layout(t: torch.Tensor) -> tuple:
    return (type(t), tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device, t.untyped_storage().nbytes(),
            t.requires_grad, t._is_view(), t.is_contiguous())


def _layouts(out) -> list:
    return [_layout(t) for t in pytree.tree_flatten(out)[0]]


x = torch.empty(8, 6, device="meta", dtype=torch.bfloat16)
CALLS = {  # op, args, kwargs: outputs of one tensor, several, a list; fresh storages of other sizes than the view
    "mm": (aten.mm.default, (torch.empty(4, 8, device="meta"), torch.empty(8, 3, device="meta").t().t()), {}),
    "strided input": (aten.mul.Tensor, (x.t(), 2.0), {}),
    "int scalar": (aten.mul.Tensor, (x, 2), {}),
    "layer norm": (aten.native_layer_norm.default, (x, [6], None, None, 1e-5), {}),
    "foreach": (aten._foreach_mul.Scalar, ([x, x[1:], x.t()], 3.0), {}),
    "to_copy": (aten._to_copy.default, (x.t(),), {"dtype": torch.float32, "memory_format": torch.preserve_format}),
    "empty_strided with a gap": (aten.empty_strided.default, ([3, 4], [10, 2]), {"device": "meta"}),
    "expanded output": (aten.expand_copy.default, (torch.empty(1, 6, device="meta"), [5, 6]), {}),
    "sum": (aten.sum.dim_IntList, (x, [0], True), {"dtype": torch.float32}),
    "cat": (aten.cat.default, ([x, x],), {"dim": 1}),
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_a_cache_hit_builds_the_kernels_outputs(name):
    func, args, kwargs = CALLS[name]
    cache = MetaResultCache()
    first = cache(func, args, kwargs)
    again = cache(func, args, kwargs)
    assert (cache.misses, cache.hits) == (1, 1)
    assert _layouts(again) == _layouts(first) == _layouts(func(*args, **kwargs))
    assert type(again) is type(first)
    stores = {t.untyped_storage()._cdata for t in pytree.tree_flatten(again)[0]}
    inputs = {t.untyped_storage()._cdata for t in tensor_leaves((args, kwargs))}
    assert len(stores) == len(pytree.tree_flatten(again)[0]) and not stores & inputs  # each a storage of its own


@pytest.mark.parametrize("func, args", [
    (aten.view.default, (x, [48])),  # a view
    (aten.add_.Tensor, (x.clone(), 1)),  # in place
    (aten.native_dropout.default, (x, 0.5, True)),  # random
    (aten.nonzero.default, (torch.empty(4, device="meta"),)),  # data-dependent size
])
def test_views_in_place_random_and_data_dependent_ops_are_not_cached(func, args):
    cache = MetaResultCache()
    for _ in range(2):
        try:
            cache(func, args, {})
        except NotImplementedError:  # nonzero has no meta kernel: the error is the kernel's, every time
            pass
    assert cache.hits == cache.misses == 0


def test_arguments_that_cannot_be_keyed_are_not_cached():
    cache = MetaResultCache()
    cpu = torch.empty(4, 8)
    param = torch.nn.Parameter(torch.empty(8, 3, device="meta"))
    for args in ((cpu, cpu.t()), (torch.empty(4, 8, device="meta"), param)):  # host tensors, a subclass
        for _ in range(2):
            cache(aten.mm.default, args, {})
    assert cache.hits == cache.misses == 0


def test_a_scalars_type_is_part_of_the_key():
    """1, 1.0 and True are equal and hash alike; the output dtypes differ."""
    cache = MetaResultCache()
    i = torch.empty(3, device="meta", dtype=torch.int64)
    dtypes = [cache(aten.mul.Tensor, (i, s), {}).dtype for s in (2, 2.0, True, 2, 2.0)]
    assert dtypes == [torch.int64, torch.float32, torch.int64, torch.int64, torch.float32]
    assert (cache.misses, cache.hits) == (3, 2)


def test_the_default_dtype_is_part_of_the_key():
    cache = MetaResultCache()
    made = [cache(aten.empty.memory_format, ([2],), {"device": "meta"}).dtype]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        made.append(cache(aten.empty.memory_format, ([2],), {"device": "meta"}).dtype)
    finally:
        torch.set_default_dtype(previous)
    assert made == [torch.float32, torch.float64] and cache.hits == 0


def test_an_output_on_an_inputs_storage_is_not_stored():
    """A kernel that returns its input, or a view of it, where the schema says the output is fresh: not stored (the
    op runs its kernel every time); a fresh output is."""
    assert recorder._entry(x, (x,), {}) is None
    assert recorder._entry(torch.empty(6, 8, device="meta").t(), (x,), {}) is None  # a view
    assert recorder._entry((aten.clone.default(x), x), (x,), {}) is None
    assert recorder._entry(aten.clone.default(x), (x,), {}) is not None


@pytest.mark.parametrize("config, options", [
    ("tiny-llama-gqa", {"checkpointing": "layers"}),
    ("tiny-gpt2", {"device": "cpu"}),
    ("tiny-mixtral", {}),
])
def test_reports_are_the_same_with_and_without_the_cache(monkeypatch, config, options):
    made = []
    init = MetaResultCache.__init__

    def counted(self):
        init(self)
        made.append(self)

    monkeypatch.setattr(MetaResultCache, "__init__", counted)
    recorders = []
    start = recorder.StepRecorder.__init__

    def made_recorder(self):
        start(self)
        recorders.append(self)

    monkeypatch.setattr(recorder.StepRecorder, "__init__", made_recorder)
    spec = RunSpec(str(FIXTURES / f"{config}.json"), 2, 32, **options)
    cached = report_json(analyze(spec, levers=False))
    assert sum(c.hits for c in made) > 0
    monkeypatch.setattr(recorder.StepRecorder, "cache_meta_results", False)
    made.clear()
    recorders.clear()
    uncached = report_json(analyze(spec, levers=False))
    assert recorders and not made  # traced again, without the cache
    assert cached == uncached
