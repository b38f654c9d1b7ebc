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


def test_memory_efficient_attention_seed_and_offset_are_host_tensors_on_cuda(tmp_path):
    # attention.cu `_efficient_attention_forward` makes the philox seed and offset on the CPU outside CUDA-graph
    # capture (with or without dropout); the meta kernel makes them on the traced device (two 512 B blocks per
    # call). The README's gpt2 fp32 row (8 x 1024, 12 heads of 64, attention dropout 0.1) allocates, per SDPA
    # call of its forward, the output and the logsumexp and nothing else. One GPT-2 layer of those sizes here.
    evidence = json.loads((EVIDENCE / "h100-gpt2-fp32-sdpa-forward.json").read_text())
    b, h, s, d = (evidence[k] for k in ("batch", "heads", "tokens", "head_dim"))
    per_call = sorted({a["bytes"] for a in evidence["allocations"]})
    assert sorted(a["bytes"] for a in evidence["allocations"]) == sorted(per_call * evidence["layers"])
    assert per_call == [b * h * s * 4, b * h * s * d * 4]  # logsumexp (B, H, S) fp32, output (B, H, S, D) fp32

    cfg = json.loads((FIXTURES / "tiny-gpt2.json").read_text())
    cfg.update(n_embd=h * d, n_head=h, n_layer=1, n_positions=s, attn_pdrop=evidence["attn_pdrop"])
    path = tmp_path / "gpt2-layer.json"
    path.write_text(json.dumps(cfg))
    r = analyze(RunSpec(str(path), batch=b, seq=s, gpu="H100", precision="fp32"), levers=False)
    assert r.model.sdpa_backends == {"efficient": 1}
    made = sorted(t.bytes for t in r.tensors if t.op == "aten._scaled_dot_product_efficient_attention.default")
    assert made == per_call


def test_autocast_casts_a_linears_weight_before_its_input_as_the_h100_did():
    # autocast_mode.h `WrapFunction_::call` casts every argument in one call's argument list
    # (`(*F)(cached_cast(to_type, args, device_type)...)`), which GCC evaluates last argument first: the weight's
    # bf16 copy is allocated before the input's. The fit boundary's real run (batch 21: Llama-2-7b dims, bf16-mixed)
    # shows it at the first q_proj: 4096 x 4096 bf16, then 21 x 2048 x 4096 bf16 (the input), then the output.
    import gzip

    trace = json.loads(gzip.open(EVIDENCE / "h100-fit-21.json.gz", "rt").read())["trace"]
    allocs = [size for action, _, size in trace if action == "alloc"]
    first = allocs.index(4096 * 4096 * 2)
    assert allocs[first:first + 3] == [4096 * 4096 * 2, 21 * 2048 * 4096 * 2, 21 * 2048 * 4096 * 2]

    r = analyze(RunSpec(str(FIXTURES / "tiny-llama-gqa.json"), batch=2, seq=32, gpu="H100", precision="bf16-mixed"),
                levers=False)
    casts = sorted((t.birth, t.category) for t in r.tensors
                   if t.module == "model.layers.0.self_attn.q_proj" and t.op == "aten._to_copy.default"
                   and t.phase == "forward")
    assert [c for _, c in casts] == ["autocast_weights", "activation"]


def test_storages_freed_after_one_op_are_replayed_in_the_order_they_died():
    # The caching allocator sees the frees in the order the step drops the last references (Python's decrefs), not
    # in the order the storages were born. At the fit boundary's first rotary embedding the real run freed the
    # key's two fp32 products (born last) before the query's and key's projections (born first).
    from vramtrace.analysis.allocator import ReplaySchedule
    from vramtrace.analysis.liveness import Lifetime, Timeline

    lts = (Lifetime(1, 4 << 20, 0, 1, "temporary", free_rank=2), Lifetime(2, 4 << 20, 0, 1, "temporary", free_rank=3),
           Lifetime(3, 8 << 20, 0, 1, "temporary", free_rank=0), Lifetime(4, 8 << 20, 0, 1, "temporary", free_rank=1))
    tl = Timeline((0, 1), ("forward", "forward"), lts, (24 << 20, 24 << 20), (24 << 20, 0), 0, 24 << 20, 0)
    events = dict(ReplaySchedule.of(tl, tl).steps)["first"]
    frees = [key[1] for malloc, key, _ in events if not malloc]
    assert frees == [3, 4, 1, 2]
