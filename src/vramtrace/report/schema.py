"""The JSON Schema (draft 2020-12) of the JSON report, generated from the report's dataclasses (`report.sections`,
report/summary.py `MemoryReport`) by walking their fields and type hints. docs/report.schema.json is its output
(scripts/gen_schema.py writes it; tests/test_report_schema.py checks it is up to date)."""

from __future__ import annotations

import dataclasses
import enum
import inspect
import types
import typing
from typing import Any

from .data import SCHEMA_TYPE, Omit, omit_rule, type_hints

DRAFT = "https://json-schema.org/draft/2020-12/schema"
_SCALARS = {bool: "boolean", int: "integer", float: "number", str: "string"}


def _def_name(cls: type) -> str:
    return cls.__name__


def _schema(hint: Any, defs: dict[str, Any]) -> dict[str, Any]:
    """The schema of one type hint; dataclasses and enums go to `defs` (by class name) and are referenced."""
    if hint is Any:
        return {}
    if hint in _SCALARS:
        return {"type": _SCALARS[hint]}
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        members = [_schema(a, defs) for a in args if a is not type(None)]
        out = members[0] if len(members) == 1 else {"anyOf": members}
        return {"anyOf": [out, {"type": "null"}]} if type(None) in args else out
    if dataclasses.is_dataclass(hint) or (isinstance(hint, type) and issubclass(hint, enum.Enum)):
        name = _def_name(hint)
        if name not in defs:
            defs[name] = {}  # reserved first: a class may refer to itself
            defs[name] = _enum_def(hint) if isinstance(hint, type) and issubclass(hint, enum.Enum) \
                else _dataclass_def(hint, defs)
        return {"$ref": f"#/$defs/{name}"}
    if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
        return {"type": "array", "prefixItems": [_schema(a, defs) for a in args], "items": False,
                "minItems": len(args)}
    if origin in (tuple, list):
        return {"type": "array", "items": _schema(args[0], defs)}
    if origin is dict:
        keys = {"propertyNames": _schema(args[0], defs)} if args[0] is not str else {}
        return {"type": "object", **keys, "additionalProperties": _schema(args[1], defs)}
    raise TypeError(f"no JSON Schema for the type {hint!r}")


def _enum_def(cls: type[enum.Enum]) -> dict[str, Any]:
    return {**_described(cls), "enum": [m.value for m in cls]}


def _described(cls: type) -> dict[str, str]:
    doc = _doc(cls)
    return {"description": doc} if doc else {}


def _doc(cls: type) -> str:
    """The class's own docstring on one line ('' when it has none: not an inherited or generated one)."""
    own = cls.__dict__.get("__doc__") or ""
    generated = dataclasses.is_dataclass(cls) and own.startswith(f"{cls.__name__}(")
    return "" if generated else " ".join(inspect.cleandoc(own).split())


def _dataclass_def(cls: type, defs: dict[str, Any]) -> dict[str, Any]:
    """An object with one property per serialized field; required: the fields never omitted; no other key."""
    hints = type_hints(cls)
    fields = [f for f in dataclasses.fields(cls) if omit_rule(f) is not Omit.ALWAYS]
    return {**_described(cls), "type": "object",
            "properties": {f.name: _schema(f.metadata.get(SCHEMA_TYPE, hints[f.name]), defs) for f in fields},
            "required": [f.name for f in fields if omit_rule(f) is None],
            "additionalProperties": False}


def json_schema(root: type, *, title: str, schema_id: str, constants: dict[str, Any] | None = None
                ) -> dict[str, Any]:
    """The JSON Schema of `root` (a dataclass) as JSON data: its properties at the top, every other dataclass and
    enum under `$defs` by class name. `constants`: top-level properties pinned to one value (e.g. the schema
    version). Raises TypeError for a field whose type has no schema."""
    defs: dict[str, Any] = {}
    body = _dataclass_def(root, defs)
    for name, value in (constants or {}).items():
        body["properties"][name] = {"const": value}
    return {"$schema": DRAFT, "$id": schema_id, "title": title, **body, "$defs": dict(sorted(defs.items()))}
