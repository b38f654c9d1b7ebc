"""`--quantization nf4|fp4`: bitsandbytes' 4-bit weights built by transformers' own quantizer on meta, traced
through bitsandbytes' own Linear4bit, against the same model loaded 4-bit by `from_pretrained(...,
quantization_config=BitsAndBytesConfig(...))` and run for real on the CPU (tests/oracle.py, public APIs only), and
the storage layout against bitsandbytes' own `quantize_4bit` on real tensors."""

from __future__ import annotations

import sys

import pytest
import torch

from conftest import FIXTURES
from oracle import measure_cpu_peak
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
    (LLAMA, {"precision": "bf16-mixed", **QLORA}),  # the fp32 norms/head of prepare_model_for_kbit_training, autocast
    (GPT2, {"precision": "bf16", "quantization": "nf4", "lora_rank": 8}),  # Conv1D layers, fp32 compute
    (GPT2, {"precision": "bf16", "quantization": "nf4", "double_quant": True, "bnb_compute_dtype": "bf16"}),
    (LLAMA, {"precision": "bf16", "quantization": "fp4", "bnb_compute_dtype": "bf16", "mode": "inference"}),
    (LLAMA, {"precision": "bf16", "quantization": "nf4", "double_quant": True, "bnb_compute_dtype": "bf16",
             "mode": "generate", "new_tokens": 4}),
], ids=["llama-qlora", "llama-qlora-bf16-mixed", "gpt2-nf4-lora", "gpt2-nf4-dq-no-lora", "llama-fp4-inference",
        "llama-nf4-generate"])
def test_quantized_step_matches_a_real_cpu_run(model, kw):
    if kw.get("mode") in ("inference", "generate") and _avx512_bf16():
        pytest.skip("on an AVX512-BF16 CPU bitsandbytes repacks 4-bit weights for inference "
                    "(`_convert_weight_packed_for_cpu`), which the trace does not model yet")
    spec = RunSpec(model, batch=2, seq=16, device="cpu", **kw)
    measured = measure_cpu_peak(spec)
    predicted = analyze(spec).peak_allocated_bytes
    assert abs(predicted - measured) <= 0.005 * measured, (predicted, measured)


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
    report = analyze(RunSpec(LLAMA, batch=2, seq=16, precision="bf16", **QLORA))
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


def test_the_cli_prints_the_quantization_categories(capsys):
    assert main([LLAMA, "--batch", "2", "--seq", "16", "--device", "cpu", "--precision", "bf16",
                 "--quantization", "nf4", "--double-quant", "--bnb-compute-dtype", "bf16", "--lora-rank", "8"]) == 0
    out = capsys.readouterr().out
    assert "quantized weights (bitsandbytes)" in out and "quantization constants" in out


@pytest.mark.parametrize("kwargs,message", [
    ({"double_quant": True}, "--double-quant and --bnb-compute-dtype apply to --quantization"),
    ({"quantization": "int3"}, "unknown --quantization 'int3'"),
    ({"quantization": "nf4", "bnb_compute_dtype": "fp8"}, "unknown --bnb-compute-dtype 'fp8'"),
    ({"quantization": "nf4", "fsdp": 2}, "--quantization with --fsdp, --tp or --ddp is not supported yet"),
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
], ids=["llama-adamw-8bit", "gpt2-lion-8bit", "llama-qlora-paged-adamw-8bit"])
def test_bitsandbytes_optimizers_match_a_real_cpu_run(model, kw):
    """bitsandbytes' own optimizers, as HF Trainer builds them, on the CPU (paged ones fall back to unpaged there).
    The trace holds one 1 KiB quantile map per 8-bit state more than the CPU run: bitsandbytes makes it on the host
    and moves it to the parameters' device, a copy on meta that the CPU run does not make (exact on a CUDA
    target, where the host map is not counted)."""
    spec = RunSpec(model, batch=2, seq=16, device="cpu", **kw)
    measured = measure_cpu_peak(spec)
    predicted = analyze(spec).peak_allocated_bytes
    assert abs(predicted - measured) <= 0.005 * measured, (predicted, measured)


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
    assert paged.run["paged_optimizer_state_bytes"] == managed
    assert "paged_optimizer_state_bytes" not in unpaged.run
    assert unpaged.breakdown_at_peak["optimizer_state"] - paged.breakdown_at_peak["optimizer_state"] == managed

