"""What makes it fit: every lever is the run its options make (the same command line analysed on its own), ranked
from cheapest; a lever or combination marked as fitting fits in a real CPU run."""

from __future__ import annotations

import io
import json
import sys
from dataclasses import replace

import pytest
from rich.console import Console

from conftest import FIXTURES
from oracle import measure_cpu_peak
from vramtrace import RunSpec, analyze
from vramtrace.cli import main
from vramtrace.fit import fit
from vramtrace.render.terminal import render

LLAMA, GPT2 = (str(FIXTURES / f"{c}.json") for c in ("tiny-llama-gqa", "tiny-gpt2"))
BASE = ["--batch", "4", "--seq", "64", "--device", "cpu"]


def _cli_json(args: list[str], tmp_path, capsys) -> dict:
    out = tmp_path / "r.json"
    assert main([LLAMA, *args, "--json", str(out), "-q", "--no-levers"]) == 0, capsys.readouterr().err
    return json.loads(out.read_text())


def _cli_peak(args: list[str], tmp_path, capsys) -> int:
    return _cli_json(args, tmp_path, capsys)["peak_allocated_bytes"]


def _what_it_costs(run: dict, base: dict) -> tuple:
    """What a lever costs the run, read from the JSON report of the run its options make (`run`) against the
    base run's (`base`), most expensive first, as the ranking of vramtrace.levers' docstring orders it: more GPUs
    (FSDP2's world), another training (other trainable parameters: LoRA, QLoRA), more micro-batches per optimizer
    step, a forward re-run in the backward (the report's `checkpointing` entry names the regions) and the share of
    the step's FLOPs it recomputes, another optimizer (8-bit states). Equal tuples: no order between them is
    checked."""
    recomputes = bool((run["checkpointing"] or {}).get("checkpointed"))
    return (run["run"].get("fsdp", {}).get("world", 1), run["model"]["trainable_params"] != base["model"][
        "trainable_params"], run["run"]["grad_accum"], recomputes, run["recompute_flops"] / run["step_flops"],
        run["run"]["optimizer"] != base["run"]["optimizer"])


def _spec(**kw) -> RunSpec:
    return RunSpec(LLAMA, **{"batch": 4, "seq": 64, "device": "cpu", **kw})


@pytest.fixture(scope="module")
def just_over():
    """The run with a capacity one byte below its peak: every lever that saves anything fits."""
    peak = analyze(_spec(), levers=False).peak_allocated_bytes
    return peak, analyze(_spec(gpu_memory_bytes=peak - 1))


def test_each_lever_is_the_run_its_options_make(just_over, tmp_path, capsys):
    peak, report = just_over
    levers = report.levers
    assert not report.fit.fits and levers.base_bytes == peak and levers.budget_bytes == peak - 1
    families = [lv.family for lv in levers.levers]
    assert {"checkpointing", "micro_batch", "lora", "optimizer_8bit", "qlora"} <= set(families), families
    by_family = {lv.family: lv for lv in levers.levers}
    assert by_family["optimizer_8bit"].options == "--optimizer adamw-8bit"
    # the run's checkpointing (none) kept: without the option QLoRA would checkpoint as peft does by default
    assert by_family["qlora"].options == ("--quantization nf4 --double-quant --bnb-compute-dtype bf16 "
                                             "--lora-rank 16 --checkpointing none")
    ckpt = [lv.recompute_overhead for lv in levers.levers if lv.family == "checkpointing"]
    assert ckpt == sorted(ckpt) and ckpt[-1] > 0.1  # layers recomputes every layer's forward
    base, costs = _cli_json(BASE, tmp_path, capsys), []
    for lv in levers.levers:
        assert lv.fits and lv.saves_bytes > 0
        run = _cli_json(BASE + lv.options.split(), tmp_path, capsys)
        assert run["peak_allocated_bytes"] == lv.peak_allocated_bytes, lv
        costs.append(_what_it_costs(run, base))
    assert costs == sorted(costs), list(zip(families, costs))  # ranked cheapest first
    assert len(set(costs)) >= 4  # the order is checked across 8-bit states, recompute, micro-batches, LoRA
    assert levers.combination is None  # a single lever is enough


def test_the_levers_that_fit_fit_in_real_runs(just_over):
    peak, report = just_over
    by_family = {lv.family: lv for lv in report.levers.levers}
    micro = by_family["micro_batch"].options.split()
    b, k = int(micro[micro.index("--batch") + 1]), int(micro[micro.index("--grad-accum") + 1])
    assert b * k == 4 and b < 4
    assert measure_cpu_peak(_spec(batch=b, grad_accum=k)) <= peak - 1
    assert measure_cpu_peak(_spec(lora_rank=16)) <= peak - 1


def test_a_combination_when_no_single_lever_fits(just_over, tmp_path, capsys):
    """A capacity between the lowest single lever and LoRA with checkpointing: nothing alone fits, the
    combination does, as the same command line analysed on its own and as a real CPU run."""
    _, report = just_over
    lowest_single = min(lv.compared_bytes for lv in report.levers.levers)
    pair = analyze(_spec(lora_rank=16, checkpointing="layers"), levers=False).peak_allocated_bytes
    assert pair < lowest_single
    capacity = (pair + lowest_single) // 2
    r = analyze(_spec(gpu_memory_bytes=capacity))
    assert not any(lv.fits for lv in r.levers.levers)
    combo = r.levers.combination
    assert combo.fits and combo.compared_bytes <= capacity and len(combo.levers) >= 2
    assert _cli_peak(BASE + combo.options.split(), tmp_path, capsys) == combo.peak_allocated_bytes
    options = combo.options.split()
    changes = {"lora_rank": 16} if "--lora-rank" in options else {}
    if "--checkpointing" in options:
        changes["checkpointing"] = options[options.index("--checkpointing") + 1]
    if "--batch" in options:
        changes.update(batch=int(options[options.index("--batch") + 1]),
                       grad_accum=int(options[options.index("--grad-accum") + 1]))
    for option in ("--quantization", "--bnb-compute-dtype", "--optimizer"):
        if option in options:
            changes[option[2:].replace("-", "_")] = options[options.index(option) + 1]
    if "--double-quant" in options:
        changes["double_quant"] = True
    assert measure_cpu_peak(_spec(**changes)) <= capacity
    text = io.StringIO()
    render(r, Console(file=text, width=120))
    assert "What makes it fit" in text.getvalue() and f"together: {combo.options}" in text.getvalue()


def test_no_levers_when_it_fits_or_when_asked(just_over, tmp_path, capsys):
    peak, _ = just_over
    assert analyze(_spec(gpu_memory_bytes=peak)).levers is None  # fits exactly
    assert analyze(_spec(gpu_memory_bytes=peak - 1), levers=False).levers is None
    out = tmp_path / "r.json"
    assert main([LLAMA, *BASE, "--gpu-memory", f"{peak - 1}B", "--json", str(out), "-q"]) == 0
    assert json.loads(out.read_text())["levers"]["levers"]
    assert main([LLAMA, *BASE, "--gpu-memory", f"{peak - 1}B", "--no-levers", "--json", str(out), "-q"]) == 0
    assert json.loads(out.read_text())["levers"] is None


def test_fit_lists_the_levers_when_nothing_fits():
    spec = RunSpec(GPT2, batch=1, seq=64, device="cpu")
    peak1 = analyze(spec, levers=False).peak_allocated_bytes
    result = fit(spec, "batch", peak1 - 1)
    assert result.best is None and result.next.x == 1
    assert result.levers.base_bytes == peak1
    assert any(lv.fits for lv in result.levers.levers)
    assert all(lv.family != "micro_batch" for lv in result.levers.levers)  # batch 1 has no smaller


def _lever_report(monkeypatch, capsys, tmp_path, *extra: str) -> tuple[int, dict, str]:
    """The CLI's exit status, JSON report and stderr for the tiny GPT-2 run one byte over its peak."""
    spec = RunSpec(GPT2, batch=2, seq=32, device="cpu")
    peak = analyze(spec, levers=False).peak_allocated_bytes
    out = tmp_path / "r.json"
    monkeypatch.setenv("COLUMNS", "250")  # each table cell on one line
    rc = main([GPT2, "--batch", "2", "--seq", "32", "--device", "cpu", "--gpu-memory", f"{peak - 1}B",
               "--json", str(out), "--html", str(tmp_path / "r.html"), *extra])
    text = capsys.readouterr()
    return rc, json.loads(out.read_text()) if rc == 0 else {}, text.out + text.err


def test_a_lever_whose_extra_is_missing_is_listed_with_the_extra(monkeypatch, capsys, tmp_path):
    """peft and bitsandbytes absent (a None entry in sys.modules: `import` raises ImportError and
    `importlib.util.find_spec` answers None, as for a package not installed): the report is kept, the levers that
    need them are rows naming the extra, the others are traced."""
    monkeypatch.setitem(sys.modules, "peft", None)
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    rc, report, out = _lever_report(monkeypatch, capsys, tmp_path)
    assert rc == 0, out
    skipped = {sk["family"]: sk for sk in report["levers"]["skipped"]}
    assert set(skipped) == {"lora", "qlora", "optimizer_8bit"}
    assert skipped["lora"]["detail"] == "needs peft (pip install 'vramtrace[lora]')"
    assert skipped["optimizer_8bit"]["detail"] == "needs bitsandbytes (pip install 'vramtrace[quant]')"
    assert skipped["qlora"]["detail"] == "needs bitsandbytes and peft (pip install 'vramtrace[quant]')"
    assert all(sk["reason"] == "needs_extra" for sk in skipped.values())
    assert skipped["lora"]["options"] == "--lora-rank 16"
    families = {lv["family"] for lv in report["levers"]["levers"]}
    assert "checkpointing" in families and not families & set(skipped)
    assert "What makes it fit" in out and "LoRA r=16: needs peft (pip install 'vramtrace[lora]')" in out
    html = (tmp_path / "r.html").read_text()
    assert "LoRA r=16: needs peft (pip install &#39;vramtrace[lora]&#39;)" in html


def test_a_lever_whose_trace_fails_keeps_the_report(monkeypatch, capsys, tmp_path):
    """Any exception while tracing one lever: its row says "could not be traced" and why, the other levers and
    the report are kept; --debug adds the traceback on stderr."""
    import vramtrace.tables

    real = vramtrace.tables.step_tables

    def failing(spec, *args, **kwargs):
        if spec.lora_rank is not None:
            raise RuntimeError("boom in the LoRA trace\nsecond line")
        return real(spec, *args, **kwargs)

    monkeypatch.setattr(vramtrace.tables, "step_tables", failing)
    rc, report, out = _lever_report(monkeypatch, capsys, tmp_path)
    assert rc == 0, out
    skipped = {sk["family"]: sk for sk in report["levers"]["skipped"]}
    assert skipped["lora"] == {"family": "lora", "title": "LoRA r=16", "options": "--lora-rank 16",
                               "reason": "failed",
                               "detail": "could not be traced: RuntimeError: boom in the LoRA trace"}
    assert "qlora" in skipped  # QLoRA is LoRA too
    assert "checkpointing" in {lv["family"] for lv in report["levers"]["levers"]}
    assert "Traceback" not in out and "LoRA r=16: could not be traced: RuntimeError: boom" in out
    import logging

    log = logging.getLogger("vramtrace")
    before = (log.level, list(log.handlers))
    rc, _, out = _lever_report(monkeypatch, capsys, tmp_path, "--debug")
    assert rc == 0 and "Traceback" in out and "boom in the LoRA trace" in out
    assert (log.level, list(log.handlers)) == before  # --debug leaves the logger as it found it


def test_the_lever_cache_gives_the_outcomes_of_the_same_traces(monkeypatch, tmp_path):
    """A second run of the same command finds every lever's outcome on disk: the same levers entry as the run that
    traced them, with no trace; another spec (a batch) or the same config file edited misses."""
    monkeypatch.setenv("VRAMTRACE_LEVER_CACHE", str(tmp_path / "cache"))
    config = tmp_path / "config.json"
    config.write_text(open(LLAMA).read())

    def levers(batch: int):
        spec = RunSpec(str(config), batch=batch, seq=32, cuda_context_bytes=0)
        capacity = analyze(spec, levers=False).peak_reserved_bytes - 1  # one byte short: the levers are searched
        return analyze(replace(spec, gpu_memory_bytes=capacity)).levers

    first = levers(2)
    assert first.traces >= 3 and first.cached is None and len(list((tmp_path / "cache").iterdir())) >= 3
    second = levers(2)
    assert second.traces == 0 and second.cached == first.traces
    assert replace(second, traces=0, cached=None) == replace(first, traces=0)
    assert levers(3).cached is None
    cfg = json.loads(config.read_text())
    cfg["intermediate_size"] += 8  # the same file edited: new keys
    config.write_text(json.dumps(cfg))
    assert levers(2).cached is None


def test_the_use_cache_false_peak_from_the_lever_cache(monkeypatch, tmp_path):
    """The report's `use_cache_false_peak_bytes` (a second trace of every run whose KV cache is live at the peak)
    is the same when a lever search cached that trace's outcome: a `--no-levers` run after a default run gives the
    same report, and one made without the cache too."""
    import vramtrace.tables

    real, calls = vramtrace.tables.step_tables, []
    monkeypatch.setattr(vramtrace.tables, "step_tables", lambda s, *a, **k: calls.append(s) or real(s, *a, **k))
    spec = RunSpec(LLAMA, batch=4, seq=64, cuda_context_bytes=0)  # its KV cache is live at the peak
    traced = analyze(spec, levers=False).to_dict()  # the cache is off (conftest)
    assert traced["run"]["use_cache_false_peak_bytes"] > 0 and len(calls) == 2
    monkeypatch.setenv("VRAMTRACE_LEVER_CACHE", str(tmp_path / "cache"))
    analyze(replace(spec, gpu_memory_bytes=traced["peak_reserved_bytes"] - 1))  # the lever search fills the cache
    calls.clear()
    assert analyze(spec, levers=False).to_dict() == traced
    assert [c.use_cache for c in calls] == [None]  # the main step traced, the use_cache false one found
