"""Rewrite the golden files of tests/golden (the terminal report at two widths, the HTML page's embedded data) from
this checkout's code, after an intended change; review `git diff tests/golden` before committing. The tests only
compare (tests/goldens.py makes the contents for both)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]
    from goldens import write_all

    for path in write_all():
        print(f"wrote {path.relative_to(ROOT)}")
