"""flash_attention_2 on a CUDA target: transformers' own flash_attention_2 path traced with a meta stand-in of
flash-attn 2.8.3's `flash_attn_func`. The expected tensors are flash-attn's rules written out here from the shapes
(flash_attn/flash_attn_interface.py FlashAttnFunc, csrc/flash_attn/flash_api.cpp mha_fwd/mha_bwd at v2.8.3)."""

from __future__ import annotations

import json

import transformers

from conftest import FIXTURES
from vramtrace import RunSpec, analyze
from vramtrace.cli import main

GQA = FIXTURES / "tiny-llama-gqa.json"
B, S = 2, 64
BLOCK = 512  # the caching allocator's smallest block (CUDACachingAllocator kMinBlockSize)


def _attention_rows(r, phase: str):
    return [t for t in r.tensors if t.module == "model.layers.0.self_attn" and t.phase == phase]


def _fa2(path, **kw):
    return analyze(RunSpec(str(path), batch=B, seq=S, gpu="H100", precision="bf16-mixed",
                           attn_implementation="flash_attention_2", **kw), levers=False)


def _config(tmp_path, **overrides):
    cfg = json.loads(GQA.read_text()) | overrides
    path = tmp_path / "llama.json"
    path.write_text(json.dumps(cfg))
    return path, cfg


def _rule(cfg: dict) -> tuple[list, list]:
    """(forward, backward) of flash-attn 2.8.3 for one attention call of `cfg` at (B, S): (category, dtype, shape)."""
    h, hk = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg["hidden_size"] // h
    dp = (d + 7) // 8 * 8  # FlashAttnFunc.forward pads the head dim to a multiple of 8
    rows = (S + 127) // 128 * 128  # mha_bwd: seqlen_q_rounded
    hd_r = (dp + 31) // 32 * 32 if dp <= 128 else (dp + 63) // 64 * 64  # head_size_rounded
    forward = [("activation", "bfloat16", (B, S, h, dp)),  # out_padded = empty_like(q)
               ("activation", "float32", (B, h, S)),  # softmax_lse
               ("activation", "int64", (2,))]  # rng_state
    backward = [("temporary", "bfloat16", (B, S, h, dp)), ("temporary", "bfloat16", (B, S, hk, dp)),
                ("temporary", "bfloat16", (B, S, hk, dp)),  # dq, dk, dv = empty_like(q, k, v)
                ("temporary", "float32", (B, h, rows)),  # softmax_d
                ("temporary", "float32", (B, rows, h, hd_r))]  # dq_accum
    if hk != h:  # GQA: dk_expanded, dv_expanded in q's dtype
        backward += [("temporary", "bfloat16", (B, S, h, dp))] * 2
    return forward, backward


def _made(rows, ops) -> list:
    return [(t.category, t.dtype, t.shape) for t in rows if t.op in ops]


FORWARD_OPS = {"aten.empty_like.default", "aten.empty.memory_format"}


def test_the_kernels_saved_tensors_and_backward_buffers_follow_flash_attn(tmp_path):
    cfg = json.loads(GQA.read_text())
    r = _fa2(GQA)
    assert r.model.attn_implementation == "flash_attention_2" and r.model.sdpa_backends == {}
    forward, backward = _rule(cfg)
    made = [m for m in _made(_attention_rows(r, "forward"), FORWARD_OPS) if m[2] != (0,)]  # p: empty({0})
    assert made == forward
    assert _made(_attention_rows(r, "backward"), FORWARD_OPS) == backward


def test_a_head_dim_not_a_multiple_of_8_pads_q_k_v_as_flash_attn_does(tmp_path):
    path, cfg = _config(tmp_path, hidden_size=48, num_attention_heads=4, num_key_value_heads=4)  # d = 12
    r = _fa2(path)
    forward, backward = _rule(cfg)
    pads = [(t.category, t.dtype, t.shape) for t in _attention_rows(r, "forward")
            if t.op == "aten.constant_pad_nd.default"]
    assert pads == [("activation", "bfloat16", (B, S, 4, 16))] * 3  # q, k, v padded to 16, saved for backward
    made = [m for m in _made(_attention_rows(r, "forward"), FORWARD_OPS) if m[2] != (0,)]
    assert made == forward
    assert _made(_attention_rows(r, "backward"), FORWARD_OPS) == backward  # MHA: no dk/dv_expanded


def test_sdpa_and_flash_attention_2_peaks_differ_by_sdpas_extra_rng_offset_per_layer():
    # both run FlashAttention-2's algorithm; SDPA's flash kernel saves its philox seed as uint64 (2,) plus an
    # offset as a 0-d uint64 tensor (torch/_meta_registrations.py `meta__scaled_dot_product_flash_attention`),
    # flash-attn one int64 (2,) rng_state: one 512 B block more per layer for SDPA, held to the backward
    spec = dict(batch=B, seq=S, gpu="H100", precision="bf16-mixed")
    sdpa = analyze(RunSpec(str(GQA), attn_implementation="sdpa", **spec), levers=False)
    fa2 = analyze(RunSpec(str(GQA), attn_implementation="flash_attention_2", **spec), levers=False)
    assert sdpa.model.sdpa_backends == {"flash": json.loads(GQA.read_text())["num_hidden_layers"]}
    layers = json.loads(GQA.read_text())["num_hidden_layers"]
    assert sdpa.peak_allocated_bytes - fa2.peak_allocated_bytes == layers * BLOCK


def test_flash_attention_2_is_still_refused_for_a_cpu_target(capsys):
    assert main([str(GQA), "--batch", "2", "--seq", "16", "--device", "cpu",
                 "--attn-implementation", "flash_attention_2"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == ("Error: attention flash_attention_2 runs only on CUDA GPUs (the flash_attn package); use "
                   "--attn-implementation sdpa or eager for --device cpu")


def test_fp32_attention_inputs_are_refused_in_one_line(capsys):
    assert main([str(GQA), "--batch", "2", "--seq", "16", "--gpu", "H100", "--precision", "fp32",
                 "--attn-implementation", "flash_attention_2"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("Error: attention flash_attention_2 runs fp16 and bf16 only") and "\n" not in err


def test_the_stand_in_leaves_transformers_as_found():
    from transformers import modeling_flash_attention_utils as fa_utils, modeling_utils

    before = (fa_utils.lazy_import_flash_attention, modeling_utils.lazy_import_flash_attention,
              fa_utils._is_packed_sequence, fa_utils._loaded_implementation,
              vars(modeling_utils.PreTrainedModel)["_flash_attn_import_error"],
              transformers.integrations.flash_attention.get_target_dtype)
    _fa2(GQA)
    after = (fa_utils.lazy_import_flash_attention, modeling_utils.lazy_import_flash_attention,
             fa_utils._is_packed_sequence, fa_utils._loaded_implementation,
             vars(modeling_utils.PreTrainedModel)["_flash_attn_import_error"],
             transformers.integrations.flash_attention.get_target_dtype)
    assert after == before
    assert not transformers.utils.is_flash_attn_2_available()  # nothing was installed or faked for good


def test_a_short_batch_takes_split_kv_accumulators_as_flash_attn_heuristic_picks():
    # flash_api.cpp `set_params_splitkv` (v2.8.3), H100 (132 SMs): d = 16 -> block_n 256; seq 1024 -> 4 key blocks;
    # b*h*ceil(s/64) = 2*4*16 = 128 < 0.8 * 264, so `num_splits_heuristic` runs: splits 1, 2, 4 are eligible (3
    # gives the same 2 blocks per split as 2), efficiencies 128/264 = 0.48, 256/264 = 0.97, 512/528 = 0.97: the
    # first >= 0.85 * 0.97 is 2 splits. Accumulators: softmax_lse_accum (2, b, h, s) and out_accum
    # (2, b, h, s, 32) fp32, freed when the kernel returns
    r = analyze(RunSpec(str(GQA), batch=2, seq=1024, gpu="H100", precision="bf16-mixed",
                        attn_implementation="flash_attention_2"), levers=False)
    temps = [(t.dtype, t.shape) for t in _attention_rows(r, "forward")
             if t.op == "aten.empty.memory_format" and t.category == "temporary" and t.shape != (0,)]
    assert temps == [("float32", (2, 2, 4, 1024)), ("float32", (2, 2, 4, 1024, 32))]


def test_a_generation_with_the_dynamic_cache_runs_flash_attn_func_on_the_growing_cache():
    # generate drops the all-ones mask, so every call (prefill, then one query token per step) is flash_attn_func
    r = analyze(RunSpec(str(GQA), batch=2, seq=32, mode="generate", new_tokens=3, gpu="H100", precision="bf16",
                        attn_implementation="flash_attention_2"), levers=False)
    assert r.model.attn_implementation == "flash_attention_2" and r.model.sdpa_backends == {}
    lse = [t.shape for t in r.tensors if t.module == "model.layers.0.self_attn" and t.dtype == "float32"
           and t.op == "aten.empty.memory_format" and len(t.shape) == 3]
    assert lse[0] == (2, 4, 32) and set(lse[1:]) == {(2, 4, 1)}  # softmax_lse of the prefill, then of each token
