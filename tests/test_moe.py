"""Mixture of experts: transformers' grouped_mm experts (routing-independent) and eager experts under the
--moe-routing policy, against real CPU runs."""

import json

import pytest

from conftest import FIXTURES
from oracle import measure_cpu_peak
from tolerance import assert_within
from vramtrace import RunSpec, analyze

MIXTRAL = str(FIXTURES / "tiny-mixtral.json")


def _eager(tmp_path) -> str:
    cfg = json.loads((FIXTURES / "tiny-mixtral.json").read_text())
    cfg["experts_implementation"] = "eager"
    path = tmp_path / "tiny-mixtral-eager.json"
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_grouped_mm_experts_match_real_run(precision):
    spec = RunSpec(MIXTRAL, batch=2, seq=16, device="cpu", precision=precision)
    report = analyze(spec)
    measured = measure_cpu_peak(spec)
    assert_within(report.peak_allocated_bytes, measured, 0.01)
    assert report.run.moe_layers == 2 and report.run.moe_experts_implementation == "grouped_mm"
    assert "no effect" in report.run.moe_routing


def test_eager_experts_follow_the_routing_policy(tmp_path):
    path = _eager(tmp_path)
    balanced = analyze(RunSpec(path, batch=2, seq=16, device="cpu", precision="fp32"))
    worst = analyze(RunSpec(path, batch=2, seq=16, device="cpu", precision="fp32", moe_routing="worst"))
    assert balanced.run.moe_routing == "balanced" and worst.run.moe_routing == "worst"
    # balanced: 2*16 tokens x top-2 over 4 experts = 16 each; worst: 32 tokens to each of experts 0 and 1
    def expert_rows(report):
        return sorted(t.shape[0] for t in report.tensors
                      if t.module.endswith("mlp.experts") and t.op == "aten.index.Tensor" and len(t.shape) == 2)
    assert set(expert_rows(balanced)) == {16} and set(expert_rows(worst)) == {32}
    measured = measure_cpu_peak(RunSpec(path, batch=2, seq=16, device="cpu", precision="fp32"))
    assert_within(balanced.peak_allocated_bytes, measured, 0.01)
