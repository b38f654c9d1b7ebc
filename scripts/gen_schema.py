"""Write docs/report.schema.json, the JSON Schema of the JSON report, generated from the report's dataclasses
(`vramtrace.report.schema.json_schema` over `MemoryReport` and `vramtrace.report.sections`).

    python scripts/gen_schema.py           # rewrite docs/report.schema.json
    python scripts/gen_schema.py --check   # exit 1 when docs/report.schema.json is out of date (tests/test_report_schema.py)

Run it after changing a field of the report.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "report.schema.json"
SCHEMA_ID = "https://github.com/vramtrace/vramtrace/docs/report.schema.json"


def generated() -> str:
    """The schema's text, as written to docs/report.schema.json."""
    from vramtrace.report.summary import SCHEMA_VERSION, MemoryReport
    from vramtrace.report.schema import json_schema

    schema = json_schema(MemoryReport, title=f"vramtrace report (schema_version {SCHEMA_VERSION})",
                         schema_id=SCHEMA_ID, constants={"schema_version": SCHEMA_VERSION})
    return json.dumps(schema, indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str]) -> int:
    text = generated()
    if "--check" in argv:
        if OUT.read_text(encoding="utf-8") != text:
            print(f"{OUT.relative_to(ROOT)} is out of date: run python scripts/gen_schema.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
