"""Print predicted vs measured (CPU profiler allocator) peaks for the tiny fixtures, as markdown tables.

Reproduce: python benchmarks/accuracy_cpu.py   (and ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 python benchmarks/accuracy_cpu.py)
Tables: precisions and modes (batch 2, seq 32); activation checkpointing policies (batch 4, seq 64, the real
run applies the same policy); layer replication (6 layers: 4 traced, all 6 rebuilt); torch.nn attention
modules; custom modules, LoRA, frozen weights, MoE. The first line names the CPU, the oneDNN ISA cap and the
thread count the figures depend on. The truth is tests/oracle.py (public APIs only).
"""

from __future__ import annotations

import itertools
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from conftest import deep_config  # noqa: E402
from oracle import measure_cpu_peak  # noqa: E402

from vramtrace import RunSpec, analyze  # noqa: E402
from vramtrace.tracer.profiling import cpu_environment  # noqa: E402


def _row(label: str, spec: RunSpec) -> None:
    pred = analyze(spec).peak_allocated_bytes
    meas = measure_cpu_peak(spec)
    print(f"| {label} | {pred:,} | {meas:,} | {100 * (pred - meas) / meas:+.3f}% |", flush=True)


def main() -> None:
    fixture = lambda name: str(ROOT / "fixtures" / "configs" / f"{name}.json")  # noqa: E731
    env = cpu_environment()
    print(f"Measured on {env['cpu']} ({env['cpu_flags']}), oneDNN ISA {env['onednn_max_isa']}, ATen "
          f"{env['aten_capability']}, {env['threads']} threads, torch {env['torch']}\n")
    print("| config | mode | precision | predicted bytes | measured bytes | error |")
    print("|---|---|---|---:|---:|---:|")
    cases = itertools.product(["tiny-gpt2", "tiny-llama-gqa", "tiny-bert"],
                              [("train", "fp32"), ("train", "bf16-mixed"), ("train", "bf16"),
                               ("inference", "fp32"), ("inference", "bf16")])
    for cfg, (mode, prec) in cases:
        _row(f"{cfg} | {mode} | {prec}", RunSpec(fixture(cfg), batch=2, seq=32, device="cpu", precision=prec,
                                                  mode=mode))
    tmp = Path(tempfile.mkdtemp())
    print("\n| config | checkpointing | precision | predicted bytes | measured bytes | error |")
    print("|---|---|---|---:|---:|---:|")
    for cfg, policy, prec in [(c, p, pr) for c in ("tiny-gpt2", "tiny-llama-gqa", "tiny-bert")
                              for p in ("none", "layers", "selective") for pr in ("fp32", "bf16-mixed")]:
        _row(f"{cfg} | {policy} | {prec}", RunSpec(fixture(cfg), batch=4, seq=64, device="cpu", precision=prec,
                                                   checkpointing=policy))
    for policy in ("every:2", "nth:2"):
        _row(f"tiny-llama-gqa, 4 layers | {policy} | fp32", RunSpec(
            deep_config(tmp, "tiny-llama-gqa", 4), batch=4, seq=64, device="cpu", precision="fp32",
            checkpointing=policy))
    print("\n| config (6 layers, 4 traced) | checkpointing | predicted bytes | measured bytes | error |")
    print("|---|---|---:|---:|---:|")
    for cfg in ("tiny-gpt2", "tiny-llama-gqa", "tiny-bert"):
        for policy in ("none", "layers"):
            _row(f"{cfg} | {policy}", RunSpec(deep_config(tmp, cfg, 6), batch=4, seq=64, device="cpu",
                                              precision="fp32", checkpointing=policy))
    custom = ROOT / "fixtures" / "custom"
    print("\n| torch.nn module (d=64, 4 heads) | mode | precision | predicted bytes | measured bytes | error |")
    print("|---|---|---|---:|---:|---:|")
    for module, mode, prec in itertools.product(["MHA", "Encoder"], ["train", "inference"], ["fp32", "bf16-mixed"]):
        _row(f"{module} | {mode} | {prec}", RunSpec(f"{custom}/attention.py:{module}", batch=2, seq=256,
                                                    inputs=("x=float32[B,S,64]",), device="cpu", precision=prec,
                                                    mode=mode))
    print("\n| model | precision | mode / checkpointing | predicted bytes | measured bytes | error |")
    print("|---|---|---|---:|---:|---:|")
    conv = dict(model=f"{custom}/convnet.py:ConvNet", batch=8, seq=None, inputs=("x=float32[B,3,32,32]",), device="cpu")
    mixer = dict(model=f"{custom}/mixer.py:Mixer", batch=8, seq=64, device="cpu")
    llama = dict(model=fixture("tiny-llama-gqa"), batch=2, seq=32, device="cpu")
    for label, kw in [
        ("ConvNet | fp32 | train", dict(conv, precision="fp32")),
        ("ConvNet | fp32 | train, `modules:blocks.*`", dict(conv, precision="fp32", checkpointing="modules:blocks.*")),
        ("ConvNet | fp32 | inference", dict(conv, precision="fp32", mode="inference")),
        ("ConvNet | bf16-mixed | train", dict(conv, precision="bf16-mixed")),
        ("ConvNet | bf16-mixed | inference", dict(conv, precision="bf16-mixed", mode="inference")),
        ("Mixer | fp32 | train", dict(mixer, precision="fp32")),
        ("Mixer | fp32 | train, `modules:blocks.*`", dict(mixer, precision="fp32", checkpointing="modules:blocks.*")),
        ("Mixer | bf16-mixed | train", dict(mixer, precision="bf16-mixed")),
        ("tiny-llama-gqa + LoRA r=4 (q_proj, v_proj) | bf16-mixed | train",
         dict(llama, precision="bf16-mixed", lora_rank=4, lora_targets=("q_proj", "v_proj"))),
        ("tiny-llama-gqa + LoRA r=4 | bf16 | train", dict(llama, precision="bf16", lora_rank=4)),
        ("tiny-llama-gqa, `--freeze model.embed_tokens.*` | bf16-mixed | train",
         dict(llama, precision="bf16-mixed", freeze=("model.embed_tokens.*",))),
        ("tiny-mixtral (grouped_mm experts) | fp32 | train", dict(llama, model=fixture("tiny-mixtral"), seq=16,
                                                                  precision="fp32")),
        ("tiny-mixtral (grouped_mm experts) | bf16 | train", dict(llama, model=fixture("tiny-mixtral"), seq=16,
                                                                  precision="bf16")),
    ]:
        _row(label, RunSpec(**kw))


if __name__ == "__main__":
    main()
