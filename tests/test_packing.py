"""Sample packing (--packing): what reaches the model, and the CPU prediction against a real packed run."""

from __future__ import annotations

import json

import pytest

from conftest import FIXTURES
from oracle import measure_cpu_peak
from tolerance import assert_within
from vramtrace import RunSpec, analyze
from vramtrace.cli import main

GQA = FIXTURES / "tiny-llama-gqa.json"


@pytest.mark.parametrize("attn,precision", [("sdpa", "fp32"), ("sdpa", "bf16-mixed"), ("eager", "fp32")])
def test_packed_rows_match_a_real_packed_cpu_run(tmp_path, attn, precision):
    # the real run: rows of two sequences with restarting position_ids and no attention_mask, use_cache False;
    # transformers builds the (B, 1, S, S) block-diagonal mask from the position ids. The oracle reads the
    # config key attn_implementation (what from_config honours)
    path = tmp_path / "llama.json"
    path.write_text(json.dumps(json.loads(GQA.read_text()) | {"attn_implementation": attn}))
    spec = RunSpec(str(path), batch=2, seq=32, device="cpu", precision=precision, attn_implementation=attn,
                   packing=True)
    report = analyze(spec)
    assert_within(report.peak_allocated_bytes, measure_cpu_peak(spec), 0.001, attn, precision)
    masks = [t for t in report.tensors if t.dtype == "bool" and t.shape == (2, 1, 32, 32) and t.phase == "forward"]
    assert masks  # the materialised 4D mask (an unpacked step skips it: is_causal)
    assert report.run.packing.startswith("2 rows of 32 tokens, 2 sequences each (16 + 16)")


def test_packing_a_lora_model_matches_a_real_packed_cpu_run(tmp_path):
    """peft's wrapper takes **kwargs and passes position_ids on (axolotl's QLoRA/LoRA examples pack): the packed
    LoRA step against the real one."""
    path = tmp_path / "llama.json"
    path.write_text(json.dumps(json.loads(GQA.read_text()) | {"attn_implementation": "sdpa"}))
    spec = RunSpec(str(path), batch=2, seq=32, device="cpu", precision="bf16-mixed", attn_implementation="sdpa",
                   packing=True, lora_rank=8)
    assert_within(analyze(spec).peak_allocated_bytes, measure_cpu_peak(spec), 0.001, "lora")


def test_packing_with_sdpa_on_cuda_leaves_the_flash_backend_for_the_masked_one():
    # masking_utils: a packed sequence mask turns allow_is_causal_skip off, so SDPA gets a mask, which its flash
    # backend does not take (sdp_utils.cpp): the memory-efficient backend runs
    spec = dict(batch=2, seq=64, gpu="H100", precision="bf16-mixed", attn_implementation="sdpa")
    layers = json.loads(GQA.read_text())["num_hidden_layers"]
    assert analyze(RunSpec(str(GQA), **spec), levers=False).model.sdpa_backends == {"flash": layers}
    packed = analyze(RunSpec(str(GQA), packing=True, **spec), levers=False)
    assert packed.model.sdpa_backends == {"efficient": layers}


def test_flash_attention_2_packing_is_one_varlen_row_whose_backward_grows_with_the_sequences():
    # axolotl's layout: one row of batch*seq tokens, cu_seq_lens of batch + 1 entries; flash-attn's
    # mha_varlen_bwd: softmax_d (h, total + 128 n) and dq_accum (total + 128 n, h, round32(d)) fp32
    cfg = json.loads(GQA.read_text())
    h, d = cfg["num_attention_heads"], cfg["hidden_size"] // cfg["num_attention_heads"]
    B, S = 2, 64
    r = analyze(RunSpec(str(GQA), batch=B, seq=S, gpu="H100", precision="bf16-mixed",
                        attn_implementation="flash_attention_2", packing=True), levers=False)
    rows = B * S + 128 * B
    made = [(t.dtype, t.shape) for t in r.tensors if t.module == "model.layers.0.self_attn"
            and t.phase == "backward" and t.op == "aten.empty.memory_format"]
    assert made[:2] == [("float32", (h, rows)), ("float32", (rows, h, (d + 31) // 32 * 32))]
    saved = [(t.dtype, t.shape) for t in r.tensors if t.module == "model.layers.0.self_attn"
             and t.phase == "forward" and t.category == "activation" and t.op.startswith("aten.empty")]
    assert saved == [("bfloat16", (B * S, h, d)), ("float32", (h, B * S)), ("int64", (2,))]
    assert r.run.packing.startswith(f"{B} sequences of {S} tokens in one row (1, {B * S})")


@pytest.mark.parametrize("args,message", [
    (["--mode", "inference"], "Error: --packing packs training sequences; drop it for --mode inference or generate"),
    (["--use-cache", "true"], "Error: --packing runs without a KV cache"),
])
def test_packing_outside_a_training_step_is_a_one_line_usage_error(capsys, args, message):
    assert main([str(GQA), "--batch", "2", "--seq", "16", "--packing", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(message) and "\n" not in err


def test_packing_a_model_without_position_ids_is_refused(capsys):
    assert main([str(FIXTURES / "tiny-bert.json"), "--batch", "2", "--seq", "16", "--packing"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("Error: --packing packs a causal LM's training sequences") and "\n" not in err


def test_an_unpacked_report_has_no_packing_field():
    r = analyze(RunSpec(str(GQA), batch=2, seq=16, gpu="H100"), levers=False)
    assert r.run.packing is None and "packing" not in r.to_dict()["run"]
