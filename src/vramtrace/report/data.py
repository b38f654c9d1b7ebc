"""One serializer (`to_data`: a report dataclass -> JSON-ready data) and one deserializer (`from_data`: that data,
e.g. a saved JSON report, -> the dataclass) for every dataclass of the report.

The JSON object of a dataclass has its fields' names as keys in the fields' declared order (json.dumps keeps it,
so the order is part of the report's bytes). A field declared with `omittable()` is left out of the JSON when its
value is absent (`Omit.NONE`: None; `Omit.EMPTY`: None or an empty str/tuple/list/dict; `Omit.UNSET`: the `UNSET`
sentinel, so that None is written as null), and reads back as its default when the key is missing; a field
declared with `not_serialized()` is never written nor read. Enums are written as their values, tuples as lists.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from typing import Any, Callable

OMIT = "vramtrace.omit"  # field metadata key: an `Omit` member
SCHEMA_TYPE = "vramtrace.schema_type"  # field metadata key: the type the JSON Schema gives a field (e.g. an enum
# whose values a str field holds) in place of its annotation


class Omit(enum.Enum):
    """When a field is left out of the JSON."""

    NONE = "none"  # when its value is None
    EMPTY = "empty"  # when its value is None or empty ('', (), [], {})
    ALWAYS = "always"  # never written, never read (e.g. an object beside the report, not data)
    UNSET = "unset"  # when its value is the `UNSET` sentinel (its default): None is still written, as null


class _Unset(enum.Enum):
    UNSET = "unset"


UNSET = _Unset.UNSET  # the default of an `Omit.UNSET` field: "not set on this path", unlike None (written as null)


def omittable(when: Omit = Omit.NONE, default: Any = None) -> Any:
    """A dataclass field left out of the JSON when absent (see `Omit`); `default` is what a missing key reads as
    (an immutable value: None, '', (), or `UNSET` with `Omit.UNSET`)."""
    return dataclasses.field(default=default, metadata={OMIT: when})


def not_serialized(default: Any = None) -> Any:
    """A dataclass field that is not part of the JSON (`Omit.ALWAYS`)."""
    return dataclasses.field(default=default, metadata={OMIT: Omit.ALWAYS}, compare=False)


def omit_rule(f: dataclasses.Field) -> Omit | None:
    """The field's `Omit` rule, or None when it is always written."""
    return f.metadata.get(OMIT)


def _absent(value: Any, rule: Omit) -> bool:
    if rule is Omit.UNSET:
        return value is UNSET
    if rule is Omit.ALWAYS or value is None:
        return True
    return rule is Omit.EMPTY and isinstance(value, (str, tuple, list, dict)) and not value


_PLAIN = (int, str, float, bool, type(None))
_Convert = Callable[[Any], Any] | None  # a value's converter; None: the value is kept as it is


def to_data(obj: Any) -> Any:
    """JSON-ready data of `obj`: a dataclass as a dict in field order without its absent omittable fields, an
    enum as its value, a tuple or list as a list, a dict's values converted; ints, floats, strs (and their
    subclasses), bools and None as they are. Raises TypeError for any other object.

    A dataclass's fields are converted by their type hints, each hint's converter made once per call (~10^5 tensor
    rows are common); values under `Any` are inspected one by one."""
    return _any(obj, {})


def _any(obj: Any, memo: dict) -> Any:
    """`to_data` of a value whose type is not declared."""
    if type(obj) in _PLAIN:
        return obj
    if dataclasses.is_dataclass(obj):
        return _writer(type(obj), memo)(obj)
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, (str, int, float)):  # a subclass (e.g. torch's TorchVersion): json writes it as its base
        return obj
    if isinstance(obj, (tuple, list)):
        return [_any(v, memo) for v in obj]
    if isinstance(obj, dict):
        return {k: _any(v, memo) for k, v in obj.items()}
    raise TypeError(f"{type(obj).__name__} is not report data")


def _writer(hint: Any, memo: dict) -> _Convert:
    """The converter to JSON data of a value of type `hint` (memoized in `memo`; None when kept as it is)."""
    if hint in _PLAIN:
        return None
    if hint in memo:
        return memo[hint]
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        memo[hint] = lambda v: w(v)  # noqa: E731 (a self-referring class: filled in below)
        w = _dataclass_writer(hint, memo)
        memo[hint] = w
        return w
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return lambda v: v.value
    if origin in (typing.Union, types.UnionType):
        members = [a for a in args if a is not type(None)]
        inner = _writer(members[0], memo) if len(members) == 1 else (lambda v: _any(v, memo))
        return None if inner is None else (lambda v: None if v is None else inner(v))
    if origin in (tuple, list):
        items = {_writer(a, memo) for a in args if a is not Ellipsis}
        item = items.pop() if len(items) == 1 else (lambda v: _any(v, memo))
        return list if item is None else (lambda v: [item(x) for x in v])
    if origin is dict:
        value = _writer(args[1], memo)
        return None if value is None else (lambda v: {k: value(x) for k, x in v.items()})
    return lambda v: _any(v, memo)  # Any, and what has no declared shape


def _dataclass_writer(cls: type, memo: dict) -> Callable[[Any], dict]:
    hints = type_hints(cls)
    plan = tuple((f.name, omit_rule(f), _writer(hints[f.name], memo)) for f in dataclasses.fields(cls))

    def write(obj: Any) -> dict:
        out = {}
        for name, rule, convert in plan:
            value = getattr(obj, name)
            if rule is not None and _absent(value, rule):
                continue
            out[name] = value if convert is None or value is None else convert(value)
        return out

    return write


def type_hints(cls: type) -> dict[str, Any]:
    """The resolved type hints of a dataclass's fields (its annotations are strings under
    `from __future__ import annotations`)."""
    return typing.get_type_hints(cls)


def from_data(hint: Any, value: Any) -> Any:
    """`value` (JSON data) as the type `hint` says: a dataclass from its dict (an unknown key raises TypeError, a
    missing one reads as the field's default, and TypeError when it has none), an enum from its value
    (ValueError for an unknown one), a tuple from a list; `X | None` as X or None. Plain values, and values under
    `Any`, are returned as they are."""
    convert = _reader(hint, {})
    return value if convert is None or value is None else convert(value)


def _reader(hint: Any, memo: dict) -> _Convert:
    """The converter from JSON data to a value of type `hint` (memoized in `memo`; None when kept as it is)."""
    if hint in _PLAIN or hint is Any:
        return None
    if hint in memo:
        return memo[hint]
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        memo[hint] = lambda v: r(v)  # noqa: E731 (a self-referring class: filled in below)
        r = _dataclass_reader(hint, memo)
        memo[hint] = r
        return r
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return hint
    if origin in (typing.Union, types.UnionType):
        members = [a for a in args if a is not type(None)]
        if len(members) > 1:
            raise TypeError(f"no reader for the union {hint!r}")
        inner = _reader(members[0], memo)
        return None if inner is None else (lambda v: None if v is None else inner(v))
    if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
        items = [_reader(a, memo) or (lambda x: x) for a in args]
        return lambda v: tuple(r(x) for r, x in zip(items, v, strict=True))
    if origin in (tuple, list):
        item = _reader(args[0], memo)
        if item is None:
            return tuple if origin is tuple else list
        return lambda v: origin(item(x) for x in v)
    if origin is dict:
        value = _reader(args[1], memo) or (lambda x: x)
        return lambda v: {k: value(x) for k, x in _expect(v, dict).items()}
    return None


def _expect(value: Any, kind: type) -> Any:
    """`value`, when it is a `kind`; else TypeError."""
    if not isinstance(value, kind):
        raise TypeError(f"expected {kind.__name__}, got {type(value).__name__}")
    return value


def _dataclass_reader(cls: type, memo: dict) -> Callable[[Any], Any]:
    """The dataclass `cls` from its JSON object. Raises TypeError for an unknown key or a missing required one."""
    hints = type_hints(cls)
    plan = {f.name: _reader(hints[f.name], memo) for f in dataclasses.fields(cls) if omit_rule(f) is not Omit.ALWAYS}

    def read(data: Any) -> Any:
        if not isinstance(data, dict):
            raise TypeError(f"{cls.__name__}: expected an object, got {type(data).__name__}")
        kw = {}
        for name, value in data.items():
            if name not in plan:
                raise TypeError(f"{cls.__name__} has no field {name!r}")
            convert = plan[name]
            kw[name] = value if convert is None or value is None else convert(value)
        return cls(**kw)

    return read
