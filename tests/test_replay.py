"""The steady step's forward and backward replayed from the first step's record (`tracer/replay.py`) must give
exactly the recording of tracing them again: the same ops, storages, frees and release marks, to the field.
A step that is not repeatable (a module that keeps a tensor made on its first call, zero_grad to zeros, a
GradScaler) is traced again, and the two recordings still agree."""

from __future__ import annotations

import textwrap

import pytest

from conftest import FIXTURES
from seam import recording
from vramtrace import RunSpec

CASES = [
    ("tiny-gpt2", dict()),
    ("tiny-gpt2", dict(precision="bf16-mixed", grad_accum=3, clip_grad_norm=1.0)),
    ("tiny-llama-gqa", dict(precision="bf16-mixed", checkpointing="layers", device="cpu")),
    ("tiny-llama-gqa", dict(grad_accum=4, optimizer="adagrad", device="cpu")),
    ("tiny-llama-gqa", dict(lora_rank=4, optimizer="sgd-momentum", optimizer_impl="for-loop")),
    ("tiny-bert", dict(precision="bf16-mixed", device="cpu", optimizer="adafactor")),
    ("tiny-mixtral", dict(grad_accum=2, checkpointing="layers")),
]


def _both(spec: RunSpec):
    return recording(spec, replay_steady=False), recording(spec)


def _assert_same(full, replayed) -> None:
    assert replayed.ops == full.ops
    assert replayed.storages == full.storages
    assert replayed.marks == full.marks
    assert replayed.sdpa_backends == full.sdpa_backends
    assert replayed.steps == full.steps == 2


@pytest.mark.parametrize("config,kw", CASES, ids=[f"{c}-{'-'.join(map(str, k.values())) or 'plain'}"
                                                  for c, k in CASES])
def test_replayed_steady_step_equals_the_traced_one(config, kw):
    spec = RunSpec(str(FIXTURES / f"{config}.json"), batch=2, seq=16, **kw)
    full, replayed = _both(spec)
    _assert_same(full, replayed)
    micro = kw.get("grad_accum", 1)
    assert f"copied from the first step's record ({micro} micro-step" in replayed.trace_note
    assert "copied" not in full.trace_note


@pytest.mark.parametrize("kw", [dict(zero_grad="zeros"), dict(precision="fp16-mixed"),
                                dict(step=str(FIXTURES.parent / "steps" / "aux_ema.py") + ":train_step")])
def test_steps_that_carry_state_are_traced_again(kw):
    """Gradients kept as zeros, a GradScaler's state or a user's step function make the steady step differ."""
    spec = RunSpec(str(FIXTURES / "tiny-llama-gqa.json"), batch=2, seq=16, **kw)
    full, replayed = _both(spec)
    assert "copied" not in replayed.trace_note
    _assert_same(full, replayed)


def test_a_tensor_made_on_the_first_call_is_not_replayed(tmp_path):
    """A module that caches a tensor on its first forward makes it only in the first step: that micro-step is
    not self-contained, so the steady step is traced, and its peak is the real one (no second cache)."""
    path = tmp_path / "lazy.py"
    path.write_text(textwrap.dedent("""
        import torch
        from torch import nn

        class Lazy(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(64, 64)
                self.scale = None

            def forward(self, x):
                if self.scale is None:
                    self.scale = torch.ones(64, 64, device=x.device)
                return self.lin(x) @ self.scale

        def example_inputs(batch, seq):
            return (torch.randn(batch, seq, 64),)

        def loss(output, x):
            return output.float().pow(2).mean()
    """))
    spec = RunSpec(f"{path}:Lazy", batch=2, seq=8)
    full, replayed = _both(spec)
    assert "copied" not in replayed.trace_note
    _assert_same(full, replayed)
