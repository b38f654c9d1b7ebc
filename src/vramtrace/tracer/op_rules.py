"""Per-op rule tables keyed by `torch._ops.OpOverload` objects, not by their names (issue 40).

In the manner of torch/utils/flop_counter.py's `register_flop_formula` (whose `flop_registry` is keyed by
`torch.ops.aten.mm` packets): a table is written with the ops' names ("aten.mm.default") and built once by
`op_table` / `op_set`, which resolve each name to its overload (`torch.ops.aten.mm.default`) and raise
`OpRuleError`, naming the table and the op, when this torch has no such op. A renamed or misspelled op then fails
when the table is built, not silently at every lookup. A lookup uses the dispatched `func` itself: an OpOverload
is hashed and compared by identity (torch/_ops.py caches one object per overload), as cheap as a string key and
without formatting `str(func)` per op.

A table whose ops a Python module registers when it is imported (`torch.library` definitions: FSDP2's `fsdp::`
ops, bitsandbytes' `bitsandbytes::` ops) is built by a function called where that module is in use, so that
building it imports nothing optional.

Three kinds of op names stay names, and are checked here at import all the same:
* names matched against *recorded* op names (`RecOp.name`, the `str(func)` the recorder wrote: layer
  replication, records.py), since the records are torch-free: `op_names` checks that each resolves and
  returns the names;
* the autocast tables of kernels.py, keyed by the Python function's name a TorchFunctionMode sees (`F.linear`'s
  `linear`, `torch.Tensor.__matmul__`'s `matmul`), not by a dispatched overload: `aten_packet_names` checks that
  each names an `aten` op packet (all its overloads), as autocast_mode.cpp's lists do;
* analysis/ (torch-free by design) keeps its op-name sets as strings of recorded names.
"""

from __future__ import annotations

from typing import Iterable, Mapping, TypeVar

import torch

from ..errors import VramtraceError

V = TypeVar("V")


class OpRuleError(VramtraceError):
    """A per-op rule table names an op this torch does not have (a typo, or an op renamed or removed)."""


def resolve(table: str, name: str) -> torch._ops.OpOverload:
    """The overload `name` ("namespace.op.overload", e.g. "aten.mm.default", as `str(func)` writes it) names:
    `torch.ops.<namespace>.<op>.<overload>`. Raises OpRuleError naming `table` and the op where the name is
    not three dotted parts or torch.ops has no such namespace, op or overload (torch/_ops.py `_OpNamespace.__getattr__`
    and `OpOverloadPacket.__getattr__` raise AttributeError)."""
    parts = name.split(".")
    if len(parts) != 3:
        raise OpRuleError(f"{table}: {name!r} is not an op overload name 'namespace.op.overload' "
                          "(e.g. 'aten.mm.default')")
    namespace, op, overload = parts
    try:
        found = getattr(getattr(getattr(torch.ops, namespace), op), overload)
    except (AttributeError, RuntimeError) as e:
        raise OpRuleError(f"{table}: no op {name} in torch {torch.__version__} (torch.ops.{name}): "
                          "misspelled, or renamed in this torch") from e
    if not isinstance(found, torch._ops.OpOverload):
        raise OpRuleError(f"{table}: torch.ops.{name} is a {type(found).__name__}, not an op overload")
    return found


def op_table(table: str, rules: Mapping[str, V]) -> dict[torch._ops.OpOverload, V]:
    """`rules` keyed by the overloads their names name (`resolve`; raises OpRuleError naming `table` and the op)."""
    return {resolve(table, name): rule for name, rule in rules.items()}


def op_set(table: str, names: Iterable[str]) -> frozenset[torch._ops.OpOverload]:
    """The overloads `names` name (`resolve`; raises OpRuleError naming `table` and the op)."""
    return frozenset(resolve(table, name) for name in names)


def op_names(table: str, names: Iterable[str]) -> frozenset[str]:
    """`names` as they are, each checked to name an overload (`resolve`; raises OpRuleError naming `table` and the
    op): for tables matched against recorded op names (`RecOp.name`, torch-free records)."""
    names = frozenset(names)
    for name in names:
        resolve(table, name)
    return names


def aten_packet_names(table: str, names: Iterable[str], aliases: Mapping[str, str] | None = None) -> None:
    """Check that each of `names` names an aten op packet (`torch.ops.aten.<name>`, every overload of it) or is an
    alias in `aliases` (a Python function's name -> the aten op it calls: `F.cross_entropy` is `cross_entropy_loss`)
    whose target does. Raises OpRuleError naming `table` and the name."""
    aliases = aliases or {}
    for name in names:
        target = aliases.get(name, name)
        if not isinstance(getattr(torch.ops.aten, target, None), torch._ops.OpOverloadPacket):
            raise OpRuleError(f"{table}: no op aten.{target} in torch {torch.__version__} (torch.ops.aten.{target}): "
                              "misspelled, or renamed in this torch")
