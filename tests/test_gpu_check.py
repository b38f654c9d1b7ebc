"""benchmarks/gpu_check.py: its dry mode end to end on the CPU (tiny cases: the real runner, the prediction
subprocess with --device cpu, the comparison, the fit boundary, the markdown file), its time guard and GPU preset
matching, and the real runner's independence from vramtrace."""

from __future__ import annotations

import ast
import concurrent.futures as cf
import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"


def _gpu_check():
    """benchmarks/gpu_check.py as a module (registered first: its dataclasses look their module up)."""
    name = "gpu_check_under_test"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, BENCH / "gpu_check.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _imports(path: Path) -> set[str]:
    imported = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            imported.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module or "")
    return imported


def test_the_real_side_imports_nothing_from_vramtrace():
    """The truth must not share code with the tool: the runner, the model file and the orchestrator (which
    reaches vramtrace only through its CLI in a subprocess) import no vramtrace module. At run time the runner
    also reports the vramtrace modules in its sys.modules, and gpu_check fails a case that has any."""
    for name in ("gpu_check_runner.py", "gpu_evidence/mha_model.py", "gpu_check.py"):
        imported = _imports(BENCH / name)
        assert "torch" in imported or name == "gpu_check.py", (name, imported)
        assert not any(m.split(".")[0] in ("vramtrace", "oracle", "conftest") for m in imported), (name, imported)


def _table(lines: list[str], first: str) -> tuple[list[str], list[list[str]]]:
    """The markdown table whose header starts with `first`: its header cells and rows' cells."""
    start = next(i for i, ln in enumerate(lines) if ln.startswith(f"| {first} |"))
    rows = []
    for ln in lines[start + 2:]:
        if not ln.startswith("|"):
            break
        rows.append([c.strip() for c in ln.strip().strip("|").split("|")])
    return [c.strip() for c in lines[start].strip().strip("|").split("|")], rows


def _int(cell: str) -> int:
    assert re.fullmatch(r"[\d,]+", cell), cell
    return int(cell.replace(",", ""))


def test_dry_run_writes_the_table_and_the_fit_boundary(tmp_path):
    out = tmp_path / "dry.md"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    p = subprocess.run([sys.executable, str(BENCH / "gpu_check.py"), "--dry-run", "--cases", "llama-train,fit",
                        "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = out.read_text().splitlines()
    assert lines[0] == "# gpu_check: DRY RUN on the CPU (tiny configs; not GPU figures)"
    header, rows = _table(lines, "case")
    assert tuple(header) == _gpu_check().COLUMNS
    assert [r[0] for r in rows] == ["llama-train"] and len(rows[0]) == len(header)
    case, pred, real, err, p_res, r_res, e_res, context, cublas, device = rows[0]
    # tiny-llama-gqa bf16-mixed, batch 2, seq 32 on the CPU: a case the oracle suite holds exact, so the harness's
    # own CPU measurement (profiler events + bytes alive at start) must meet the prediction
    assert _int(pred) == _int(real) > 1_000_000
    assert err == "+0 B (+0.000%)"
    assert {p_res, r_res, e_res, context, cublas} == {"n/a (CPU)"} and device == "CPU (dry run)"
    assert "- llama-train: `vramtrace [fixtures/configs/tiny-llama-gqa.json] --batch 2 " in "\n".join(lines)

    answer = int(re.search(r"^Answer: batch (\d+) ", "\n".join(lines), re.M).group(1))
    capacity = int(re.search(r"capacity ([\d,]+) B", "\n".join(lines)).group(1).replace(",", ""))
    assert capacity == 8 * 2**20
    fit_header, fit_rows = _table(lines, "batch")
    assert fit_header == ["batch", "real", "peak allocated", "peak reserved", "device used"]
    assert [int(r[0]) for r in fit_rows] == [answer, answer + 1, answer + 2]
    measured = [_int(r[2]) for r in fit_rows]
    # `vramtrace fit`'s answer is the real largest batch under the capacity: it fits, the next ones do not
    assert measured[0] <= capacity < measured[1] < measured[2]
    assert [r[1] for r in fit_rows] == ["ran on the CPU: fits"] + ["ran on the CPU: over the capacity"] * 2


def test_time_budget_skips_the_remaining_cases_and_says_so(tmp_path):
    gc = _gpu_check()
    plan = gc.Plan(dry=False, predict_only=False, target=("--gpu", "H100-80GB"), tmp=tmp_path,
                   deadline=time.monotonic() + 10)
    assert plan.has_time(5) and not plan.has_time(15)  # a case estimated past the deadline does not start
    late = gc.Plan(dry=False, predict_only=False, target=("--gpu", "H100-80GB"), tmp=tmp_path,
                   deadline=time.monotonic() - 1)
    cases = [c for c in gc.CASES if c.name in ("mha", "vit")]
    with cf.ThreadPoolExecutor(1) as pool:
        rows, skipped, fit = gc.run_cases(cases, late, pool, want_fit=False)
    assert rows == [] and fit == {}
    assert skipped == ["mha: time budget (--max-minutes): not run", "vit: time budget (--max-minutes): not run"]


def test_gpu_presets_from_device_names():
    gc = _gpu_check()
    args = gc.parse_args([])
    for name, preset in [("NVIDIA H100 80GB HBM3", "H100-80GB"), ("NVIDIA H100 NVL", "H100-NVL"),
                         ("NVIDIA A100-SXM4-40GB", "A100-40GB"), ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
                         ("NVIDIA L40S", "L40S"), ("NVIDIA L4", "L4"), ("NVIDIA A10G", "A10G"), ("NVIDIA A10", "A10"),
                         ("NVIDIA GeForce RTX 4090", "RTX4090"), ("Tesla T4", "T4"), ("Tesla V100-SXM2-32GB",
                                                                                           "V100-32GB")]:
        assert gc.target_args({"name": name, "total": 1}, args)[0] == ["--gpu", preset], name
    chosen, line = gc.target_args({"name": "NVIDIA RTX PRO 6000", "total": 102_000_000_000}, args)
    assert chosen == ["--gpu-memory", "102000000000B"] and "no preset matches" in line


def test_unknown_case_is_a_usage_error():
    p = subprocess.run([sys.executable, str(BENCH / "gpu_check.py"), "--cases", "llama-train,nope"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stderr.startswith("Error: unknown case nope; known: ")


def test_the_recorded_h100_run_names_every_case_and_agrees_with_the_evidence():
    """--predict-only --recorded: the real side is the recorded H100 run (`--real-only --record` on an H100). It
    holds every case of gpu_check (a renamed case would silently lose its figure); where the evidence README
    (shared/gpu-evidence, an earlier run on the same kind of machine) printed a figure, the record has it (two rows
    checked here, as printed there); the fit boundary's runs say which batches ran and which ran out of memory."""
    gc = _gpu_check()
    import json
    recorded = json.loads(gc.RECORDED.read_text())
    assert set(recorded["cases"]) == {c.name for c in gc.CASES}
    bert = gc.recorded_run(recorded, "bert-seqcls")
    assert (bert["outcome"], bert["allocated"], bert["reserved"]) == ("ran", 8_231_135_744, 8_633_974_784)
    assert gc.recorded_run(recorded, "t5")["reserved"] == 10_225_713_152
    assert gc.recorded_run(recorded, 23)["allocated"] == 78_544_239_616
    assert gc.recorded_run(recorded, 24)["outcome"] == "oom"
    assert gc.recorded_run(recorded, 26)["outcome"] == "not run"
    assert gc.recorded_run(None, "bert-seqcls")["outcome"] == "not run"


def test_real_only_writes_a_record_that_predict_only_reads(tmp_path):
    """--real-only on a GPU machine whose Python cannot run vramtrace: the runs alone, written as a record after
    each one (here the dry plan's CPU runs stand in for the GPU's), which --predict-only --recorded FILE reads
    back as the real side, the fit batches first."""
    gc = _gpu_check()
    import json
    plan = gc.Plan(dry=True, predict_only=False, target=("--device", "cpu"), tmp=tmp_path,
                   deadline=time.monotonic() + 600)
    probe = {"name": "CPU stand-in", "capability": "none", "torch": "x", "cuda_version": None,
             "transformers": "x", "total": 0, "extras": {"peft": None}}
    record = tmp_path / "record.json"
    cases = [gc.dry_case(c) for c in gc.CASES if c.name == "mha"]
    out = gc.record_real(cases, plan, [2, 3], set(), record, None, probe)
    assert json.loads(record.read_text()) == out
    assert list(out["fit"]["runs"]) == ["2", "3"] and out["source"].startswith("gpu_check --real-only on CPU")
    runs = {b: gc.recorded_run(out, b) for b in (2, 3)}
    assert all(r["outcome"] == "ran" for r in runs.values()) and runs[2]["allocated"] < runs[3]["allocated"]
    mha = gc.recorded_run(out, "mha")
    assert mha["outcome"] == "ran" and mha["allocated"] > 0 and mha["device_name"] == "CPU (dry run)"
