"""The main job on a fresh install without extras (issue 38): a virtual environment with torch and vramtrace only
(no peft, no bitsandbytes), built by pip from this checkout, runs `vramtrace MODEL --batch B --seq S`: exit 0, the
report printed, and the levers that need an extra named with the extra that would add them.

Slow (pip installs torch and vramtrace's dependencies into the new environment, about 1 to 3 minutes; pip takes
them from its cache or the configured index, so it runs offline where the index is local): marked `slow`,
deselect with `-m "not slow"`."""

from __future__ import annotations

import os
import shutil
import subprocess
import venv
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent


def _run(cmd: list, env: dict, timeout: int = 900) -> subprocess.CompletedProcess:
    p = subprocess.run([str(c) for c in cmd], env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{cmd}: exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p


@pytest.mark.slow
def test_main_job_without_extras(tmp_path):
    # the project's files only (a copy: pip builds in the source tree, which would leave build/ and egg-info here)
    src = tmp_path / "vramtrace"
    shutil.copytree(REPO / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True, system_site_packages=False)  # sees nothing installed outside it
    bindir = env_dir / ("Scripts" if os.name == "nt" else "bin")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(HF_HUB_OFFLINE="1", COLUMNS="250", PIP_DISABLE_PIP_VERSION_CHECK="1")
    python = bindir / "python"
    # --no-compile: pip does not byte-compile every installed module ahead of time (most of torch's and transformers'
    # install CPU time); Python compiles the modules the job imports when it imports them
    pip = [python, "-m", "pip", "install", "-q", "--no-compile"]
    _run([*pip, f"torch=={torch.__version__.split('+')[0]}"], env)
    _run([*pip, src], env)
    absent = _run([python, "-c", "import importlib.util as u; print(u.find_spec('peft'), u.find_spec('bitsandbytes'))"],
                  env)
    assert absent.stdout.split() == ["None", "None"]  # the environment really has no extras
    # the user's main job at a small size: Llama-2-7b's AdamW training does not fit an H100 (about 16 bytes per
    # parameter), so the levers are searched
    p = subprocess.run([bindir / "vramtrace", "meta-llama/Llama-2-7b", "--batch", "1", "--seq", "64"], env=env,
                       capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "peak" in p.stdout and "What makes it fit" in p.stdout, p.stdout
    assert "LoRA r=16: needs peft (pip install 'vramtrace[lora]')" in p.stdout, p.stdout
    assert "8-bit optimizer: needs bitsandbytes (pip install 'vramtrace[quant]')" in p.stdout, p.stdout
    assert "Error" not in p.stderr and "Traceback" not in p.stderr, p.stderr
