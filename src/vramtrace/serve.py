"""`vramtrace serve`: what a paged-attention server (vLLM) finds for its KV cache on a GPU, term by term.

Follows vLLM 0.33.0 (commit g4ba787ec9, the V1 engine with its default V2 model runner); every rule names the
file and function it mirrors. The one part that is not arithmetic is the activation peak of vLLM's profile run,
which is traced (`tracer/serving.py`): one forward of `max_num_batched_tokens` tokens packed as `max_num_seqs`
requests, logits at each request's last token only, then the dummy sampler. The model traced is transformers'
implementation of the architecture, not vLLM's own (vLLM is CUDA-only and is not installed here); vLLM fuses
the QKV and gate/up projections, which changes the order of the MLP's temporaries but not their bytes, and it
skips attention in the profile run (`skip_attn=True`), which transformers cannot: the traced peak keeps
attention's output, a (tokens, hidden) tensor the MLP's peak already exceeds.

With `--tp N` the figures are rank 0's (for the models served here every rank holds shards of the same sizes, so
each profiles and sizes the same budget). The profile run is traced under transformers' own tensor
parallelism on N fake ranks (`RunSpec.tp`, `tracer/sharding.py`): each rank holds 1/N of every projection and of
the vocabulary (embeddings, `lm_head`), the norms whole, the attention and MLP intermediates of its heads and
columns, and the all-reduced hidden states whole, as vLLM's QKVParallelLinear / MergedColumnParallelLinear /
RowParallelLinear / VocabParallelEmbedding do (`vllm/model_executor/layers/linear.py`, `vocab_parallel_embedding.py`;
vLLM pads the vocabulary to a multiple of 64 per rank first, which Llama's and Mistral's vocabularies already
are). The KV heads per rank are max(1, kv_heads // N) (`ModelConfig.get_num_kv_heads`: fewer KV heads than ranks
are replicated), and N must divide the attention heads (`ModelConfig.verify_with_parallel_config`). NCCL's and
the custom all-reduce's buffers are outside PyTorch's allocator: part of the non-PyTorch memory (`--non-torch-memory`),
which grows with N in vLLM's logs.

The budget (`vllm/v1/worker/gpu_worker.py::Worker.determine_available_memory`):

    requested  = ceil(total × gpu_memory_utilization)          vllm/v1/worker/utils.py::request_memory
    non_kv     = consumed + transient peak headroom            vllm/utils/mem_utils.py::memory_profiling
               = the profile run's peak allocated (weights included; the cuBLAS workspace, made before vLLM's
                 baseline snapshot in Worker.init_device, left out) + non-PyTorch memory that grows during
                 loading and profiling (NCCL, attention workspaces)
    available  = requested − non_kv − CUDA graph estimate      (the estimate: 0 with --enforce-eager)

The KV cache (`vllm/v1/kv_cache_interface.py::AttentionSpec.page_size_bytes`, `vllm/v1/core/kv_cache_planning.py`):

    page       = 2 × block_size × max(1, kv_heads // tp) × head_size × dtype bytes   (one layer, one block)
    per block  = layers × page                                  one KV cache group: every layer full attention
    blocks     = available // per block                         get_kv_cache_configs
    fits one   = cdiv(L, block_size) × per block ≤ available − per block   (block 0 is the null block)
    concurrency= blocks / cdiv(L, block_size)                   kv_cache_utils.py::update_kv_cache_capacity
    tokens     = int(concurrency × L)

Bytes are ints; GiB = 2**30.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from .errors import UsageError
from .gpus import GpuPreset, parse_gpu

MiB, GiB = 2**20, 2**30

VLLM_VERSION = "vLLM 0.33.0 (commit g4ba787ec9)"
DEFAULT_GPU_MEMORY_UTILIZATION = 0.92  # vllm/config/cache.py CacheConfig.gpu_memory_utilization (0.9 before 0.28)
DEFAULT_BLOCK_SIZE = 16  # vllm/config/cache.py CacheConfig.DEFAULT_BLOCK_SIZE
# Not traceable here; published vLLM logs, overridable (--non-torch-memory, --cudagraph-memory):
# non-PyTorch growth after vLLM's baseline: 0.16 GiB (PR #12126, H100) and 0.20 GiB (PR #14447, RTX 3090)
DEFAULT_NON_TORCH_BYTES = 256 * MiB
# "Estimated CUDA graph memory": 0.17 GiB (3090, TP 4) to 0.36 GiB (PIECEWISE, 16 sizes) in vLLM's logs
DEFAULT_CUDAGRAPH_BYTES = 512 * MiB
KV_DTYPE_BYTES = {"fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}  # vllm/utils/torch_utils.py STR_DTYPE_TO_TORCH_DTYPE: uint8


@dataclass(frozen=True, slots=True)
class ServeSpec:
    """What `vramtrace serve` is asked. `max_model_len` None: the config's `max_position_embeddings` (vLLM's
    derived default); `max_num_batched_tokens`/`max_num_seqs` None: vLLM's defaults for the GPU (`batch_defaults`);
    `kv_cache_dtype` 'auto' (the weights' dtype) or fp8; byte sizes are ints."""

    model: str
    gpu: str = "H100-80GB"
    max_model_len: int | None = None
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    tp: int = 1
    kv_cache_dtype: str = "auto"
    block_size: int = DEFAULT_BLOCK_SIZE
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    enforce_eager: bool = False
    non_torch_bytes: int = DEFAULT_NON_TORCH_BYTES
    cudagraph_bytes: int = DEFAULT_CUDAGRAPH_BYTES
    gpu_memory_bytes: int | None = None
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        for name in ("max_model_len", "tp", "block_size", "max_num_batched_tokens", "max_num_seqs"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
                raise UsageError(f"--{name.replace('_', '-')} must be a positive integer, got {v!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise UsageError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in KV_DTYPE_BYTES:
            raise UsageError(f"unknown --kv-cache-dtype {self.kv_cache_dtype!r}; choose one of: auto, "
                             f"{', '.join(KV_DTYPE_BYTES)}")
        for name in ("non_torch_bytes", "cudagraph_bytes"):
            if getattr(self, name) < 0:
                raise UsageError(f"--{name.removesuffix('_bytes').replace('_', '-')}-memory must be a size >= 0")
        parse_gpu(self.gpu)

    @property
    def preset(self) -> GpuPreset:
        return parse_gpu(self.gpu)


def batch_defaults(total_bytes: int, gpu_name: str) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) of `vllm serve` (usage context OPENAI_API_SERVER) on a GPU of
    `total_bytes`: vllm/engine/arg_utils.py `EngineArgs.get_batch_defaults` (0.33.0): 16384/1024 from 160 GiB,
    8192/1024 from 70 GiB except the A100, else 2048/256."""
    if total_bytes >= 160 * GiB:
        return 16384, 1024
    if total_bytes >= 70 * GiB and "a100" not in gpu_name.lower():
        return 8192, 1024
    return 2048, 256


@dataclass(frozen=True, slots=True)
class KvShape:
    """A decoder's KV cache shape as vLLM reads it from the config: attention layers, KV heads (all ranks),
    head size, and the bytes of one element of the cache dtype."""

    layers: int
    kv_heads: int
    head_size: int
    dtype_bytes: int


def kv_shape(config: dict, weight_dtype_bytes: int, kv_cache_dtype: str, tp: int = 1) -> KvShape:
    """The `KvShape` of a transformers config dict (its text config for multimodal ones). Raises UsageError for
    what this planner does not model: sliding-window or chunked layers (vLLM sizes them as their own KV cache
    groups), MLA (DeepSeek: one latent head without the factor 2), encoder-decoders, attention heads that `tp`
    ranks do not divide."""
    text = config.get("text_config") or config
    if config.get("is_encoder_decoder") or text.get("is_encoder_decoder"):
        raise UsageError("vramtrace serve models decoder-only models; this config is an encoder-decoder")
    if text.get("kv_lora_rank"):
        raise UsageError("vramtrace serve does not model MLA KV caches (kv_lora_rank) yet")
    types = set(text.get("layer_types") or [])
    if (text.get("sliding_window") and text.get("use_sliding_window", True) and (not types or types - {
            "full_attention"})) or text.get("attention_chunk_size") or types - {"full_attention"}:
        raise UsageError("vramtrace serve models full-attention layers only; this config has sliding-window or "
                         "other layer types, which vLLM sizes as separate KV cache groups (not modelled yet)")
    heads = text["num_attention_heads"]
    head_size = text.get("head_dim") or text["hidden_size"] // heads
    if heads % tp:  # vllm/config/model.py ModelConfig.verify_with_parallel_config
        raise UsageError(f"--tp {tp}: the model's {heads} attention heads must be divisible by the tensor-parallel "
                         "size, as vLLM requires")
    kv_heads = text.get("num_key_value_heads") or heads
    dtype_bytes = weight_dtype_bytes if kv_cache_dtype == "auto" else KV_DTYPE_BYTES[kv_cache_dtype]
    return KvShape(text["num_hidden_layers"], kv_heads, head_size, dtype_bytes)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def plan(spec: ServeSpec, profile_peak: Callable[[int, int], tuple[int, int, str]], config: dict,
         weight_dtype_bytes: int) -> dict:
    """Every term of the KV budget of `spec` (see the module docstring), as a JSON-ready dict of ints, floats and
    strings. `profile_peak(tokens, requests) -> (peak allocated bytes without the cuBLAS workspace, weights bytes,
    where the peak is)` traces the profile run. Raises UsageError (a config this planner does not model, a
    max_model_len beyond the model's)."""
    gpu = spec.preset
    total = spec.gpu_memory_bytes or gpu.memory_bytes
    shape = kv_shape(config, weight_dtype_bytes, spec.kv_cache_dtype, spec.tp)
    text = config.get("text_config") or config
    model_max = text.get("max_position_embeddings")
    L = spec.max_model_len or model_max
    if L is None:
        raise UsageError("the config has no max_position_embeddings: give --max-model-len")
    if model_max is not None and L > model_max:
        raise UsageError(f"--max-model-len {L} is longer than the model's max_position_embeddings {model_max}; "
                         "vLLM refuses it too")
    T, S = batch_defaults(total, gpu.name)
    T = spec.max_num_batched_tokens or min(T, S * L)  # arg_utils: min(max_num_seqs × max_model_len, default)
    S = spec.max_num_seqs or min(S, T)
    if S > T:
        raise UsageError(f"--max-num-seqs {S} exceeds --max-num-batched-tokens {T}")
    peak, weights, where = profile_peak(T, S)
    requested = math.ceil(total * spec.gpu_memory_utilization)
    cudagraph = 0 if spec.enforce_eager else spec.cudagraph_bytes
    non_kv = peak + spec.non_torch_bytes
    available = requested - non_kv - cudagraph
    kv_heads_rank = max(1, shape.kv_heads // spec.tp)
    page = 2 * spec.block_size * kv_heads_rank * shape.head_size * shape.dtype_bytes
    per_block = shape.layers * page
    blocks = max(available, 0) // per_block
    per_request = cdiv(L, spec.block_size)
    usable = available - per_block  # block 0 is the null block
    longest = max(usable, 0) // per_block * spec.block_size
    concurrency = blocks / per_request
    return {
        "vllm": VLLM_VERSION, "gpu": gpu.name, "total_bytes": total,
        "gpu_memory_utilization": spec.gpu_memory_utilization, "requested_bytes": requested,
        "max_model_len": L, "model_max_position_embeddings": model_max,
        "max_num_batched_tokens": T, "max_num_seqs": S,
        "profile_peak_bytes": peak, "profile_peak_at": where, "weights_bytes": weights,
        "activation_peak_bytes": peak - weights, "non_torch_bytes": spec.non_torch_bytes,
        "cudagraph_bytes": cudagraph, "non_kv_bytes": non_kv, "available_kv_bytes": available,
        "kv_layers": shape.layers, "kv_heads": shape.kv_heads, "kv_heads_per_rank": kv_heads_rank,
        "head_size": shape.head_size, "kv_dtype_bytes": shape.dtype_bytes, "kv_cache_dtype": spec.kv_cache_dtype,
        "block_size": spec.block_size, "page_bytes": page, "bytes_per_block": per_block,
        "kv_bytes_per_token": per_block // spec.block_size, "num_blocks": blocks,
        "blocks_per_request": per_request, "fits_one_request": available > 0 and per_request * per_block <= usable,
        "max_concurrency": concurrency, "kv_cache_tokens": int(concurrency * L),
        "longest_max_model_len": min(longest, model_max) if model_max else longest,
        "longest_by_kv_bytes": longest, "tp": spec.tp, "enforce_eager": spec.enforce_eager,
    }


def analyze_serve(spec: ServeSpec, progress: Callable[[str], None] | None = None) -> dict:
    """`plan` of `spec` with the profile run traced: transformers' model of `spec.model` built on meta in the
    serving dtype (vLLM's dtype 'auto': the config's fp16, else bf16), one inference forward of batch 1 ×
    max_num_batched_tokens packed as max_num_seqs requests with the dummy sampler (`RunSpec.serve_requests`),
    on the CUDA target of `spec.gpu` (512-byte blocks); with `spec.tp` > 1, rank 0 of transformers' tensor
    parallelism over that many fake ranks (`RunSpec.tp`). Raises what `analyze` raises, and UsageError.

    Not on `search.TraceSession`: a session keeps exact traces of sized variants of one run and refreezes the
    caller's frozen heap after each, for searches that trace several sizes (fit, sweep, levers, the planner).
    Serving traces one run once, at a size `plan` derives from the GPU's batch defaults, its dtype set here
    (vLLM's 'auto', not `resolve_precision`'s rule), with no heap to refreeze and nothing to keep: a session
    would add a cache and a heap that are never used. The config is resolved once here and the run built and
    traced with `load_model` and `step_tables`, the same two calls `TraceSession.fresh` makes."""
    from .analysis.categories import Category
    from .spec import Mode, RunSpec
    from .tables import step_tables
    from .tracer.building import load_model
    from .tracer.loading import resolve_config

    say = progress or (lambda _m: None)
    say("resolving config")
    resolved = resolve_config(spec.model)
    config = resolved.config
    text = config.get("text_config") or config
    stored = str(text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype") or "")
    precision, dtype_bytes = ("fp16", 2) if stored.endswith("float16") and "b" not in stored else ("bf16", 2)
    kv_shape(config, dtype_bytes, spec.kv_cache_dtype, spec.tp)  # a config this planner refuses, before any trace

    def profile_peak(tokens: int, requests: int) -> tuple[int, int, str]:
        run = RunSpec(spec.model, batch=1, seq=tokens, mode=Mode.INFERENCE, precision=precision, gpu=spec.gpu,
                      gpu_memory_bytes=spec.gpu_memory_bytes, serve_requests=requests,
                      trust_remote_code=spec.trust_remote_code,
                      tp=spec.tp if spec.tp > 1 else None, rank=0 if spec.tp > 1 else None)
        say(f"building model on meta ({precision})")
        loaded = load_model(run, resolved)
        say(f"tracing the profile run: {tokens:,} tokens as {requests:,} requests")
        tables = step_tables(run, loaded, progress=say)
        steady = tables.timeline()
        at = steady.peak_step
        live = [lt for lt in steady.lifetimes if lt.birth <= at <= lt.death]
        workspace = sum(lt.bytes for lt in live if lt.category is Category.CUBLAS_WORKSPACE)
        weights = sum(lt.bytes for lt in steady.lifetimes if lt.category is Category.PARAMETER)
        op = tables.traced.ops[steady.steps[at]]
        return steady.peak_bytes - workspace, weights, f"{op.name} in {op.module or '(root)'}"

    return plan(spec, profile_peak, config, dtype_bytes)
