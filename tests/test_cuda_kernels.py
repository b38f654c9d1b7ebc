"""CUDA-target kernel behaviour checked against a real H100 run (../shared/gpu-evidence/README.md, issue 39).

The figures come from the memory snapshots of that run, copied into tests/fixtures/gpu_evidence/ (real
measurements: `torch.cuda.memory._snapshot()` of the measured step, torch 2.11 cu130, transformers 5.24)."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import FIXTURES
from vramtrace import RunSpec, analyze

EVIDENCE = Path(__file__).resolve().parent / "fixtures" / "gpu_evidence"


def test_cross_entropy_under_cuda_autocast_keeps_the_inputs_dtype_then_an_fp32_copy(tmp_path):
    # LossNLL.cpp cross_entropy_loss_symint calls log_softmax(self, 1, self.scalar_type()): autocast keeps that
    # explicit dtype (bf16 log-probabilities), then nll_loss (fp32 policy) casts them to fp32. At the backward's
    # first op three vocab-sized tensors are live: the bf16 log-probabilities, their fp32 copy and the fp32
    # gradient. The README's t5-base row (bf16-mixed, 8 x 512 tokens, vocab 32128) has exactly these blocks at
    # its peak; the trace held three fp32 ones (+263,192,576 B, the row's miss once the allocator's remainders
    # are set apart). A tiny T5 with t5-base's vocabulary has the same loss.
    evidence = json.loads((EVIDENCE / "h100-t5-loss-at-peak.json").read_text())
    n, vocab = evidence["tokens"], evidence["vocab"]
    real = sorted(b["bytes"] for b in evidence["blocks_live_at_peak"] if b["bytes"] >= n * vocab * 2)
    assert real == [n * vocab * 2, n * vocab * 4, n * vocab * 4]

    cfg = json.loads((FIXTURES / "tiny-t5.json").read_text())
    cfg["vocab_size"] = vocab
    path = tmp_path / "t5-vocab.json"
    path.write_text(json.dumps(cfg))
    r = analyze(RunSpec(str(path), batch=8, seq=512, gpu="H100", precision="bf16-mixed"), levers=False)
    assert r.peak_op == "aten._log_softmax_backward_data.default" or r.peak_op == "aten.nll_loss_backward.default"
    live = [t for t in r.tensors if t.birth <= r.peak_step <= t.death and t.bytes >= n * vocab * 2]
    assert sorted(t.bytes for t in live) == real
    assert sorted((t.dtype, t.op) for t in live) == [("bfloat16", "aten._log_softmax.default"),
                                                    ("float32", "aten._to_copy.default"),
                                                    ("float32", "aten.nll_loss_backward.default")]
