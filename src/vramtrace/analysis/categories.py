"""Storage categories, as readable str enums (the style of torch/distributed/_tools/mem_tracker.py)."""

from __future__ import annotations

import enum


class Category(str, enum.Enum):
    PARAMETER = "parameter"
    GRADIENT = "gradient"
    OPTIMIZER_STATE = "optimizer_state"
    ACTIVATION = "activation"  # saved for backward by autograd during the forward
    TEMPORARY = "temporary"
    INPUT = "input"  # inputs and module buffers
    # autocast's low-precision copies of fp32 weights, cached until the autocast region exits
    # (aten/src/ATen/autocast_mode.cpp `cached_cast`)
    AUTOCAST_WEIGHTS = "autocast_weights"
    KV_CACHE = "kv_cache"  # the key/value cache a model builds when use_cache is on (transformers' Cache)
    OUTPUTS = "outputs"  # the model's outputs the loop holds (logits, loss), neither saved nor categorised above
    KEPT = "kept_across_steps"  # made by a step and kept for the next (a --step function's EMA copy, scaler state)
    # cuBLAS workspaces: one per (thread, stream) that runs GEMMs, allocated through the caching allocator and
    # never freed (analysis/device.py::cublas_workspace_bytes)
    CUBLAS_WORKSPACE = "cublas_workspace"
    # FSDP2 (`--fsdp`, tracer/sharding.py): each layer's parameters all-gathered whole for its forward and
    # backward (FSDPParam.all_gather_outputs, freed by resizing their storage to 0 at reshard)
    UNSHARDED_PARAMETERS = "unsharded_parameters"
    # FSDP2's flat all-gather input/output (fsdp.all_gather_copy_in), reduce-scatter input (fsdp.chunk_cat) and the
    # temporaries a CPU target's gloo collectives hold; under CPU offload each shard's copy from host memory (the
    # all-gather's input); DDP's gradient buckets
    COLLECTIVE_BUFFERS = "collective_buffers"
    # bitsandbytes' quantized weights (`--quantization`, tracer/quantization.py): the packed 4-bit Params4bit
    # storages (ceil(n / 2) bytes), and their quantization constants (QuantState: absmax per block, with double
    # quantization the uint8 absmax plus its nested fp32 absmax, code tables and offset)
    QUANTIZED_WEIGHTS = "quantized_weights"
    QUANT_CONSTANTS = "quantization_constants"
    # the weights bitsandbytes dequantizes for each matmul, in the forward and again in the backward
    # (bitsandbytes/autograd/_functions.py `MatMul4Bit`: `F.dequantize_4bit`), freed after the matmul
    DEQUANTIZED_WEIGHTS = "dequantized_weights"
    # a paged bitsandbytes optimizer's states of parameters of at least 1e5 elements on a CUDA target: CUDA managed
    # memory (cudaMallocManaged, bitsandbytes/functional.py `get_paged`), outside PyTorch's caching allocator: not
    # in allocated or reserved bytes (tracer/recorder.py `managed`)
    PAGED_OPTIMIZER_STATE = "paged_optimizer_state"
    # a CUDA target's caching allocator: the bytes by which blocks handed out whole exceed their rounded requests,
    # a large-pool block's rest of at most 1 MiB not split off (c10/cuda/CUDACachingAllocator.cpp `should_split`,
    # `alloc_found_block` counts `block->size` in memory_allocated()); not a storage, a line of the breakdown
    ALLOCATOR_REMAINDER = "allocator_remainder"
    # a pipeline stage's (`--pp`, tracer/pipelining.py) receive buffers, one per micro-batch and direction, made in
    # its first step and kept for its life (torch/distributed/pipelining/stage.py `_RecvInfo.buffer`), and the
    # input gradients its send Works hold until the schedule drops them
    PIPELINE_BUFFERS = "pipeline_buffers"


# Categories only some steps have (a report leaves them out of its table when they hold nothing): a sharded
# step's, a quantized model's.
OPTIONAL = frozenset({Category.UNSHARDED_PARAMETERS, Category.COLLECTIVE_BUFFERS, Category.QUANTIZED_WEIGHTS,
                      Category.QUANT_CONSTANTS, Category.DEQUANTIZED_WEIGHTS, Category.PAGED_OPTIMIZER_STATE,
                      Category.ALLOCATOR_REMAINDER, Category.PIPELINE_BUFFERS})


# Categories whose storages must outlive the step even under last-use freeing (graph-optimal figure).
PERSISTENT = frozenset({Category.PARAMETER, Category.OPTIMIZER_STATE, Category.INPUT, Category.KEPT,
                        Category.CUBLAS_WORKSPACE, Category.QUANTIZED_WEIGHTS, Category.QUANT_CONSTANTS})
