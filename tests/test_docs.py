"""The documentation stays true: the README's commands (.ci/run runs its test command), links that resolve, the
generated CLI reference up to date, and the JSON Schema of the report against real reports."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FIXTURES
from vramtrace import COMPARED_POLICIES, RunSpec, analyze, compare_reports, report_json, with_comparison
from vramtrace.analysis.categories import Category

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
SCHEMA = ROOT / "docs" / "report.schema.json"
SETUP = "pip install torch==2.13.0 && pip install -e . && vramtrace meta-llama/Llama-2-7b --batch 4 --seq 2048"
TESTS = 'pip install torch==2.13.0 && pip install -e ".[test]" && python -m pytest -q -n 2'


def test_readme_is_short_and_keeps_the_two_setup_commands():
    text = README.read_text(encoding="utf-8")
    assert len(text.encode("utf-8")) < 15_000
    assert SETUP in text and TESTS in text
    assert "python -m pytest -q -n 2" in (ROOT / ".ci" / "run").read_text()  # CI runs the README's test command


def test_every_relative_link_in_readme_and_docs_resolves():
    pages = [README, *sorted((ROOT / "docs").glob("**/*.md")), ROOT / "CHANGELOG.md"]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            if "://" not in target and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken


def test_cli_reference_is_up_to_date():
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_cli_reference.py"), "--check"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr  # regenerate: python scripts/gen_cli_reference.py


def test_cli_reference_lists_every_option():
    """Not a copy of itself: each option the typer app declares appears in docs/cli.md."""
    import typer.main

    from vramtrace.cli import app, serve_app

    text = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    for a in (app, serve_app):
        for param in typer.main.get_command(a).params:
            if not getattr(param, "hidden", False):
                assert all(opt in text for opt in param.opts if opt.startswith("--")), param.opts


def test_schema_categories_are_the_analysis_categories():
    schema = json.loads(SCHEMA.read_text())
    assert schema["$defs"]["Category"]["enum"] == [c.value for c in Category]


@pytest.fixture(scope="module")
def validator():
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


@pytest.mark.parametrize("config,kw", [
    ("tiny-gpt2.json", dict(batch=2, seq=16)),  # CUDA target: allocator, fit verdict
    ("tiny-llama-gqa.json", dict(batch=2, seq=16, device="cpu", mode="inference")),
    ("tiny-llama-gqa.json", dict(batch=1, seq=8, device="cpu", mode="generate", new_tokens=3)),
    ("tiny-bert.json", dict(batch=2, seq=16, device="cpu", checkpointing="layers")),
])
def test_real_reports_validate_against_the_schema(validator, config, kw):
    report = analyze(RunSpec(str(FIXTURES / config), **kw))
    data = json.loads(report_json(report))
    errors = [f"{list(e.path)}: {e.message}" for e in validator.iter_errors(data)]
    assert not errors, errors[:5]


def test_a_compare_report_validates(validator):
    spec = RunSpec(str(FIXTURES / "tiny-gpt2.json"), batch=2, seq=16, device="cpu")
    labels = list(COMPARED_POLICIES)
    reports = compare_reports(spec, labels)
    data = json.loads(report_json(with_comparison(reports, labels)))
    assert data["comparison"]
    errors = [f"{list(e.path)}: {e.message}" for e in validator.iter_errors(data)]
    assert not errors, errors[:5]


def test_the_schema_rejects_a_broken_report(validator):
    """The schema has teeth: a report with a fractional byte count or a made-up category does not validate."""
    report = json.loads(report_json(analyze(RunSpec(str(FIXTURES / "tiny-gpt2.json"), batch=1, seq=8, device="cpu",
                                                    mode="inference"))))
    assert validator.is_valid(report)
    assert not validator.is_valid({**report, "peak_allocated_bytes": 1.5})
    bad_row = {**report["tensors"][0], "category": "weights"}
    assert not validator.is_valid({**report, "tensors": [bad_row, *report["tensors"][1:]]})
    assert not validator.is_valid({k: v for k, v in report.items() if k != "schema_version"})
