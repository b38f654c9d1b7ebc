"""`--recipe axolotl|llamafactory`: the model built as the framework builds it, against the same step built for
real the way the framework builds it (tests/recipe_oracle.py, public APIs only) and run on the CPU."""

from __future__ import annotations

import json

import pytest

from conftest import FIXTURES
from recipe_oracle import measure_recipe_peak
from tolerance import assert_within
from vramtrace import RunSpec, analyze
from vramtrace.errors import UsageError

LLAMA = str(FIXTURES / "tiny-llama-gqa.json")
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# a Qwen3 of the tiny fixtures' size (LLaMA-Factory's QLoRA example trains Qwen3-4B)
QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 512, "hidden_size": 64,
         "intermediate_size": 176, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 16, "max_position_embeddings": 256, "tie_word_embeddings": False}


def test_axolotl_qlora_matches_the_real_step_built_as_axolotl_builds_it():
    """Issue 41's done-when: axolotl's examples/llama-2/qlora.yml settings (r 32, alpha 16, dropout 0.05,
    lora_target_linear, bf16, gradient_checkpointing with 0.21's non-reentrant default), tiny Llama."""
    case = {"model": LLAMA, "lora_rank": 32, "lora_alpha": 16, "lora_dropout": 0.05, "lora_targets": list(LINEAR),
            "batch": 2, "seq": 64, "optimizer": "adamw"}
    measured = measure_recipe_peak("axolotl", case)
    spec = RunSpec(LLAMA, batch=2, seq=64, device="cpu", recipe="axolotl", quantization="nf4", double_quant=True,
                   lora_rank=32, lora_alpha=16, lora_dropout=0.05, lora_targets=LINEAR, precision="bf16-autocast",
                   checkpointing="layers", attn_implementation="sdpa", clip_grad_norm=1.0)
    assert_within(analyze(spec).peak_allocated_bytes, measured, 0.001)


def test_llamafactory_qlora_matches_the_real_step_built_as_llamafactory_builds_it(tmp_path):
    """LLaMA-Factory's examples/train_qlora/qwen3_lora_sft_otfq.yaml settings (quantization_bit 4, lora_rank 8,
    lora_alpha default 2 * rank, lora_target all, bf16, adamw_torch_fused), its default reentrant checkpointing."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(QWEN3))
    case = {"model": str(config), "lora_rank": 8, "lora_alpha": 16, "lora_dropout": 0.0,
            "lora_targets": list(LINEAR), "batch": 2, "seq": 64, "optimizer": "adamw", "optimizer_impl": "fused"}
    measured = measure_recipe_peak("llamafactory", case)
    spec = RunSpec(str(config), batch=2, seq=64, device="cpu", recipe="llamafactory", quantization="nf4",
                   double_quant=True, lora_rank=8, lora_alpha=16, lora_targets=LINEAR, optimizer="adamw_torch_fused",
                   attn_implementation="sdpa", clip_grad_norm=1.0)
    assert_within(analyze(spec).peak_allocated_bytes, measured, 0.001)
