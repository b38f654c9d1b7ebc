"""Sample packing (`RunSpec.packing`): the inputs a packing trainer feeds a causal LM, as transformers 5.24 reads them.

Sources (docs/research/issue-41-config-sources.md section 5):

* flash_attention_2: axolotl's multipack sampler with a packing-capable attention puts one bin of
  `micro_batch_size * sequence_len` tokens in one row (`utils/samplers/multipack.py`, `core/builders/causal.py`),
  drops the attention mask (`sample_packing_drop_attention_mask`) and its collator precomputes `cu_seq_lens_q/k`
  (int32, n + 1) and `max_length_q/k` (`fa_varlen_kwargs_in_collator`, default True, with transformers'
  `prepare_fa_kwargs_from_position_ids`). transformers then takes the varlen branch of
  modeling_flash_attention_utils.py `_flash_attention_forward` (`x.reshape(-1, heads, d)`, flash_attn_varlen_func).
  Here the bin holds n = batch sequences of seq tokens each (full bins): input_ids (1, batch*seq), position_ids
  restarting at 0 every seq tokens, cu_seq_lens (0, seq, 2*seq, ..., batch*seq), max_length seq. The varlen
  backward's buffers grow with n (`softmax_d`/`dq_accum`: total + 128*n rows, tracer/flash_attn.py).
* sdpa and eager: rows (batch, seq) (axolotl with sdpa/eager: `batch_size = micro_batch_size`, bins of
  `sequence_len`), no attention mask, position ids restarting per packed sequence: masking_utils.py
  `_preprocess_mask_arguments` finds the packed sequences from the position ids (`find_packed_sequence_indices`,
  only with no attention mask and no cache) and `sdpa_mask`/`eager_mask` materialise a 4D block-diagonal causal
  mask (`allow_is_causal_skip=False`), so SDPA cannot take its flash backend. Each row here holds `PACKED_PER_ROW`
  sequences (seq - seq // 2 and seq // 2 tokens); the mask's bytes do not depend on that number. On meta, the
  value check of `find_packed_sequence_indices` is answered by the PACKED_SEQUENCES bridge
  (feature_bridges.packed_sequences): transformers' own code builds the mask from the position ids.
* In both, the config's use_cache is False (`RunSpec._check_packing` sets `use_cache`): with a cache transformers
  does not look for packed sequences, and packing trainers train without one.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from ..errors import UsageError
from ..spec import AttnImplementation, RunSpec

PACKED_PER_ROW = 2  # sdpa/eager: sequences per row of `seq` tokens


def _positions(lengths: list[int], rows: int, device: str) -> torch.Tensor:
    """position_ids (rows, sum(lengths)) int64 restarting at 0 for each length (empty on meta)."""
    total = sum(lengths)
    if device == "meta":
        return torch.empty((rows, total), dtype=torch.int64, device="meta")
    row = torch.cat([torch.arange(n, dtype=torch.int64) for n in lengths])
    return row.expand(rows, total).contiguous().to(device)


def _is_flash(spec: RunSpec) -> bool:
    return spec.attn_implementation is AttnImplementation.FLASH_ATTENTION_2


def check_packable(spec: RunSpec, model: torch.nn.Module, task: str, vlm: bool = False) -> None:
    """Raise UsageError unless `model` is a text-only causal LM whose forward takes position_ids (what packing
    feeds); `vlm`: the model is fed images (its position ids are not one row of restarting positions)."""
    if task != "causal-lm":
        raise UsageError(f"--packing packs a causal LM's training sequences; this model is built as {task}")
    if vlm:
        raise UsageError("--packing packs text sequences; vramtrace does not pack a vision-language model's "
                         "image inputs: drop --packing")
    # a peft wrapper passes its keyword arguments on to the model it wraps (peft/peft_model.py
    # PeftModelForCausalLM.forward): the wrapped model's forward decides
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if "position_ids" not in inspect.signature(base.forward).parameters:
        raise UsageError(f"--packing needs a model whose forward takes position_ids (they separate the packed "
                         f"sequences); {type(base).__name__} takes none")
    if not _is_flash(spec) and spec.seq < PACKED_PER_ROW:
        raise UsageError(f"--packing packs {PACKED_PER_ROW} sequences per row with sdpa or eager: use --seq >= "
                         f"{PACKED_PER_ROW}")


def packed_inputs(spec: RunSpec, inputs: dict[str, Any], device: str) -> dict[str, Any]:
    """`inputs` (input_ids and labels (B, S) from `building.step_inputs`) laid out as packing feeds them (module
    docstring): flash_attention_2: input_ids and labels (1, B*S), position_ids, cu_seq_lens_q/k int32 (B + 1,),
    max_length_q/k S; sdpa/eager: input_ids and labels (B, S) with position_ids (B, S) of `PACKED_PER_ROW`
    sequences per row."""
    B, S = spec.batch, spec.seq
    ids = inputs["input_ids"]
    if not _is_flash(spec):
        lengths = [S - S // PACKED_PER_ROW, S // PACKED_PER_ROW]
        return {**inputs, "position_ids": _positions(lengths, B, device)}
    flat = ids.reshape(1, B * S)
    labels = inputs["labels"].reshape(1, B * S) if "labels" in inputs else None  # its own storage, as collated
    out = {**inputs, "input_ids": flat, "position_ids": _positions([S] * B, 1, device)}
    if labels is not None:
        out["labels"] = labels
    if device == "meta":
        cu = torch.empty((B + 1,), dtype=torch.int32, device="meta")
    else:
        cu = torch.arange(0, B * S + 1, S, dtype=torch.int32, device=device)
    return {**out, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": S, "max_length_k": S}


def describe(spec: RunSpec, attn_implementation: str) -> str | None:
    """The report's `run.packing`: how the packed sequences reach the model; None without packing."""
    if not spec.packing:
        return None
    B, S = spec.batch, spec.seq
    if attn_implementation == AttnImplementation.FLASH_ATTENTION_2.value:
        return (f"{B} sequences of {S} tokens in one row (1, {B * S}) with cu_seq_lens (flash_attn_varlen_func), "
                "no attention mask; use_cache false")
    return (f"{B} rows of {S} tokens, {PACKED_PER_ROW} sequences each ({S - S // PACKED_PER_ROW} + "
            f"{S // PACKED_PER_ROW}), position ids restarting, no attention mask: a 4D block-diagonal mask "
            "built by transformers; use_cache false")
