"""Bad input and failing user code: one `Error: ...` line (phase, module, exception), exit 1 or 2, the traceback
only with --debug; Hub ids offline or unreachable; the precision's source; --memory-budget; validate's order."""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import FIXTURES
from vramtrace import RunSpec, analyze
from vramtrace.cli import main
from vramtrace.errors import ModelLoadError, TraceError, UsageError
from vramtrace.tracer.loading import ResolvedConfig, bundled_ids, resolve_config

RAISES = Path(__file__).resolve().parent.parent / "fixtures" / "custom" / "raises.py"
TINY = str(FIXTURES / "tiny-llama-gqa.json")
SRC = str(Path(__file__).resolve().parent.parent / "src")


def _one_line(err: str) -> str:
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith("Error: "), err
    return err


# --- 3. exceptions from the model's or the user's code ---------------------------------------------------------

@pytest.mark.parametrize("mode", ["train", "inference"])
@pytest.mark.parametrize("net,exc,text", [
    ("AssertNet", "AssertionError", "expected 32 features"),
    ("KeyNet", "KeyError", "'features'"),
    ("ZeroDivNet", "ZeroDivisionError", "integer division or modulo by zero"),
])
def test_user_code_exception_is_one_line(net, exc, text, mode, capsys):
    code = main([f"{RAISES}:{net}", "--input", "x=float32[B,16]", "--device", "cpu", "--mode", mode])
    err = _one_line(capsys.readouterr().err)
    assert code == 1
    assert f"phase forward, module block, after aten.addmm.default: {exc}: {text}" in err


def test_trace_error_keeps_the_cause():
    spec = RunSpec(f"{RAISES}:ZeroDivNet", batch=2, seq=None, inputs=("x=float32[B,16]",), device="cpu")
    with pytest.raises(TraceError) as info:
        analyze(spec)
    assert isinstance(info.value.__cause__, ZeroDivisionError)


@pytest.mark.parametrize("how", ["flag", "env"])
def test_debug_shows_the_chained_traceback(how, capsys, monkeypatch):
    args = [f"{RAISES}:KeyNet", "--input", "x=float32[B,16]", "--device", "cpu"]
    if how == "flag":
        args.append("--debug")
    else:
        monkeypatch.setenv("VRAMTRACE_DEBUG", "1")
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "KeyError: 'features'" in err
    assert "The above exception was the direct cause of the following exception" in err
    assert err.strip().splitlines()[-1].startswith("Error: tracing failed in phase forward, module block")


def test_validate_converts_an_exception_of_the_real_run(capsys):
    # RealOnlyNet passes on the meta device and raises KeyError on real tensors
    args = ["validate", f"{RAISES}:RealOnlyNet", "--input", "x=float32[B,16]", "--device", "cpu", "-q"]
    assert main(args) == 1
    err = _one_line(capsys.readouterr().err)
    assert "the real warm-up step on cpu failed in phase forward, module block: KeyError: 'label 7'" in err
    assert main(args + ["--debug"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "direct cause" in err and err.strip().splitlines()[-1].startswith("Error: ")


def test_measure_step_keeps_the_cause():
    from vramtrace.validate import measure_step

    spec = RunSpec(f"{RAISES}:RealOnlyNet", batch=2, seq=None, inputs=("x=float32[B,16]",), device="cpu")
    with pytest.raises(TraceError, match="module block") as info:
        measure_step(spec)
    assert isinstance(info.value.__cause__, KeyError)


