"""Check that nothing of an earlier README was lost when it moved to docs/: every sentence of README.md at git
revision REV (at least 40 characters) is found, whitespace aside, in today's README.md or a page under docs/.

    python scripts/check_moved.py REV     # prints the sentences not found; exit 1 when there are any
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def normal(text: str) -> str:
    """`text` with heading marks dropped (a section may move one level down) and whitespace runs made one space."""
    return re.sub(r"\s+", " ", re.sub(r"(?m)^#+ ", "", text)).strip()


def sentences(markdown: str) -> list[str]:
    """The sentences of `markdown`'s paragraphs (split after '.' or ';' before a capital, a backquote, a bracket or
    a dash), headings left out."""
    out: list[str] = []
    markdown = re.sub(r"(?m)^#+ .*$", "\n", markdown)  # headings are titles, not sentences: pages retitle them
    for para in re.split(r"\n\s*\n", markdown):
        flat = normal(para)
        out += [s for s in re.split(r"(?<=[.;])\s+(?=[A-Z`(\-])", flat) if len(s) >= 40]
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    old = subprocess.run(["git", "show", f"{argv[0]}:README.md"], cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout
    now = normal(" ".join(p.read_text(encoding="utf-8") for p in [ROOT / "README.md", *sorted(ROOT.glob("docs/**/*.md"))]))
    missing = [s for s in sentences(old) if s not in now]
    for s in missing:
        print(f"- {s}")
    print(f"{len(missing)} of {len(sentences(old))} sentences not found", file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
