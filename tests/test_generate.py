"""`--mode generate`: transformers' own `model.generate()` traced on meta against the same generate() run for real on
the CPU (tests/oracle.py: public APIs only), the KV cache against the config's arithmetic, and the options' errors."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import FIXTURES
from seam import recording
from oracle import measure_cpu_peak
from tolerance import assert_within
from vramtrace import RunSpec, analyze, feature_bridges
from vramtrace.cli import main
from vramtrace.errors import TraceError, UsageError

GPT2 = str(FIXTURES / "tiny-gpt2.json")
LLAMA = str(FIXTURES / "tiny-llama-gqa.json")
T5 = str(FIXTURES / "tiny-t5.json")  # encoder-decoder: the prompt in the encoder, an EncoderDecoderCache


def _spec(model, batch, cache, seq=4, new_tokens=10, precision="fp32"):
    return RunSpec(model, batch=batch, seq=seq, mode="generate", new_tokens=new_tokens, cache=cache, device="cpu",
                   precision=precision)


@pytest.mark.parametrize("model,batch,cache,precision", [
    (GPT2, 1, "dynamic", "fp32"), (GPT2, 4, "static", "fp32"), (LLAMA, 1, "static", "fp32"),
    (LLAMA, 4, "dynamic", "fp32"), (LLAMA, 4, "static", "bf16"), (GPT2, 4, "dynamic", "bf16"),
    (T5, 1, "dynamic", "fp32"), (T5, 4, "static", "bf16"), (T5, 4, "dynamic", "bf16"), (T5, 1, "static", "fp32")],
    ids=lambda x: x.rsplit("/", 1)[-1].removesuffix(".json") if isinstance(x, str) else str(x))
def test_generate_matches_a_real_cpu_generate(model, batch, cache, precision):
    spec = _spec(model, batch, cache, precision=precision)
    report = analyze(spec)
    real = measure_cpu_peak(spec)
    assert_within(report.peak_allocated_bytes, real, 0.001)


def test_the_peak_moves_from_the_prefill_to_the_decode_steps_as_real_runs_do():
    """A long prompt peaks in the prefill (logits of the last position only, the prompt's activations); a short
    prompt with many new tokens peaks in a decode step (the cache grown by torch.cat, old and new copies)."""
    long_prompt, many_tokens = _spec(LLAMA, 2, "dynamic", seq=48, new_tokens=2), _spec(LLAMA, 2, "dynamic", seq=2,
                                                                                          new_tokens=40)
    a, b = analyze(long_prompt), analyze(many_tokens)
    assert a.run.peak_in == "prefill" and b.run.peak_in.startswith("decode step")
    for spec, report in ((long_prompt, a), (many_tokens, b)):
        assert abs(report.peak_allocated_bytes - measure_cpu_peak(spec)) <= 0.001 * report.peak_allocated_bytes


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_kv_cache_bytes_per_token_are_the_configs(cache):
    """2 (keys, values) × layers × KV heads × head dim × dtype bytes, per token per request (GQA: 2 KV heads)."""
    cfg = json.loads((FIXTURES / "tiny-llama-gqa.json").read_text())
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 2  # bf16
    report = analyze(RunSpec(LLAMA, batch=3, seq=5, mode="generate", new_tokens=7, cache=cache, device="cpu"))
    assert report.run.kv_bytes_per_token == per_token
    assert report.run.kv_tokens_per_request == 5 + 7 - 1
    assert report.run.kv_cache_bytes_at_end >= 3 * 11 * per_token
    assert report.breakdown_at_peak["optimizer_state"] == 0 and report.breakdown_at_peak["gradient"] == 0


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_encoder_decoder_cache_splits_self_and_cross_attention(cache):
    """T5: the decoder's self-attention cache holds N tokens (start token + N - 1), the cross-attention cache the
    encoder's keys and values of the S prompt tokens; each 2 × decoder layers × heads × d_kv × dtype bytes."""
    cfg = json.loads((FIXTURES / "tiny-t5.json").read_text())
    per_token = 2 * cfg["num_decoder_layers"] * cfg["num_heads"] * cfg["d_kv"] * 2  # bf16
    report = analyze(RunSpec(T5, batch=3, seq=5, mode="generate", new_tokens=7, cache=cache, device="cpu"))
    r = report.run
    assert (r.kv_tokens_per_request, r.kv_bytes_per_token) == (7, per_token)
    assert r.kv_cross_attention_bytes == 3 * 5 * per_token and r.kv_cross_bytes_per_token == per_token


@pytest.mark.parametrize("kwargs,message", [
    ({"new_tokens": 4}, "new_tokens, cache and kv_dtype apply to mode generate"),
    ({"kv_dtype": "fp8"}, "new_tokens, cache and kv_dtype apply to mode generate"),
    ({"mode": "generate", "new_tokens": 4, "kv_dtype": "int3"}, "unknown kv_dtype 'int3'"),
    ({"mode": "generate", "new_tokens": 4, "kv_dtype": "fp8", "cache": "static"}, "a dynamic cache; drop cache"),
    ({"mode": "generate"}, "mode generate needs new_tokens"),
    ({"mode": "generate", "new_tokens": 4, "cache": "paged"}, "unknown cache 'paged'"),
    ({"mode": "generate", "new_tokens": 0}, "new_tokens must be a positive integer"),
    ({"mode": "generate", "new_tokens": 2, "lora_rank": 8}, "mode generate with lora_rank is not supported"),
])
def test_bad_generation_options_are_usage_errors(kwargs, message):
    with pytest.raises(UsageError, match=message):
        RunSpec(GPT2, batch=1, seq=8, **kwargs)


@pytest.mark.parametrize("model,batch,seq,new_tokens,precision", [
    (LLAMA, 4, 4, 10, "fp32"), (GPT2, 1, 3, 12, "bf16"), (LLAMA, 2, 24, 3, "bf16")])
def test_fp8_quantized_cache_matches_a_real_cpu_generate(model, batch, seq, new_tokens, precision):
    """transformers' QuantizedCache(backend="fp8"): fp8 states appended each step, then dequantized whole (a float32
    copy and the compute dtype), as real generate() runs allocate them."""
    spec = RunSpec(model, batch=batch, seq=seq, mode="generate", new_tokens=new_tokens, kv_dtype="fp8", device="cpu",
                   precision=precision)
    report = analyze(spec)
    real = measure_cpu_peak(spec)
    assert_within(report.peak_allocated_bytes, real, 0.001)
    assert report.run.kv_dtype == "fp8"


def test_fp8_cache_keeps_one_byte_per_element():
    """2 × layers × KV heads × head dim × 1 byte (float8_e4m3fn) per token per request; the scales are per layer."""
    cfg = json.loads((FIXTURES / "tiny-llama-gqa.json").read_text())
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    report = analyze(RunSpec(LLAMA, batch=3, seq=5, mode="generate", new_tokens=7, kv_dtype="fp8", device="cpu"))
    assert report.run.kv_bytes_per_token == 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim


def test_fp8_cache_on_an_encoder_decoder_is_a_usage_error(capsys):
    assert main([T5, "--mode", "generate", "--seq", "4", "--new-tokens", "2", "--kv-dtype", "fp8",
                 "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert "QuantizedCache has no encoder-decoder form" in err and "\n" not in err


def test_generate_needs_a_causal_lm_and_the_cli_says_so(capsys):
    assert main([str(FIXTURES / "tiny-bert.json"), "--mode", "generate", "--seq", "8", "--new-tokens", "2",
                 "--device", "cpu"]) in (1, 2)
    err = capsys.readouterr().err.strip()
    assert "--mode generate needs a causal or seq2seq LM head" in err and "\n" not in err


def test_a_question_generate_was_not_known_to_ask_is_a_trace_error():
    with feature_bridges.generating(3):
        assert torch.zeros((), device="meta").add(1).numel() == 1
        with pytest.raises(TraceError, match="test_a_question_generate_was_not_known_to_ask"):
            bool(torch.zeros((), device="meta"))
        assert bool(torch.ones(()))  # real tensors answer as always
    with pytest.raises(RuntimeError):
        bool(torch.zeros((), device="meta"))  # the original Tensor.__bool__ is back


MISTRAL_SW = str(FIXTURES / "tiny-mistral-sw.json")  # sliding_window 8: DynamicSlidingWindowLayer stops growing


@pytest.mark.parametrize("model,cache,seq,new_tokens,precision", [
    (LLAMA, "dynamic", 5, 20, "fp32"), (GPT2, "static", 7, 16, "bf16"),
    (MISTRAL_SW, "dynamic", 2, 20, "fp32"),  # the window fills at decode step 6: the pattern starts after it
    (MISTRAL_SW, "static", 12, 14, "bf16"),  # the prompt is past the window already
    (T5, "dynamic", 6, 14, "fp32"),
], ids=["llama-dynamic", "gpt2-static", "mistral-window-fills", "mistral-past-window", "t5"])
def test_rebuilt_decode_steps_equal_every_step_traced(model, cache, seq, new_tokens, precision):
    """Decode steps traced in part and rebuilt (tracer/decoding.py) give the recording of tracing every step: the
    same ops, storages, frees and SDPA calls, to the field."""
    spec = _spec(model, 2, cache, seq=seq, new_tokens=new_tokens, precision=precision)
    rebuilt, full = recording(spec), recording(spec, rebuild_decode=False)
    assert "the rest rebuilt" in rebuilt.trace_note and "decode" not in full.trace_note
    assert rebuilt.ops == full.ops
    assert rebuilt.storages == full.storages
    assert rebuilt.sdpa_backends == full.sdpa_backends


def test_the_pattern_starts_after_a_sliding_window_fills():
    from vramtrace.tracer.decoding import TRACED_DECODE_STEPS, decode_steps_to_trace

    assert decode_steps_to_trace(512, 512, ()) == TRACED_DECODE_STEPS
    assert decode_steps_to_trace(512, 512, (4096,)) == TRACED_DECODE_STEPS  # the window is never reached
    assert decode_steps_to_trace(512, 8192, (4096,)) == TRACED_DECODE_STEPS  # filled in the prefill
    assert decode_steps_to_trace(512, 200, (256,)) == 56 + 2 + 3 + 1  # fills at step 56: 3 steps after it
    assert decode_steps_to_trace(8, 512, ()) is None  # too few steps to rebuild any


@pytest.mark.parametrize("batch,cache", [(1, "dynamic"), (4, "static"), (4, "dynamic"), (1, "static")])
def test_sliding_window_generate_matches_a_real_cpu_generate(batch, cache):
    """Mistral with an 8-token window, a 4-token prompt and 20 new tokens: the window fills during the
    generation, the decode steps after it are rebuilt; a real CPU generate() is the truth."""
    spec = _spec(MISTRAL_SW, batch, cache, seq=4, new_tokens=20)
    report = analyze(spec)
    real = measure_cpu_peak(spec)
    assert "the rest rebuilt" in report.run.trace
    assert_within(report.peak_allocated_bytes, real, 0.001)
