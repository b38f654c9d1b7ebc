"""What is live at the peak, aggregated: identical layers folded into one row ("32 × model.layers.*.mlp").

Pure data over a MemoryReport's rows: no torch here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_INDEX = re.compile(r"\.(\d+)(?=\.|$)")


def module_pattern(path: str) -> str:
    """'model.layers.3.mlp' -> 'model.layers.*.mlp': every layer index folded, so identical layers group."""
    return _INDEX.sub(".*", path)


def stack_pattern(pattern: str) -> str | None:
    """A module pattern's layer stack, up to its first folded index: 'model.layers.*.mlp' -> 'model.layers.*';
    None for a pattern without one."""
    return pattern[:pattern.index("*") + 1] if "*" in pattern else None


@dataclass(frozen=True, slots=True)
class Group:
    """Storages live at the peak that share a module pattern and a category. `instances` is how many distinct
    modules of the pattern hold them (32 for one row per decoder layer), `bytes` their total (int bytes),
    `count` the storages."""

    pattern: str
    category: str
    instances: int
    count: int
    bytes: int

    @property
    def bytes_each(self) -> int:
        """Bytes per module instance (the total when the bytes are not spread evenly, as a mean)."""
        return self.bytes // max(self.instances, 1)


def owner(row) -> str:
    """The module a storage (TensorRow: name, module) is placed under: a named storage (a parameter, a gradient,
    an optimizer state) by its name's module ('model.layers.0.mlp.up_proj.weight:exp_avg' and
    'lm_head.weight.grad' -> 'model.layers.0.mlp.up_proj', 'lm_head'), the others by the module that allocated
    them; '' for the root."""
    name = row.name.split(":")[0].split(" ")[0].removesuffix(".grad")
    return name.rsplit(".", 1)[0] if "." in name else (row.module or name)


def live_groups(rows, peak: int) -> list[Group]:
    """The storages of `rows` (TensorRow: module, name, category, bytes, birth, death) live at timeline step
    `peak`, grouped by (module pattern, category), largest total first, each placed by `owner`."""
    groups: dict[tuple[str, str], list] = {}
    for r in rows:
        if not r.birth <= peak <= r.death:
            continue
        path = owner(r)
        key = (module_pattern(path), r.category)
        g = groups.setdefault(key, [set(), 0, 0])
        g[0].add(path)
        g[1] += 1
        g[2] += r.bytes
    out = [Group(p, c, len(paths), n, b) for (p, c), (paths, n, b) in groups.items()]
    out.sort(key=lambda g: (-g.bytes, g.pattern, g.category))
    return out


def layer_totals(groups: list[Group]) -> list[Group]:
    """`groups` (from `live_groups`) rolled up to whole layers: every group whose pattern has a folded layer index
    summed into its stack's pattern up to that index ('model.layers.*.mlp.up_proj' -> 'model.layers.*'), per
    category, with the most instances of its members; largest total first. 'What each of the 32 decoder layers
    holds at the peak.'"""
    totals: dict[tuple[str, str], list[int]] = {}
    for g in groups:
        stack = stack_pattern(g.pattern)
        if stack is None:
            continue
        t = totals.setdefault((stack, g.category), [0, 0, 0])
        t[0] = max(t[0], g.instances)
        t[1] += g.count
        t[2] += g.bytes
    out = [Group(p, c, n, k, b) for (p, c), (n, k, b) in totals.items()]
    out.sort(key=lambda g: (-g.bytes, g.pattern, g.category))
    return out
