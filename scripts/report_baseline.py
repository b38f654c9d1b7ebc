"""The JSON reports of a fixed set of vramtrace runs, written once and compared later: the proof that a change of
structure (issue 40) changes no report byte.

    python scripts/report_baseline.py --list                 # the runs and their arguments
    python scripts/report_baseline.py --write DIR            # every run's report as DIR/NAME.json
    python scripts/report_baseline.py --check DIR            # run them again; exit 1 when any report differs
    python scripts/report_baseline.py --check DIR --quick    # only the tiny-config runs (seconds each)
    python scripts/report_baseline.py --check DIR --runs readme-llama2-7b,readme-fit-l40s

Each run is the CLI's own argument list plus `--json DIR/NAME.json -q`, run in this process (`vramtrace.cli.main`,
as tests/conftest.py's `run_cli`; `--subprocess`: each in a fresh `python -m vramtrace.cli`) from the repository
root, so the model paths in the reports are the relative paths given here, never this checkout's location. The
environment is the tests' one: HF_HUB_OFFLINE=1 (bundled configs and fixtures only), the CPU probe's and the
levers' disk caches off (every figure measured or traced in this run, never read back from an earlier one).

A report is compared byte for byte after `normalise`, which replaces only what legitimately varies between two
runs of the same command on the same machine (`VOLATILE`) with a fixed token; `--check` prints "identical" or the
differing JSON paths with the baseline's and the new value (the first 20). Write the baseline and check it on the
same machine: the CPU targets' kernel workspaces are measured on this machine's kernels at its thread count
(DIR/_environment.json records both; `--check` warns when they differ).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENVIRONMENT = {"HF_HUB_OFFLINE": "1", "VRAMTRACE_CPU_PROBE_CACHE": "off", "VRAMTRACE_LEVER_CACHE": "off"}
TOKEN = "<normalised>"
SHOWN = 20  # differing paths printed per run
TINY = "fixtures/configs"


@dataclass(frozen=True)
class Run:
    """One named run: `args`, the vramtrace CLI's arguments (without --json); `quick`: a tiny-config run of a few
    seconds, in `--quick`'s subset; `source`: where the command comes from."""

    name: str
    args: tuple[str, ...]
    quick: bool
    source: str


def _run(name: str, command: str, source: str, quick: bool = False) -> Run:
    return Run(name, tuple(command.split()), quick, source)


LLAMA = "meta-llama/Llama-2-7b"
RUNS: tuple[Run, ...] = (
    # the README: "What it prints" and "The commands people use most" (MODEL: Llama-2-7b, as "What it prints")
    _run("readme-llama2-7b", f"{LLAMA} --batch 4 --seq 2048", "README: What it prints"),
    _run("readme-llama2-7b-no-levers", f"{LLAMA} --batch 4 --seq 2048 --no-levers", "README, --no-levers"),
    _run("readme-a100", f"{LLAMA} --batch 8 --seq 2048 --gpu A100-80GB", "README: commands"),
    _run("readme-fit-l40s", f"fit {LLAMA} --seq 4096 --gpu L40S", "README: commands"),
    _run("readme-checkpointing-auto", f"{LLAMA} --batch 8 --seq 2048 --checkpointing auto --memory-budget 40GiB "
         "--no-levers", "README: commands (--no-levers: the budget is the question)"),
    _run("readme-qlora-4090", f"{LLAMA} --batch 4 --seq 2048 --quantization nf4 --lora-rank 16 --gpu RTX4090 "
         "--no-levers", "README: commands"),
    _run("readme-fsdp8", f"{LLAMA} --batch 1 --seq 4096 --fsdp 8 --no-levers", "README: commands"),
    # docs/usage pages' commands, on bundled configs
    _run("docs-fit-lora-h100", f"fit {LLAMA} --seq 2048 --lora-rank 16 --checkpointing layers --gpu H100-80GB",
         "docs/usage/fit.md"),
    _run("docs-sweep-gpt2", "fit gpt2 --sweep 1,2,4,8x256,512,1024", "docs/usage/fit.md (--sweep)"),
    _run("docs-serve-llama31-8b", "serve meta-llama/Llama-3.1-8B --gpu L40S --max-model-len 8192",
         "docs/usage/serving.md"),
    _run("docs-generate-gpt2", "gpt2 --mode generate --batch 4 --seq 256 --new-tokens 16 --no-levers",
         "docs/usage/generation.md"),
    _run("docs-inference-mistral", "mistralai/Mistral-7B-v0.1 --mode inference --batch 2 --seq 1024 --no-levers",
         "docs/usage/models.md (inference)"),
    _run("docs-tp2-llama31-8b", "meta-llama/Llama-3.1-8B --batch 1 --seq 2048 --tp 2 --optimizer-impl for-loop "
         "--no-levers", "docs/usage/sharding.md"),
    _run("docs-mixtral-moe", "mistralai/Mixtral-8x7B-v0.1 --batch 1 --seq 512 --lora-rank 8 "
         "--lora-targets q_proj,v_proj --no-levers", "docs/usage/adapters.md (MoE, LoRA)"),
    _run("docs-cpu-gpt2", "gpt2 --batch 1 --seq 64 --device cpu --no-levers",
         "docs/usage/adapters.md (CPU workspaces)"),
    # the tiny fixtures: one feature each, a few seconds each (--quick)
    _run("tiny-gpt2-train", f"{TINY}/tiny-gpt2.json --batch 2 --seq 32", "tiny: default train", quick=True),
    _run("tiny-gpt2-no-levers", f"{TINY}/tiny-gpt2.json --batch 2 --seq 32 --gpu T4 --no-levers",
         "tiny: --no-levers", quick=True),
    _run("tiny-gpt2-cpu", f"{TINY}/tiny-gpt2.json --batch 2 --seq 32 --device cpu", "tiny: --device cpu",
         quick=True),
    _run("tiny-llama-generate", f"{TINY}/tiny-llama-gqa.json --mode generate --batch 2 --seq 16 --new-tokens 4",
         "tiny: generation", quick=True),
    _run("tiny-llama-lora", f"{TINY}/tiny-llama-gqa.json --batch 2 --seq 32 --lora-rank 4", "tiny: LoRA (peft)",
         quick=True),
    _run("tiny-llama-fsdp2", f"{TINY}/tiny-llama-gqa.json --batch 2 --seq 32 --fsdp 2", "tiny: FSDP2", quick=True),
    _run("tiny-llama-checkpointing", f"{TINY}/tiny-llama-gqa.json --batch 2 --seq 32 --checkpointing layers",
         "tiny: checkpointing", quick=True),
    _run("tiny-mixtral", f"{TINY}/tiny-mixtral.json --batch 2 --seq 32", "tiny: MoE", quick=True),
    _run("tiny-bert-inference", f"{TINY}/tiny-bert.json --mode inference --batch 2 --seq 32", "tiny: encoder",
         quick=True),
    _run("tiny-gpt2-compile", f"{TINY}/tiny-gpt2.json --batch 2 --seq 32 --device cpu --compile",
         "docs/usage/compile.md, on a tiny config (about a minute: Inductor)"),
    _run("tiny-fit", f"fit {TINY}/tiny-gpt2.json --seq 64 --gpu-memory 1GiB", "tiny: fit", quick=True),
    _run("tiny-sweep", f"fit {TINY}/tiny-gpt2.json --sweep 1,2x16,32", "tiny: fit --sweep", quick=True),
    _run("tiny-serve", f"serve {TINY}/tiny-llama-gqa.json --gpu L4", "tiny: serve", quick=True),
)



def _benchmark_runs() -> tuple[Run, ...]:
    """benchmarks/gpu_check.py's cases (the H100 evidence's: training with checkpointing, LoRA, accumulation, the
    8-bit optimizer, generation with both caches, a custom module, encoders, T5, expandable segments), predicted as
    gpu_check predicts them (`vramtrace_args`) for the H100-80GB preset without levers. The model is the bundled
    config at full depth (gpu_check's `layers` override needs a written config file, whose path would differ from
    run to run) or the evidence's MHANet module, both as paths relative to the repository root."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = gpu_check  # dataclasses look their module up there
    spec.loader.exec_module(gpu_check)
    runs = []
    for case in gpu_check.CASES:
        model = ("benchmarks/gpu_evidence/mha_model.py:MHANet" if case.model == "mha"
                 else f"src/vramtrace/tracer/configs/{case.model}.json")
        args = gpu_check.vramtrace_args(case, model) + ["--gpu", "H100-80GB", "--no-levers"]
        runs.append(Run(f"bench-{case.name}", tuple(args), False, "benchmarks/gpu_check.py CASES (full depth)"))
    return tuple(runs)


RUNS += _benchmark_runs()

# What legitimately varies between two runs of the same command on the same machine: (JSON path pattern, why).
# A pattern's parts are keys, `*` any key or list index. Empty: two runs of every command above gave the same bytes.
VOLATILE: tuple[tuple[tuple[str, ...], str], ...] = ()


def select(names: str | None, quick: bool) -> list[Run]:
    """The runs named in `names` (comma-separated, in that order), else all (only the quick ones with `quick`).
    Raises SystemExit(2) naming an unknown run."""
    runs = [r for r in RUNS if r.quick or not quick]
    if not names:
        return runs
    by_name = {r.name: r for r in RUNS}
    unknown = [n for n in names.split(",") if n not in by_name]
    if unknown:
        print(f"Error: unknown run {', '.join(unknown)}; --list lists them", file=sys.stderr)
        raise SystemExit(2)
    return [by_name[n] for n in names.split(",")]


def _matches(pattern: tuple[str, ...], path: tuple) -> bool:
    return len(pattern) == len(path) and all(p == "*" or p == str(k) for p, k in zip(pattern, path))


def normalise(data, path: tuple = ()):
    """`data` with every value at a `VOLATILE` path replaced by TOKEN, and this checkout's absolute path (should a
    string hold it) replaced by `<repo>`, so that a baseline written in one worktree checks in another."""
    if any(_matches(p, path) for p, _ in VOLATILE):
        return TOKEN
    if isinstance(data, dict):
        return {k: normalise(v, path + (k,)) for k, v in data.items()}
    if isinstance(data, list):
        return [normalise(v, path + (i,)) for i, v in enumerate(data)]
    if isinstance(data, str) and str(ROOT) in data:
        return data.replace(str(ROOT), "<repo>")
    return data


def differences(old, new, path: str = "$") -> list[tuple[str, object, object]]:
    """The JSON paths (`$.run.batch`, `$.tensors[3].bytes`) where `old` and `new` differ, with both values
    ("<absent>" where one has no such key or index)."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for k in list(old) + [k for k in new if k not in old]:
            out += differences(old.get(k, "<absent>"), new.get(k, "<absent>"), f"{path}.{k}")
        return out
    if isinstance(old, list) and isinstance(new, list):
        out = []
        for i in range(max(len(old), len(new))):
            out += differences(old[i] if i < len(old) else "<absent>", new[i] if i < len(new) else "<absent>",
                               f"{path}[{i}]")
        return out
    if type(old) is not type(new) or old != new:
        return [(path, old, new)]
    return []


def trace(run: Run, out: Path, isolate: bool) -> int:
    """Run `run` with `--json out -q` from the repository root; its exit status (its output and errors are kept
    only when it fails: printed then)."""
    argv = [*run.args, "--json", str(out), "-q"]
    if isolate:
        path = os.pathsep.join([str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])
        done = subprocess.run([sys.executable, "-m", "vramtrace.cli", *argv], cwd=ROOT, capture_output=True,
                              text=True, env={**os.environ, **ENVIRONMENT, "PYTHONPATH": path})
        if done.returncode:
            print(done.stdout + done.stderr, file=sys.stderr)
        return done.returncode
    from vramtrace.cli import main

    here, printed = Path.cwd(), io.StringIO()
    os.chdir(ROOT)
    try:
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            status = main(argv)
    finally:
        os.chdir(here)
    if status:
        print(printed.getvalue(), file=sys.stderr)
    return status


def report_bytes(path: Path) -> bytes:
    """The report at `path`, normalised, as the CLI writes it (`json.dumps`, no indent, key order kept, newline)."""
    return (json.dumps(normalise(json.loads(path.read_text(encoding="utf-8")))) + "\n").encode()


def environment() -> dict:
    """What the CPU targets' measured figures depend on: the versions and the thread count."""
    import platform

    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__, "threads": torch.get_num_threads(),
            "machine": platform.machine(), "processor": platform.processor()}


def write(runs: list[Run], folder: Path, isolate: bool) -> int:
    """Each run's normalised report as folder/NAME.json (and folder/_environment.json); 1 when any run failed."""
    folder.mkdir(parents=True, exist_ok=True)
    failed = 0
    for run in runs:
        out, start = folder / f"{run.name}.json", time.perf_counter()
        status = trace(run, out, isolate)
        if status == 0:
            out.write_bytes(report_bytes(out))
        else:  # no baseline of an earlier write left to be checked against as if it were this one's
            out.unlink(missing_ok=True)
        print(f"{run.name}: {'written' if status == 0 else f'FAILED (exit {status})'} "
              f"({time.perf_counter() - start:.1f} s)", flush=True)
        failed += status != 0
    (folder / "_environment.json").write_text(json.dumps(environment(), indent=1) + "\n")
    return 1 if failed else 0


def compare(run: Run, folder: Path, isolate: bool) -> tuple[bool, list[str]]:
    """Run `run` again and compare with folder/NAME.json: (identical, the lines that say how it differs)."""
    import tempfile

    baseline = folder / f"{run.name}.json"
    if not baseline.is_file():
        return False, [f"  no baseline {baseline}; write it with --write"]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / f"{run.name}.json"
        status = trace(run, out, isolate)
        if status:
            return False, [f"  FAILED (exit {status})"]
        new = report_bytes(out)
    if new == baseline.read_bytes():
        return True, []
    diffs = differences(json.loads(baseline.read_bytes()), json.loads(new))
    if not diffs:
        return False, ["  the same values, other bytes (key order or formatting)"]
    lines = [f"  {p}: {json.dumps(o)[:200]} -> {json.dumps(n)[:200]}" for p, o, n in diffs[:SHOWN]]
    return False, lines + ([f"  ... and {len(diffs) - SHOWN} more"] if len(diffs) > SHOWN else [])


def check(runs: list[Run], folder: Path, isolate: bool) -> int:
    """Compare every run with its baseline in `folder`; 1 when any differs or failed."""
    recorded = folder / "_environment.json"
    written = json.loads(recorded.read_text()) if recorded.is_file() else None
    if written is not None and written != environment():
        print(f"warning: the baseline was written under {json.dumps(written)}, this run is under "
              f"{json.dumps(environment())}: the CPU targets' figures may differ", file=sys.stderr)
    differing = 0
    for run in runs:
        start = time.perf_counter()
        same, lines = compare(run, folder, isolate)
        print(f"{run.name}: {'identical' if same else 'DIFFERS'} ({time.perf_counter() - start:.1f} s)", flush=True)
        for line in lines:
            print(line)
        differing += not same
    print(f"{len(runs) - differing} of {len(runs)} identical")
    return 1 if differing else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="report_baseline.py", description=__doc__.split("\n\n")[0])
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--write", metavar="DIR", type=Path, help="write each run's report as DIR/NAME.json")
    action.add_argument("--check", metavar="DIR", type=Path, help="compare each run's report with DIR/NAME.json")
    action.add_argument("--list", action="store_true", help="list the runs and their arguments")
    parser.add_argument("--runs", help="only these runs (comma-separated names)")
    parser.add_argument("--quick", action="store_true", help="only the tiny-config runs")
    parser.add_argument("--subprocess", action="store_true", help="each run in a fresh `python -m vramtrace.cli`")
    options = parser.parse_args(argv)
    runs = select(options.runs, options.quick)
    if options.list:
        for run in runs:
            print(f"{run.name:<28} {'quick ' if run.quick else ''}vramtrace {' '.join(run.args)}   # {run.source}")
        return 0
    os.environ.update(ENVIRONMENT)  # before vramtrace is imported: its caches read these
    if str(ROOT / "src") not in sys.path:  # this checkout's vramtrace, whatever is installed
        sys.path.insert(0, str(ROOT / "src"))
    if options.write:
        return write(runs, options.write, options.subprocess)
    return check(runs, options.check, options.subprocess)


if __name__ == "__main__":
    sys.exit(main())
