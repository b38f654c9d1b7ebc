"""The GPU accuracy suite in one command: real runs against vramtrace's predictions, as a markdown table.

Reproduce (a machine with one idle CUDA GPU, torch with CUDA, transformers; peft and bitsandbytes optional):
    python benchmarks/gpu_check.py --out gpu_check.md                 # every case, about 6 min on one H100
    python benchmarks/gpu_check.py --cases llama-train,fit --out x.md  # a selection (--list names them)
    python benchmarks/gpu_check.py --dry-run --out dry.md              # the CPU: tiny configs, the same code paths
    python benchmarks/gpu_check.py --predict-only --out pred.md        # the CPU: only the GPU cases' predictions
    python benchmarks/gpu_check.py --predict-only --recorded            # the same, against the recorded H100 run
    python benchmarks/gpu_check.py --real-only --record h100.json      # the GPU: real runs only, as a record
    python benchmarks/gpu_check.py --predict-only --recorded h100.json # predictions against that record

`--real-only` is for a GPU machine whose Python cannot run vramtrace (another torch than the one vramtrace is
tested with): it runs the cases and the fit batches (`--fit-batches`, default the recorded boundary's 21..25) for
real, writes what they measured to `--record` after each run, and `--snapshot NAMES` records the allocator's
history of those runs (case names, or fit batches as `fit-B`) as `torch.cuda.memory._snapshot()` pickles
(gzip) in `--snapshot-dir`; the predictions are then made on any machine with `--predict-only --recorded FILE`.

Each case runs for real in a fresh process (benchmarks/gpu_check_runner.py: its own CUDA context and allocator,
public APIs only, nothing from vramtrace) with the H100 evidence's protocol (two warm-up steps,
`reset_peak_memory_stats`, one measured step; see the runner's docstring), and is predicted by the vramtrace CLI
in another process of the same tree (`python -m vramtrace.cli ... --gpu PRESET --no-levers --json`, the GPU hidden
from it with CUDA_VISIBLE_DEVICES= so that only the measured process holds a context). Predictions run in
parallel with the real runs (`--jobs`). The fit boundary: `vramtrace fit` on the evidence's config (Llama-2-7b
dims, 4 layers, seq 2048, bf16-mixed, AdamW) with the measured CUDA context, then real runs at the answer, +1
and +2. `--max-minutes` (default 8) skips the cases that would start past the budget, and says which.

Dry mode (`--dry-run`, CI): every case shrunk to a tiny config (the repo's fixtures/configs, or the bundled config
with tiny dimensions), run by the same runner on the CPU (truth: torch.profiler's allocator events plus the bytes
alive at step start) and predicted with `--device cpu`; the fit boundary against a capacity of 8 MiB, each real
run's verdict being its measured peak against that capacity. The table says it is a dry run.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import enum
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNNER = ROOT / "benchmarks" / "gpu_check_runner.py"
BUNDLED = ROOT / "src" / "vramtrace" / "tracer" / "configs"
FIXTURES = ROOT / "fixtures" / "configs"
MHA = f"{ROOT / 'benchmarks' / 'gpu_evidence' / 'mha_model.py'}:MHANet"
# what a real H100 measured for every case and the fit boundary's batches (`--real-only --record`, 2026-11-26)
RECORDED = ROOT / "benchmarks" / "gpu_evidence" / "h100-2026-11-26-gpu_check.json"
DRY_CAPACITY_BYTES = 8 * 2**20  # the dry fit's capacity: tiny Llama fp32 at seq 32 fits about 11 samples
NA = "n/a (CPU)"


class Mode(str, enum.Enum):
    TRAIN = "train"
    GENERATE = "generate"


class Extra(str, enum.Enum):
    """An optional dependency a case needs: (module, vramtrace extra)."""
    PEFT = "peft"
    BITSANDBYTES = "bitsandbytes"


EXTRA_INSTALL = {Extra.PEFT: "pip install 'vramtrace[lora]' (peft)",
                 Extra.BITSANDBYTES: "pip install 'vramtrace[quant]' (bitsandbytes)"}


class Outcome(str, enum.Enum):
    RAN = "ran"
    OOM = "oom"
    FAILED = "failed"
    SKIPPED = "skipped"
    NOT_RUN = "not run"


@dataclasses.dataclass(frozen=True)
class Case:
    """One case: the same fields drive the real runner and the vramtrace command. `model`: a bundled config's file
    stem (src/vramtrace/tracer/configs) or "mha" (the evidence's MHANet); `layers`: num_hidden_layers override;
    `est_s`: estimated seconds of the real run on one H100 (process start, build, three steps)."""
    name: str
    model: str
    batch: int
    seq: int | None
    precision: str
    est_s: int
    task: str | None = "causal-lm"
    mode: Mode = Mode.TRAIN
    layers: int | None = None
    checkpointing: str = "none"
    lora_rank: int | None = None
    grad_accum: int = 1
    optimizer: str = "adamw"
    new_tokens: int | None = None
    cache: str | None = None
    alloc_conf: str | None = None
    extra: Extra | None = None


_L7 = dict(model="llama-2-7b", layers=4, batch=4, seq=2048, precision="bf16-mixed", est_s=15)
_GEN = dict(model="llama-2-7b", batch=4, seq=512, precision="bf16", mode=Mode.GENERATE, new_tokens=64, est_s=30)
_MHA = dict(model="mha", batch=8, seq=2048, precision="fp32", task=None, est_s=10)
EXPANDABLE = "expandable_segments:True"
CASES = (  # the H100 evidence's cases (../shared/gpu-evidence/README.md), at its sizes
    Case("llama-train", **_L7),
    Case("llama-ckpt", **_L7, checkpointing="layers"),
    Case("llama-lora", **_L7, lora_rank=16, extra=Extra.PEFT),
    Case("llama-accum", **{**_L7, "est_s": 18}, grad_accum=2),
    Case("llama-adamw8bit", **{**_L7, "est_s": 18}, optimizer="adamw-8bit", extra=Extra.BITSANDBYTES),
    Case("llama-gen-dynamic", **_GEN, cache="dynamic"),
    Case("llama-gen-static", **_GEN, cache="static"),
    Case("mha", **_MHA),
    Case("vit", "vit-base-patch16-224", 64, None, "fp32", 12, task="image-classification"),
    Case("bert-seqcls", "bert-base-uncased", 32, 512, "fp16-mixed", 12, task="sequence-classification"),
    Case("t5", "t5-base", 8, 512, "bf16-mixed", 12, task="seq2seq-lm"),
    Case("gpt2-fp32", "gpt2", 8, 1024, "fp32", 12),
    Case("gpt2-bf16mixed", "gpt2", 8, 1024, "bf16-mixed", 12),
    Case("qwen-4l", "qwen2.5-7b", 2, 4096, "bf16-mixed", 20, layers=4),
    Case("llama-train-expandable", **_L7, alloc_conf=EXPANDABLE),
    Case("llama-gen-dynamic-expandable", **_GEN, cache="dynamic", alloc_conf=EXPANDABLE),
    Case("mha-expandable", **_MHA, alloc_conf=EXPANDABLE),
)
FIT = Case("fit", **{**_L7, "est_s": 20})  # the fit boundary's config; the batch comes from `vramtrace fit`
FIT_CONTEXT_CASE = "llama-train"  # the fit's --cuda-context: the context this case measured (same model)
FIT_EST_S = 3 * 20  # three real runs near capacity

# dry mode: each model's tiny double (a fixture, or the bundled config with tiny dimensions)
TINY = {
    "llama-2-7b": ("fixture", "tiny-llama-gqa", ()),
    "gpt2": ("fixture", "tiny-gpt2", ()),
    "t5-base": ("fixture", "tiny-t5", ()),
    "bert-base-uncased": ("fixture", "tiny-bert", ()),
    "qwen2.5-7b": ("bundled", "qwen2.5-7b", (("hidden_size", 64), ("intermediate_size", 128),
                                             ("num_attention_heads", 4), ("num_key_value_heads", 2),
                                             ("num_hidden_layers", 2), ("vocab_size", 512),
                                             ("max_position_embeddings", 256))),
    "vit-base-patch16-224": ("bundled", "vit-base-patch16-224", (
        ("hidden_size", 64), ("intermediate_size", 128), ("num_attention_heads", 4), ("num_hidden_layers", 2),
        ("image_size", 32), ("patch_size", 8))),
}


def dry_case(case: Case) -> Case:
    """The case at a tiny size for the CPU: batch 2, seq 32 (MHANet 64), 4 new tokens, the tiny config's layers;
    no PYTORCH_CUDA_ALLOC_CONF (vramtrace refuses --alloc-conf for --device cpu)."""
    seq = None if case.seq is None else 64 if case.model == "mha" else 32
    return dataclasses.replace(case, batch=2, seq=seq, layers=None, new_tokens=case.new_tokens and 4, alloc_conf=None)


def config_file(case: Case, dry: bool, tmp: Path) -> str:
    """The model reference both sides read: the MHANet file, or a config.json written under `tmp` (the bundled
    config, its tiny double in dry mode, with `layers` applied)."""
    if case.model == "mha":
        return MHA
    if dry:
        kind, stem, overrides = TINY[case.model]
        cfg = json.loads(((FIXTURES if kind == "fixture" else BUNDLED) / f"{stem}.json").read_text())
        cfg.update(dict(overrides))
    else:
        cfg = json.loads((BUNDLED / f"{case.model}.json").read_text())
    if case.layers is not None:
        cfg["num_hidden_layers"] = case.layers
    path = tmp / f"{case.name}.config.json"
    path.write_text(json.dumps(cfg, indent=1))
    return str(path)


def vramtrace_args(case: Case, model: str) -> list[str]:
    """The case's `vramtrace` arguments, without the target (--gpu/--device) and the output options."""
    args = [model, "--batch", str(case.batch), "--precision", case.precision, "--mode", case.mode.value]
    args += ["--seq", str(case.seq)] if case.seq is not None else []
    args += ["--task", case.task] if case.task else ["--input", "x=float32[B,S,256]"]
    args += ["--checkpointing", case.checkpointing] if case.checkpointing != "none" else []
    args += ["--lora-rank", str(case.lora_rank)] if case.lora_rank else []
    args += ["--grad-accum", str(case.grad_accum)] if case.grad_accum > 1 else []
    args += ["--optimizer", case.optimizer] if case.optimizer != "adamw" else []
    args += ["--new-tokens", str(case.new_tokens), "--cache", case.cache] if case.mode is Mode.GENERATE else []
    args += ["--alloc-conf", case.alloc_conf] if case.alloc_conf else []
    return args


def runner_spec(case: Case, model: str, device: str) -> dict:
    """The plain description the real runner reads (the same fields as `vramtrace_args`)."""
    return {"model": model, "task": case.task, "mode": case.mode.value, "precision": case.precision,
            "batch": case.batch, "seq": case.seq, "checkpointing": case.checkpointing, "lora_rank": case.lora_rank,
            "grad_accum": case.grad_accum, "optimizer": case.optimizer, "new_tokens": case.new_tokens,
            "cache": case.cache, "inputs": None if case.task else ["x=float32[B,S,256]"], "device": device}


def missing_extra(case: Case) -> str | None:
    """Why the case cannot run here (an absent optional dependency), or None."""
    if case.extra is not None and importlib.util.find_spec(case.extra.value) is None:
        return f"needs {case.extra.value}: {EXTRA_INSTALL[case.extra]}"
    return None


PRESETS = (  # torch.cuda.get_device_name() words -> vramtrace's --gpu preset (docs/gpus.md)
    (("H100", "NVL"), "H100-NVL"), (("H100",), "H100-80GB"), (("H200",), "H200"), (("B200",), "B200"),
    (("A100", "80GB"), "A100-80GB"), (("A100",), "A100-40GB"), (("A6000",), "A6000"), (("L40S",), "L40S"),
    (("A10G",), "A10G"), (("A10",), "A10"), (("L4",), "L4"), (("4090",), "RTX4090"), (("3090",), "RTX3090"),
    (("V100", "32GB"), "V100-32GB"), (("V100",), "V100-16GB"), (("T4",), "T4"),
)


def target_args(probe: dict | None, args: argparse.Namespace) -> tuple[list[str], str]:
    """vramtrace's target options and a line saying how they were chosen: --gpu/--gpu-memory as given, else the
    preset the device's name matches, else --gpu-memory with the device's cudaMemGetInfo total."""
    if args.dry_run:
        return ["--device", "cpu"], "dry run: --device cpu"
    if args.gpu or args.gpu_memory:
        chosen = (["--gpu", args.gpu] if args.gpu else []) + (["--gpu-memory", args.gpu_memory] if args.gpu_memory
                                                               else [])
        return chosen, f"target as given: {' '.join(chosen)}"
    if probe is None:
        return ["--gpu", "H100-80GB"], "no device probed: --gpu H100-80GB"
    words = probe["name"].replace("-", " ").split()
    for need, preset in PRESETS:
        if all(any(w.startswith(n) for w in words) for n in need):
            return ["--gpu", preset], f"preset {preset} (matched from {probe['name']!r})"
    return ["--gpu-memory", f"{probe['total']}B"], (f"no preset matches {probe['name']!r}: --gpu-memory "
                                                    f"{probe['total']}B (kernels modelled as H100-80GB's)")


# -- the two sides, each in a process of its own ------------------------------------------------------------------
def _env(alloc_conf: str | None = None, predict: bool = False) -> dict:
    """The child's environment: offline hub, the case's PYTORCH_CUDA_ALLOC_CONF only (the caller's is dropped);
    a prediction gets this checkout's src first on PYTHONPATH and no visible GPU."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if alloc_conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = alloc_conf
    if predict:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
        env["CUDA_VISIBLE_DEVICES"] = ""  # only the measured process may hold a CUDA context
    return env


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else "(no output)"


def predict(cli_args: list[str], out: Path, deadline: float) -> dict:
    """One `vramtrace` CLI run (`python -m vramtrace.cli ...`; its first argument may be `fit`), killed at the
    deadline: its JSON report, or {"error": its last stderr line}."""
    left = deadline - time.monotonic()
    if left <= 1:
        return {"error": "not started: time budget"}
    cmd = [sys.executable, "-m", "vramtrace.cli", *cli_args, "--no-levers", "-q", "--json", str(out)]
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, env=_env(predict=True), capture_output=True, text=True, timeout=left)
    except subprocess.TimeoutExpired:
        return {"error": f"killed at the time budget after {left:.0f} s"}
    if p.returncode != 0 or not out.exists():
        return {"error": _last_line(p.stderr or p.stdout)}
    return {**json.loads(out.read_text()), "seconds": time.monotonic() - t0}


def run_real(case: Case, model: str, device: str, tmp: Path, deadline: float, tag: str = "",
             extra: dict | None = None) -> dict:
    """The case run for real by gpu_check_runner.py in a fresh process: its result (outcome "ran" with the
    figures, "oom"), or outcome "failed" with the runner's last stderr line. `extra`: more runner spec keys
    ("snapshot")."""
    spec_path, result = tmp / f"{case.name}{tag}.spec.json", tmp / f"{case.name}{tag}.result.json"
    spec_path.write_text(json.dumps({**runner_spec(case, model, device), **(extra or {})}))
    left = min(600.0, deadline - time.monotonic())
    try:
        p = subprocess.run([sys.executable, str(RUNNER), str(spec_path), str(result)], env=_env(case.alloc_conf),
                           capture_output=True, text=True, timeout=max(left, 1.0))
    except subprocess.TimeoutExpired:
        return {"outcome": Outcome.FAILED.value, "message": f"killed at the time budget after {left:.0f} s"}
    if p.returncode != 0 or not result.exists():
        return {"outcome": Outcome.FAILED.value, "message": _last_line(p.stderr)}
    real = json.loads(result.read_text())
    if real.get("vramtrace_modules"):  # the truth must not depend on the tool it checks
        return {"outcome": Outcome.FAILED.value, "message": f"the runner imported {real['vramtrace_modules'][:3]}"}
    return real


def probe_device(tmp: Path) -> dict:
    """The device as the runner sees it (its own process: gpu_check itself never initialises CUDA)."""
    out = tmp / "probe.json"
    p = subprocess.run([sys.executable, str(RUNNER), "--probe", str(out)], env=_env(), capture_output=True,
                       text=True, timeout=300)
    if p.returncode != 0 or not out.exists():
        raise RuntimeError(f"the device probe failed: {_last_line(p.stderr)}")
    return json.loads(out.read_text())


# -- the suite -----------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Plan:
    """How this invocation runs: dry (CPU, tiny) or not, predictions only or not, vramtrace's target options, the
    scratch folder and the deadline (time.monotonic())."""
    dry: bool
    predict_only: bool
    target: tuple[str, ...]
    tmp: Path
    deadline: float
    recorded: dict | None = None  # --recorded: RECORDED's content, the "real" side of --predict-only

    @property
    def device(self) -> str:
        return "cpu" if self.dry else "cuda"

    def sized(self, case: Case) -> Case:
        return dry_case(case) if self.dry else case

    def has_time(self, est_s: int) -> bool:
        """Whether a real run estimated at `est_s` seconds on the H100 (dry: at once) ends before the deadline."""
        return time.monotonic() + (0 if self.dry or self.predict_only else est_s) <= self.deadline


def fit_cli_args(plan: Plan, context: int | None) -> tuple[Case, str, list[str]]:
    """The fit boundary's case (sized), model file and `vramtrace fit` arguments; `context`: the measured CUDA
    context in bytes, passed as --cuda-context."""
    case = plan.sized(FIT)
    model = config_file(case, plan.dry, plan.tmp)
    args = ["fit", model, "--seq", str(case.seq), "--precision", case.precision, *plan.target]
    args += ["--gpu-memory", f"{DRY_CAPACITY_BYTES}B"] if plan.dry else []
    args += ["--cuda-context", f"{context}B"] if context is not None else []
    return case, model, args


def run_cases(cases: list[Case], plan: Plan, pool: cf.Executor, want_fit: bool) -> tuple[list, list, dict]:
    """Every case predicted (in `pool`) and run for real (here, one after the other); returns the rows
    (case, its vramtrace arguments, prediction, real result), the skipped cases' lines and the fit's prediction
    state {"future", "args", "case", "model"} (submitted once the context is measured)."""
    skipped, pending, fit = [], [], {}
    for case in cases:
        why = missing_extra(case)
        if why:
            skipped.append(f"{case.name}: {why}")
            continue
        sized = plan.sized(case)
        model = config_file(sized, plan.dry, plan.tmp)
        args = [*vramtrace_args(sized, model), *plan.target]
        pending.append((sized, model, args, pool.submit(predict, args, plan.tmp / f"{case.name}.pred.json",
                                                        plan.deadline)))
    if want_fit and (plan.dry or plan.predict_only):
        context = plan.recorded["fit"]["context"] if plan.recorded else None
        fit = _submit_fit(plan, pool, context, "the recorded H100 run's" if plan.recorded else "")
    rows = []
    for i, (case, model, args, future) in enumerate(pending):
        if not plan.has_time(case.est_s):
            for later in pending[i:]:
                later[3].cancel()
                skipped.append(f"{later[0].name}: time budget (--max-minutes): not run")
            break
        real = (recorded_run(plan.recorded, case.name) if plan.predict_only
                else run_real(case, model, plan.device, plan.tmp, plan.deadline))
        rows.append((case, args, future, real))
        measured = real.get("context")
        if want_fit and not fit and measured is not None and (
                case.name == FIT_CONTEXT_CASE or FIT_CONTEXT_CASE not in {c.name for c in cases}):
            fit = _submit_fit(plan, pool, measured, f"the context {case.name} measured")
    if want_fit and not fit:
        fit = _submit_fit(plan, pool, None)
    return [(c, a, f.result() if not f.cancelled() else {"error": "not run"}, r) for c, a, f, r in rows], skipped, fit


def recorded_run(recorded: dict | None, key: str | int) -> dict:
    """The "real" side of a --predict-only case (`key`: a case name) or fit run (`key`: a batch) from the recorded
    H100 run (`RECORDED`), or "not run" when there is none (or no --recorded)."""
    if recorded is None:
        return {"outcome": Outcome.NOT_RUN.value}
    if isinstance(key, int):
        runs = recorded["fit"]["runs"]
        if str(key) not in runs:
            return {"outcome": Outcome.NOT_RUN.value}
        if runs[str(key)] is None:
            return {"outcome": Outcome.OOM.value, "message": "recorded"}
        allocated, reserved, used = runs[str(key)]
        return {"outcome": Outcome.RAN.value, "allocated": allocated, "reserved": reserved, "device_used": used}
    if key not in recorded["cases"]:
        return {"outcome": Outcome.NOT_RUN.value, "message": "matched to 512 B on the recorded run, figure not kept"}
    entry = recorded["cases"][key]
    if isinstance(entry, dict):  # a --real-only record: the runner's result as it came
        return {"device_name": recorded["device_name"], **entry}
    allocated, reserved = entry
    return {"outcome": Outcome.RAN.value, "allocated": allocated, "reserved": reserved, "context": None,
            "cublas_workspace": None, "device_name": recorded["device_name"]}


def _submit_fit(plan: Plan, pool: cf.Executor, context: int | None, source: str = "") -> dict:
    case, model, args = fit_cli_args(plan, context)
    return {"future": pool.submit(predict, args, plan.tmp / "fit.pred.json", plan.deadline), "args": args,
            "case": case, "model": model, "context": context, "context_source": source}


def fit_boundary(plan: Plan, fit: dict) -> dict:
    """`vramtrace fit`'s answer, then real runs at the answer, +1 and +2 (each in a fresh process)."""
    pred = fit["future"].result()
    out = {**fit, "pred": pred, "runs": []}
    best = pred.get("best") if "error" not in pred else None
    if best is None:
        return out
    for batch in (best["x"], best["x"] + 1, best["x"] + 2):
        if not plan.has_time(FIT_EST_S // 3):
            out["runs"].append((batch, {"outcome": Outcome.SKIPPED.value, "message": "time budget (--max-minutes)"}))
        elif plan.predict_only:
            out["runs"].append((batch, recorded_run(plan.recorded, batch)))
        else:
            sized = dataclasses.replace(fit["case"], batch=batch)
            out["runs"].append((batch, run_real(sized, fit["model"], plan.device, plan.tmp, plan.deadline,
                                                f"-b{batch}")))
    return out


def record_real(cases: list[Case], plan: Plan, fit_batches: list[int], snapshots: set[str], record: Path,
                snapshot_dir: Path | None, probe: dict) -> dict:
    """--real-only: the fit batches first (the runs nearest the capacity), then the cases, each run for real in a
    fresh process; the record (RECORDED's format, cases as the runner's results) is rewritten to `record` after
    every run, so that a run cut short still leaves what it measured. The fit's context is the one the first
    measured case reports (the fit runs' own `device_used` - `reserved`)."""
    versions = ", ".join(f"{k} {v}" for k, v in probe.get("extras", {}).items() if v)
    out = {"source": f"gpu_check --real-only on {probe['name']} ({probe['capability']}), torch {probe['torch']} "
                     f"(CUDA {probe['cuda_version']}), transformers {probe['transformers']}"
                     + (f", {versions}" if versions else "") + "; the runner's protocol (benchmarks/"
                     "gpu_check_runner.py)",
           "device_name": f"{probe['name']} (recorded {time.strftime('%Y-%m-%d', time.gmtime())}, torch "
                          f"{probe['torch']})",
           "total": probe["total"], "cases": {}, "fit": {"context": None, "runs": {}}}

    def spec_extra(name: str) -> dict:
        if name not in snapshots or snapshot_dir is None:
            return {}
        stacks = not name.startswith("llama-gen")  # generation: ~10^5 events; no stacks keeps the file small
        return {"snapshot": {"path": str(snapshot_dir / f"{name}.pickle.gz"), "stacks": stacks}}

    fit_case = plan.sized(FIT)
    fit_model = config_file(fit_case, plan.dry, plan.tmp)
    for batch in fit_batches:
        if not plan.has_time(FIT_EST_S // 3):
            break
        sized = dataclasses.replace(fit_case, batch=batch)
        real = run_real(sized, fit_model, plan.device, plan.tmp, plan.deadline, f"-b{batch}",
                        spec_extra(f"fit-{batch}"))
        print(f"fit batch {batch}: {json.dumps(real)}", flush=True)
        ran = real.get("outcome") == Outcome.RAN.value
        out["fit"]["runs"][str(batch)] = [real["allocated"], real["reserved"], real["device_used"]] if ran else None
        if ran and out["fit"]["context"] is None:
            out["fit"]["context"] = real["context"]
        record.write_text(json.dumps(out, indent=1))
    for case in cases:
        why = missing_extra(case)
        if why or not plan.has_time(case.est_s):
            print(f"{case.name}: {why or 'time budget (--max-minutes): not run'}", flush=True)
            continue
        real = run_real(case, config_file(case, plan.dry, plan.tmp), plan.device, plan.tmp, plan.deadline,
                        extra=spec_extra(case.name))
        real.pop("vramtrace_modules", None)
        print(f"{case.name}: {json.dumps(real)}", flush=True)
        out["cases"][case.name] = real
        record.write_text(json.dumps(out, indent=1))
    return out


# -- the table -----------------------------------------------------------------------------------------------------
COLUMNS = ("case", "predicted allocated", "real allocated", "error allocated", "predicted reserved", "real reserved",
           "error reserved", "context", "cuBLAS workspace", "device")


def _n(value: int | None, dry: bool) -> str:
    return NA if value is None and dry else "—" if value is None else f"{value:,}"


def _err(pred: int | None, real: int | None, dry: bool) -> str:
    if pred is None or real is None:
        return NA if dry else "—"
    diff = pred - real
    return f"{diff:+,} B ({100 * diff / real:+.3f}%)" if real else f"{diff:+,} B"


def row_cells(case: Case, pred: dict, real: dict, dry: bool) -> list[str]:
    """One table row: the predicted and real peaks, the errors (predicted minus real), the measured context and
    cuBLAS workspaces (with the prediction's workspaces at its peak), the device."""
    p_alloc = pred.get("peak_allocated_bytes")
    p_res = pred.get("peak_reserved_bytes")
    p_cublas = (pred.get("breakdown_at_peak") or {}).get("cublas_workspace")
    if "error" in pred:
        p_alloc_cell = p_res_cell = f"error: {pred['error']}"
    else:
        p_alloc_cell, p_res_cell = _n(p_alloc, dry), _n(p_res, dry)
    if real.get("outcome") != Outcome.RAN.value:
        what = real.get("outcome", "?") + (f": {real['message']}" if real.get("message") else "")
        return [case.name, p_alloc_cell, what, "—", p_res_cell, "—", "—", "—", "—", "—"]
    r_alloc, r_res = real["allocated"], real["reserved"]
    cublas = _n(real["cublas_workspace"], dry)
    if real["cublas_workspace"] is not None or not dry:
        cublas += f" (predicted at peak {_n(p_cublas, dry)})"
    return [case.name, p_alloc_cell, _n(r_alloc, dry), _err(p_alloc, r_alloc, dry), p_res_cell, _n(r_res, dry),
            _err(p_res, r_res, dry), _n(real["context"], dry), cublas, real["device_name"]]


def model_label(case: Case, dry: bool) -> str:
    """How the table names the case's model file: the bundled config (or its tiny double) and the layers."""
    if case.model == "mha":
        return "benchmarks/gpu_evidence/mha_model.py:MHANet"
    if dry:
        kind, stem, overrides = TINY[case.model]
        return f"fixtures/configs/{stem}.json" if kind == "fixture" else f"{stem}.json with tiny dimensions"
    layers = f" with num_hidden_layers {case.layers}" if case.layers is not None else ""
    return f"{case.model}.json{layers}"


def shown_args(args: list[str], case: Case, dry: bool) -> str:
    return " ".join(f"[{model_label(case, dry)}]" if a.endswith(".json") or a.endswith(":MHANet") else a
                    for a in args)


def _table(header: tuple[str, ...], rows: list[list[str]]) -> list[str]:
    align = ["---"] + ["---:" if h not in ("device", "real") else "---" for h in header[1:]]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    return lines + ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in rows]


def fit_lines(fit: dict, dry: bool) -> list[str]:
    """The fit boundary's section: the command, its answer, the real runs."""
    pred, case = fit["pred"], fit["case"]
    what = model_label(case, dry)
    lines = ["", f"## Fit boundary: {what}, seq {case.seq}, {case.precision}, AdamW", "",
             f"`vramtrace {shown_args(fit['args'], case, dry)} --no-levers` (--cuda-context: "
             f"{fit['context_source'] or 'not given: vramtrace default'})", ""]
    if "error" in pred:
        return lines + [f"vramtrace fit failed: {pred['error']}"]
    best, nxt = pred.get("best"), pred.get("next")
    if best is None:
        return lines + ["vramtrace fit: nothing fits (no real runs)."]
    lines.append(f"Answer: batch {best['x']} (predicted peak allocated {_n(best['peak_allocated_bytes'], dry)}, "
                 f"reserved {_n(best['peak_reserved_bytes'], dry)}); capacity {pred['capacity_bytes']:,} B, basis: "
                 f"{pred['basis']}." + (f" Next, batch {nxt['x']}: allocated {_n(nxt['peak_allocated_bytes'], dry)}, "
                                        f"reserved {_n(nxt['peak_reserved_bytes'], dry)}, fits {nxt['fits']}."
                                        if nxt else ""))
    rows = []
    for batch, real in fit["runs"]:
        if real.get("outcome") == Outcome.RAN.value and dry:
            verdict = "fits" if real["allocated"] <= pred["capacity_bytes"] else "over the capacity"
            outcome = f"ran on the CPU: {verdict}"
        else:
            outcome = real.get("outcome", "?") + (f": {real['message']}" if real.get("message") else "")
        rows.append([str(batch), outcome, _n(real.get("allocated"), dry), _n(real.get("reserved"), dry),
                     _n(real.get("device_used"), dry)])
    return lines + [""] + _table(("batch", "real", "peak allocated", "peak reserved", "device used"), rows)


def render(head: list[str], rows: list, skipped: list[str], fit: dict | None, dry: bool) -> str:
    """The whole markdown document: the header lines, the table, the cases' commands, skipped cases, the fit."""
    lines = [*head, ""] + _table(COLUMNS, [row_cells(c, p, r, dry) for c, _, p, r in rows])
    lines += ["", "Commands (beside `--no-levers --json`; [the model file]):", ""]
    lines += [f"- {c.name}: `vramtrace {shown_args(args, c, dry)}`" for c, args, _, _ in rows]
    if skipped:
        lines += ["", "Skipped:", ""] + [f"- {s}" for s in skipped]
    if fit is not None:
        lines += fit_lines(fit, dry)
    return "\n".join(lines) + "\n"


# -- the command ---------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the markdown table to this file as well (default: print only)")
    ap.add_argument("--cases", help="comma-separated case names (--list), 'fit' for the fit boundary "
                                    "(default: all and the fit)")
    ap.add_argument("--list", action="store_true", help="list the cases with their estimated H100 seconds and exit")
    ap.add_argument("--dry-run", action="store_true", help="the CPU: tiny configs, profiler truth, --device cpu")
    ap.add_argument("--predict-only", action="store_true", help="only the predictions of the GPU cases (no GPU)")
    ap.add_argument("--recorded", nargs="?", const=str(RECORDED), metavar="FILE",
                    help="with --predict-only: compare with a recorded run (default: the H100 record in "
                         "benchmarks/gpu_evidence/; FILE: a --real-only --record file)")
    ap.add_argument("--real-only", action="store_true",
                    help="the GPU: real runs only (no vramtrace here), written to --record")
    ap.add_argument("--record", metavar="FILE", help="with --real-only: where the record is written")
    ap.add_argument("--fit-batches", default="21,22,23,24,25",
                    help="with --real-only: the fit config's batches run for real (default 21,22,23,24,25)")
    ap.add_argument("--snapshot", default="", metavar="NAMES",
                    help="with --real-only: comma-separated runs (case names, fit-B) whose allocator history is "
                         "saved to --snapshot-dir")
    ap.add_argument("--snapshot-dir", metavar="DIR", help="where --snapshot writes NAME.pickle.gz")
    ap.add_argument("--max-minutes", type=float, default=8.0, help="time budget; later cases are skipped (default 8)")
    ap.add_argument("--jobs", type=int, default=max(1, min(4, (os.cpu_count() or 2) // 4)),
                    help="predictions run at once beside the real runs (default: CPU cores / 4, at most 4)")
    ap.add_argument("--gpu", help="vramtrace's --gpu preset (default: matched from the device's name)")
    ap.add_argument("--gpu-memory", help="vramtrace's --gpu-memory, e.g. 81079MiB (default: the preset's)")
    args = ap.parse_args(argv)
    if args.dry_run and args.predict_only:
        ap.error("--dry-run and --predict-only exclude each other")
    if args.recorded and not args.predict_only:
        ap.error("--recorded goes with --predict-only")
    if args.real_only and (args.dry_run or args.predict_only or not args.record):
        ap.error("--real-only needs --record FILE and excludes --dry-run and --predict-only")
    if args.snapshot and not (args.real_only and args.snapshot_dir):
        ap.error("--snapshot goes with --real-only and --snapshot-dir")
    if args.jobs < 1 or args.max_minutes <= 0:
        ap.error("--jobs must be at least 1 and --max-minutes above 0")
    return args


def select(names: str | None) -> tuple[list[Case], bool]:
    """The cases `--cases` names, in the suite's order, and whether the fit boundary is asked for.
    Raises ValueError naming an unknown case and the known ones."""
    if names is None:
        return list(CASES), True
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    known = {c.name for c in CASES} | {"fit"}
    unknown = [n for n in wanted if n not in known]
    if unknown or not wanted:
        raise ValueError(f"unknown case {', '.join(unknown) or '(none given)'}; known: {', '.join(sorted(known))}")
    return [c for c in CASES if c.name in wanted], "fit" in wanted


def header(args: argparse.Namespace, probe: dict | None, target_line: str) -> list[str]:
    git = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    rev = git.stdout.strip() or "unknown"
    title = ("# gpu_check: DRY RUN on the CPU (tiny configs; not GPU figures)" if args.dry_run else
             "# gpu_check: vramtrace predictions against the recorded H100 run" if args.recorded else
             "# gpu_check: vramtrace predictions only (no real run)" if args.predict_only else
             "# gpu_check: vramtrace predictions against real runs")
    lines = [title, "", f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, vramtrace at {rev}; "
                        f"vramtrace target: {target_line}."]
    if args.dry_run:
        lines.append("Truth on the CPU: the bytes alive at step start plus torch.profiler's allocator events "
                     "(two warm-up steps, then the measured one); the CPU has no reserved, context or cuBLAS figure.")
    if args.recorded:
        lines.append(f"Real side: {json.loads(Path(args.recorded).read_text())['source']}. Error = predicted - "
                     f"real.")
    if probe:
        lines.append(f"Device: {probe['name']} ({probe['capability']}), cudaMemGetInfo total {probe['total']:,} B, "
                     f"used by the probe's process {probe['used_at_start']:,} B; torch {probe['torch']} (CUDA "
                     f"{probe['cuda_version']}), transformers {probe['transformers']}.")
        lines.append("Truth: max_memory_allocated() of the measured step (after two warm-ups), max_memory_reserved() "
                     "over the run; context = cudaMemGetInfo used - memory_reserved(); cuBLAS workspace = what "
                     "torch._C._cuda_clearCublasWorkspaces() frees after the step. Error = predicted - real.")
    return lines


def list_cases() -> None:
    for c in CASES:
        extra = f" (needs {c.extra.value})" if c.extra else ""
        print(f"{c.name:30} ~{c.est_s:3d} s  {shown_args(vramtrace_args(c, c.model + '.json'), c, False)}{extra}")
    print(f"{'fit':30} ~{FIT_EST_S:3d} s  vramtrace fit [{model_label(FIT, False)}] --seq {FIT.seq} --precision "
          f"{FIT.precision}, then real runs at the answer, +1, +2")
    print(f"estimated real-run time on one H100: {sum(c.est_s for c in CASES) + FIT_EST_S} s (predictions run "
          f"beside them)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cases, want_fit = select(args.cases)
    except ValueError as e:
        print(f"Error: {e}", file=sys.stderr)
        return 2
    if args.list:
        list_cases()
        return 0
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as scratch:
        tmp, probe = Path(scratch), None
        if not (args.dry_run or args.predict_only):
            try:
                probe = probe_device(tmp)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                print(f"Error: {e}", file=sys.stderr)
                return 1
            if not probe["cuda"]:
                print("Error: no CUDA device (torch.cuda.is_available() is False in the runner's process); use "
                      "--dry-run to exercise the harness on the CPU, or --predict-only", file=sys.stderr)
                return 1
        if args.real_only:
            snap_dir = Path(args.snapshot_dir) if args.snapshot_dir else None
            if snap_dir:
                snap_dir.mkdir(parents=True, exist_ok=True)
            plan = Plan(False, False, (), tmp, t0 + 60 * args.max_minutes)
            batches = [int(b) for b in args.fit_batches.split(",") if b.strip()] if want_fit else []
            record_real(cases, plan, batches, {n.strip() for n in args.snapshot.split(",") if n.strip()},
                        Path(args.record), snap_dir, probe)
            print(f"record written to {args.record} in {time.monotonic() - t0:.0f} s")
            return 0
        target, target_line = target_args(probe, args)
        recorded = json.loads(Path(args.recorded).read_text()) if args.recorded else None
        plan = Plan(args.dry_run, args.predict_only, tuple(target), tmp, t0 + 60 * args.max_minutes, recorded)
        with cf.ThreadPoolExecutor(args.jobs) as pool:
            rows, skipped, fit = run_cases(cases, plan, pool, want_fit)
            fit_done = fit_boundary(plan, fit) if fit else None
        head = header(args, probe, target_line)
        head.append(f"Wall time {time.monotonic() - t0:.0f} s (budget {args.max_minutes:g} min, {args.jobs} "
                    f"prediction job(s) at once).")
        text = render(head, rows, skipped, fit_done, args.dry_run)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
