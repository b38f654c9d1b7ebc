"""The Python API: `analyze(model=<nn.Module>, inputs=..., ...)` for a module the user built on the meta device,
the report's short repr and the renderers `report_json`, `write_html` and `print_report`."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import FIXTURES
from vramtrace import RunSpec, analyze, print_report, report_json, write_html
from vramtrace.errors import UsageError

CONVNET = FIXTURES.parent / "custom" / "convnet.py"


def convnet():
    import importlib.util

    spec = importlib.util.spec_from_file_location("api_convnet", CONVNET)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with torch.device("meta"):
        return module.ConvNet()


def test_module_object_is_traced_as_its_file_is_and_left_unchanged():
    net = convnet()
    before = [(n, type(m)) for n, m in net.named_modules()]
    report = analyze(model=net, inputs={"x": "float32[B,3,32,32]"}, batch=4, device="cpu",
                     checkpointing="modules:blocks.*", levers=False)
    from_file = analyze(RunSpec(f"{CONVNET}:ConvNet", 4, None, device="cpu", inputs=("x=float32[B,3,32,32]",),
                                checkpointing="modules:blocks.*"), levers=False)
    assert report.peak_allocated_bytes == from_file.peak_allocated_bytes
    assert report.model.ref == "ConvNet (nn.Module passed to analyze)"
    assert [(n, type(m)) for n, m in net.named_modules()] == before  # checkpointing wrapped a copy
    assert all(p.device.type == "meta" and p.grad is None for p in net.parameters())


def test_module_inputs_as_meta_tensors_and_a_loss_function():
    net = convnet()
    calls = []

    def loss(output, x):
        calls.append(tuple(x.shape))
        return output.float().logsumexp(-1).mean()

    report = analyze(model=net, inputs=(torch.empty(2, 3, 32, 32, device="meta"),), loss=loss, batch=2,
                     device="cuda", levers=False)
    assert calls and calls[0] == (2, 3, 32, 32) and report.peak_allocated_bytes > 0


def test_module_with_real_weights_or_without_inputs_is_refused():
    with pytest.raises(UsageError, match="build it on the meta device"):
        analyze(model=torch.nn.Linear(4, 4), inputs=(torch.empty(1, 4),))
    with pytest.raises(UsageError, match="needs inputs="):
        analyze(model=convnet())
    with pytest.raises(UsageError, match="RunSpec's fields"):
        analyze(model=convnet(), inputs={"x": "float32[B,3,32,32]"}, no_such_option=1)
    with pytest.raises(UsageError, match="not both"):
        analyze(RunSpec("gpt2", 1, 8), model=convnet())


def test_report_repr_is_short_and_writes_json_and_html(tmp_path, capsys):
    report = analyze(model=str(FIXTURES / "tiny-gpt2.json"), batch=1, seq=8, device="cuda", levers=False)
    text = repr(report)
    assert len(text) < 300 and "peak allocated" in text and f"{report.peak_allocated_bytes:,} B" in text
    data = json.loads(report_json(report, str(tmp_path / "r.json")))
    assert data["peak_allocated_bytes"] == report.peak_allocated_bytes
    assert json.loads((tmp_path / "r.json").read_text())["peak_allocated_bytes"] == report.peak_allocated_bytes
    write_html(report, str(tmp_path / "r.html"))
    assert (tmp_path / "r.html").read_text().startswith("<!DOCTYPE html>")
    print_report(report, width=100)
    assert "Peak allocated" in capsys.readouterr().out


def test_a_module_travels_in_the_spec_by_identity_with_no_registry():
    from vramtrace.custom_inputs import InProcessModel
    from vramtrace.tracer.custom import in_process_model

    net = convnet()
    carried = in_process_model(net, {"x": "float32[B,3,32,32]"})
    spec = RunSpec(carried, 2, None, device="cpu")
    assert spec.in_process is carried and RunSpec("gpt2", 1, 8).in_process is None
    # compared and hashed by identity: another carrier of the same module is another run (it may hold other inputs)
    assert spec == RunSpec(carried, 2, None, device="cpu") and len({spec, RunSpec(carried, 2, None, device="cpu")}) == 1
    assert spec != RunSpec(InProcessModel(net, carried.inputs), 2, None, device="cpu")
    # nothing is registered for the duration of one analyze(): the spec traces again after it returned
    first, again = analyze(spec, levers=False), analyze(spec, levers=False)
    assert first.peak_allocated_bytes == again.peak_allocated_bytes > 0
    assert first.model.ref == "ConvNet (nn.Module passed to analyze)"
    with pytest.raises(UsageError, match="apply to transformers models, not custom modules"):
        RunSpec(carried, 2, None, task="causal-lm")
