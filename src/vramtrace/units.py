"""Byte formatting and parsing. Bytes are ints everywhere else; only this module formats them.

Binary units throughout: KiB = 2**10, MiB = 2**20, GiB = 2**30. Decimal units (KB, MB, GB = 10**9)
are accepted by `parse_bytes` and say so in their name.
"""

from __future__ import annotations

import re

from .errors import UsageError

_BINARY = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))
_UNITS = {
    "b": 1,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}


def format_bytes(n_bytes: int, *, signed: bool = False) -> str:
    """Format an int byte count in binary units, e.g. 1610612736 -> '1.50 GiB'."""
    sign = "-" if n_bytes < 0 else ("+" if signed and n_bytes > 0 else "")
    a = abs(int(n_bytes))
    for name, scale in _BINARY:
        if a >= scale:
            return f"{sign}{a / scale:.2f} {name}"
    return f"{sign}{a} B"


def parse_bytes(text: str, option: str = "a size") -> int:
    """Parse '40GiB', '40 GB', '512MiB', '4096B' into an int byte count. The unit is required: a bare number
    such as '24' is ambiguous (24 bytes? 24 GiB?), so it is refused.

    Raises UsageError naming `option` (e.g. '--memory-budget') and the valid units when the text is not understood
    or has no unit.
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    if not m:
        raise UsageError(f"cannot read {option} {text!r} as a size; write e.g. 40GiB, 512MiB or 80GB")
    if not m.group(2):
        raise UsageError(f"{option} {text!r} has no unit; write e.g. {m.group(1)}GiB (binary, 2**30 bytes) or "
                         f"{m.group(1)}GB (decimal, 10**9 bytes)")
    value, unit = float(m.group(1)), m.group(2).lower()
    if unit not in _UNITS:
        valid = ", ".join(["B", "KiB", "MiB", "GiB", "TiB", "KB", "MB", "GB", "TB"])
        raise UsageError(f"unknown unit {m.group(2)!r} in {option} {text!r}; valid units: {valid}")
    return int(round(value * _UNITS[unit]))


def parse_fraction(text: str, option: str = "a share") -> float:
    """Parse '5%' or '0.05' into 0.05. Raises UsageError naming `option` when the text is not a share in [0, 1)."""
    t = text.strip()
    try:
        value = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        raise UsageError(f"cannot read {option} {text!r} as a share; write e.g. 5% or 0.05") from None
    if not 0 <= value < 1:
        raise UsageError(f"{option} must be at least 0% and below 100%, got {text!r}")
    return value


def format_count(n: int) -> str:
    """Format a count with thousands separators and a short scale, e.g. 6738415616 -> '6,738,415,616 (6.74B)'."""
    for suffix, scale in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= scale:
            return f"{n:,} ({n / scale:.2f}{suffix})"
    return f"{n:,}"


def format_flops(n: int) -> str:
    """Format a FLOP count in decimal SI units (1 TFLOP = 10**12 FLOPs), e.g. 8796093022208 -> '8.80 TFLOP'."""
    for name, scale in (("PFLOP", 10**15), ("TFLOP", 10**12), ("GFLOP", 10**9), ("MFLOP", 10**6), ("KFLOP", 10**3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {name}"
    return f"{n} FLOP"
