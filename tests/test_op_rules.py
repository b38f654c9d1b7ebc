"""Per-op rule tables (tracer/op_rules.py, issue 40): keyed by torch.ops overload objects, and a table naming an op
this torch does not have fails when it is built, with a message naming the table and the op."""

from __future__ import annotations

import pytest
import torch

from vramtrace.errors import VramtraceError
from vramtrace.tracer import kernels, probe, sharding
from vramtrace.tracer.op_rules import OpRuleError, aten_packet_names, op_names, op_set, op_table, resolve

OVERLOAD_TABLES = {
    "probe.GLOO_TEMPORARY": probe.GLOO_TEMPORARY,
    "probe.SCRATCHPAD_QUERIES": probe.SCRATCHPAD_QUERIES,
    "probe.NOT_EXTRAPOLATED": probe.NOT_EXTRAPOLATED,
    "probe.REDUCTION_RULES": probe.REDUCTION_RULES,
    "kernels.CUDA_OUTPUT_ORDER": kernels.CUDA_OUTPUT_ORDER,
    "sharding.fsdp_op_categories()": sharding.fsdp_op_categories(),
}


@pytest.mark.parametrize("name", sorted(OVERLOAD_TABLES))
def test_every_entry_is_an_op_overload(name):
    table = OVERLOAD_TABLES[name]
    assert table, f"{name} is empty"
    for op in table:
        assert isinstance(op, torch._ops.OpOverload), f"{name}: {op!r} is a {type(op).__name__}"


def test_the_quantized_tables_are_keyed_by_overloads():
    """Built where bitsandbytes is in use (its ops are defined when it loads): int8 has all three tables."""
    pytest.importorskip("bitsandbytes")
    from vramtrace.tracer.quantization import quantized_recording

    categories, meta_kernels, derived = quantized_recording(four_bit=False)
    assert categories and meta_kernels and derived
    for op in [*categories, *meta_kernels, *(op for op, _ in derived)]:
        assert isinstance(op, torch._ops.OpOverload), f"{op!r} is a {type(op).__name__}"
    assert quantized_recording(four_bit=True)[1:] == ({}, {})


def test_a_lookup_by_the_dispatched_overload_hits():
    """The object a dispatch mode receives is the one the table holds (torch/_ops.py caches one per overload)."""
    seen = []

    class Spy(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    a = torch.empty(4, 4, device="meta")
    with Spy():
        torch.mm(a, a)
    assert seen == [torch.ops.aten.mm.default]
    assert seen[0] in probe.SCRATCHPAD_QUERIES
    assert str(seen[0]) not in probe.SCRATCHPAD_QUERIES  # keyed by the object, not its name


@pytest.mark.parametrize("build", [
    lambda: op_table("MY_TABLE", {"aten.mm.default": 1, "aten.mmm.default": 2}),
    lambda: op_set("MY_TABLE", ["aten.mm.default", "aten.mmm.default"]),
    lambda: op_names("MY_TABLE", ["aten.mm.default", "aten.mmm.default"]),
])
def test_a_misspelled_op_fails_naming_the_table_and_the_op(build):
    with pytest.raises(OpRuleError) as e:
        build()
    message = str(e.value)
    assert "MY_TABLE" in message and "aten.mmm.default" in message
    assert "\n" not in message
    assert isinstance(e.value, VramtraceError)


@pytest.mark.parametrize("name, why", [
    ("aten.mm.defualt", "aten.mm.defualt"),  # a missing overload of an existing op
    ("c10d._allgather_base.default", "c10d._allgather_base.default"),  # the in-place op is `_allgather_base_`
    ("nosuchlib.op.default", "nosuchlib.op.default"),  # a namespace nothing registered
    ("aten.mm", "'namespace.op.overload'"),  # a packet's name, not an overload's
])
def test_resolve_refuses_what_is_not_an_overload(name, why):
    with pytest.raises(OpRuleError, match="MY_TABLE") as e:
        resolve("MY_TABLE", name)
    assert why in str(e.value)


def test_resolve_returns_the_overload_a_dispatch_names():
    assert resolve("T", "aten.mm.default") is torch.ops.aten.mm.default
    assert resolve("T", "c10d._allgather_base_.default") is torch.ops.c10d._allgather_base_.default
    assert op_names("T", ["aten.cat.default"]) == frozenset({"aten.cat.default"})


def test_autocast_names_are_checked_against_aten_packets():
    aten_packet_names("T", ["mm", "layer_norm"])
    aten_packet_names("T", ["cross_entropy"], aliases={"cross_entropy": "cross_entropy_loss"})
    with pytest.raises(OpRuleError, match=r"CPU_AUTOCAST: no op aten\.layernorm"):
        aten_packet_names("CPU_AUTOCAST", ["mm", "layernorm"])
    with pytest.raises(OpRuleError, match=r"aten\.cross_entropy\b"):
        aten_packet_names("T", ["cross_entropy"])


def test_the_tables_of_recorded_names_name_real_ops():
    """What stays a name, matched against recorded op names (torch-free modules) or read by a TorchFunctionMode,
    names an op of this torch all the same."""
    import torch.distributed._functional_collectives  # noqa: F401  (defines _c10d_functional._wrap_tensor_autograd)

    from vramtrace.analysis.device import GEMM_OPS, LT_GEMM_OPS
    from vramtrace.tracer import recorder, replication
    from vramtrace.tracer.records import ALLOCATION_OP

    op_names("replication._STACKS", replication._STACKS)
    op_names("records.ALLOCATION_OP", [ALLOCATION_OP])
    op_names("recorder._WRAP_COLLECTIVE", [recorder._WRAP_COLLECTIVE])
    aten_packet_names("analysis.device.GEMM_OPS", [n.removeprefix("aten.") for n in GEMM_OPS | LT_GEMM_OPS])
