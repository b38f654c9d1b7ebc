"""`--recipe axolotl|llamafactory`: the model built as the framework builds it, against the same step built for
real the way the framework builds it (tests/recipe_oracle.py, public APIs only) and run on the CPU."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from conftest import FIXTURES, deep_config
from recipe_oracle import measure_recipe_peak
from tolerance import assert_within
from vramtrace import RunSpec, analyze
from vramtrace.errors import UsageError
from vramtrace.sources import spec_from

LLAMA = str(FIXTURES / "tiny-llama-gqa.json")
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# a Qwen3 of the tiny fixtures' size (LLaMA-Factory's QLoRA example trains Qwen3-4B)
QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 512, "hidden_size": 64,
         "intermediate_size": 176, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 16, "max_position_embeddings": 256, "tie_word_embeddings": False}


def test_axolotl_qlora_matches_the_real_step_built_as_axolotl_builds_it():
    """Issue 41's done-when: axolotl's examples/llama-2/qlora.yml settings (r 32, alpha 16, dropout 0.05,
    lora_target_linear, bf16, gradient_checkpointing with 0.21's non-reentrant default), tiny Llama."""
    case = {"model": LLAMA, "quantization": "nf4", "lora_rank": 32, "lora_alpha": 16, "lora_dropout": 0.05, "lora_targets": list(LINEAR),
            "batch": 2, "seq": 64, "optimizer": "adamw"}
    measured = measure_recipe_peak("axolotl", case)
    spec = RunSpec(LLAMA, batch=2, seq=64, device="cpu", recipe="axolotl", quantization="nf4", double_quant=True,
                   lora_rank=32, lora_alpha=16, lora_dropout=0.05, lora_targets=LINEAR, precision="bf16-autocast",
                   checkpointing="layers", attn_implementation="sdpa", clip_grad_norm=1.0)
    assert_within(analyze(spec).peak_allocated_bytes, measured, 0.001)


def test_axolotl_qlora_example_file_read_by_from_matches_the_real_axolotl_build():
    """Issue 41's done-when end to end: axolotl's own examples/llama-2/qlora.yml read by `vramtrace.sources`
    (`--from`), its base model, sequence length, attention and packing replaced for a CPU run (a tiny Llama at 64
    tokens, sdpa: flash-attn runs on CUDA only; the real build does not pack), against the step built as axolotl
    builds it from the values the test reads from the YAML itself. The file is read for the GPU it is written for
    (the default H100: `bf16: auto` resolves to bf16, axolotl's `resolve_dtype`), as the real build runs it (bf16
    weights, compute dtype and autocast), then predicted on the CPU: read for `device="cpu"`, `bf16: auto` resolves
    to fp16 (no bf16 GPU), and an fp16 prediction against the bf16 run agrees only where the CPU runs both dtypes'
    matmuls without a workspace (AVX2); on AVX-512 ATen sends bf16 mm to oneDNN, whose scratchpad the fp16 trace
    lacks (16,512 B for the peak's (128, 176) @ (176, 32) at two threads)."""
    path = Path(__file__).resolve().parent.parent / "docs/research/issue-41-examples/axolotl/llama-2__qlora.yml"
    data = yaml.safe_load(path.read_text())
    assert data["adapter"] == "qlora" and data["load_in_4bit"] and data["lora_target_linear"]
    case = {"model": LLAMA, "quantization": "nf4", "lora_rank": data["lora_r"], "lora_alpha": data["lora_alpha"],
            "lora_dropout": data["lora_dropout"], "lora_targets": list(LINEAR), "batch": data["micro_batch_size"],
            "seq": 64, "optimizer": data["optimizer"], "grad_accum": data["gradient_accumulation_steps"]}
    measured = measure_recipe_peak("axolotl", case)
    spec = spec_from(path, model=LLAMA, seq=64, attn_implementation="sdpa", packing=False)
    assert (spec.recipe.value, spec.batch, spec.grad_accum, str(spec.checkpointing), spec.precision.value,
            spec.bnb_compute_dtype) == ("axolotl", data["micro_batch_size"], data["gradient_accumulation_steps"],
                                        "layers", "bf16-autocast", "bf16")  # what recipe_oracle builds
    assert_within(analyze(replace(spec, device="cpu")).peak_allocated_bytes, measured, 0.001)


def test_llamafactory_qlora_matches_the_real_step_built_as_llamafactory_builds_it(tmp_path):
    """LLaMA-Factory's examples/train_qlora/qwen3_lora_sft_otfq.yaml settings (quantization_bit 4, lora_rank 8,
    lora_alpha default 2 * rank, lora_target all, bf16, adamw_torch_fused), its default reentrant checkpointing."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(QWEN3))
    case = {"model": str(config), "quantization": "nf4", "lora_rank": 8, "lora_alpha": 16, "lora_dropout": 0.0,
            "lora_targets": list(LINEAR), "batch": 2, "seq": 64, "optimizer": "adamw", "optimizer_impl": "fused"}
    measured = measure_recipe_peak("llamafactory", case)
    spec = RunSpec(str(config), batch=2, seq=64, device="cpu", recipe="llamafactory", quantization="nf4",
                   double_quant=True, lora_rank=8, lora_alpha=16, lora_targets=LINEAR, optimizer="adamw_torch_fused",
                   attn_implementation="sdpa", clip_grad_norm=1.0)
    assert_within(analyze(spec).peak_allocated_bytes, measured, 0.001)


LORA = {"lora_rank": 16, "lora_alpha": 32, "lora_dropout": 0.0, "lora_targets": list(LINEAR)}


@pytest.mark.parametrize("recipe,case,kw", [
    # axolotl LoRA on 16-bit weights: norms fp32 then back to bf16, no kbit preparation, fp32 adapters
    ("axolotl", {**LORA, "checkpointing": True}, {"checkpointing": "layers"}),
    # axolotl full fine-tune (sdpa: should_convert_embedding_dtypes False): norms, embed_tokens and lm_head in
    # fp32, the other weights bf16, AdamW states alike; gradient_checkpointing off (axolotl's default)
    ("axolotl", {"checkpointing": False}, {}),
    # LLaMA-Factory full fine-tune: every parameter cast to fp32 (_setup_full_tuning) under bf16 autocast
    ("llamafactory", {}, {}),
    # LLaMA-Factory LoRA on 16-bit weights, its reentrant checkpointing of every layer
    ("llamafactory", LORA, {}),
], ids=["axolotl-lora", "axolotl-full", "llamafactory-full", "llamafactory-lora"])
def test_recipe_lora_and_full_fine_tune_match_the_real_build(recipe, case, kw):
    case = {"model": LLAMA, "batch": 2, "seq": 32, "optimizer": "adamw", **case}
    measured = measure_recipe_peak(recipe, case)
    lora = {k: tuple(v) if isinstance(v, list) else v for k, v in case.items() if k.startswith("lora_")}
    spec = RunSpec(LLAMA, batch=2, seq=32, device="cpu", recipe=recipe, attn_implementation="sdpa",
                   clip_grad_norm=1.0, **{k: v for k, v in lora.items() if k != "lora_dropout" or v}, **kw)
    assert_within(analyze(spec).peak_allocated_bytes, measured, 0.001)


def test_a_recipe_sets_its_defaults_and_is_named_in_the_report():
    """No --precision: bf16-autocast; checkpointing: axolotl none, LLaMA-Factory reentrant layers; use_cache False;
    `run.recipe` names it (absent without a recipe)."""
    axolotl = RunSpec(LLAMA, batch=1, seq=8, device="cpu", recipe="axolotl", lora_rank=8, quantization="nf4")
    factory = RunSpec(LLAMA, batch=1, seq=8, device="cpu", recipe="llamafactory", lora_rank=8)
    assert (str(axolotl.checkpointing), str(factory.checkpointing)) == ("none", "layers:reentrant")
    assert axolotl.use_cache is False and factory.use_cache is False
    assert axolotl.double_quant  # axolotl's BitsAndBytesConfig always quantizes the absmax
    report = analyze(factory)
    assert report.run.recipe.value == "llamafactory" and report.run.precision.value == "bf16-autocast"
    assert report.run.checkpointing_source == "--recipe llamafactory's default"
    assert report.model.param_dtype == "bfloat16"
    assert "recipe" not in analyze(RunSpec(LLAMA, batch=1, seq=8, device="cpu")).to_dict()["run"]
    assert report.to_dict()["run"]["recipe"] == "llamafactory"


@pytest.mark.parametrize("kw,match", [
    ({"mode": "inference"}, "training"),
    ({"freeze": ("model.embed_tokens.*",)}, "freeze"),
    ({"recipe": "unsloth"}, "axolotl, llamafactory"),
    ({"quantization": "nf4"}, "adapter only"),
    ({"recipe": "axolotl", "quantization": "fp4", "lora_rank": 8}, "nf4"),
])
def test_a_recipe_refuses_what_it_does_not_model_in_one_line(kw, match):
    with pytest.raises(UsageError, match=match):
        RunSpec(LLAMA, batch=1, seq=8, device="cpu", **{"recipe": "llamafactory", **kw})


@pytest.mark.parametrize("recipe", ["axolotl", "llamafactory"])
def test_a_recipe_applies_to_the_replicated_layers_as_to_every_layer(tmp_path, recipe):
    """The shallow copy traced for a deep stack (replication.py) is built with the recipe too: the same peak as
    tracing all 5 layers."""
    spec = RunSpec(deep_config(tmp_path, "tiny-llama-gqa", 5), batch=2, seq=16, device="cpu", recipe=recipe,
                   quantization="nf4", lora_rank=8, lora_targets=LINEAR, checkpointing="layers")
    shallow = analyze(spec)
    assert "every layer traced" not in shallow.run.trace
    assert shallow.peak_allocated_bytes == analyze(replace(spec, replicate_layers=False)).peak_allocated_bytes
