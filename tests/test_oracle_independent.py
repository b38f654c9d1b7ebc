"""The tests' oracle shares no code with vramtrace: tests/oracle.py imports nothing from it."""

import ast
from pathlib import Path


def test_oracle_imports_nothing_from_vramtrace():
    tree = ast.parse((Path(__file__).parent / "oracle.py").read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module or "")
    assert imported and not any(m.split(".")[0] in ("vramtrace", "conftest") for m in imported), imported


def test_zero_oracle_imports_nothing_from_vramtrace():
    """tests/zero_oracle.py (DeepSpeed ZeRO's real runs) neither; it builds on tests/oracle.py only."""
    tree = ast.parse((Path(__file__).parent / "zero_oracle.py").read_text())
    imported = {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert "oracle" in imported and not any(m.split(".")[0] in ("vramtrace", "conftest") for m in imported), imported
