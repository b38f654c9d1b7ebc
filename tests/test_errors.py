"""Bad input and failing user code: one `Error: ...` line (phase, module, exception), exit 1 or 2, the traceback
only with --debug; Hub ids offline or unreachable; the precision's source; --memory-budget; validate's order."""

import json
import os
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from types import SimpleNamespace
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


# --- 4. Hub ids offline or unreachable, `vramtrace models` -------------------------------------------------------

def test_offline_unknown_hub_id_says_offline():
    # conftest sets HF_HUB_OFFLINE=1 before huggingface_hub is imported
    with pytest.raises(ModelLoadError) as info:
        resolve_config("microsoft/phi-2")
    msg = str(info.value)
    assert "HF_HUB_OFFLINE is set" in msg and "neither config.json" not in msg
    assert "vramtrace models" in msg and "local directory" in msg


def test_offline_suggests_close_bundled_ids(capsys):
    assert main(["meta-llama/Llama-3-8B", "--seq", "8"]) == 1
    err = _one_line(capsys.readouterr().err)
    assert "did you mean meta-llama/Llama-3.1-8B" in err


def _fake_cache(cache: Path, repo: str) -> None:
    """An HF hub cache (huggingface_hub's layout) holding `repo`'s config.json: tiny-llama-gqa's."""
    folder = cache / ("models--" + repo.replace("/", "--"))
    commit = "0" * 40
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(commit)
    (folder / "snapshots" / commit).mkdir(parents=True)
    shutil.copy(TINY, folder / "snapshots" / commit / "config.json")


def test_offline_reads_the_hf_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    _fake_cache(tmp_path, "acme/tiny-llama")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    resolved = resolve_config("acme/tiny-llama")
    assert resolved.source == "hub" and resolved.config["model_type"] == "llama" and resolved.checkpoint is None


class _SilentServer:
    """A local TCP port that accepts connections and never answers (a Hub that hangs), or None: a closed port
    (connection refused). No traffic leaves the machine."""

    def __init__(self, answers: bool):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        if answers:
            self.sock.listen(16)
        self.port = self.sock.getsockname()[1]

    def close(self):
        self.sock.close()


def _cli_online(tmp_path, endpoint: str, *args) -> subprocess.CompletedProcess:
    """The CLI in a subprocess, online (no HF_HUB_OFFLINE), against `endpoint`, with an empty HF home. A CLI still
    running after 120 s hangs, and fails the test: that bound only guards against a hang (an unreachable Hub
    answers in about loading.HUB_TIMEOUT_S; benchmarks/bench_hub_unreachable.py prints how long it takes)."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_ENDPOINT=endpoint, HF_HOME=str(tmp_path / "hf"), PYTHONPATH=SRC)
    try:
        return subprocess.run([sys.executable, "-m", "vramtrace.cli", *args], capture_output=True, text=True, env=env,
                              timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the CLI hung on an unreachable Hub ({endpoint})")


@pytest.mark.parametrize("answers", [True, False], ids=["hangs", "refused"])
def test_unreachable_hub_answers_with_one_line(tmp_path, answers):
    """A Hub that accepts connections and never answers, or refuses them: the CLI gives up and says so in one
    line (exit 1), instead of hanging."""
    server = _SilentServer(answers)
    try:
        p = _cli_online(tmp_path, f"http://127.0.0.1:{server.port}", "microsoft/phi-2", "--seq", "8")
    finally:
        server.close()
    assert p.returncode == 1
    err = _one_line(p.stderr)
    assert "the Hub cannot be reached" in err and "local directory" in err


def test_a_hub_that_never_answers_is_given_up_at_the_probe_deadline(tmp_path, monkeypatch):
    """The probe's own deadline, not huggingface_hub's timeouts and retries, ends the wait: a HEAD that never
    returns (whatever the transport's timeouts) still gives the one error, after HUB_TIMEOUT_S (0.1 s here), with
    the deadline passed on as the request's timeout and no download tried after it."""
    import threading

    import huggingface_hub
    from huggingface_hub import constants

    from vramtrace.tracer import loading

    never = threading.Event()
    asked: list = []
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))  # an empty cache: nothing to fall back to
    monkeypatch.setattr(loading, "HUB_TIMEOUT_S", 0.1)
    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata",
                        lambda url, timeout: asked.append(timeout) or never.wait(60))  # a HEAD that never returns
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda *a, **kw: asked.append("download"))
    try:
        with pytest.raises(ModelLoadError, match=r"the Hub cannot be reached \(no answer within 0.1 s\), and the HF "
                                                 r"cache does not hold it"):
            resolve_config("acme/never-answers")
    finally:
        never.set()  # the probe's daemon thread ends
    assert asked == [0.1]


def test_unreachable_hub_falls_back_to_the_cache(tmp_path):
    server = _SilentServer(answers=True)
    _fake_cache(tmp_path / "hf" / "hub", "acme/tiny-llama")
    try:
        p = _cli_online(tmp_path, f"http://127.0.0.1:{server.port}", "acme/tiny-llama", "--seq", "8",
                           "--device", "cpu", "--json", "-", "-q")
    finally:
        server.close()
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["model"]["config_source"] == "hub" and d["model"]["model_type"] == "llama"


def test_models_lists_the_bundled_ids(capsys):
    assert main(["models"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == len(bundled_ids())
    assert any(line.split() == ["meta-llama/Llama-3.1-8B", "llama"] for line in lines)
    assert main(["models", "extra"]) == 2


# --- 5. where the precision comes from ---------------------------------------------------------------------------

def precision_for(spec, resolved):
    from vramtrace.tracer.checkpoint_headers import precision_for as resolve_precision

    return resolve_precision(spec, resolved)


def _resolved(source: str, dtype: str | None) -> ResolvedConfig:
    from vramtrace.tracer.checkpoint_headers import CheckpointHeader

    header = CheckpointHeader(1, ((dtype, 1000),), "hub" if source == "hub" else "local safetensors") if dtype else None
    return ResolvedConfig("acme/x", {}, source, "somewhere", header)


def test_hub_stored_dtype_is_information_only():
    precision, source = precision_for(RunSpec(TINY, 1, 8), _resolved("hub", "bfloat16"))
    assert precision.value == "bf16-mixed"
    assert source == "default for train (the hub checkpoint stores bfloat16; --precision stored uses it)"
    # the same without a header (offline): the same precision
    assert precision_for(RunSpec(TINY, 1, 8), _resolved("hub", None))[0] is precision


@pytest.mark.parametrize("source,dtype,want", [("hub", "bfloat16", "bf16"), ("hub", "float32", "fp32"),
                                               ("local", "float16", "fp16")])
def test_precision_stored_uses_the_header(source, dtype, want):
    precision, why = precision_for(RunSpec(TINY, 1, 8, precision="stored"), _resolved(source, dtype))
    assert precision.value == want and why.startswith("--precision stored")


@pytest.mark.parametrize("source,dtype,needle", [
    ("bundled", None, "comes with a config only"), ("hub", None, "offline, unreachable"),
    ("custom", None, "custom module"), ("local", None, "has no *.safetensors"),
    ("hub", "float8_e4m3fn", "stores float8_e4m3fn")])
def test_precision_stored_without_a_usable_header_is_an_error(source, dtype, needle):
    with pytest.raises(UsageError, match=needle.replace("*", r"\*")):
        precision_for(RunSpec(TINY, 1, 8, precision="stored"), _resolved(source, dtype))


def test_hub_id_online_keeps_the_default_precision(monkeypatch):
    # a Hub id whose safetensors headers (bf16) were fetched: the default precision stays bf16-mixed
    from vramtrace.tracer import loading
    from vramtrace.tracer.checkpoint_headers import CheckpointHeader

    header = CheckpointHeader(1, (("bfloat16", 10**6),), "hub")
    monkeypatch.setattr(loading, "_hub", lambda ref: ResolvedConfig(ref, json.loads(Path(TINY).read_text()), "hub",
                                                                     "cache", header))
    report = analyze(RunSpec("acme/tiny-llama", batch=1, seq=8, device="cpu"))
    assert report.run.precision == "bf16-mixed" and "stores bfloat16" in report.run.precision_source
    stored = analyze(RunSpec("acme/tiny-llama", batch=1, seq=8, device="cpu", precision="stored"))
    assert stored.run.precision == "bf16" and stored.model.param_dtype == "bfloat16"


def test_precision_stored_on_a_bundled_id_is_a_usage_error(capsys):
    assert main(["gpt2", "--seq", "8", "--precision", "stored"]) == 2
    assert "bundled id 'gpt2' comes with a config only" in _one_line(capsys.readouterr().err)


# --- 6. --memory-budget -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args,needle", [
    (["--checkpointing", "auto", "--memory-budget", "24"], "--memory-budget '24' has no unit; write e.g. 24GiB"),
    (["--memory-budget", "24GiB"], "--memory-budget applies to --checkpointing auto only"),
    (["--lora-alpha", "16"], "need --lora-rank"),
    (["--lora-targets", "q_proj"], "need --lora-rank"),
    (["--compare", "--checkpointing", "layers"], "--compare traces none, layers and selective itself"),
])
def test_options_that_would_do_nothing_are_usage_errors(args, needle, capsys):
    assert main([TINY, "--seq", "8", *args]) == 2
    assert needle in _one_line(capsys.readouterr().err)


def test_validate_refuses_report_options(tmp_path, capsys):
    html = tmp_path / "x.html"
    assert main(["validate", TINY, "--seq", "8", "--device", "cpu", "--html", str(html)]) == 2
    assert "validate writes no --compare, --html or --snapshot" in _one_line(capsys.readouterr().err)
    assert not html.exists()  # refused before anything is written


def test_no_plan_fits_prints_no_snippet(capsys):
    assert main([TINY, "--seq", "32", "--device", "cpu", "--checkpointing", "auto", "--memory-budget", "1KiB"]) == 0
    out = capsys.readouterr().out
    assert "no plan fits" in out and "Apply it" not in out


@dataclass(frozen=True)
class _Report:
    """The fields of a MemoryReport that the planner reads."""

    peak_allocated_bytes: int
    peak_reserved_bytes: int | None
    recompute_flops: int
    run: SimpleNamespace = field(default_factory=SimpleNamespace)
    activation_bytes: int = 0
    recompute_overhead: float = 0.0
    peak_phase: str = "forward"
    peak_op: str = "aten.mm"
    checkpointing: dict | None = None


@pytest.mark.parametrize("reserved,basis", [(True, "peak reserved"), (False, "peak allocated")])
def test_budget_is_compared_on_the_fit_basis(reserved, basis):
    from vramtrace.planner import plan_checkpointing

    # allocated fits 100 with every policy; reserved fits only with layers (CUDA: the allocator model's peak)
    peaks = {"none": (90, 130, 0), "selective": (80, 120, 5), "layers": (60, 95, 10)}

    def analyze_one(spec, say):
        alloc, res, flops = peaks[str(spec.checkpointing)]
        return _Report(alloc, res if reserved else None, flops, run=SimpleNamespace(
            checkpointing=str(spec.checkpointing), num_layers=1, layer_stack=""))

    spec = RunSpec(TINY, 1, 8, checkpointing="auto", memory_budget_bytes=100)
    report = plan_checkpointing(spec, analyze_one, lambda _m: None)
    plan = report.checkpointing.plan
    assert plan.basis == basis and plan.fits
    assert plan.chosen == ("layers" if reserved else "none")


# --- 7. validate --device cuda without a GPU ------------------------------------------------------------------------

def test_validate_cuda_without_a_gpu_refuses_before_tracing(monkeypatch):
    import torch

    import vramtrace.pipeline
    from vramtrace import validate as validate_mod

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    monkeypatch.setattr(vramtrace.pipeline, "analyze", lambda *a, **k: pytest.fail("traced before refusing"))
    with pytest.raises(UsageError, match="needs a CUDA GPU"):
        validate_mod.validate(RunSpec(TINY, batch=1, seq=8, device="cuda"))


@pytest.mark.parametrize("options,api,cli", [
    ({"batch": 0}, "batch must be a positive integer, got 0", "--batch must be a positive integer, got 0"),
    ({"batch": 1, "seq": 8, "memory_budget_bytes": 2**30},
     "memory_budget_bytes applies to checkpointing auto only; add checkpointing auto or drop memory_budget_bytes",
     "--memory-budget applies to --checkpointing auto only; add --checkpointing auto or drop --memory-budget"),
    ({"batch": 1, "seq": 8, "mode": "inference", "grad_accum": 2},
     "grad_accum applies to training; drop it for mode inference",
     "--grad-accum applies to training; drop it for --mode inference"),
])
def test_spec_errors_speak_the_api_and_the_cli_in_their_own_terms(options, api, cli, capsys):
    """RunSpec's validation names fields (the Python API); the CLI names the options that set them."""
    with pytest.raises(UsageError) as e:
        analyze(model=TINY, **options)
    assert str(e.value) == api
    flags = {"batch": "--batch", "seq": "--seq", "memory_budget_bytes": "--memory-budget", "mode": "--mode",
             "grad_accum": "--grad-accum"}
    argv = [TINY] + [a for k, v in options.items() for a in (flags[k], "1GiB" if k == "memory_budget_bytes" else str(v))]
    assert main(argv) == 2
    assert capsys.readouterr().err.strip() == f"Error: {cli}"
