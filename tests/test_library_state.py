"""vramtrace as a library: it leaves the caller's global state as it found it, and its declared dependencies are
the packages it imports (peft only for --lora-rank)."""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import sys
from pathlib import Path

import pytest
import torch
import transformers

from conftest import FIXTURES
from vramtrace import RunSpec, analyze
from vramtrace.cli import main
from vramtrace.errors import UsageError
from vramtrace.validate import measure_step, real_model

ROOT = Path(__file__).resolve().parent.parent
TINY_GPT2 = str(FIXTURES / "tiny-gpt2.json")
CONVNET = str(ROOT / "fixtures" / "custom" / "convnet.py") + ":ConvNet"


def _global_state() -> dict:
    hooks = torch.nn.modules.module
    fd2 = os.fstat(2)
    return {
        "cpu_rng_state": torch.get_rng_state().tolist(),
        "get_rng_state": torch.get_rng_state,
        "default_dtype": torch.get_default_dtype(),
        "grad_enabled": torch.is_grad_enabled(),
        "autocast_cpu": torch.is_autocast_enabled("cpu"),
        "transformers_verbosity": transformers.logging.get_verbosity(),
        "global_forward_hooks": dict(hooks._global_forward_hooks),
        "global_forward_pre_hooks": dict(hooks._global_forward_pre_hooks),
        "global_backward_hooks": dict(hooks._global_backward_hooks),
        "sys_stderr": sys.stderr,
        "fd2": (fd2.st_dev, fd2.st_ino),
        "open_fds": len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None,
        "sys_path": list(sys.path),
    }


def test_analyze_a_real_build_and_a_measured_step_leave_global_state_as_found():
    torch.manual_seed(1234)  # a caller's RNG state, not the seed 0 of a real build
    transformers.logging.set_verbosity_info()  # a caller's verbosity, not ERROR (what vramtrace logs at)
    try:
        before = _global_state()
        analyze(RunSpec(TINY_GPT2, batch=2, seq=16))
        analyze(RunSpec(TINY_GPT2, batch=2, seq=16, device="cpu", checkpointing="layers"))  # RNG-state bridge
        assert _global_state() == before
        first = real_model(RunSpec(TINY_GPT2, batch=2, seq=16, device="cpu"))
        assert _global_state() == before
        custom = real_model(RunSpec(CONVNET, batch=2, seq=None, device="cpu", inputs=("x=float32[B,3,8,8]",)))
        assert _global_state() == before
        measure_step(RunSpec(TINY_GPT2, batch=2, seq=16, device="cpu"))  # profiler (fd 2 silenced), autocast
        assert _global_state() == before
    finally:
        transformers.logging.set_verbosity_warning()
    # still seeded: a second real build draws the same weights and inputs
    again = real_model(RunSpec(TINY_GPT2, batch=2, seq=16, device="cpu"))
    assert torch.equal(first.inputs["input_ids"], again.inputs["input_ids"])
    assert all(torch.equal(a, b) for a, b in zip(first.model.parameters(), again.model.parameters()))
    custom_again = real_model(RunSpec(CONVNET, batch=2, seq=None, device="cpu", inputs=("x=float32[B,3,8,8]",)))
    assert torch.equal(custom.inputs["x"], custom_again.inputs["x"])


def test_peft_is_imported_only_for_lora(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "peft", None)  # `import peft` raises ImportError, as when not installed
    from seam import loaded_model

    assert loaded_model(RunSpec(TINY_GPT2, batch=1, seq=8)).params > 0
    with pytest.raises(UsageError, match=re.escape("--lora-rank needs peft: pip install 'vramtrace[lora]'")):
        loaded_model(RunSpec(TINY_GPT2, batch=1, seq=8, lora_rank=4))
    assert main([TINY_GPT2, "--batch", "1", "--seq", "8", "--lora-rank", "4"]) == 2
    assert capsys.readouterr().err == "Error: --lora-rank needs peft: pip install 'vramtrace[lora]'\n"


# Imported but deliberately not declared, and why.
UNDECLARED = {
    "torch": "installed first and separately (README: a bare requirement pulls the CUDA wheels)",
    "click": "only for typer < 0.2x (the cli package's fallback), which itself depends on click",
}


def _third_party_imports() -> set[str]:
    names = set()
    for path in (ROOT / "src" / "vramtrace").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n not in ("vramtrace", "__future__")}


def _requirement_name(req: str) -> str:
    return re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0].lower().replace("_", "-")


def test_pyproject_declares_what_the_package_imports():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {_requirement_name(r) for r in project["dependencies"]}
    extras = {k: {_requirement_name(r) for r in v} for k, v in project["optional-dependencies"].items()}
    assert "peft" not in core and "peft" in extras["lora"] and "peft" in extras["test"]
    assert "bitsandbytes" not in core and "bitsandbytes" in extras["quant"] and "bitsandbytes" in extras["test"]
    assert "torch" not in core
    distributions = importlib.metadata.packages_distributions()
    missing = []
    for name in sorted(_third_party_imports()):
        if name in UNDECLARED:
            continue
        dists = {d.lower().replace("_", "-") for d in distributions.get(name, [name])}
        if not dists & (core | extras["lora"] | extras["quant"] | extras["trainer"] | extras["deepspeed"]):
            missing.append((name, sorted(dists)))
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"
