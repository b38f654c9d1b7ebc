"""Coverage of transformers' architectures: build a tiny variant of each, trace train and inference on the CPU
target, run the same step for real on this CPU (profiler allocator events, as `vramtrace validate`), and
write docs/coverage.md.

    python benchmarks/coverage.py            # rewrites docs/coverage.md (a few minutes on 2 cores)
    python benchmarks/coverage.py llama t5   # only these rows, printed, docs untouched

The tiny configs below keep each architecture's structure (attention variant, norms, MoE, encoder-decoder,
vision stems) at hidden size 64 and 2 layers; batch 2, sequence 32, images 32x32, fp32, AdamW.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent

TEXT = {"vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 128, "max_position_embeddings": 256}
LLAMA_LIKE = {**TEXT, "num_key_value_heads": 2, "tie_word_embeddings": False}
LABELS = {"num_labels": 10}
VISION = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
          "image_size": 32, "patch_size": 8}

CONFIGS: dict[str, dict] = {
    "llama": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], **LLAMA_LIKE},
    "mistral": {"model_type": "mistral", "architectures": ["MistralForCausalLM"], **LLAMA_LIKE, "sliding_window": 16},
    "mixtral": {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], **LLAMA_LIKE,
                "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], **LLAMA_LIKE},
    "gemma2": {"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"], **LLAMA_LIKE, "head_dim": 16,
               "query_pre_attn_scalar": 16, "sliding_window": 16},
    "phi3": {"model_type": "phi3", "architectures": ["Phi3ForCausalLM"], **LLAMA_LIKE, "pad_token_id": 0,
             "bos_token_id": 1, "eos_token_id": 2},
    "gpt2": {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 512, "n_embd": 64,
             "n_layer": 2, "n_head": 4, "n_positions": 256},
    "gpt_neox": {"model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"], **TEXT, "rotary_pct": 0.25},
    "falcon": {"model_type": "falcon", "architectures": ["FalconForCausalLM"], "vocab_size": 512, "hidden_size": 64,
               "num_hidden_layers": 2, "num_attention_heads": 4},
    "opt": {"model_type": "opt", "architectures": ["OPTForCausalLM"], "vocab_size": 512, "hidden_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "ffn_dim": 128, "word_embed_proj_dim": 64,
            "max_position_embeddings": 256, "pad_token_id": 1},
    "bloom": {"model_type": "bloom", "architectures": ["BloomForCausalLM"], "vocab_size": 512, "hidden_size": 64,
              "n_layer": 2, "n_head": 4},
    "bert": {"model_type": "bert", "architectures": ["BertForMaskedLM"], **TEXT},
    "roberta": {"model_type": "roberta", "architectures": ["RobertaForMaskedLM"], **TEXT, "pad_token_id": 1,
                "max_position_embeddings": 258},
    "deberta-v2": {"model_type": "deberta-v2", "architectures": ["DebertaV2ForMaskedLM"], **TEXT,
                   "relative_attention": True, "pos_att_type": ["p2c", "c2p"], "position_buckets": 32},
    "t5": {"model_type": "t5", "architectures": ["T5ForConditionalGeneration"], "vocab_size": 512, "d_model": 64,
           "d_ff": 128, "d_kv": 16, "num_heads": 4, "num_layers": 2, "decoder_start_token_id": 0, "pad_token_id": 0},
    "bart": {"model_type": "bart", "architectures": ["BartForConditionalGeneration"], "vocab_size": 512,
             "d_model": 64, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
             "decoder_attention_heads": 4, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128,
             "max_position_embeddings": 256, "pad_token_id": 1, "decoder_start_token_id": 2},
    "vit": {"model_type": "vit", "architectures": ["ViTForImageClassification"], **VISION, **LABELS},
    "convnext": {"model_type": "convnext", "architectures": ["ConvNextForImageClassification"],
                 "hidden_sizes": [16, 32, 64, 128], "depths": [1, 1, 1, 1], **LABELS},
    "resnet": {"model_type": "resnet", "architectures": ["ResNetForImageClassification"], "embedding_size": 16,
               "hidden_sizes": [16, 32, 64, 128], "depths": [1, 1, 1, 1], "layer_type": "basic", **LABELS},
    "swin": {"model_type": "swin", "architectures": ["SwinForImageClassification"], "image_size": 32,
             "patch_size": 4, "embed_dim": 16, "depths": [1, 1], "num_heads": [2, 4], "window_size": 4, **LABELS},
    "clip": {"model_type": "clip", "architectures": ["CLIPModel"], "projection_dim": 32,
             "text_config": {**TEXT, "max_position_embeddings": 64},
             "vision_config": {**VISION}},
}


def run(name: str, cfg: dict, tmp: Path) -> list[dict]:
    from vramtrace import RunSpec, analyze
    from vramtrace.validate import measure_step

    path = tmp / f"tiny-{name}.json"
    path.write_text(json.dumps(cfg))
    rows = []
    for mode in ("train", "inference"):
        spec = RunSpec(str(path), batch=2, seq=32, mode=mode, device="cpu", precision="fp32", image_size=32)
        row = {"arch": name, "class": cfg["architectures"][0], "mode": mode}
        try:
            t0 = time.perf_counter()
            report = analyze(spec)
            row["trace_s"] = time.perf_counter() - t0
            row["predicted"] = report.peak_allocated_bytes
            row["unresolved"] = len(report.unresolved)
        except Exception as e:  # the table records why
            row["error"] = f"trace: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
            rows.append(row)
            continue
        try:
            row["measured"] = measure_step(spec).peak_allocated_bytes
        except Exception as e:
            row["error"] = f"real run: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    out = ["| architecture | class | mode | traced | predicted (B) | measured (B) | error |",
           "|---|---|---|---|---:|---:|---:|"]
    for r in rows:
        if "predicted" not in r:
            out.append(f"| {r['arch']} | {r['class']} | {r['mode']} | no: {r['error']} | | | |")
            continue
        err = f"{100 * (r['predicted'] - r['measured']) / r['measured']:+.3f}%" if "measured" in r else r["error"]
        out.append(f"| {r['arch']} | {r['class']} | {r['mode']} | yes | {r['predicted']:,} | "
                   f"{r.get('measured', 0):,} | {err} |")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    import platform

    import torch
    import transformers

    names = argv or list(CONFIGS)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            rows += run(name, CONFIGS[name], Path(tmp))
            for r in rows[-2:]:
                print(table([r]).splitlines()[-1], flush=True)
    ok = [r for r in rows if "measured" in r]
    worst = max((abs(r["predicted"] - r["measured"]) / r["measured"] for r in ok), default=0.0)
    summary = (f"{len({r['arch'] for r in rows if 'predicted' in r})} of {len(names)} architectures traced in both "
               f"modes; {len(ok)} of {len(rows)} runs compared; largest |error| {100 * worst:.3f}%")
    print(summary)
    if argv:
        return 0
    doc = f"""# Coverage of transformers' architectures

Generated by `python benchmarks/coverage.py` (do not edit by hand). Each row builds the tiny variant of the
architecture (hidden size 64, 2 layers; configs in the script), predicts the peak allocated bytes of one step
with `--device cpu --precision fp32 --batch 2 --seq 32 --image-size 32` (AdamW to train), then runs the same
step for real on this CPU and measures it with torch.profiler's allocator events after one warm-up step (the
method of `vramtrace validate`). Error = (predicted - measured) / measured.

{summary}.

Versions: torch {torch.__version__}, transformers {transformers.__version__}, Python {platform.python_version()},
{platform.machine()}.

{table(rows)}
"""
    (ROOT / "docs" / "coverage.md").write_text(doc)
    print(f"wrote {ROOT / 'docs' / 'coverage.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
