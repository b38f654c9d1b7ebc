"""Compare, per FSDP2 rank, vramtrace's peak, PyTorch's FSDPMemTracker peak and the real gloo run's peak.

Reproduce: python benchmarks/bench_fsdp_memtracker.py   (CPU only, sets HF_HUB_OFFLINE=1; about 40 s)
Cases: tiny-gpt2 and tiny-llama-gqa (fixtures/configs) x fp32 and bf16-mixed x reshard_after_forward True/False,
FSDP2 on 2 ranks (`fully_shard` on each decoder layer, then the root; bf16-mixed = MixedPrecisionPolicy(
param_dtype=bf16, reduce_dtype=fp32), no autocast), batch 2 and seq 16 per rank, torch.optim.AdamW (defaults; the
oracle's lr=1e-4), the loop `loss = model(**inputs).loss; loss.backward(); optim.step();
optim.zero_grad(set_to_none=True)`. Every column is rank 0's peak of the steady-state (second) step, in bytes.

Columns:
- vramtrace: `analyze(RunSpec(model, batch=2, seq=16, device="cpu", precision, fsdp=2, rank=0,
  reshard_after_forward)).peak_allocated_bytes`, the traced prediction (the script's only use of vramtrace).
- FSDPMemTracker: torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker on the same program on one fake rank:
  `dist.init_process_group("fake", rank=0, world_size=2)`, the model built on meta (AutoConfig.from_pretrained +
  AutoModelForCausalLM.from_config) and fully_shard'ed, then under FakeTensorMode(allow_non_fake_inputs=True)
  `to_empty(device="cpu")`, the inputs (input_ids = labels = randint(0, vocab, (2, 16))), the optimizer,
  `FSDPMemTracker(model, optim)`, `track_inputs`; a warm-up step inside `with tracker:`, `reset_mod_stats()`, the
  measured step inside a second `with tracker:`, and `get_tracker_snapshot("peak")[cpu]["Total"]`. The tracker is
  exited and re-entered because `reset_mod_stats()` clears only the per-module stats, while entering sets the
  global peak to the bytes tracked at that moment (fsdp2_mem_tracker.py `__enter__`): one `with` around both steps
  would report the larger of the two steps. A line below the table says when the warm-up's peak was higher.
  What it counts: the storages of the tensors every dispatched op returns (fake tensors: exact sizes, no rounding
  on the CPU), plus the sharded parameters, buffers, inputs and optimizer states; not what a collective allocates
  inside the process group (the fake one allocates nothing).
- real gloo (rank 0): tests/oracle.py `measure_cpu_peak_ranks`, two CPU processes over gloo running the step for
  real: the storages alive before the warm-up plus torch.profiler's allocator events, maximised over the measured
  step; gloo's own CPU temporaries (the all-gather's flat output, the reduce-scatter's clone of its input) count.
- vramtrace err, FSDPMemTracker err: (column - real gloo) / real gloo.
A column that fails prints `-` and one line below the table with the error and the source line that raised it.
"""

from __future__ import annotations

import itertools
import os
import sys
import traceback
import types
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

WORLD, BATCH, SEQ = 2, 2, 16


def _where(exc: BaseException) -> str:
    """The exception and the innermost source line that raised it."""
    frame = traceback.extract_tb(exc.__traceback__)[-1]
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''} ({frame.filename}:{frame.lineno})"


def memtracker_peak(path: str, precision: str, reshard: bool) -> tuple[int, int]:
    """FSDPMemTracker's peak on rank 0 of a fake 2-rank run, and its peak after the warm-up step alone."""
    import torch.distributed as dist
    import transformers
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dist.init_process_group("fake", rank=0, world_size=WORLD)
    try:
        config = transformers.AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        model.train()
        kw = {"reshard_after_forward": reshard}
        if precision == "bf16-mixed":
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        layers = next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList))  # gpt2 .h, llama .layers
        for module in (*layers, model):
            fully_shard(module, **kw)
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device="cpu")
            ids = torch.randint(0, config.vocab_size, (BATCH, SEQ))
            inputs = {"input_ids": ids, "labels": ids}
            optim = torch.optim.AdamW(model.parameters())
            tracker = FSDPMemTracker(model, optim)
            tracker.track_inputs((inputs,))

            def step() -> None:
                loss = model(**inputs).loss
                loss.backward()
                optim.step()
                optim.zero_grad(set_to_none=True)

            cpu = torch.device("cpu")
            with tracker:
                step()  # warm-up: AdamW makes its state
            warm = tracker.get_tracker_snapshot("peak")[cpu]["Total"]
            tracker.reset_mod_stats()
            with tracker:  # entering sets the peak to the bytes tracked now (fsdp2_mem_tracker.py __enter__)
                step()
            return tracker.get_tracker_snapshot("peak")[cpu]["Total"], warm
    finally:
        dist.destroy_process_group()


def vramtrace_peak(path: str, precision: str, reshard: bool) -> int:
    """vramtrace's predicted peak of rank 0 (the only use of vramtrace here)."""
    from vramtrace import RunSpec, analyze

    return analyze(RunSpec(path, batch=BATCH, seq=SEQ, device="cpu", precision=precision, fsdp=WORLD, rank=0,
                           reshard_after_forward=reshard)).peak_allocated_bytes


def real_peak(path: str, precision: str, reshard: bool) -> int:
    """Rank 0's measured peak of the real gloo run; the case is given to the oracle as its plain fields (it reads
    nothing else), so this column does not go through vramtrace."""
    from oracle import measure_cpu_peak_ranks

    case = types.SimpleNamespace(model=path, batch=BATCH, seq=SEQ, mode="train", precision=precision,
                                 optimizer="adamw", optimizer_impl="default", device="cpu", checkpointing="none",
                                 fsdp=WORLD, reshard_after_forward=reshard)
    return measure_cpu_peak_ranks(case)[0]


def main() -> None:
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    failures: list[str] = []
    print("| model | precision | reshard_after_forward | vramtrace | FSDPMemTracker | real gloo (rank 0) "
          "| vramtrace err | FSDPMemTracker err |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for name, precision, reshard in itertools.product(["tiny-gpt2", "tiny-llama-gqa"], ["fp32", "bf16-mixed"],
                                                      [True, False]):
        label = f"{name} | {precision} | {reshard}"
        path = str(ROOT / "fixtures" / "configs" / f"{name}.json")
        values: dict[str, int | None] = {}
        for column, run in (("FSDPMemTracker", lambda: memtracker_peak(path, precision, reshard)),
                            ("vramtrace", lambda: vramtrace_peak(path, precision, reshard)),
                            ("real gloo", lambda: real_peak(path, precision, reshard))):
            try:
                values[column] = run()
            except Exception as exc:  # noqa: BLE001 - reported below the table, the other columns still run
                values[column] = None
                failures.append(f"{label.replace(' | ', ', ')}: {column} failed: {_where(exc)}")
        if values["FSDPMemTracker"] is not None:
            peak, warm = values["FSDPMemTracker"]
            values["FSDPMemTracker"] = peak
            if warm > peak:
                failures.append(f"{label.replace(' | ', ', ')}: FSDPMemTracker's warm-up step peaked at {warm:,} "
                                f"(measured step: {peak:,}); one `with` around both steps would report the former")
        real = values["real gloo"]
        cell = lambda v: "-" if v is None else f"{v:,}"  # noqa: E731
        err = lambda v: "-" if v is None or not real else f"{100 * (v - real) / real:+.3f}%"  # noqa: E731
        print(f"| {label} | {cell(values['vramtrace'])} | {cell(values['FSDPMemTracker'])} | {cell(real)} "
              f"| {err(values['vramtrace'])} | {err(values['FSDPMemTracker'])} |", flush=True)
    for line in failures:
        print(line)


if __name__ == "__main__":
    main()
