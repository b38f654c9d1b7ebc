"""scripts/report_baseline.py, the harness that proves a change of structure changes no report byte (issue 40):
a baseline written and checked at once is identical, and a baseline with one number changed is caught, naming its
JSON path with both values."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "report_baseline.py"
RUNS = "tiny-gpt2-no-levers,tiny-bert-inference"  # two tiny --quick runs, under a second each once warm


@pytest.fixture(scope="module")
def harness():
    spec = importlib.util.spec_from_file_location("report_baseline", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["report_baseline"] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules["report_baseline"]


def test_write_then_check_is_identical_and_an_edited_number_is_caught(harness, tmp_path, capsys):
    assert harness.main(["--write", str(tmp_path), "--runs", RUNS]) == 0
    capsys.readouterr()
    assert harness.main(["--check", str(tmp_path), "--runs", RUNS]) == 0
    printed = capsys.readouterr().out
    assert "tiny-gpt2-no-levers: identical" in printed and "tiny-bert-inference: identical" in printed

    written = tmp_path / "tiny-bert-inference.json"
    report = json.loads(written.read_text())
    true_peak = report["peak_allocated_bytes"]
    report["peak_allocated_bytes"] = true_peak + 512
    written.write_text(json.dumps(report) + "\n")
    assert harness.main(["--check", str(tmp_path), "--runs", RUNS]) == 1
    printed = capsys.readouterr().out
    assert "tiny-gpt2-no-levers: identical" in printed
    assert "tiny-bert-inference: DIFFERS" in printed
    assert f"$.peak_allocated_bytes: {true_peak + 512} -> {true_peak}" in printed
    assert "1 of 2 identical" in printed


def test_runs_are_listed_and_an_unknown_run_is_one_error_line(harness, capsys):
    assert harness.main(["--list", "--quick"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert listed and all(" quick vramtrace " in line for line in listed)
    assert any("tiny-gpt2-cpu" in line and "--device cpu" in line for line in listed)
    with pytest.raises(SystemExit) as exit_:
        harness.main(["--check", "/nonexistent", "--runs", "tiny-gpt2-train,no-such-run"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip() == "Error: unknown run no-such-run; --list lists them"


def test_differences_name_nested_paths_and_absent_entries(harness):
    old = {"run": {"batch": 2}, "tensors": [{"bytes": 4}, {"bytes": 8}]}
    new = {"run": {"batch": 2, "seq": 32}, "tensors": [{"bytes": 4}]}
    assert harness.differences(old, new) == [("$.run.seq", "<absent>", 32), ("$.tensors[1]", {"bytes": 8}, "<absent>")]
    assert harness.differences(old, json.loads(json.dumps(old))) == []
    assert harness.differences({"a": 1}, {"a": 1.0}) == [("$.a", 1, 1.0)]  # an int that became a float differs


def test_normalise_replaces_only_the_volatile_values_and_the_checkout_path(harness, monkeypatch):
    report = {"run": {"batch": 2, "seconds": 1.5}, "model": {"ref": f"{harness.ROOT}/fixtures/configs/x.json"}}
    assert harness.normalise(report) == {"run": {"batch": 2, "seconds": 1.5},
                                         "model": {"ref": "<repo>/fixtures/configs/x.json"}}
    monkeypatch.setattr(harness, "VOLATILE", ((("run", "seconds"), "wall clock"), (("steps", "*", "t"), "time")))
    assert harness.normalise({**report, "steps": [{"t": 3, "op": "mm"}]}) == {
        "run": {"batch": 2, "seconds": "<normalised>"}, "model": {"ref": "<repo>/fixtures/configs/x.json"},
        "steps": [{"t": "<normalised>", "op": "mm"}]}
