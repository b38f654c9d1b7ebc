"""The recorder's fast flatten (`recorder.tensor_leaves`): the tensors of an op's arguments and outputs, in the
order of `torch.utils._pytree.tree_flatten`, which decides the records' `ins`, `outs` and numbering. Truth:
`tree_flatten` itself, on plain containers, on the containers it flattens its own way (namedtuples, structseqs,
OrderedDicts, registered classes), and on leaves it does not open (a tuple subclass that is no namedtuple)."""

import collections
import dataclasses

import pytest
import torch
import torch.utils._pytree as pytree

from vramtrace.tracer.recorder import tensor_leaves


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
