"""Custom models: the reference `path/to/model.py:NAME` / `package.module:NAME` (`custom_ref`) and the grammar of
their `--input NAME=DTYPE[DIMS][:LO..HI]` (`InputSpec`). Torch-free."""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import UsageError

_CUSTOM_REF = re.compile(r"^(?P<target>.+\.py|[A-Za-z_][\w]*(?:\.[A-Za-z_]\w*)*):(?P<name>[A-Za-z_]\w*)$")


IN_PROCESS_PREFIX = "vramtrace_in_process_"  # a module passed to analyze() (`tracer.custom.in_process_module`)


def custom_ref(model: str) -> tuple[str, str] | None:
    """(file or module, NAME) for a custom-module reference `path/to/model.py:NAME` or `package.module:NAME`,
    else None (a Hub id, bundled id or path)."""
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
