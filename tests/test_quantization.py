"""`--quantization nf4|fp4|int8`: bitsandbytes' 4-bit and int8 weights built by transformers' own quantizer on meta,
traced through bitsandbytes' own Linear4bit and Linear8bitLt, against the same model loaded by `from_pretrained(...,
quantization_config=BitsAndBytesConfig(...))` and run for real on the CPU (tests/oracle.py, public APIs only), and
the storage layout against bitsandbytes' own `quantize_4bit` and `int8_vectorwise_quant` on real tensors."""

from __future__ import annotations

import sys

import pytest
import torch

from conftest import FIXTURES
from oracle import measure_cpu_peak
from tolerance import assert_within
from vramtrace import RunSpec, analyze
from vramtrace.cli import main
from vramtrace.errors import UsageError

GPT2 = str(FIXTURES / "tiny-gpt2.json")
LLAMA = str(FIXTURES / "tiny-llama-gqa.json")
QLORA = {"quantization": "nf4", "double_quant": True, "bnb_compute_dtype": "bf16", "lora_rank": 8}


def _avx512_bf16() -> bool:
    import bitsandbytes as bnb

    return bool(bnb.functional.has_avx512bf16())


@pytest.mark.parametrize("model,kw", [
    (LLAMA, {"precision": "bf16", **QLORA}),  # QLoRA as the recipes run it
    # the fp32 norms/head of prepare_model_for_kbit_training, autocast; peft's lora_dropout as the recipes set it
    (LLAMA, {"precision": "bf16-mixed", "lora_dropout": 0.05, **QLORA}),
    (GPT2, {"precision": "bf16", "quantization": "nf4", "lora_rank": 8, "checkpointing": "none"}),  # Conv1D, fp32
    (GPT2, {"precision": "bf16", "quantization": "nf4", "double_quant": True, "bnb_compute_dtype": "bf16"}),
    (LLAMA, {"precision": "bf16", "quantization": "fp4", "bnb_compute_dtype": "bf16", "mode": "inference"}),
    (LLAMA, {"precision": "bf16", "quantization": "nf4", "double_quant": True, "bnb_compute_dtype": "bf16",
             "mode": "generate", "new_tokens": 4}),
    # MatMul8bitFp (the CPU's training path) keeps its input as `ctx.A`: under peft's default reentrant
    # checkpointing it is not kept (10% below the non-reentrant variant's peak, measured)
    (LLAMA, {"precision": "bf16", "quantization": "int8", "lora_rank": 8}),
    (LLAMA, {"precision": "bf16", "quantization": "int8", "lora_rank": 8, "checkpointing": "layers"}),
    (GPT2, {"precision": "bf16", "quantization": "int8"}),  # the biases and norms train, the int8 weights do not
    (LLAMA, {"precision": "bf16", "quantization": "int8", "mode": "inference"}),  # MatMul8bitLt, int8 CPU kernels
    (GPT2, {"precision": "fp32", "quantization": "int8", "mode": "generate", "new_tokens": 4}),
], ids=["llama-qlora", "llama-qlora-bf16-mixed", "gpt2-nf4-lora", "gpt2-nf4-dq-no-lora", "llama-fp4-inference",
        "llama-nf4-generate", "llama-int8-lora", "llama-int8-lora-non-reentrant", "gpt2-int8-no-lora",
        "llama-int8-inference", "gpt2-int8-generate"])
def test_quantized_step_matches_a_real_cpu_run(model, kw):
    if kw.get("mode") in ("inference", "generate") and kw["quantization"] != "int8" and _avx512_bf16():
        pytest.skip("on an AVX512-BF16 CPU bitsandbytes repacks 4-bit weights for inference "
                    "(`_convert_weight_packed_for_cpu`), which the trace does not model yet")
    spec = RunSpec(model, batch=2, seq=16, device="cpu", **kw)
    measured = measure_cpu_peak(spec)
    predicted = analyze(spec).peak_allocated_bytes
    assert_within(predicted, measured, 0.005)


@pytest.mark.parametrize("quant_type,double", [("nf4", True), ("fp4", False)])
def test_the_storages_are_laid_out_as_bitsandbytes_quantize_4bit_lays_them_out(quant_type, double):
    """Each quantized weight and constant of the traced model has the bytes, dtype and shape that bitsandbytes'
    own `quantize_4bit` gives a real CPU tensor of the weight's shape (packed ceil(n / 2) uint8, absmax per 64
    elements, with double quantization its uint8 absmax, nested fp32 absmax per 256 blocks and code tables)."""
    import bitsandbytes as bnb

    report = analyze(RunSpec(LLAMA, batch=1, seq=8, device="cpu", precision="bf16", quantization=quant_type,
                             double_quant=double, mode="inference"))
    rows = {t.name: t for t in report.tensors if t.category in ("quantized_weights", "quantization_constants")}
    packed, state = bnb.functional.quantize_4bit(torch.randn(176, 64, dtype=torch.bfloat16), blocksize=64,
                                                 compress_statistics=double, quant_type=quant_type)
    name = "model.layers.0.mlp.gate_proj.weight"  # a (176, 64) weight
    expected = {name: packed, f"{name}:absmax": state.absmax, f"{name}:code": state.code}
    if double:
        expected |= {f"{name}:offset": state.offset, f"{name}:nested:absmax": state.state2.absmax,
                     f"{name}:nested:code": state.state2.code}
    for key, t in expected.items():
        row = rows[key]
        assert (row.bytes, row.dtype, row.shape) == (t.untyped_storage().nbytes(), str(t.dtype).removeprefix(
            "torch."), tuple(t.shape)), key
    assert packed.numel() == 176 * 64 // 2


def test_the_report_shows_quantized_weights_constants_and_dequantized_temporaries():
    """QLoRA on tiny Llama for a CUDA target: the packed weights (every Linear but lm_head: 2 layers × (q, k, v, o,
    gate, up, down), half a byte per element) at the peak; in the forward, bitsandbytes' CUDA `gemm_4bit` of 32
    rows takes its dequantize-then-linear path, holding the weight dequantized to bf16 (N × K × 2 B) and the
    nested absmax as two fp32 copies (one per block of 64) while it runs, each in the caching allocator's 512-byte
    blocks; in the backward, `dequantize_4bit`
    makes the weight in bf16 for the input gradient."""
    report = analyze(RunSpec(LLAMA, batch=2, seq=16, precision="bf16", checkpointing="none", **QLORA))
    shapes = [(64, 64), (32, 64), (32, 64), (64, 64), (176, 64), (176, 64), (64, 176)]
    assert report.breakdown_at_peak["quantized_weights"] == 2 * sum(n * k for n, k in shapes) // 2
    assert report.breakdown_at_peak["quantization_constants"] > 0
    dequantized = [t for t in report.tensors if t.category == "dequantized_weights"]
    forward = sorted(t.bytes for t in dequantized if t.phase == "forward")
    blocks = [-(-n * k * 2 // 512) * 512 + 2 * -(-(n * k // 64) * 4 // 512) * 512 for n, k in shapes]  # 512-B blocks
    assert forward == sorted(blocks * 2)  # two layers
    backward = {t.shape for t in dequantized if t.phase == "backward"}
    assert backward == {(64, 64), (32, 64), (176, 64), (64, 176)}
    assert all(t.dtype == "bfloat16" for t in dequantized if t.phase == "backward")


def test_int8_storages_are_laid_out_as_int8_vectorwise_quant_lays_them_out():
    """An int8 weight of the traced model is what bitsandbytes' own `int8_vectorwise_quant` gives a real fp16
    tensor of its shape (what `Int8Params._quantize` runs): int8 of the full shape and one fp32 scale per row."""
    import bitsandbytes as bnb

    report = analyze(RunSpec(LLAMA, batch=1, seq=8, device="cpu", precision="bf16", quantization="int8",
                             mode="inference"))
    rows = {t.name: t for t in report.tensors if t.category in ("quantized_weights", "quantization_constants")}
    weight, scales, _ = bnb.functional.int8_vectorwise_quant(torch.randn(176, 64, dtype=torch.float16))
    name = "model.layers.0.mlp.gate_proj.weight"
    for key, t in {name: weight, f"{name}:SCB": scales}.items():
        row = rows[key]
        assert (row.bytes, row.dtype, row.shape) == (t.untyped_storage().nbytes(), str(t.dtype).removeprefix(
            "torch."), tuple(t.shape)), key


def test_int8_on_cuda_multiplies_in_int8_and_dequantizes_for_the_input_gradient():
    """int8 LoRA for a CUDA target runs MatMul8bitLt: the forward's `int8_mixed_scaled_mm` of 32 rows holds the
    int32 product and the fp16 output of `int8_mm_dequant` (bitsandbytes/backends/default/ops.py, cuda/ops.py) while
    it casts to the input's dtype, in 512-byte blocks; no weight is dequantized in the forward; in the backward each
    weight is dequantized for the input gradient, in the input's dtype (fp32: prepare_model_for_kbit_training makes
    the norms fp32). The report warns that no outlier column is assumed."""
    report = analyze(RunSpec(LLAMA, batch=2, seq=16, precision="bf16", quantization="int8", lora_rank=8))
    dequantized = [t for t in report.tensors if t.category == "dequantized_weights"]
    assert {t.phase for t in dequantized} == {"backward"}
    assert {t.shape for t in dequantized} == {(64, 64), (32, 64), (176, 64), (64, 176)}
    assert all(t.dtype == "float32" for t in dequantized)
    up = [t for t in report.tensors if t.op == "bitsandbytes.int8_mixed_scaled_mm.default" and t.phase == "forward"
          and t.module.endswith("layers.0.mlp.up_proj") and t.name == "kernel workspace"]
    assert [t.bytes for t in up] == [-(-32 * 176 * 4 // 512) * 512 + -(-32 * 176 * 2 // 512) * 512]
    assert any("outlier" in w for w in report.run.warnings)


def test_the_cli_prints_the_quantization_categories(capsys):
    assert main([LLAMA, "--batch", "2", "--seq", "16", "--device", "cpu", "--precision", "bf16",
                 "--quantization", "nf4", "--double-quant", "--bnb-compute-dtype", "bf16", "--lora-rank", "8"]) == 0
    out = capsys.readouterr().out
    assert "quantized weights (bitsandbytes)" in out and "quantization constants" in out


def test_qlora_checkpoints_as_prepare_model_for_kbit_training_does_by_default():
    """peft's `prepare_model_for_kbit_training(model)` enables reentrant checkpointing unless told otherwise; an
    explicit --checkpointing wins; without LoRA (no prepare_model_for_kbit_training) none."""
    assert str(RunSpec(LLAMA, batch=1, seq=8, **QLORA).checkpointing) == "layers:reentrant"
    assert str(RunSpec(LLAMA, batch=1, seq=8, checkpointing="none", **QLORA).checkpointing) == "none"
    assert str(RunSpec(LLAMA, batch=1, seq=8, quantization="nf4").checkpointing) == "none"
    assert str(RunSpec(LLAMA, batch=1, seq=8, lora_rank=8).checkpointing) == "none"


@pytest.mark.parametrize("kwargs,message", [
    ({"double_quant": True}, "double_quant and bnb_compute_dtype apply to quantization"),
    ({"quantization": "int3"}, "unknown quantization 'int3'"),
    ({"quantization": "nf4", "bnb_compute_dtype": "fp8"}, "unknown bnb_compute_dtype 'fp8'"),
    ({"quantization": "nf4", "fsdp": 2}, "quantization with fsdp, tp or ddp is not supported yet"),
    ({"quantization": "int8", "double_quant": True}, "apply to the 4-bit types"),
])
def test_bad_quantization_options_are_usage_errors(kwargs, message):
    with pytest.raises(UsageError, match=message):
        RunSpec(LLAMA, batch=1, seq=8, **kwargs)


def test_without_bitsandbytes_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # `import bitsandbytes` raises ImportError
    with pytest.raises(UsageError, match=r"pip install 'vramtrace\[quant\]'"):
        analyze(RunSpec(LLAMA, batch=1, seq=8, device="cpu", quantization="nf4"))


@pytest.mark.parametrize("model,kw", [
    (LLAMA, {"precision": "bf16", "optimizer": "adamw-8bit"}),
    (GPT2, {"precision": "bf16-mixed", "optimizer": "lion-8bit"}),
    (LLAMA, {"precision": "bf16", "optimizer": "paged_adamw_8bit", **QLORA}),  # HF Trainer's name; QLoRA's usual
    (LLAMA, {"precision": "bf16", "optimizer": "ademamix_8bit"}),  # two stacked first moments, 8-bit
    (GPT2, {"precision": "fp32", "optimizer": "rmsprop_bnb_8bit"}),
    (LLAMA, {"precision": "bf16", "optimizer": "paged_lion_32bit"}),
], ids=["llama-adamw-8bit", "gpt2-lion-8bit", "llama-qlora-paged-adamw-8bit", "llama-ademamix-8bit",
        "gpt2-rmsprop-8bit", "llama-paged-lion-32bit"])
def test_bitsandbytes_optimizers_match_a_real_cpu_run(model, kw):
    """bitsandbytes' own optimizers, as HF Trainer builds them, on the CPU (paged ones fall back to unpaged there).
    The trace holds one 1 KiB quantile map per 8-bit state more than the CPU run: bitsandbytes makes it on the host
    and moves it to the parameters' device, a copy on meta that the CPU run does not make (exact on a CUDA
    target, where the host map is not counted)."""
    spec = RunSpec(model, batch=2, seq=16, device="cpu", **kw)
    measured = measure_cpu_peak(spec)
    predicted = analyze(spec).peak_allocated_bytes
    assert_within(predicted, measured, 0.005)


def test_paged_optimizer_state_is_managed_memory_on_a_cuda_target(tmp_path):
    """A vocabulary of 2048: the embeddings and lm_head (2048 × 64 = 131,072 elements, at least bitsandbytes'
    1e5) get their two uint8 states from `F.get_paged` (CUDA managed memory): not in the allocated peak, reported
    on their own; the smaller parameters' states stay in the allocator. AdamW 8-bit unpaged holds them all."""
    import json

    config = json.loads((FIXTURES / "tiny-llama-gqa.json").read_text()) | {"vocab_size": 2048}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    kw = {"batch": 2, "seq": 16, "precision": "bf16"}
    paged = analyze(RunSpec(str(path), optimizer="paged-adamw-8bit", **kw))
    unpaged = analyze(RunSpec(str(path), optimizer="adamw-8bit", **kw))
    managed = 2 * 2 * 2048 * 64  # embeddings and lm_head, state1 and state2, one byte each
    assert paged.run.paged_optimizer_state_bytes == managed
    assert unpaged.run.paged_optimizer_state_bytes is None
    assert unpaged.breakdown_at_peak["optimizer_state"] - paged.breakdown_at_peak["optimizer_state"] == managed
    # AdEMAMix: its two stacked first moments (`_get_state_double_buffer`) and its second moment, paged too
    ademamix = analyze(RunSpec(str(path), optimizer="paged_ademamix_8bit", **kw))
    assert ademamix.run.paged_optimizer_state_bytes == 3 * managed // 2

