"""Custom models: the reference `path/to/model.py:NAME` / `package.module:NAME` (`custom_ref`), an nn.Module
passed to `analyze(model=...)` (`InProcessModel`), and the grammar of their `--input NAME=DTYPE[DIMS][:LO..HI]`
(`InputSpec`). Torch-free."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

from .errors import UsageError

_CUSTOM_REF = re.compile(r"^(?P<target>.+\.py|[A-Za-z_][\w]*(?:\.[A-Za-z_]\w*)*):(?P<name>[A-Za-z_]\w*)$")

# where an in-process module's config "comes from" (the report's model.config_location)
IN_PROCESS_LOCATION = "nn.Module passed to analyze"


@dataclass(frozen=True, eq=False, slots=True)
class InProcessModel:
    """An `nn.Module` passed to `analyze(model=module, inputs=..., loss=...)`, carried by `RunSpec.model` in place
    of a reference string. `module`: built by the caller on the meta device, never changed (each build is a deep
    copy, `tracer/custom.py::build_custom`); `inputs`: as a file's `example_inputs` returns them (a dict of keyword
    arguments, a tuple or list of positional ones, or one tensor; each a meta tensor or a shape spec string);
    `loss(output, *inputs)`: the training loss, or None (a file without `loss()`); `held`: meta tensors or shape
    specs by name that the caller's loop keeps alive through the whole step besides the inputs (HF Trainer's prefetched batches,
    `integrations/transformers.py`), or None. Compared and hashed by identity
    (`eq=False`): it holds objects of this process only. `str()`: the report's `model.ref`."""

    module: Any
    inputs: Any
    loss: Callable | None = None
    held: dict | None = None

    @property
    def name(self) -> str:
        """The module's class name."""
        return type(self.module).__name__

    def __str__(self) -> str:
        return f"{self.name} ({IN_PROCESS_LOCATION})"


def custom_ref(model: "str | InProcessModel") -> tuple[str, str] | None:
    """(file or module, NAME) for a custom-module reference `path/to/model.py:NAME` or `package.module:NAME`
    ((`IN_PROCESS_LOCATION`, class name) for an `InProcessModel`), else None (a Hub id, bundled id or path)."""
    if isinstance(model, InProcessModel):
        return IN_PROCESS_LOCATION, model.name
    m = _CUSTOM_REF.match(model.strip())
    return (m["target"], m["name"]) if m else None


# `--input` dtype names: torch's names and the usual aliases, mapped to the canonical torch name.
INPUT_DTYPES = {
    "float32": "float32", "float": "float32", "fp32": "float32", "float16": "float16", "half": "float16",
    "fp16": "float16", "bfloat16": "bfloat16", "bf16": "bfloat16", "float64": "float64", "double": "float64",
    "int64": "int64", "long": "int64", "int32": "int32", "int": "int32", "int16": "int16", "int8": "int8",
    "uint8": "uint8", "bool": "bool",
}
# Values of an integer input without a range: [0, 2), valid indices of any embedding or class count >= 2.
DEFAULT_INT_RANGE = (0, 2)
_INPUT_RE = re.compile(r"^(?:(?P<name>[A-Za-z_]\w*)=)?(?P<dtype>\w+)\[(?P<dims>[^\]]*)\](?::(?P<lo>-?\d+)\.\.(?P<hi>-?\d+))?$")
_INPUT_USAGE = "NAME=DTYPE[DIMS] or NAME=int64[DIMS]:LO..HI, e.g. x=float32[B,3,224,224] or ids=int64[B,S]:0..32000"


@dataclass(frozen=True, slots=True)
class InputSpec:
    """One model input of `--input NAME=DTYPE[DIMS][:LO..HI]`. `dims` holds ints and the symbols 'B' and 'S'
    (bound to --batch and --seq). Integer and bool inputs draw values from [low, high) as `torch.randint` does;
    without a range, `DEFAULT_INT_RANGE`. Values matter only to a real run (`vramtrace validate`)."""

    name: str
    dtype: str  # canonical torch dtype name, e.g. 'float32', 'int64'
    dims: tuple[int | str, ...]
    low: int | None = None
    high: int | None = None

    @classmethod
    def parse(cls, text: str, need_name: bool = True) -> "InputSpec":
        """Parse `NAME=DTYPE[DIMS][:LO..HI]` (NAME optional when `need_name` is False). Raises UsageError."""
        m = _INPUT_RE.match(text.strip().replace(" ", ""))
        if m is None or (need_name and not m["name"]):
            raise UsageError(f"bad --input {text!r}; use {_INPUT_USAGE}")
        dtype = INPUT_DTYPES.get(m["dtype"].lower())
        if dtype is None:
            raise UsageError(f"bad --input {text!r}: unknown dtype {m['dtype']!r}; use one of: {', '.join(sorted(set(INPUT_DTYPES.values())))}")
        dims: list[int | str] = []
        for d in filter(None, m["dims"].split(",")):
            if d in ("B", "S"):
                dims.append(d)
            elif d.isdigit():
                dims.append(int(d))
            else:
                raise UsageError(f"bad --input {text!r}: dimension {d!r} is neither an int nor B or S")
        low = high = None
        if m["lo"] is not None:
            if dtype.startswith("float") or dtype == "bfloat16":
                raise UsageError(f"bad --input {text!r}: a range LO..HI applies to integer inputs only")
            low, high = int(m["lo"]), int(m["hi"])
            if high <= low:
                raise UsageError(f"bad --input {text!r}: the range {low}..{high} is empty (HI is exclusive)")
        return cls(m["name"] or "", dtype, tuple(dims), low, high)

    def shape(self, batch: int, seq: int | None) -> tuple[int, ...]:
        """The concrete shape. Raises UsageError when a dim is S and `seq` is None."""
        if "S" in self.dims and seq is None:
            raise UsageError(f"input {self.name or self.dtype} uses S: pass --seq")
        return tuple(batch if d == "B" else seq if d == "S" else d for d in self.dims)  # type: ignore[misc]

    @property
    def value_range(self) -> tuple[int, int]:
        return (self.low, self.high) if self.low is not None else DEFAULT_INT_RANGE

    def __str__(self) -> str:
        rng = f":{self.low}..{self.high}" if self.low is not None else ""
        name = f"{self.name}=" if self.name else ""
        return f"{name}{self.dtype}[{','.join(map(str, self.dims))}]{rng}"
