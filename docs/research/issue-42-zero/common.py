"""Shared by real_zero.py and fake_zero.py: the tiny model, the ds_config, the inputs, the step (issue 42 research).

Run with the research venv: /work/venv-ds/bin/python (deepspeed 0.19.8, DS_BUILD_OPS=0, DS_ACCELERATOR=cpu).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import transformers

ROOT = Path(__file__).resolve().parents[3]
MODELS = {"llama": ROOT / "fixtures" / "configs" / "tiny-llama-gqa.json",
          "gpt2": ROOT / "fixtures" / "configs" / "tiny-gpt2.json"}
BATCH, SEQ = 2, 32


def set_env(rank: int, world: int, port: int) -> None:
    """The environment DeepSpeed's CPU accelerator and comm init read (without LOCAL_RANK it tries MPI discovery)."""
    os.environ.update(DS_ACCELERATOR="cpu", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      CROSS_RANK="0", CROSS_SIZE="1", LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")


def build_model(name: str) -> torch.nn.Module:
    """AutoModelForCausalLM.from_config of the fixture, fp32 random weights, seed 0 (as a user builds it)."""
    cfg = json.loads(MODELS[name].read_text())
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(0)
    attn = os.environ.get("ZERO_ATTN")  # e.g. eager, to test mismatch 2 (the doc); default: transformers' (sdpa)
    kw = {"attn_implementation": attn} if attn else {}
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, **kw)


def ds_config(stage: int, precision: str, bucket: float | None, offload: bool, world: int) -> dict:
    """A ds_config as a user writes it: torch_adam AdamW, micro batch BATCH, grad accumulation 1."""
    zero = {"stage": stage}
    if bucket is not None:
        zero["reduce_bucket_size"] = int(bucket)
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    cfg = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1,
           "train_batch_size": BATCH * world,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
           "zero_optimization": zero, "steps_per_print": 10**9, "wall_clock_breakdown": False}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def inputs(vocab: int):
    torch.manual_seed(1)
    ids = torch.randint(0, vocab, (BATCH, SEQ))
    return ids, ids.clone()


def step(engine, ids, labels) -> None:
    """One DeepSpeed training step as HF Trainer / the DeepSpeed tutorial run it."""
    loss = engine(input_ids=ids, labels=labels).loss
    engine.backward(loss)
    engine.step()


CASES = [(stage, precision, bucket, offload)
         for stage, offload in ((1, False), (2, False), (3, False), (3, True))
         for precision in ("fp32", "bf16") for bucket in (None, 1e6)]


def case_name(stage, precision, bucket, offload) -> str:
    return f"zero{stage}{'+offload' if offload else ''}-{precision}-{'default' if bucket is None else '1e6'}"
