"""The typed report (issue 40): the JSON Schema in docs/report.schema.json is the one generated from the report's
dataclasses; real reports of tiny runs validate against it, read back (`MemoryReport.from_dict`) to the same report
and the same JSON bytes; the schema rejects a key no dataclass declares; the serializer leaves out exactly the
fields declared omittable when they are absent, in declared order."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from vramtrace import RunSpec, analyze
from vramtrace.report.summary import MemoryReport
from vramtrace.report.data import UNSET, Omit, from_data, omittable, to_data
from vramtrace.report.sections import FitVerdict, LeversSummary, SkippedLever, SkipReason

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures" / "configs"
SCHEMA = ROOT / "docs" / "report.schema.json"
LLAMA = str(FIXTURES / "tiny-llama-gqa.json")
GPT2 = str(FIXTURES / "tiny-gpt2.json")


def test_the_checked_in_schema_is_the_generated_one():
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_schema.py"), "--check"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr  # regenerate: python scripts/gen_schema.py


@pytest.fixture(scope="module")
def validator():
    jsonschema = pytest.importorskip("jsonschema")  # the [test] extra
    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


RUNS = {
    "cuda-target": dict(model=LLAMA, batch=2, seq=16, gpu="a100-80gb"),  # fit verdict and allocator
    "generate": dict(model=LLAMA, batch=1, seq=8, device="cpu", mode="generate", new_tokens=3),
    "checkpointing": dict(model=GPT2, batch=2, seq=16, device="cpu", checkpointing="layers"),
    "auto-plan": dict(model=LLAMA, batch=2, seq=16, device="cpu", checkpointing="auto", memory_budget_bytes=1024),
    "levers": dict(model=LLAMA, batch=2, seq=16, precision="fp32", gpu_memory_bytes=2 << 20),  # does not fit
    "fsdp-cpu": dict(model=LLAMA, batch=2, seq=16, device="cpu", fsdp=2),  # run.fsdp, run.cpu_kernels
}


@pytest.fixture(scope="module", params=sorted(RUNS))
def report(request):
    kw = dict(RUNS[request.param])
    return request.param, analyze(RunSpec(kw.pop("model"), **kw))


def test_real_reports_validate_and_read_back(validator, report):
    name, r = report
    text = json.dumps(r.to_dict())
    data = json.loads(text)
    errors = [f"{list(e.path)}: {e.message}" for e in validator.iter_errors(data)]
    assert not errors, errors[:5]
    section = {"cuda-target": "allocator", "generate": "run", "checkpointing": "checkpointing",
               "auto-plan": "checkpointing", "levers": "levers", "fsdp-cpu": "run"}[name]
    assert data[section] is not None  # the run exercises the section it is here for
    assert name != "generate" or data["run"]["peak_in"] and "clip_grad_norm" not in data["run"]
    assert name != "fsdp-cpu" or data["run"]["fsdp"]["world"] == 2 and data["run"]["cpu_kernels"]["threads"] >= 1
    assert name != "checkpointing" or data["run"]["clip_grad_norm"] is None  # a train run writes it, as null
    back = MemoryReport.from_dict(data)
    assert json.dumps(back.to_dict()) == text
    assert back == dataclasses.replace(r, eager=None)


def test_the_schema_rejects_unknown_keys(validator, report):
    _, r = report
    data = r.to_dict()
    assert not validator.is_valid({**data, "peak_bytes": 1})
    assert not validator.is_valid({**data, "model": {**data["model"], "layers": 2}})
    assert not validator.is_valid({**data, "run": {**data["run"], "layers": 2}})
    assert not validator.is_valid({**data, "run": {**data["run"], "mode": "training"}})  # not a Mode value
    assert not validator.is_valid({**data, "tensors": [{**data["tensors"][0], "owner": "x"}]})
    assert not validator.is_valid({**data, "peak_allocated_bytes": 1.5})


def test_the_reader_rejects_unknown_keys_and_values():
    data = analyze(RunSpec(GPT2, batch=1, seq=8, device="cpu", mode="inference")).to_dict()
    with pytest.raises(TypeError, match="ModelInfo has no field 'layers'"):
        MemoryReport.from_dict({**data, "model": {**data["model"], "layers": 2}})
    with pytest.raises(TypeError, match="RunInfo has no field 'layers'"):
        MemoryReport.from_dict({**data, "run": {**data["run"], "layers": 2}})
    with pytest.raises(TypeError, match="missing"):
        MemoryReport.from_dict({k: v for k, v in data.items() if k != "peak_step"})


def test_a_saved_report_reads_back_or_fails_in_one_line(tmp_path):
    from vramtrace.errors import ReportWriteError
    from vramtrace.render.json_report import read_json_report, write_json

    r = analyze(RunSpec(GPT2, batch=1, seq=8, device="cpu", mode="inference", gpu_memory_bytes=1 << 40))
    path = tmp_path / "r.json"
    write_json(r, str(path))
    assert read_json_report(str(path)) == r and r.fit.fits
    data = json.loads(path.read_text())
    for broken in ({**data, "fit": {**data["fit"], "verdict": "yes"}}, {**data, "model": "gpt2"},
                   {**data, "breakdown_at_peak": [1]}):
        path.write_text(json.dumps(broken))
        with pytest.raises(ReportWriteError, match="looks like a vramtrace report but cannot be read"):
            read_json_report(str(path))


def test_absent_fields_are_left_out_in_declared_order():
    cpu = FitVerdict(gpu="x", capacity_bytes=10, headroom_bytes=-2, fits=False, basis="b")
    assert list(to_data(cpu)) == ["gpu", "capacity_bytes", "headroom_bytes", "fits", "basis"]
    cuda = dataclasses.replace(cpu, cuda_context_bytes=0, cuda_context_source="", oom="")
    assert list(to_data(cuda)) == ["gpu", "capacity_bytes", "cuda_context_bytes", "cuda_context_source",
                                   "headroom_bytes", "fits", "oom", "basis"]  # '' and 0 are values, not absent
    assert from_data(FitVerdict, to_data(cpu)) == cpu and from_data(FitVerdict, to_data(cuda)) == cuda
    skipped = SkippedLever(family="lora", title="LoRA", options="--lora-rank 16", reason=SkipReason.NEEDS_EXTRA,
                           detail="needs peft")
    levers = LeversSummary(budget_bytes=1, base_bytes=2, basis="b", levers=(), combination=None, traces=3)
    assert list(to_data(levers)) == ["budget_bytes", "base_bytes", "basis", "levers", "combination", "traces"]
    with_skipped = dataclasses.replace(levers, skipped=(skipped,), cached=4)
    data = to_data(with_skipped)
    assert data["skipped"] == [{"family": "lora", "title": "LoRA", "options": "--lora-rank 16",
                                "reason": "needs_extra", "detail": "needs peft"}] and data["cached"] == 4
    assert from_data(LeversSummary, data) == with_skipped


def test_omit_rules():
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Row:
        a: int
        b: tuple[str, ...] = omittable(Omit.EMPTY, ())
        c: str | None = omittable()

    assert to_data(Row(a=1, b=(), c="")) == {"a": 1, "c": ""}
    assert to_data(Row(a=1, b=("x",))) == {"a": 1, "b": ["x"]}
    assert from_data(Row, {"a": 1, "b": ["x"]}) == Row(a=1, b=("x",))

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Step:
        clip: float | None = omittable(Omit.UNSET, UNSET)

    assert to_data(Step()) == {} and from_data(Step, {}) == Step()  # not set: left out
    assert to_data(Step(clip=None)) == {"clip": None} and from_data(Step, {"clip": None}) == Step(clip=None)
    assert to_data(Step(clip=1.0)) == {"clip": 1.0}
