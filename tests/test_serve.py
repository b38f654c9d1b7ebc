"""`vramtrace serve`: vLLM 0.33's KV budget term by term (serve.py), with its profile run traced (the forward of
max_num_batched_tokens tokens, logits at each request's last token, the dummy sampler, the runner's buffers).
No vLLM runs here (CUDA only): the arithmetic is checked against vLLM's formulas worked by hand for a real config,
the trace against the tensors vLLM's profile run makes."""

from __future__ import annotations

import json
import math

import pytest

from conftest import FIXTURES
from seam import step_tables
from vramtrace import RunSpec
from vramtrace.cli import main
from vramtrace.errors import UsageError
from vramtrace.serve import ServeSpec, analyze_serve, batch_defaults, plan

LLAMA = str(FIXTURES / "tiny-llama-gqa.json")
LLAMA31_8B = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
              "max_position_embeddings": 131072, "vocab_size": 128256}


def test_llama31_8b_worked_by_hand():
    """vLLM's budget for Llama-3.1-8B's config on a 44 GiB device (`--gpu-memory`; below 70 GiB: the L40S tier's
    batch defaults 2048/256), with a profile peak of 15 GiB (weights 14.96 GiB), 256 MiB of non-PyTorch memory and
    512 MiB of CUDA graphs, worked here from vLLM 0.33's formulas: requested = ceil(total × 0.92), vLLM's default
    gpu_memory_utilization (vllm/config/cache.py); available = requested - peak - non-PyTorch - CUDA graphs; a
    block is layers × 2 (K and V) × 16 tokens (vLLM's default block size) × KV heads × head size × 2 B (bf16),
    32 × 2 × 16 × 8 × 128 × 2 B = 2 MiB; 8192 tokens need 8192 / 16 = 512 blocks; block 0 is the null block."""
    total, peak = 44 * 2**30, 15 * 2**30
    head_size = LLAMA31_8B["hidden_size"] // LLAMA31_8B["num_attention_heads"]
    block = LLAMA31_8B["num_hidden_layers"] * 2 * 16 * LLAMA31_8B["num_key_value_heads"] * head_size * 2
    assert block == 2 * 2**20
    terms = dict(gpu="L40S", gpu_memory_bytes=total, max_model_len=8192, non_torch_bytes=256 * 2**20,
                 cudagraph_bytes=512 * 2**20)
    r = plan(ServeSpec("x", **terms), lambda t, s: (peak, 16060522496, "mlp"), LLAMA31_8B, 2)
    assert (r["max_num_batched_tokens"], r["max_num_seqs"]) == (2048, 256)
    requested = math.ceil(total * 0.92)
    assert r["requested_bytes"] == requested
    available = requested - peak - 256 * 2**20 - 512 * 2**20
    assert r["available_kv_bytes"] == available and r["bytes_per_block"] == block
    assert r["num_blocks"] == available // block and r["blocks_per_request"] == 8192 // 16
    assert r["max_concurrency"] == r["num_blocks"] / 512 and r["kv_cache_tokens"] == int(r["num_blocks"] / 512 * 8192)
    assert r["longest_by_kv_bytes"] == (available - block) // block * 16
    fp8 = plan(ServeSpec("x", **terms, kv_cache_dtype="fp8", enforce_eager=True),
               lambda t, s: (peak, 16060522496, "mlp"), LLAMA31_8B, 2)
    assert fp8["bytes_per_block"] == block // 2 and fp8["cudagraph_bytes"] == 0  # 1 B per element; no graphs


def test_batch_defaults_follow_the_gpu_tier():
    assert batch_defaults(80 * 2**30, "H100-80GB") == (8192, 1024)
    assert batch_defaults(80 * 2**30, "A100-80GB") == (2048, 256)
    assert batch_defaults(180 * 2**30, "B200") == (16384, 1024)
    # max_num_batched_tokens is capped at max_num_seqs × max_model_len (arg_utils)
    r = plan(ServeSpec("x", gpu="H100-80GB", max_model_len=4), lambda t, s: (2**30, 2**29, ""), LLAMA31_8B, 2)
    assert (r["max_num_batched_tokens"], r["max_num_seqs"]) == (4096, 1024)


def test_a_long_max_model_len_that_does_not_fit_says_so():
    r = plan(ServeSpec("x", gpu="T4", max_model_len=131072), lambda t, s: (14 * 2**30, 14 * 2**30, ""),
             LLAMA31_8B, 2)
    assert not r["fits_one_request"] and r["longest_max_model_len"] < 131072


def test_the_profile_run_trace_holds_vllms_tensors():
    """The traced forward keeps logits for R rows only, the dummy sampler's fp32 (R, V) copies exist, and the
    runner's (M, V) int32 bin counts are alive from the start."""
    cfg = json.loads((FIXTURES / "tiny-llama-gqa.json").read_text())
    V, T, R = cfg["vocab_size"], 40, 8  # T: not the hidden size (64), so shapes tell them apart
    spec = RunSpec(LLAMA, batch=1, seq=T, mode="inference", precision="bf16", serve_requests=R)
    tables = step_tables(spec)
    shapes = [(s.shape, s.dtype) for s in tables.traced.storages]
    assert ((R, V), "bfloat16") in shapes  # the lm_head's output: R rows (a matmul over (R, hidden))
    assert not any(V in shape and T in shape for shape, _ in shapes)  # no logits for every token
    assert shapes.count(((R, V), "float32")) >= 3  # the fp32 copy, the masked logits, the probabilities
    bins = [s for s in tables.traced.storages if s.name == "vLLM output_bin_counts"]
    assert bins and bins[0].shape == (R, V) and bins[0].op_index == -1


def test_serve_cli_prints_blocks_and_concurrency(capsys):
    assert main(["serve", LLAMA, "--gpu", "T4", "--max-model-len", "256", "--max-num-batched-tokens", "64",
                 "--max-num-seqs", "4"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # the terminal wraps at its width
    assert "blocks of 16 tokens" in out and "maximum concurrency for 256 tokens per request" in out


def test_serve_with_tp_is_per_rank():
    """Llama-3.1-8B by hand at TP 2: a block holds 4 KV heads per rank (half the bytes). The tiny Llama's profile
    run traced under its TP plan: rank 0 holds half of every matrix and the whole norms, and as many blocks of
    half the KV heads."""
    r = plan(ServeSpec("x", gpu="L40S", max_model_len=8192, tp=2), lambda t, s: (8 * 2**30, 8030527488, "mlp"),
             LLAMA31_8B, 2)
    assert r["kv_heads_per_rank"] == 4 and r["bytes_per_block"] == 2**20
    kw = {"gpu": "T4", "max_model_len": 256, "max_num_batched_tokens": 64, "max_num_seqs": 4}
    one, two = analyze_serve(ServeSpec(LLAMA, **kw)), analyze_serve(ServeSpec(LLAMA, tp=2, **kw))
    # bf16 rank-0 shards (rows × columns × 2 B), each in a 512-byte block: q 32×64, k and v 16×64, o 64×32,
    # gate and up 88×64, down 64×88, two norms of 64 (one block each); embeddings and lm_head 256×64; final norm
    layer = 2 * (32 * 64 + 16 * 64 * 2 + 64 * 32 + 88 * 64 * 3) + 2 * 512
    assert two["weights_bytes"] == 2 * layer + 2 * (2 * 256 * 64) + 512
    assert two["page_bytes"] * 2 == one["page_bytes"] and two["kv_heads_per_rank"] == 1
    assert two["activation_peak_bytes"] < one["activation_peak_bytes"]


@pytest.mark.parametrize("args,message", [
    (["--tp", "3"], "--tp 3: the model's 4 attention heads must be divisible"),
    (["--kv-cache-dtype", "int3"], "unknown --kv-cache-dtype 'int3'"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be in (0, 1]"),
    (["--max-model-len", "100000"], "longer than the model's max_position_embeddings 256"),
])
def test_serve_usage_errors_are_one_line(capsys, args, message):
    assert main(["serve", LLAMA, "--gpu", "T4", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_serve_refuses_sliding_window_configs():
    with pytest.raises(UsageError, match="sliding-window"):
        analyze_serve(ServeSpec(str(FIXTURES / "tiny-mistral-sw.json"), gpu="T4", max_model_len=128))
