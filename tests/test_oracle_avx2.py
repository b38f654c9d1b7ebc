"""The CPU oracle tests a second time, in a subprocess with oneDNN and ATen's own kernels capped at AVX2
(`ONEDNN_MAX_CPU_ISA=AVX2`, `ATEN_CPU_CAPABILITY=avx2`), as a CPU without AVX-512 runs them: on a CPU with
AVX-512 (bf16) both paths are exercised on one machine (bf16 matmuls allocate a scratchpad only on the AVX-512
path). On a CPU without AVX-512 both runs take the same path."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
ORACLE_TESTS = ["test_oracle_cpu.py", "test_attention_modules.py",
                "test_checkpointing.py::test_layers_matches_real_run", "test_checkpointing.py::test_selective_matches_real_run",
                "test_custom.py::test_mixer_with_example_inputs_and_loss", "test_custom.py::test_convnet_matches_real_cpu_step"]


def _has_avx512() -> bool:
    try:
        return "avx512" in Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: run it
        return True


@pytest.mark.skipif(os.environ.get("ONEDNN_MAX_CPU_ISA") == "AVX2", reason="this is the AVX2 run")
@pytest.mark.skipif(not _has_avx512(), reason="this CPU has no AVX-512: the oracle tests already ran on the AVX2 path")
def test_oracle_tests_pass_with_onednn_capped_at_avx2():
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *ORACLE_TESTS],
                         cwd=TESTS, env=env, capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]


def test_report_names_the_onednn_isa_in_effect():
    from conftest import FIXTURES
    from vramtrace import RunSpec, analyze

    report = analyze(RunSpec(str(FIXTURES / "tiny-gpt2.json"), batch=1, seq=8, device="cpu", mode="inference"))
    cpu = report.run.cpu_kernels
    assert cpu.onednn_max_isa == (os.environ.get("ONEDNN_MAX_CPU_ISA") or "(all the CPU has)")
    assert cpu.threads >= 1 and cpu.torch
    if os.environ.get("ATEN_CPU_CAPABILITY") == "avx2":
        assert cpu.aten_capability == "AVX2"
