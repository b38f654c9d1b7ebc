"""The CLI: a report on stdout, JSON with the stable keys, and one-line errors with the right exit status."""

import json
import subprocess
import sys

import pytest

from conftest import FIXTURES, run_cli

TINY = str(FIXTURES / "tiny-llama-gqa.json")


def run(*args, env=None):
    return subprocess.run([sys.executable, "-m", "vramtrace.cli", *args], capture_output=True, text=True,
                          timeout=300, env=env)


def test_report_and_json(tmp_path, capsys):
    out = tmp_path / "r.json"
    p = run_cli(capsys, TINY, "--batch", "2", "--seq", "16", "--json", str(out))
    assert p.returncode == 0, p.stderr
    assert "Peak allocated" in p.stdout and "Step waterfall" in p.stdout
    d = json.loads(out.read_text())
    for key in ("schema_version", "params", "peak_allocated_bytes", "first_step_peak_allocated_bytes",
                "graph_optimal_peak_bytes", "peak_phase", "breakdown_at_peak", "phases", "tensors"):
        assert key in d
    assert isinstance(d["peak_allocated_bytes"], int)
    assert d["peak_allocated_bytes"] % 512 == 0  # CUDA target: 512 B blocks
    t = d["tensors"][0]
    assert {"bytes", "category", "module", "op", "birth", "death"} <= set(t)


def test_json_to_stdout():
    p = run(TINY, "--batch", "1", "--seq", "8", "--json", "-", "--mode", "inference")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["run"]["precision"] == "bf16"


def test_json_to_stdout_stays_json_under_deepspeed():
    """DeepSpeed's logger writes to stdout, and its import warns there ('Setting accelerator to CPU'): under
    --zero, `--json -` still puts the report alone on stdout (what a library prints during the trace goes to
    stderr)."""
    pytest.importorskip("deepspeed")
    p = run(TINY, "--zero", "2", "--dp", "2", "--batch", "2", "--seq", "16", "--device", "cpu", "--no-levers",
            "--json", "-")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["run"]["zero"]["stage"] == 2


@pytest.mark.parametrize("args,status,needle", [
    (["--batch", "0", "--seq", "8"], 2, "--batch must be a positive integer"),
    (["--batch", "x", "--seq", "8"], 2, "valid integer"),
    (["--batch", "1", "--seq", "-3"], 2, "--seq must be a positive integer"),
    (["--batch", "1", "--seq", "8", "--precision", "fp8"], 2, "unknown precision"),
    (["--batch", "1", "--seq", "8", "--optimizer", "lion"], 2, "unsupported optimizer 'lion'"),
    (["--batch", "1", "--seq", "8", "--json", "/no/such/dir/r.json"], 1, "cannot write --json"),
    (["--batch", "1", "--seq", "8", "--html", "/no/such/dir/r.html"], 1, "cannot write --html"),
    (["--batch", "1"], 2, "--seq is required"),
    (["--batch", "1", "--seq", "8", "--checkpointing", "every:0"], 2, "unknown checkpointing"),
    (["--batch", "1", "--seq", "8", "--checkpointing", "auto"], 2, "needs --memory-budget"),
    (["--batch", "1", "--seq", "8", "--checkpointing", "auto", "--memory-budget", "4parsecs"], 2, "unknown unit"),
    (["--batch", "1", "--seq", "8", "--checkpointing", "selective:aten.nope"], 2, "is not an op"),
    (["--batch", "1", "--seq", "8", "--compile"], 2, "--compile is traced for --device cpu only"),
    (["--batch", "1", "--seq", "8", "--device", "cpu", "--compile", "--compare"], 2, "not fit, validate or --compare"),
    (["--batch", "1", "--seq", "8", "--device", "cpu", "--compile-mode", "max-autotune-no-cudagraphs"], 2,
     "--compile-mode sets torch.compile's mode: add --compile"),
    (["--batch", "1", "--seq", "8", "--device", "cpu", "--compile", "--compile-mode", "max-autotune"], 2,
     "unknown --compile-mode 'max-autotune'"),
])
def test_usage_errors(args, status, needle, capsys):
    """In process (`cli.main`, what the console script calls): one `Error:` line on stderr and the exit status;
    the subprocess test below checks the same through a real process."""
    from vramtrace.cli import main

    assert main([TINY, *args]) == status
    err = capsys.readouterr().err
    assert err.startswith("Error: ") and needle in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_usage_error_from_a_real_process():
    p = run(TINY, "--batch", "1")
    assert p.returncode == 2
    assert p.stderr.startswith("Error: ") and "--seq is required" in p.stderr
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_model_errors(tmp_path, capsys):
    bad = tmp_path / "config.json"
    bad.write_text("{oops")
    for ref, needle in ((str(bad), "not valid JSON"), ("./missing/config.json", "does not exist"),
                        ("some-org/surely-not-cached-model-xyz", "local")):
        p = run_cli(capsys, ref, "--batch", "1", "--seq", "8")
        assert p.returncode == 1 and p.stderr.startswith("Error: ") and needle in p.stderr, p.stderr
        assert "Traceback" not in p.stderr


def test_compare_and_checkpointing_json(tmp_path, capsys):
    out = tmp_path / "c.json"
    p = run_cli(capsys, TINY, "--batch", "2", "--seq", "32", "--compare", "--json", str(out))
    assert p.returncode == 0, p.stderr
    assert "Checkpointing compared" in p.stdout
    rows = json.loads(out.read_text())["comparison"]
    assert [r["policy"] for r in rows] == ["none", "layers", "selective"]
    assert rows[0]["recompute_flops"] == 0 < rows[1]["recompute_flops"]
    p = run_cli(capsys, TINY, "--batch", "2", "--seq", "32", "--checkpointing", "layers", "--json", "-")
    d = json.loads(p.stdout)
    assert d["checkpointing"]["policy"] == "layers"
    # the same policy analysed on its own and in --compare; the recompute re-runs (part of) the forward only,
    # at most a third of forward + backward
    assert d["recompute_flops"] == rows[1]["recompute_flops"] and 0 < d["recompute_flops"] < d["step_flops"] / 3
    assert d["checkpointing"]["activation_bytes"] < d["checkpointing"]["activation_bytes_without"]


@pytest.mark.parametrize("args, usage, needles", [
    (["--help"], "vramtrace [OPTIONS] [model]...", ["--batch", "--compare", "--json"]),
    (["fit", "--help"], "vramtrace fit [OPTIONS] [model]...", ["--headroom", "--sweep", "--seq"]),
    (["validate", "-h"], "vramtrace validate [OPTIONS] [model]...", ["--seq", "--json"]),
    (["serve", "--help"], "vramtrace serve [OPTIONS] {model}", ["--max-model-len", "--kv-cache-dtype"]),
])
def test_each_command_has_its_own_help(args, usage, needles, capsys):
    """Real subcommands: each `--help` names its own command on the usage line and lists its options; the main
    run's has no command word, as it is typed. MODEL is optional (`[model]`) where a --from file may name it."""
    p = run_cli(capsys, *args)
    assert p.returncode == 0 and p.stderr == ""
    assert f"Usage: {usage}" in " ".join(p.stdout.split())
    for needle in needles:
        assert needle in p.stdout


def test_models_help_and_arguments(capsys):
    p = run_cli(capsys, "models", "--help")
    assert p.returncode == 0 and p.stdout.startswith("Usage: vramtrace models\n")
    p = run_cli(capsys, "models", "extra", "words")
    assert p.returncode == 2 and p.stderr == "Error: `vramtrace models` takes no arguments, got 'extra words'\n"


@pytest.mark.parametrize("args, needle", [
    # the default command by its name: the same run as without it
    (["run", TINY, "--seq", "8", "--headroom", "5%"], "--headroom applies to `vramtrace fit MODEL ...`"),
    ([TINY, "--seq", "8", "--sweep", "1x8"], "--sweep applies to `vramtrace fit MODEL ...`"),
    # fit's axis from the options given, wherever they stand on the line
    (["fit", "--sweep", "1x8", TINY, "-b", "2"], "--sweep gives the batches and sequences itself"),
    (["fit", TINY, "--seq=8", "--sweep", "1x8"], "--sweep gives the batches and sequences itself"),
    # the options of the main run that fit and validate refuse, from the command word itself
    (["validate", TINY, "--seq", "8", "--compare"], "validate writes no --compare"),
    (["fit", TINY, "--seq", "8", "--snapshot", "s.pickle"], "fit writes no --compare or --snapshot"),
    # the hidden flags the old argv rewriting used are no options
    ([TINY, "--seq", "8", "--fit", "batch"], "No such option: --fit"),
])
def test_subcommands_dispatch_without_rewriting_argv(args, needle, capsys):
    p = run_cli(capsys, *args)
    assert p.returncode == 2 and p.stderr.startswith("Error: ") and needle in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
