"""Pipeline parallelism in "what makes it fit": `vramtrace fit --pp` (the smallest pipeline depth that fits, fit.py
`_fit_depth`) and the levers of a --pp run (levers.py: a deeper pipeline, more micro-batches). Every figure is
checked against a separate `analyze()` of the changed run (whose per-stage peaks tests/test_pipelining.py checks
against real gloo ranks), and against the budget it was searched for."""

from __future__ import annotations

import json

import pytest

from conftest import FIXTURES, deep_config, run_cli
from vramtrace import RunSpec, analyze
from vramtrace.errors import UsageError
from vramtrace.fit import fit

LLAMA = str(FIXTURES / "tiny-llama-gqa.json")
BUDGET = 3 << 20  # between the 4-layer tiny Llama's largest stage at --pp 2 (3.5 MiB) and at --pp 4 (2.5 MiB)


def test_fit_finds_the_smallest_pipeline_depth_whose_largest_stage_fits(capsys, tmp_path):
    model = deep_config(tmp_path, "tiny-llama-gqa", 4)
    out = tmp_path / "fit.json"
    r = run_cli(capsys, "fit", model, "--batch", "8", "--seq", "16", "--device", "cpu", "--precision", "fp32",
                "--pp", "2", "--pp-schedule", "gpipe", "--gpu-memory", "3MiB", "--json", out)
    assert r.returncode == 0, r.stderr
    result = json.loads(out.read_text())
    assert result["axis"] == "pp" and result["budget_bytes"] == BUDGET
    # --pp 3 is no depth for batch 8 (M follows P: 8 rows do not split into 3 micro-batches), so 2 then 4
    assert [p["x"] for p in result["curve"]] == [2, 4] and "skipped --pp 3" in result["method"]
    assert (result["best"]["x"], result["next"]["x"]) == (4, 2)
    assert "Smallest pipeline depth that fits (--pp): 4" in " ".join(r.stdout.split())
    # each point is the largest stage of the report of the same run, traced on its own
    for p in result["curve"]:
        report = analyze(RunSpec(model, batch=8, seq=16, device="cpu", precision="fp32", pp=p["x"],
                                 pp_schedule="gpipe"))
        assert p["peak_allocated_bytes"] == report.peak_allocated_bytes == max(
            s.peak_bytes for s in report.run.pp.stage_peaks)
        assert p["exact"] and p["fits"] == (report.peak_allocated_bytes <= BUDGET)
    assert result["best"]["peak_allocated_bytes"] <= BUDGET < result["next"]["peak_allocated_bytes"]


def test_fit_pp_needs_the_batch_and_the_sequence(capsys):
    r = run_cli(capsys, "fit", LLAMA, "--seq", "8", "--device", "cpu", "--gpu-memory", "3MiB", "--pp", "2")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "Error: `vramtrace fit --pp P` searches the smallest pipeline depth from P that fits at a given --batch and "
        "--seq: give both (and no --sweep)"]


def test_fit_pp_axis_needs_a_pipeline_and_a_pipeline_only_the_pp_axis():
    with pytest.raises(UsageError, match="give --pp P"):
        fit(RunSpec(LLAMA, batch=2, seq=8, device="cpu", gpu_memory_bytes=1 << 30), "pp")
    with pytest.raises(UsageError, match="with --pp, fit searches the depth"):
        fit(RunSpec(LLAMA, batch=2, seq=8, device="cpu", gpu_memory_bytes=1 << 30, pp=2), "batch")


def _levers(capsys, tmp_path, model, *extra) -> dict:
    out = tmp_path / "r.json"
    r = run_cli(capsys, model, "--batch", "8", "--seq", "16", "--device", "cpu", "--precision", "fp32", "--pp", "2",
                "--gpu-memory", "3MiB", "--json", out, *extra)
    assert r.returncode == 0, r.stderr
    return json.loads(out.read_text())


def test_levers_under_pp_size_the_whole_pipeline(capsys, tmp_path):
    """A 1F1B pipeline of 2 stages that does not fit: more micro-batches (the same batch per schedule.step) and a
    deeper pipeline, each lever's figure that of the whole changed pipeline (its largest stage), as a separate
    analyze() of the changed run reports it."""
    model = deep_config(tmp_path, "tiny-llama-gqa", 4)
    report = _levers(capsys, tmp_path, model)
    levers = report["levers"]
    assert levers["base_bytes"] == report["peak_allocated_bytes"] > BUDGET
    rows = {lv["family"]: lv for lv in levers["levers"]}
    assert {"micro_batch", "pp"} <= set(rows) <= {"use_cache", "optimizer_impl", "optimizer_8bit", "checkpointing",
                                                  "micro_batch", "pp"}
    base = dict(batch=8, seq=16, device="cpu", precision="fp32", pp=2)
    # the first doubling of M = P = 2 that fits; --pp 3 is no depth for batch 8 (M follows P), so --pp 4
    for family, options, spec in (("micro_batch", "--micro-batches 4", RunSpec(model, **{**base, "micro_batches": 4})),
                                  ("pp", "--pp 4", RunSpec(model, **{**base, "pp": 4}))):
        row, expected = rows[family], analyze(spec)
        assert row["options"] == options
        assert row["peak_allocated_bytes"] == expected.peak_allocated_bytes == max(
            s.peak_bytes for s in expected.run.pp.stage_peaks)
        assert row["fits"] == (row["peak_allocated_bytes"] <= BUDGET) and row["fits"]
    assert [s["family"] for s in levers["skipped"]] == ["not_under_pp"]


def test_levers_under_pp_with_a_stage_size_that_stage(capsys, tmp_path):
    """--stage K: each lever sized on that stage alone, and says so; a deeper pipeline's figure is its last stage's
    when K is the last (the stage with the head and the loss)."""
    model = deep_config(tmp_path, "tiny-llama-gqa", 4)
    report = _levers(capsys, tmp_path, model, "--stage", "1", "--pp-schedule", "gpipe")
    rows = {lv["family"]: lv for lv in report["levers"]["levers"]}
    assert "checkpointing" in rows and all(
        lv["cost"].endswith("(stage 1 only, as --stage)") for f, lv in rows.items() if f != "pp")
    assert rows["pp"]["cost"].endswith("(stage 3 only, as --stage 1 of 2)")
    deeper = analyze(RunSpec(model, batch=8, seq=16, device="cpu", precision="fp32", pp=4, pp_schedule="gpipe",
                             stage=3))
    assert rows["pp"]["options"] == "--pp 4 --stage 3"
    assert rows["pp"]["peak_allocated_bytes"] == deeper.peak_allocated_bytes


def test_fit_pp_with_a_stage_sizes_every_stage():
    """The pipeline fits only when all its stages do: --stage is dropped, and the method says so."""
    spec = RunSpec(LLAMA, batch=4, seq=8, device="cpu", precision="fp32", pp=2, stage=0, gpu_memory_bytes=1 << 30)
    result = fit(spec, "pp")
    assert "--stage dropped: every stage sized" in result.method
    assert (result.best.x, result.next, result.traces) == (2, None, 2)
    whole = analyze(RunSpec(LLAMA, batch=4, seq=8, device="cpu", precision="fp32", pp=2))
    assert result.best.peak_allocated_bytes == whole.peak_allocated_bytes == max(
        s.peak_bytes for s in whole.run.pp.stage_peaks)


def test_fit_pp_when_no_depth_fits_names_the_deepest_and_the_layer_limit(capsys, tmp_path):
    """2 decoder layers: no deeper pipeline than 2 stages; 1 MiB is below its largest stage (1.6 MiB)."""
    out = tmp_path / "fit.json"
    r = run_cli(capsys, "fit", LLAMA, "--batch", "4", "--seq", "8", "--device", "cpu", "--precision", "fp32",
                "--pp", "2", "--gpu-memory", "1MiB", "--json", out)
    assert r.returncode == 0, r.stderr
    result = json.loads(out.read_text())
    assert result["best"] is None and result["next"]["x"] == result["limit"] == 2
    assert result["next"]["peak_allocated_bytes"] > result["budget_bytes"] == 1 << 20
    text = " ".join(r.stdout.split())
    assert "Does not fit even with --pp 2" in text and "depths searched up to --pp 2" in text


def test_fit_pp_stops_before_a_depth_past_its_cap_of_stage_traces(capsys, tmp_path, monkeypatch):
    """The search stops before a depth whose stages would take it past `MAX_PIPELINE_STAGE_TRACES` stage traces
    (here 5: --pp 2 and 3 traced, 2 + 3 stages; --pp 4 would make 9) and says so; the limit is the last depth
    searched."""
    import vramtrace.fit

    monkeypatch.setattr(vramtrace.fit, "MAX_PIPELINE_STAGE_TRACES", 5)
    out = tmp_path / "fit.json"
    r = run_cli(capsys, "fit", deep_config(tmp_path, "tiny-llama-gqa", 8), "--batch", "12", "--seq", "8",
                "--device", "cpu", "--precision", "fp32", "--pp", "2", "--gpu-memory", "1KiB", "--json", out)
    assert r.returncode == 0, r.stderr
    result = json.loads(out.read_text())
    assert result["best"] is None and [p["x"] for p in result["curve"]] == [2, 3] and result["limit"] == 3
    assert result["traces"] == 5 and "stopped before --pp 4" in result["method"]


def test_a_candidate_depth_has_a_layer_for_every_stage_and_options_the_spec_accepts():
    """`levers.pipeline_depth` (the fit axis's and the pp lever's candidates), no trace: with 2 virtual stages per
    rank, depth P' needs 2 P' layers; 1F1B raises a given M below the depth to it; a batch that M does not divide
    is no candidate."""
    from vramtrace.levers import pipeline_depth

    inter = RunSpec(LLAMA, batch=8, seq=8, pp=2, pp_schedule="interleaved-1f1b", virtual_stages=2, micro_batches=4)
    assert pipeline_depth(inter, 2, 4) is not None and pipeline_depth(inter, 3, 4) is None
    one = RunSpec(LLAMA, batch=8, seq=8, pp=2, micro_batches=2)
    assert pipeline_depth(one, 4, 8).micro_batches == 4
    assert pipeline_depth(one, 3, 8) is None  # M raised to 3 does not divide the batch of 8


def test_the_micro_batch_lever_under_pp_tries_every_divisor_of_the_batch_above_m():
    """`levers.pp_micro_batch_candidates`, no trace: every M' > M that divides the batch, ascending (batch 12 with
    M = 4: 6 and 12, where doubling M found none); past `PP_MICRO_BATCH_EXTRA` divisors that are no doubling of M,
    the smallest of them and the largest, every doubling kept; an M' the spec refuses is left out."""
    from dataclasses import replace

    from vramtrace.levers import PP_MICRO_BATCH_EXTRA, accepted, pp_micro_batch_candidates

    assert pp_micro_batch_candidates(12, 4) == [6, 12]
    assert pp_micro_batch_candidates(8, 2) == [4, 8]
    assert pp_micro_batch_candidates(8, 8) == [] and pp_micro_batch_candidates(7, 1) == [7]
    assert pp_micro_batch_candidates(96, 4) == [6, 8, 12, 16, 24, 32, 48, 96]
    # 720 = 2^4 · 3^2 · 5 at M = 8: one doubling (16), 22 other divisors above 8: 9, 10, 12, 15, 18 ... 360, 720
    assert PP_MICRO_BATCH_EXTRA == 6 and pp_micro_batch_candidates(720, 8) == [9, 10, 12, 15, 16, 18, 720]
    for batch in range(1, 257):
        for m in (d for d in range(1, batch + 1) if batch % d == 0):
            got = pp_micro_batch_candidates(batch, m)
            doublings = [m << k for k in range(1, 9) if batch % (m << k) == 0]
            assert got == sorted(set(got)) and all(d > m and batch % d == 0 for d in got), (batch, m, got)
            assert set(doublings) <= set(got) and len(got) <= len(doublings) + PP_MICRO_BATCH_EXTRA, (batch, m)
            if batch > m:
                assert got[-1] == batch, (batch, m, got)  # the strongest: one row per micro-batch
    # interleaved-1f1b at P = 2 refuses M = 5 (torch's ScheduleInterleaved1F1B: 2 rounds do not divide it)
    inter = RunSpec(LLAMA, batch=20, seq=8, pp=2, pp_schedule="interleaved-1f1b", micro_batches=4)
    with pytest.raises(UsageError):
        replace(inter, micro_batches=5)
    assert pp_micro_batch_candidates(20, 4, lambda k: accepted(inter, micro_batches=k) is not None) == [10, 20]


def test_a_lever_pipeline_stops_at_the_first_stage_that_does_not_fit(tmp_path):
    """On a CUDA target a lever's whole pipeline is traced stage by stage and stops at a stage that alone does not
    fit (levers.py `pipeline_outcome`): its row names that stage, its figures are that stage's own (a separate
    --stage run's), and fewer stages were traced than the pipeline has; a lever that fits has every stage traced
    and the figures of a separate run of the same pipeline (its largest stage). 68 MiB: between the 4-layer tiny
    Llama's largest stage at --pp 2 (72 MiB reserved, 64 MiB of it cuBLAS workspaces) and at --micro-batches 8;
    --pp-split (the even split) fixes the depth, so no deeper pipeline is traced (a shorter test)."""
    import io
    import re

    from rich.console import Console

    from vramtrace.render.html import render_html
    from vramtrace.render.levers import render_levers
    from vramtrace.units import format_bytes

    model = deep_config(tmp_path, "tiny-llama-gqa", 4)
    base = dict(batch=8, seq=64, pp=2, pp_split="2,2", gpu_memory_bytes=68 << 20, cuda_context_bytes=0)
    said: list[str] = []
    report = analyze(RunSpec(model, **base), progress=said.append)
    levers = report.levers
    assert levers.basis == "peak reserved" and levers.base_bytes > levers.budget_bytes == 68 << 20
    partial = [lv for lv in levers.levers if lv.decided_by_stage is not None]
    whole = [lv for lv in levers.levers if lv.fits]
    assert partial and whole and not any(lv.fits for lv in partial)
    # the stages traced after each lever's first progress line, up to the next lever's
    traced: dict[str, int] = {}
    for line in said:
        if line.startswith("what makes it fit, trace "):
            options = line.split(": ", 1)[1]
            traced[options] = 0
        elif traced and re.fullmatch(r"stage \d+( \(for stages [\d, ]+\))?", line):
            traced[options] += 1
    assert levers.traces == sum(traced.values()) < 2 * len(traced)  # each lever a pipeline of 2 stages
    for lv in partial:
        assert traced[lv.options] < 2
        changes = {"checkpointing": "modules:layers.*"} if lv.family == "checkpointing" else None
        if changes:  # its figures are the deciding stage's, as that stage alone reports them
            alone = analyze(RunSpec(model, **base, **changes, stage=lv.decided_by_stage), levers=False)
            assert (lv.peak_allocated_bytes, lv.peak_reserved_bytes) == (alone.peak_allocated_bytes,
                                                                         alone.peak_reserved_bytes)
            assert alone.peak_reserved_bytes > levers.budget_bytes
    assert any(lv.family == "checkpointing" for lv in partial)
    console = Console(width=400, file=io.StringIO())  # wide: no row wraps
    render_levers(levers, console)
    shown = {line.split("│")[1].strip(): line for line in console.file.getvalue().splitlines() if "│" in line}
    page = render_html([report])
    for lv in partial:  # a lower bound, an upper bound of what it saves, and why, on the terminal and the page
        k, row = lv.decided_by_stage, shown[lv.options]
        assert f"│ ≥ {format_bytes(lv.compared_bytes)} │ ≤ {format_bytes(lv.saves_bytes)} │ no " in row
        why = f"stage {k} alone does not fit (the other stages not traced; figures: stage {k}&#39;s)"
        assert why.replace("&#39;", "'") in row and why in page
        assert f"≥ {format_bytes(lv.compared_bytes)}" in page
    rows = {lv.family: lv for lv in whole}
    assert rows["micro_batch"].options == "--micro-batches 8" and traced["--micro-batches 8"] == 2
    expected = analyze(RunSpec(model, **base, micro_batches=8), levers=False)
    assert rows["micro_batch"].decided_by_stage is None
    assert rows["micro_batch"].peak_allocated_bytes == expected.peak_allocated_bytes == max(
        s.peak_bytes for s in expected.run.pp.stage_peaks)
    assert rows["micro_batch"].peak_reserved_bytes == expected.peak_reserved_bytes <= levers.budget_bytes


def test_a_lever_pipeline_traces_the_stages_of_the_runs_largest_first():
    """`levers.stage_order`, no trace: a deeper pipeline's stage takes the figures of the run's stage at the nearest
    relative position (4 stages from 2: stages 0, 1 near the first, 2, 3 near the last), the largest first; peak
    allocated breaks a tie of peak reserved; a stage the run did not trace itself (a class's other stages) takes its
    nearest traced stage's."""
    from vramtrace.levers import stage_order

    def order(figures, base_depth, depth):
        return sorted(range(depth), key=stage_order(figures, base_depth, depth))

    assert order({0: (10, 5), 1: (12, 3)}, 2, 4) == [2, 3, 0, 1]
    assert order({0: (12, 5), 1: (10, 3)}, 2, 4) == [0, 1, 2, 3]
    assert order({0: (10, 7), 1: (10, 9)}, 2, 2) == [1, 0]
    assert order({0: (8, 0), 1: (6, 0), 3: (9, 0)}, 4, 4) == [3, 0, 1, 2]  # 2 as 1 (as near as 3, the lower)
