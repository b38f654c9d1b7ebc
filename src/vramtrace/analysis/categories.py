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
    # temporaries a CPU target's gloo collectives hold; DDP's gradient buckets
    COLLECTIVE_BUFFERS = "collective_buffers"


# Categories only a sharded step has (a report leaves them out of its table when they hold nothing).
SHARDING = frozenset({Category.UNSHARDED_PARAMETERS, Category.COLLECTIVE_BUFFERS})


# Categories whose storages must outlive the step even under last-use freeing (graph-optimal figure).
PERSISTENT = frozenset({Category.PARAMETER, Category.OPTIMIZER_STATE, Category.INPUT, Category.KEPT,
                        Category.CUBLAS_WORKSPACE})
