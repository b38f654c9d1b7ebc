"""What vLLM's profile run allocates around the model's forward, written as the tensors it makes, so that the trace
counts them like any other storage (`RunSpec.serve_requests`, `vramtrace serve`).

Mirrors vLLM 0.33.0 (commit g4ba787ec9) with its default V2 model runner on CUDA
(`vllm/v1/worker/gpu/model_runner.py`) and FlashInfer's top-k/top-p sampling (the default where FlashInfer
supports the GPU, `VLLM_USE_FLASHINFER_SAMPLER`); each line names the vLLM source it stands for. Triton and
FlashInfer kernels are written as the tensors they return (`torch.empty` of their shape and dtype): on meta
only shapes and dtypes matter. T = max_num_batched_tokens, R = the profile run's requests (min(max_num_seqs,
T)), M = max_num_seqs, V = the vocabulary (vLLM pads the lm_head's rows to a multiple of 64; transformers'
lm_head is not padded, so V here is the config's).
"""

from __future__ import annotations

import torch


def runner_buffers(tokens: int, max_seqs: int, vocab: int, device: str) -> dict[str, torch.Tensor]:
    """The model runner's persistent GPU buffers sized by T, M and V, made before the profile run (so part of
    what vLLM measures as consumed, not of its transient peak), by name. Sizes from vLLM 0.33:
    `gpu/input_batch.py::InputBuffers` (input_ids int32, positions int64, is_padding bool: 13 B per token;
    query_start_loc, seq_lens, dcp_local_seq_lens: int32 per request), the penalties' `output_bin_counts`
    [M, V] int32 and `prompt_bin_mask` [M, cdiv(V, 32)] int32 (`gpu/sample/penalties.py`), the structured-output
    grammar bitmask [M, cdiv(V, 32)] int32, the logprob token ids [M, 128] int32, and FlashInfer's 1 MiB sampling
    workspace (cached from the profile run's sampler on)."""
    words = -(-vocab // 32)
    i32 = torch.int32
    shapes = {
        "vLLM input_ids": ((tokens,), i32), "vLLM positions": ((tokens,), torch.int64),
        "vLLM is_padding": ((tokens,), torch.bool), "vLLM query_start_loc": ((max_seqs + 1,), i32),
        "vLLM seq_lens": ((max_seqs,), i32), "vLLM dcp_local_seq_lens": ((max_seqs,), i32),
        "vLLM output_bin_counts": ((max_seqs, vocab), i32), "vLLM prompt_bin_mask": ((max_seqs, words), i32),
        "vLLM grammar bitmask": ((max_seqs, words), i32), "vLLM logprob token ids": ((max_seqs, 128), i32),
        "FlashInfer sampling workspace": ((1 << 20,), torch.uint8),
    }
    return {name: torch.empty(shape, dtype=dtype, device=device) for name, (shape, dtype) in shapes.items()}


def dummy_sampler(logits: torch.Tensor) -> torch.Tensor:
    """vLLM's `_dummy_sampler_run` on `logits` (R, V) in the model's dtype: a greedy pass, then the
    warmup-parameters pass ("warmup_kernels (run after the KV cache is sized) pays for the fp32 logits pipeline,
    so the profiled peak must too", gpu/model_runner.py `_dummy_sampler_run`). Returns the sampled ids (R,)."""
    R, V = logits.shape
    dev, f32, i32, i64 = logits.device, torch.float32, torch.int32, torch.int64

    def call(warmup: bool) -> torch.Tensor:  # gpu/sample/sampler.py Sampler.__call__
        torch.empty(R, dtype=i64, device=dev)  # positions of the sampled tokens
        torch.empty(R, dtype=i32, device=dev)  # their input ids
        if not warmup:  # temperature 0: gumbel.py::gumbel_sample, a blockwise argmax over the raw logits
            blocks = -(-V // 1024)
            local_argmax = logits.new_empty((R, blocks), dtype=i64)
            local_max = logits.new_empty((R, blocks), dtype=f32)
            return local_argmax.gather(-1, local_max.argmax(-1, keepdim=True)).view(-1)
        x = torch.empty_like(logits, dtype=f32).copy_(logits)  # sampler.py apply_sampling_params: fp32 copy
        # logit bias, penalties, bad words, temperature, min-p: in-place Triton kernels on x
        torch.empty(R, dtype=i32, device=dev)  # states.py get_top_k_top_p: top_k
        torch.empty(R, dtype=f32, device=dev)  # top_p
        masked = torch.empty_like(x)  # FlashInfer top_k_mask_logits: the masked logits (R, V) fp32
        probs = torch.softmax(masked, dim=-1)  # top_k_top_p_sampling_from_logits: (R, V) fp32, the peak
        samples = torch.empty(R, dtype=i32, device=dev)
        torch.empty(R, dtype=torch.bool, device=dev)  # valid
        del masked, probs
        sampled = samples.to(i64)
        topk = torch.topk(logits, 5, dim=-1).indices  # gpu/sample/logprob.py compute_topk_scores: 5 logprobs
        torch.cat((sampled.unsqueeze(-1), topk), 1)  # (R, 6) int64
        logits.new_empty((R, 6), dtype=f32)  # compute_token_logprobs: scores
        torch.empty(R, dtype=i64, device=dev)  # ranks
        del x  # the fp32 copy lives until the sampler returns
        return sampled

    call(False)
    return call(True)
