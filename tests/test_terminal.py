"""The terminal report (render/terminal.py): golden renders at 80 and 120 columns, the by-layer aggregation,
FLOPs in human units, no optimizer lines for inference."""

from __future__ import annotations

import pytest

from conftest import FIXTURES
from goldens import rendered, terminal_path, terminal_report
from vramtrace import RunSpec, analyze
from vramtrace.analysis.aggregate import layer_totals, live_groups, module_pattern
from vramtrace.units import format_flops



@pytest.fixture(scope="module")
def report():
    return terminal_report()


@pytest.mark.parametrize("width", [80, 120])
def test_render_matches_golden_and_holds_its_width(report, width):
    text = rendered(report, width)
    path = terminal_path(width)  # rewritten only by scripts/regen_goldens.py
    assert max(map(len, text.splitlines())) <= width
    # every word of the storage table's first row stays whole at this width
    assert "model.embed_tokens.weight" in text or "lm_head.weight" in text
    assert text == path.read_text()


def test_identical_layers_fold_into_one_row(report):
    groups = live_groups(report.tensors, report.peak_step)
    layers = [g for g in groups if g.pattern.startswith("model.layers.*")]
    assert layers and all(g.instances == 2 for g in layers)  # the fixture has 2 decoder layers
    live = [t for t in report.tensors if t.birth <= report.peak_step <= t.death]
    assert sum(g.bytes for g in groups) == sum(t.bytes for t in live) == report.peak_allocated_bytes
    assert "2 × model.layers.*" in rendered(report, 120)
    # a gradient sits with its parameter's module, as its optimizer states do
    grads = {g.pattern for g in groups if g.category == "gradient"}
    assert grads and not any(p.endswith((".weight", ".bias")) for p in grads)
    # whole layers: the decoder layers' parameters live at the peak, counted from the storages' own names
    whole = {(t.pattern, t.category): t for t in layer_totals(groups)}
    params = sum(t.bytes for t in live if t.category == "parameter" and t.name.startswith("model.layers."))
    assert whole["model.layers.*", "parameter"].bytes == params > 0
    assert whole["model.layers.*", "parameter"].instances == 2
    assert "2 × model.layers.* (all)" in rendered(report, 80)


def test_module_pattern_and_flops_units():
    assert module_pattern("model.layers.31.mlp.up_proj") == "model.layers.*.mlp.up_proj"
    assert module_pattern("encoder.block.0.layer.1.DenseReluDense") == "encoder.block.*.layer.*.DenseReluDense"
    assert format_flops(8_796_093_022_208) == "8.80 TFLOP" and format_flops(999) == "999 FLOP"


def test_inference_report_has_no_optimizer_lines():
    r = analyze(RunSpec(str(FIXTURES / "tiny-gpt2.json"), batch=1, seq=8, device="cuda", mode="inference"),
                levers=False)
    text = rendered(r, 120)
    assert "optimizer" not in text.lower()
