"""gpu_check's real runner: one case built and run for real in this process, its memory measured.

Usage (gpu_check.py calls it, one fresh process per case, so each has its own CUDA context and allocator):
    python benchmarks/gpu_check_runner.py SPEC.json RESULT.json     # run the case SPEC describes
    python benchmarks/gpu_check_runner.py --probe RESULT.json        # the device: name, total, versions

This file imports nothing from vramtrace (tests/test_gpu_check.py checks its imports, and the result names any
vramtrace module found in sys.modules at the end). It builds everything from public APIs, as a user writes it:
`AutoConfig.for_model` + `AutoModelFor<task>.from_config` on the device (random weights, seed 0), or the custom
module file's class; `torch.optim.AdamW` (torch's default implementation: foreach on CUDA, for-loop on the CPU)
or bitsandbytes' `bnb.optim.AdamW(optim_bits=8)`; peft's `get_peft_model(model, LoraConfig(r=R))`; transformers'
`gradient_checkpointing_enable(use_reentrant=False)`; the literal loop
`with torch.autocast(...): loss = model(**batch).loss; loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)`
with the forward and backward in a function of their own, as HF Trainer's `training_step` (the loss is freed before
`opt.step()`, the loop vramtrace's default `--loop trainer` models); loss / N and one optimizer step per N
micro-batches with gradient accumulation; `torch.amp.GradScaler` for fp16-mixed; `model.generate(...)` for
generation (greedy, `max_new_tokens = min_new_tokens = N`, `disable_compile=True`).

Measurement on CUDA (the protocol of the H100 evidence): two warm-up steps, `torch.cuda.reset_peak_memory_stats()`,
one measured step; peak allocated = `max_memory_allocated()` of the measured step, peak reserved =
`max_memory_reserved()` over the whole run (read before the reset as well), context = cudaMemGetInfo's used
(`torch.cuda.mem_get_info`) minus `memory_reserved()` after the step, cuBLAS workspaces = the drop of
`memory_allocated()` when `torch._C._cuda_clearCublasWorkspaces()` frees them after the step (CublasHandlePool.cpp
`clearCublasWorkspaces`). A `torch.OutOfMemoryError` is an outcome ("oom"), not a crash.

Measurement on the CPU (gpu_check's dry mode): the bytes of the storages alive before the warm-up (parameters,
buffers, inputs) plus the running sum of torch.profiler's allocator events (`profile_memory=True`) from the first
warm-up on, maximised over the measured step (a marker allocation splits the steps). No reserved, context or
cuBLAS figure on the CPU.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import itertools
import json
import re
import sys
import time
import warnings
from pathlib import Path

import torch
import transformers

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MIXED = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}
AUTO = {"causal-lm": "AutoModelForCausalLM", "seq2seq-lm": "AutoModelForSeq2SeqLM",
        "sequence-classification": "AutoModelForSequenceClassification",
        "image-classification": "AutoModelForImageClassification"}
MARKER_BYTES = 1_234_577  # a size no case allocates: marks where the CPU's measured step starts


def _custom(ref: str):
    """`path/file.py:NAME`: the file imported with importlib, the class NAME."""
    path, _, name = ref.rpartition(":")
    spec = importlib.util.spec_from_file_location(f"gpu_check_custom_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


def build_model(spec: dict, device: torch.device) -> torch.nn.Module:
    """The case's model on `device` with random weights (seed 0): fp32 weights under a mixed precision (autocast
    computes in the low one), the precision's dtype otherwise."""
    dtype = torch.float32 if spec["precision"] in MIXED else DTYPES[spec["precision"]]
    torch.manual_seed(0)
    if re.search(r"\.py:\w+$", spec["model"]):
        with device:
            return _custom(spec["model"])().to(dtype)
    cfg = json.loads(Path(spec["model"]).read_text())
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with device:
        return getattr(transformers, AUTO[spec["task"]]).from_config(config, dtype=dtype)


def make_batch(model: torch.nn.Module, spec: dict, device: torch.device) -> dict:
    """The keyword inputs a user feeds this head: input_ids (B, S) and labels, or pixel_values (B, C, H, W) and
    class labels (B,), or the custom module's `--input`-style tensors (float only: NAME=float32[B,S,256])."""
    b, s = spec["batch"], spec["seq"]
    dtype = torch.float32 if spec["precision"] in MIXED else DTYPES[spec["precision"]]
    if spec.get("inputs"):
        batch = {}
        for text in spec["inputs"]:
            name, dims = re.fullmatch(r"(\w+)=float32\[([^\]]*)\]", text).groups()
            shape = [b if d == "B" else s if d == "S" else int(d) for d in dims.split(",")]
            batch[name] = torch.randn(shape, device=device, dtype=dtype)
        return batch
    config = model.config
    if spec["task"] == "image-classification":
        size = config.image_size
        return {"pixel_values": torch.randn(b, config.num_channels, size, size, device=device, dtype=dtype),
                "labels": torch.randint(0, config.num_labels, (b,), device=device)}
    ids = torch.randint(0, config.vocab_size, (b, s), device=device)  # (B, S)
    if spec["mode"] == "generate":  # a tokenizer's output for unpadded prompts
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if spec["task"] == "sequence-classification":
        return {"input_ids": ids, "labels": torch.randint(0, config.num_labels, (b,), device=device)}
    return {"input_ids": ids, "labels": ids}


def prepare(model: torch.nn.Module, spec: dict) -> torch.nn.Module:
    """LoRA (peft) and activation checkpointing (transformers), as a user applies them before training."""
    if spec.get("lora_rank"):
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=spec["lora_rank"]))
    if spec.get("checkpointing", "none") == "layers":
        with warnings.catch_warnings():  # transformers 5.23 renamed it activation_checkpointing_enable
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train(spec["mode"] == "train")
    return model


def make_optimizer(spec: dict, params: list):
    """torch.optim.AdamW with torch's default implementation, or bitsandbytes' 8-bit AdamW as HF Trainer builds
    it for optim="adamw_bnb_8bit"."""
    if spec.get("optimizer", "adamw") == "adamw-8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW(params, lr=1e-4, optim_bits=8, is_paged=False)
    return torch.optim.AdamW(params, lr=1e-4)


def make_step(spec: dict, device: torch.device):
    """The case built for real; returns (step, alive): `step()` runs one literal step, `alive()` the tensors alive
    before the first one (parameters, buffers, inputs)."""
    model = prepare(build_model(spec, device), spec)
    batch = make_batch(model, spec, device)
    mixed = MIXED.get(spec["precision"])
    autocast = (lambda: torch.autocast(device.type, dtype=mixed)) if mixed else contextlib.nullcontext
    custom = bool(spec.get("inputs"))

    def alive() -> list:
        return [*model.parameters(), *model.buffers(), *batch.values()]

    if spec["mode"] == "generate":
        cache = "static" if spec["cache"] == "static" else None
        # disable_compile: on CUDA transformers compiles a static cache's decode step itself
        # (generation/utils.py `_valid_auto_compile_criteria`); the eager step is the one compared.
        kw = dict(max_new_tokens=spec["new_tokens"], min_new_tokens=spec["new_tokens"], do_sample=False,
                  cache_implementation=cache, disable_compile=True)

        def generate() -> None:
            with autocast():
                out = model.generate(**batch, **kw)
            del out
        return generate, alive
    opt = make_optimizer(spec, [p for p in model.parameters() if p.requires_grad])
    scaler = torch.amp.GradScaler(device.type) if spec["precision"] == "fp16-mixed" else None
    n = spec.get("grad_accum", 1)

    def micro_step() -> None:  # HF Trainer's training_step: the loss dies when it returns, before opt.step()
        with autocast():
            loss = model(**batch).mean() if custom else model(**batch).loss
        if n > 1:
            loss = loss / n
        (scaler.scale(loss) if scaler is not None else loss).backward()

    def train_step() -> None:
        for _ in range(n):
            micro_step()
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
    return train_step, alive


def measure_cuda(step) -> dict:
    """Two warm-up steps, then one measured step (the H100 evidence's protocol); bytes as ints."""
    step()
    step()
    torch.cuda.synchronize()
    reserved_before = torch.cuda.max_memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    allocated = torch.cuda.max_memory_allocated()
    reserved = max(reserved_before, torch.cuda.max_memory_reserved())
    free, total = torch.cuda.mem_get_info()
    context = (total - free) - torch.cuda.memory_reserved()
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    cublas = None
    if clear is not None:
        held = torch.cuda.memory_allocated()
        clear()
        cublas = held - torch.cuda.memory_allocated()
    return {"allocated": allocated, "reserved": reserved, "context": context, "cublas_workspace": cublas,
            "device_used": reserved + context, "total": total}


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
    return total


def measure_cpu(step, alive) -> dict:
    """Bytes alive before the warm-ups plus the running sum of the profiler's allocator events, maximised over the
    measured step (after two warm-ups, as on CUDA)."""
    start = _storage_bytes(alive())
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
        step()
        marker = torch.empty(MARKER_BYTES, dtype=torch.uint8)
        del marker
        step()
    warm, measured, measuring = [], [], False
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    for e in events:
        if e.nbytes() == MARKER_BYTES:
            measuring = True
        elif not (measuring and e.nbytes() == -MARKER_BYTES):
            (measured if measuring else warm).append(e.nbytes())
    running = list(itertools.accumulate(measured, initial=sum(warm)))
    peak = start + (max(running[1:]) if measured else running[0])
    return {"allocated": peak, "reserved": None, "context": None, "cublas_workspace": None, "device_used": None,
            "total": None}


@contextlib.contextmanager
def recording(snapshot: dict | None):
    """With `snapshot` ({"path": P, "stacks": bool}) on CUDA: the allocator's history recorded from here (before the
    model is built) to the end of the run, written to P as a gzip of `torch.cuda.memory._snapshot()`'s pickle, for
    PyTorch's memory_viz or a replay of `device_traces[0]`; the allocations' python stacks (5 innermost frames)
    with stacks, none without (`_record_memory_history(context=None)`). Written on an out-of-memory error too."""
    if not snapshot:
        yield
        return
    import gzip
    import pickle

    torch.cuda.init()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, context="alloc" if snapshot["stacks"] else None,
                                             stacks="python")
    try:
        yield
    finally:
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        for entry in [*(e for trace in snap["device_traces"] for e in trace),
                      *(b for seg in snap["segments"] for b in seg["blocks"])]:
            if entry.get("frames"):
                entry["frames"] = entry["frames"][:5]
        with gzip.open(snapshot["path"], "wb") as f:
            pickle.dump(snap, f)


def run_case(spec: dict) -> dict:
    """The case run and measured on its device; an out-of-memory error is the outcome "oom"."""
    device = torch.device(spec["device"])
    t0 = time.perf_counter()
    try:
        with recording(spec.get("snapshot") if device.type == "cuda" else None):
            step, alive = make_step(spec, device)
            figures = measure_cuda(step) if device.type == "cuda" else measure_cpu(step, alive)
    except torch.OutOfMemoryError as e:
        return {"outcome": "oom", "message": str(e).splitlines()[0][:300], "seconds": time.perf_counter() - t0}
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (dry run)"
    return {"outcome": "ran", "device_name": name, "seconds": time.perf_counter() - t0, **figures}


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def probe() -> dict:
    """The device, read in a process of its own so that gpu_check's own process never creates a CUDA context."""
    info = {"cuda": torch.cuda.is_available(), "torch": torch.__version__, "cuda_version": torch.version.cuda,
            "transformers": transformers.__version__,
            "extras": {m: _version(m) for m in ("peft", "bitsandbytes")}}
    if info["cuda"]:
        free, total = torch.cuda.mem_get_info()
        major, minor = torch.cuda.get_device_capability()
        info.update(name=torch.cuda.get_device_name(), total=total, used_at_start=total - free,
                    capability=f"sm{major}{minor}")
    return info


def main(argv: list[str]) -> int:
    if argv[:1] == ["--probe"]:
        result = probe()
        out = argv[1]
    else:
        spec, out = json.loads(Path(argv[0]).read_text()), argv[1]
        result = run_case(spec)
    result["vramtrace_modules"] = sorted(m for m in sys.modules if m.split(".")[0] == "vramtrace")
    Path(out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
