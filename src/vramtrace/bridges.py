"""Every patch vramtrace makes to transformers or torch internals, and every private name it reads, in one place.

A trace runs real transformers and torch code on meta tensors. A few places in that code ask a question meta
tensors cannot answer (a `.item()`), or take a path the target device would not take. Each bridge below
replaces one such symbol while a step is recorded (`installed`) and puts the original back on exit, also when
the step raises. Each declares what it patches (`targets`: module and attribute) and the library versions it
was written for (`written_for`). A bridge of kind READ patches nothing: it declares private names the tracer reads
(a reference count, a cache to clear, Inductor's internals), checked the same way before they are used.

When a target is missing (an upgrade renamed or removed it), the bridge does not quietly do nothing: the
trace stops with a `BridgeError` naming the target and the installed version, before anything is patched.
The exceptions say why in their `when_absent`: `padding_warning`, a symbol that exists only to log a warning,
which no transformers code can call once it is gone; the Qwen-VL bridge, whose modules an older transformers
lacks (no such model to trace); the two bitsandbytes bridges, absent without the optional extra [quant].

The patches applied around one feature rather than every step (a traced generation, FSDP2 and DDP on meta,
activation checkpointing) and two feature reads live in `vramtrace.feature_bridges`; every bridge is declared here.

`tests/test_bridges.py` checks that every target exists in the installed versions (so CI fails when an
upgrade removes one) and that a missing target raises.
"""

from __future__ import annotations

import contextlib
import dis
import importlib
import inspect
import sys
from typing import Callable, Iterator

import torch

from .bridge_types import Bridge, BridgeKind, KernelPolicy, StepRecording
from .errors import BridgeError


# The versions the bridges were written and tested against. Targets were also checked present in the
# released wheels of transformers 5.17.0, 5.18.0, 5.20.0, 5.21.0 and 5.22.0 (absent in 5.0.0: no `fast_all`,
# `is_tracing` import in masking_utils, nor `integrations.moe._can_use_grouped_mm`).
TRANSFORMERS_WRITTEN_FOR = "transformers 5.23"
TORCH_WRITTEN_FOR = "torch 2.13"




HOST_RNG_STATE = Bridge(
    "host_rng_state", "torch", (("torch", "get_rng_state"),), TORCH_WRITTEN_FOR,
    "torch.get_rng_state() allocates a host tensor outside the dispatcher (torch.utils.checkpoint's "
    "preserve_rng_state, torch.random.fork_rng): register it with the recorder")
MAYBE_AUTOCAST = Bridge(
    "maybe_autocast", "transformers", (("transformers.utils.generic", "maybe_autocast"),), TRANSFORMERS_WRITTEN_FOR,
    "maybe_autocast(device_type='meta', enabled=False) is a no-op on meta: make it disable the emulated "
    "autocast, as the real call does on the target device (e.g. Llama's rotary embedding)")
PACKED_SEQUENCE_CHECK = Bridge(
    "packed_sequence_check", "transformers",
    (("transformers.masking_utils", "find_packed_sequence_indices"), ("transformers.masking_utils", "is_tracing")),
    TRANSFORMERS_WRITTEN_FOR,
    "find_packed_sequence_indices ends in bool((mask[:, -1] == 0).all()), a .item() meta cannot answer: run "
    "its ops, answer None (our position ids are one sequence per row)")
PADDING_MASK_CHECK = Bridge(
    "padding_mask_check", "transformers", (("transformers.masking_utils", "fast_all"),), TRANSFORMERS_WRITTEN_FOR,
    "`padding_mask is None or fast_all(padding_mask)` needs a .item(): on meta it is True (the inputs carry "
    "no padding token: building.step_inputs draws none)")
PADDING_WARNING = Bridge(
    "padding_warning", "transformers",
    (("transformers.modeling_utils", "PreTrainedModel.warn_if_padding_and_no_attention_mask"),),
    TRANSFORMERS_WRITTEN_FOR,
    "warn_if_padding_and_no_attention_mask asks `pad_token_id in input_ids[:, [-1, 0]]` (a .item()) only to "
    "log a warning: on meta, run the check's ops and skip the answer",
    when_absent="models call it as self.warn_if_padding_and_no_attention_mask, which fails for real runs too "
                "once PreTrainedModel lacks it, so a transformers without it does not call it")
MOE_GROUPED_MM = Bridge(
    "moe_grouped_mm", "transformers", (("transformers.integrations.moe", "_can_use_grouped_mm"),),
    TRANSFORMERS_WRITTEN_FOR,
    "torch.nn.functional.grouped_mm's meta kernel takes bf16 only: on meta weights take transformers' "
    "grouped_mm_fallback custom op, whose fake kernel allocates the same outputs")
CHECKPOINT_FUNCTION = Bridge(
    "checkpoint_function", "transformers",
    (("transformers.modeling_layers", "GradientCheckpointingLayer"),), TRANSFORMERS_WRITTEN_FOR,
    "activation_checkpointing_enable stores the checkpoint function as the instance attribute "
    "`_gradient_checkpointing_func` of each module GradientCheckpointingLayer.__call__ checkpoints: route it "
    "through the tracer's region wrapper (recompute marking, autocast); none found is a BridgeError")

MHA_FAST_PATH = Bridge(
    "mha_fast_path", "torch",
    (("torch.overrides", "has_torch_function"), ("torch", "is_autocast_enabled"),
     ("torch.utils.backend_registration", "_privateuse1_backend_name")), TORCH_WRITTEN_FOR,
    "nn.MultiheadAttention.forward and nn.TransformerEncoderLayer.forward (torch/nn/modules/activation.py, "
    "transformer.py) take their eval fast path (torch._native_multi_head_attention, "
    "torch._transformer_encoder_layer_fwd) on CPU and CUDA tensors with no torch-function override; they refuse "
    "meta tensors and any active torch-function mode. Called from those two forwards only, answer as on the "
    "target: has_torch_function False for meta tensors, is_autocast_enabled() (CUDA autocast) the emulated "
    "autocast on a CUDA target, and the device-type lists accept 'meta' (through the privateuse1 name) while "
    "such a module runs in eval")
GRAD_SCALER_FOUND_INF = Bridge(
    "grad_scaler_found_inf", "torch", (("torch.amp.grad_scaler", "GradScaler._maybe_opt_step"),), TORCH_WRITTEN_FOR,
    "GradScaler.step runs optimizer.step() only if `sum(v.item() for v in found_inf_per_device)` is 0, a .item() "
    "meta cannot answer: answer 0 (no inf or NaN: the steady-state step that updates the weights, the one whose "
    "memory matters)")
CLIP_GRAD_FOREACH = Bridge(
    "clip_grad_foreach", "torch",
    (("torch.nn.utils.clip_grad", "_has_foreach_support"), ("torch.nn.utils.clip_grad", "_device_has_foreach_support")),
    TORCH_WRITTEN_FOR,
    "clip_grad_norm_(foreach=None) takes the foreach kernels where torch/utils/_foreach_utils.py "
    "`_device_has_foreach_support` says so: CUDA and CPU, never meta. Answer for meta tensors as for the target "
    "(both targets have them), so the trace runs the target's foreach norms")
FUNCTIONAL_TORCH_FUNCTION_CHECK = Bridge(
    "functional_torch_function_check", "torch", (("torch.nn.functional", "has_torch_function"),), TORCH_WRITTEN_FOR,
    "a Python composite of torch.nn.functional (multi_head_attention_forward) first hands itself whole to the "
    "active torch-function mode; called again from inside the kernel-policy mode, its next check answers False "
    "once, so its body runs and the mode sees its linear and scaled_dot_product_attention calls")

FUSED_OPTIMIZER_DEVICES = Bridge(
    "fused_optimizer_devices", "torch", (("torch.optim.optimizer", "_get_fused_kernels_supported_devices"),),
    TORCH_WRITTEN_FOR,
    "Adam/AdamW/SGD/Adagrad(fused=True) refuse parameters on a device outside torch/utils/_foreach_utils.py "
    "`_get_fused_kernels_supported_devices` (torch/optim/optimizer.py `_device_dtype_check_for_fused`); meta is "
    "not listed, though `_fused_adam_`/`_fused_adamw_` have meta kernels. Both targets are listed: add meta")
ADAFACTOR_SCALARS = Bridge(
    "adafactor_scalars", "torch",
    (("torch.optim._adafactor", "_single_tensor_adafactor"), ("torch.optim._adafactor", "_multi_tensor_adafactor")),
    TORCH_WRITTEN_FOR,
    "torch.optim.Adafactor's step functions (for-loop and foreach) turn norms into Python floats "
    "(`param.norm(2).item()` for the relative step size, `update.norm(2).item()` for the update clipping), a "
    ".item() meta cannot answer. The norms' ops run; while either function runs, Tensor.item of a meta tensor "
    "answers 1.0: the values only scale the update, never a size")

_WHISPER = "transformers.models.whisper.generation_whisper"
GENERATION_QUESTIONS = Bridge(
    "generation_questions", "transformers",
    (("transformers.generation.utils", "GenerationMixin.generate"),
     ("transformers.generation.utils", "GenerationMixin._prepare_special_tokens"),
     ("transformers.generation.utils", "GenerationMixin._get_logits_processor"),
     ("transformers.generation.utils", "StopCheck"),
     ("transformers.masking_utils", "_ignore_bidirectional_mask_sdpa"),
     (_WHISPER, "WhisperGenerationMixin.generate_with_fallback"),
     (_WHISPER, "WhisperGenerationMixin._retrieve_segment")), TRANSFORMERS_WRITTEN_FOR,
    "model.generate() reads values: Tensor.__bool__, Tensor.item and Tensor.tolist of meta tensors, which meta "
    "cannot answer. "
    "While a generation is traced (`generating`), they are answered as the real run with the traced inputs "
    "(an unpadded prompt of token ids in [0, vocab), its attention mask all ones, greedy with min_new_tokens = "
    "max_new_tokens = N) answers them, by the function asking: generate's `has_right_padding = torch.any("
    "attention_mask[:, -1] == 0).item()` False and `(attention_mask == 1).all()` True (the mask is then dropped); "
    "_prepare_special_tokens' eos/pad checks False (they only log warnings); an encoder-decoder's "
    "_ignore_bidirectional_mask_sdpa's `padding_mask.all()` True (the prompt has no padding); "
    "_get_logits_processor's "
    "`(encoder_input_ids < 0).any()` False; StopCheck's `bool(unfinished_sequences.max() == 0)` False until the "
    "N-th token, then True (MaxLengthCriteria ends every row at once). Whisper's generate (short-form: one window of "
    "the encoder's input, 30 s for Whisper's checkpoints, temperature 0, one pass of generate_with_fallback) asks two more: generate_with_fallback's "
    "`seek_sequence[-1] == pad_token_id` and `seek_sequence[-1] == eos_token_id` False (min_new_tokens = N masks "
    "the EOS token, which is the pad token in Whisper's configs), and _retrieve_segment's "
    "`seek_sequence.tolist()`, read only to find timestamp tokens (`token >= timestamp_begin`), a list of 0s: "
    "no timestamp token (return_timestamps is off; without the generation config's no_timestamps_token_id, "
    "timestamp_begin is vocab_size + 1, past every token). A question from any other function is a TraceError "
    "naming it")

TENSOR_CHECKS = Bridge(
    "tensor_checks", "transformers",
    (("torch", "_check_tensor_all_with"), ("transformers.utils.import_utils", "torch_compilable_check")),
    TRANSFORMERS_WRITTEN_FOR,
    "transformers' `torch_compilable_check(cond, msg)` (utils/import_utils.py) asserts a condition tensor with "
    "torch._check_tensor_all_with, whose `.item()` meta cannot answer; vision-language models check that the "
    "image placeholder tokens match the image features (e.g. Qwen2-VL's and Gemma-3's `get_placeholder_mask`). "
    "Called from torch_compilable_check on a meta condition, it holds: vramtrace builds the inputs the way the "
    "processor does (tracer/vlm.py), one placeholder per feature, and the real-run tests check it")
_QWEN2_VL, _QWEN2_5_VL = ("transformers.models.qwen2_vl.modeling_qwen2_vl",
                          "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl")
QWEN_VL_POSITIONS = Bridge(
    "qwen_vl_positions", "transformers",
    ((_QWEN2_VL, "get_vision_position_ids"), (_QWEN2_5_VL, "get_vision_position_ids"),
     (_QWEN2_VL, "Qwen2VLForConditionalGeneration._prepare_position_ids_for_generation"),
     (_QWEN2_5_VL, "Qwen2_5_VLForConditionalGeneration._prepare_position_ids_for_generation")),
    TRANSFORMERS_WRITTEN_FOR,
    "Qwen2-VL and Qwen2.5-VL compute positions from values in Python: the vision tower's rotary positions "
    "(transformers/vision_utils.py `get_vision_position_ids`, `grid_thw.tolist()`) and the M-RoPE positions "
    "(`get_rope_index`, grouping `mm_token_type_ids.tolist()`), which meta cannot hold. vramtrace feeds "
    "`image_grid_thw` and `mm_token_type_ids` as real CPU tensors (tracer/vlm.py); the vision positions they give, "
    "(patches, 2) int64, are moved to meta, where the real run has them (on its device). generate's "
    "`_prepare_position_ids_for_generation` also reads the prompt's mask and ids: on meta it runs on CPU stand-ins "
    "(the traced prompt's mask is all ones; get_rope_index reads the ids' shape only) and its positions (4, B, S) "
    "and `rope_deltas` (B, 1) are moved to meta",
    when_absent="a transformers without these modules has no Qwen2-VL or Qwen2.5-VL to trace")

_FSDP = "torch.distributed.fsdp._fully_shard."
FSDP_ON_META = Bridge(
    "fsdp_on_meta", "torch",
    (("torch.distributed.device_mesh", "_get_device_handle"),
     *((_FSDP + m, "_get_device_handle") for m in ("_fsdp_collectives", "_fsdp_init", "_fsdp_param_group",
                                                   "_fsdp_state")),
     (_FSDP + "_fully_shard", "_get_device_from_mesh"),
     (_FSDP + "_fsdp_param_group", "FSDPParamGroup._validate_no_meta_params"),
     (_FSDP + "_fsdp_param_group", "FSDPParamGroup._validate_cpu_offload_params"),
     (_FSDP + "_fsdp_param", "FSDPParam.all_gather_inputs"),
     (_FSDP + "_fsdp_param", "alloc_storage"), (_FSDP + "_fsdp_param", "free_storage"),
     (_FSDP + "_fsdp_param_group", "alloc_storage")), TORCH_WRITTEN_FOR,
    "FSDP2 (fully_shard) runs on a DeviceMesh of the meta device (`fsdp_on_meta`): its device handle "
    "(`_get_device_handle(device_type)`, getattr(torch, type)) has no `torch.meta`, so 'meta' gets `torch.cpu`, "
    "whose Stream, Event and stream() are no-ops (on the CPU FSDP2 runs on one stream too; CUDA's side streams "
    "delay the reuse of freed blocks, not the allocated bytes: FSDP2 frees by dropping references); "
    "`_get_device_from_mesh` gives the meta device; `_validate_no_meta_params`, which refuses "
    "meta parameters, and `_validate_cpu_offload_params`, which refuses non-CPU ones under CPUOffloadPolicy, let "
    "them through; under CPUOffloadPolicy `FSDPParam.all_gather_inputs` copies the host shard to the device "
    "(`.to(self.device, non_blocking=True)`, a no-op from meta to meta): the copy is made, a new device storage; "
    "and FSDP2's `alloc_storage`/`free_storage` "
    "(`tensor.untyped_storage().resize_(n)`, outside the dispatcher) are told to the recorder, which records a "
    "resize to 0 as the storage's free and a resize up as a new allocation, as the CPU allocator makes one")

DDP_ON_META = Bridge(
    "ddp_on_meta", "torch",
    (("torch.distributed", "Reducer._rebuild_buckets"), ("torch.distributed", "Logger.set_runtime_stats_and_log")),
    TORCH_WRITTEN_FOR,
    "DistributedDataParallel on meta (`ddp_on_meta`, on one DDP object's reducer and logger, C++ objects whose "
    "methods cannot be patched: their attributes are replaced by proxies): the bucket rebuild at the second "
    "forward answers False (it syncs the bucket order through a tensor copied to the host; tracer/sharding.py "
    "`wrap_ddp` says what that leaves out) and the logger's runtime statistics are not collected (timers that "
    "warn on a device without one)")

BNB_WRITTEN_FOR = "bitsandbytes 0.50"
BNB_OPTIMIZER_STATE = Bridge(
    "bnb_optimizer_state", "bitsandbytes", (("bitsandbytes.optim.optimizer", "Optimizer8bit.get_state_buffer"),
                                            ("bitsandbytes.optim.ademamix", "AdEMAMix._get_state_double_buffer")),
    BNB_WRITTEN_FOR,
    "bitsandbytes' optimizers make each state with `get_state_buffer` (bitsandbytes/optim/optimizer.py): zeros on a "
    "CPU parameter (a paged optimizer falls back to unpaged there), else for a paged optimizer and a parameter of "
    "at least 1e5 elements CUDA managed memory (`F.get_paged`: cudaMallocManaged in bitsandbytes' C library, outside "
    "PyTorch's allocator, which meta cannot run), else zeros; AdEMAMix's two stacked first moments the same way "
    "(`AdEMAMix._get_state_double_buffer`, bitsandbytes/optim/ademamix.py). A meta parameter gets zeros on meta; on "
    "a CUDA target the paged ones are recorded as paged optimizer state, outside the allocated bytes "
    "(`StepRecorder.managed`)",
    when_absent="bitsandbytes (the optional extra [quant]) is not installed: no bitsandbytes optimizer to trace")

INT8_MATMUL_DEVICE = Bridge(
    "int8_matmul_device", "bitsandbytes",
    (("bitsandbytes", "matmul"), ("bitsandbytes.autograd._functions", "MatMul8bitFp"),
     ("bitsandbytes.autograd._functions", "logger")), BNB_WRITTEN_FOR,
    "`bitsandbytes.matmul` (bitsandbytes/autograd/_functions.py), which Linear8bitLt.forward calls, picks its "
    "autograd function by the input's device: in training MatMul8bitFp on a CPU (the weight dequantized, a float "
    "matmul), else MatMul8bitLt (int8 matmul). Meta is neither: on a CPU target take the CPU's. MatMul8bitLt's "
    "warning at every call ('inputs will be cast to float16', true of the real step too) is silenced while tracing",
    when_absent="bitsandbytes (the optional extra [quant]) is not installed: no int8 layer to trace")

_INDUCTOR = "torch._inductor."
INDUCTOR_GRAPHS = Bridge(
    "inductor_graphs", "torch",
    (*((_INDUCTOR + "compile_fx", name) for name in (
        "compile_fx", "_recursive_post_grad_passes", "_recursive_record_original_output_strides", "fake_tensor_prop",
        "get_input_idxs_to_check", "maybe_disable_comprehensive_padding", "maybe_disable_graph_partition")),
     (_INDUCTOR + "graph", "GraphLowering"), (_INDUCTOR + "output_code", "OutputCode"),
     (_INDUCTOR + "fx_passes.post_grad", "view_to_reshape"),
     (_INDUCTOR + "graph", "GraphLowering.codegen"), (_INDUCTOR + "codecache", "FxGraphCache.prepare_key"),
     ("torch._C._dynamo.eval_frame", "reset_code"), ("torch._inductor", "config"),
     ("torch._inductor", "list_mode_options"), ("torch._functorch", "config"), (_INDUCTOR + "debug", "DebugContext"),
     (_INDUCTOR + "virtualized", "V"), (_INDUCTOR + "decomposition", "select_decomp_table"),
     *((_INDUCTOR + "utils", name) for name in ("shape_env_from_inputs", "get_dtype_size")),
     *((_INDUCTOR + "ir", name) for name in ("MultiOutput", "MultiOutputLayout", "NoneLayout", "ExternKernel",
                                             "TensorBox", "StorageBox", "ReinterpretView")),
     *(("torch._dynamo.convert_frame", name) for name in ("input_codes", "output_codes", "compile_lock")),
     ("torch._guards", "TracingContext.try_get")), TORCH_WRITTEN_FOR,
    "the private names tracer/compiled.py `compiled_twin` calls to run Inductor's own compile_fx "
    "with its per-graph compile replaced (`inner_compile`) under torch.compile's mode options with the FX-graph and "
    "AOTAutograd caches off, lower each graph and generate its code as "
    "`_InProcessFxCompile.codegen_and_compile` does (nothing compiled; the wrapper's `call` is read for its "
    "allocations, its buffers' IR classes for their layouts; `LoweredGraphCache` keys it by Inductor's own FX-graph "
    "cache key), report the outputs' strides to AOTAutograd's tracing context, and drop dynamo's cache entries of "
    "what it compiled (convert_frame's code trackers); checked before a capture starts", kind=BridgeKind.READ)
INDUCTOR_IR = Bridge(
    "inductor_ir", "torch",
    ((_INDUCTOR + "graph", "GraphLowering.__init__"), (_INDUCTOR + "graph", "GraphLowering.freeze_runtime_asserts"),
     (_INDUCTOR + "codegen.common", "CodegenSymbol.get_name"),
     *((_INDUCTOR + "ir", "IRNode." + name) for name in (
         "get_layout", "get_dtype", "get_size", "get_stride", "get_output_spec", "get_inputs_that_alias_output")),
     *((_INDUCTOR + "ir", "Layout." + name) for name in ("size", "stride", "offset")),
     (_INDUCTOR + "sizevars", "SizeVarAllocator.optimization_hint")), TORCH_WRITTEN_FOR,
    "what tracer/inductor_code.py reads of a lowered graph (`cpu_allocations`, `_extern_workspaces`, "
    "`_output_specs`): GraphLowering's buffers by name (`name_to_buffer`), its inputs, outputs and removed "
    "buffers, the scheduler's nodes and the size hints of its symbols (`sizevars.optimization_hint`); each "
    "buffer's name, layout (size, stride, offset), dtype, output spec and the inputs it aliases. Read unchecked: "
    "`graph_outputs` (assigned in GraphLowering.output, an fx.Interpreter override), the boxes' `data` (a "
    "dataclass field, no class attribute) and an extern kernel's `op_overload` and `python_kernel_name` (class "
    "defaults None; read with getattr, a kernel without them is skipped); "
    "checked with `inductor_graphs` before a capture starts", kind=BridgeKind.READ,
    assigns=("name_to_buffer", "graph_input_names", "graph_inputs", "removed_buffers", "scheduler", "sizevars"))

ACCUMULATION_USE_COUNTS = Bridge(
    "accumulation_use_counts", "torch",
    (("torch._C", "TensorBase._use_count"), ("torch._C", "_storage_Use_Count"), ("torch._C", "StorageBase._cdata")),
    TORCH_WRITTEN_FOR,
    "tracer/recorder.py `_accumulates_in_place` asks what the autograd engine asks before adding a second gradient "
    "into an input buffer in place (torch/csrc/autograd/input_buffer.cpp `can_accumulate_inplace`: the buffer "
    "holds the only reference to the tensor and to its storage), through the reference counts `Tensor._use_count()` "
    "and `torch._C._storage_Use_Count(storage._cdata)`. Seen from the top of __torch_dispatch__ they carry the "
    "dispatch call's own references: the engine holds the last one when the tensor has 4 (the buffer, the "
    "dispatcher's argument, the Python argument, the engine's own copy: recorder.py `ACCUMULATE_USE_COUNT`) and "
    "the storage 2 (the buffer's tensor and the storage object `untyped_storage()` makes to ask), as "
    "tests/test_recorder_accumulation.py calibrates against real runs without a dispatch mode; checked before a "
    "step is recorded", kind=BridgeKind.READ)
GRAD_SCALER_STATE = Bridge(
    "grad_scaler_state", "torch", (("torch.amp.grad_scaler", "GradScaler._lazy_init_scale_growth_tracker"),),
    TORCH_WRITTEN_FOR,
    "fp16-mixed's GradScaler keeps its scale and growth tracker, (), float32 and int32 tensors made on the loss's "
    "device at the first `scale()`, in the private `_scale` and `_growth_tracker` (torch/amp/grad_scaler.py "
    "`_lazy_init_scale_growth_tracker`); the public `get_scale()` and `state_dict()` read their values (`.item()`), "
    "which meta cannot answer. The trace reads the tensors (`grad_scaler_state`) to categorise them; checked "
    "before a step is recorded", kind=BridgeKind.READ, assigns=("_scale", "_growth_tracker"))
_DTENSOR = "torch.distributed.tensor."
DTENSOR_PLAN_CACHES = Bridge(
    "dtensor_plan_caches", "torch",
    ((_DTENSOR + "debug", "_clear_sharding_prop_cache"), (_DTENSOR + "_redistribute", "clear_redistribute_planner_cache"),
     (_DTENSOR + "_redistribute", "_gen_transform_infos.cache_clear")), TORCH_WRITTEN_FOR,
    "DTensor caches its sharding decisions and redistribution plans (torch/distributed/tensor/debug/__init__.py "
    "`_clear_sharding_prop_cache`, _redistribute.py `clear_redistribute_planner_cache` and the lru_cache of "
    "`_gen_transform_infos`) under keys that compare meshes by layout, not by process group: tracer/sharding.py "
    "`fake_rank` clears them after destroying its fake group (`clear_dtensor_caches`), so a later trace is not "
    "handed that group's name; checked before the group is made", kind=BridgeKind.READ)
AUTOGRAD_NODE = Bridge(
    "autograd_node", "torch", (("torch._C", "_current_autograd_node"),), TORCH_WRITTEN_FOR,
    "`torch._C._current_autograd_node()`, the autograd Node the engine is running on this thread (None outside a "
    "backward): tracer/recorder.py tells a backward op from a forward one by it and names its module from the "
    "node's metadata, and learns which node's input buffer the next accumulation fills; tracer/compiled_step.py "
    "spots the zeros a compiled backward (`CompiledFunctionBackward`) makes; checked before a step is recorded",
    kind=BridgeKind.READ)
FUNCTION_MODE_STACK = Bridge(
    "function_mode_stack", "torch", (("torch.overrides", "_get_current_function_mode_stack"),), TORCH_WRITTEN_FOR,
    "the thread's torch-function modes (torch/overrides.py `_get_current_function_mode_stack`): the autograd "
    "engine runs a checkpointed forward's recompute without them, so tracer/trace.py pushes the kernel policy "
    "again unless it is on the stack; checked before a step is recorded", kind=BridgeKind.READ)
DISPATCH_TOOLKIT = Bridge(
    "dispatch_toolkit", "torch",
    (("torch.utils._python_dispatch", "TorchDispatchMode"), ("torch.utils._python_dispatch", "_disable_current_modes"),
     *(("torch.utils._pytree", name) for name in ("tree_flatten", "tree_unflatten", "tree_map", "tree_leaves")),
     ("torch._ops", "OpOverload"), ("torch._ops", "OpOverloadPacket"),
     ("torch._subclasses.fake_tensor", "FakeTensorMode"),
     ("torch._prims_common", "is_non_overlapping_and_dense_or_false")), TORCH_WRITTEN_FOR,
    "the names torch's own dispatch-mode code is written with, which the recorder, the CPU probe, the replay and the "
    "compiled tracer use the same way: `TorchDispatchMode` and `_disable_current_modes` "
    "(torch/utils/_python_dispatch.py), the pytree helpers (torch/utils/_pytree.py), the op classes `OpOverload` "
    "and `OpOverloadPacket` (torch/_ops.py), `FakeTensorMode` (torch/_subclasses/fake_tensor.py) and the "
    "recorder's dense-layout test (torch/_prims_common `is_non_overlapping_and_dense_or_false`); checked before a "
    "step is recorded", kind=BridgeKind.READ)
_FA_UTILS = "transformers.modeling_flash_attention_utils"
FLASH_ATTENTION_STANDIN = Bridge(
    "flash_attention_standin", "transformers",
    (("transformers.modeling_utils", "PreTrainedModel._flash_attn_import_error"),
     ("transformers.modeling_utils", "lazy_import_flash_attention"), (_FA_UTILS, "lazy_import_flash_attention"),
     (_FA_UTILS, "_lazy_define_process_function"), (_FA_UTILS, "_is_packed_sequence"), (_FA_UTILS, "_pad_input"),
     (_FA_UTILS, "_unpad_input"), ("transformers.integrations.flash_attention", "get_target_dtype")),
    TRANSFORMERS_WRITTEN_FOR,
    "attn_implementation='flash_attention_2' on a CUDA target (`flash_attention_standin`, entered only for such a "
    "run, around the build and the step): the flash_attn package is not installed, so PreTrainedModel's "
    "_flash_attn_import_error (the package and CUDA checks of _flash_attn_can_dispatch) passes, "
    "lazy_import_flash_attention (both names: modeling_utils imports it) returns tracer/flash_attn.py's stand-ins "
    "of flash_attn_func and flash_attn_varlen_func (with transformers' own _pad_input/_unpad_input and "
    "_lazy_define_process_function), and _is_packed_sequence, whose answer is a value meta cannot give, runs its "
    "ops and answers False: a step's position ids are one sequence per row (packed steps pass cu_seq_lens_q/k, "
    "checked before it); get_target_dtype, which asks torch.is_autocast_enabled of the query's device ('meta', which "
    "autocast does not know), answers for an fp32 query as on the target: the emulated autocast's dtype while it is "
    "on, else its own fallbacks (a quantized config's dtype, else the first Linear's weight dtype)")
PACKED_SEQUENCES = Bridge(
    "packed_sequences", "transformers",
    (("transformers.masking_utils", "find_packed_sequence_indices"), ("transformers.masking_utils", "is_tracing")),
    TRANSFORMERS_WRITTEN_FOR,
    "a --packing step (`packed_sequences`, entered only for one, inside the per-step bridges): "
    "find_packed_sequence_indices' check `(packed_sequence_mask[:, -1] == 0).all()` is a .item() meta cannot "
    "answer; its ops run and, the step's position ids restarting within each row (tracer/packing.py), it "
    "answers with the sequence-index mask as the real run does, from which transformers builds the 4D "
    "block-diagonal mask")
KERNEL_CHOICES = Bridge(
    "kernel_choices", "torch",
    (("torch", "_fused_sdp_choice"), ("torch", "_native_multi_head_attention"),
     ("torch", "_transformer_encoder_layer_fwd")), TORCH_WRITTEN_FOR,
    "tracer/kernels.py asks torch's own SDPA dispatch which CPU kernel it takes (`torch._fused_sdp_choice`, "
    "sdp_utils_cpp.cpp `select_sdp_backend_cpp`) on tiny stand-ins, and knows nn.MultiheadAttention's and "
    "nn.TransformerEncoderLayer's eval fast paths by their ops (`torch._native_multi_head_attention`, "
    "`torch._transformer_encoder_layer_fwd`); checked before a step is recorded", kind=BridgeKind.READ)

_PP = "torch.distributed.pipelining."
PIPELINE_P2P = Bridge(
    "pipeline_p2p", "torch", ((_PP + "schedules", "_batch_p2p"), (_PP + "schedules", "_sorted_batch_p2p")),
    TORCH_WRITTEN_FOR,
    "a --pp step (`feature_bridges.pipelining_on_meta`, entered only for one): the schedules send and receive "
    "through `_batch_p2p`/`_sorted_batch_p2p` (torch/distributed/pipelining/schedules.py), whose "
    "`batch_isend_irecv` looks a backend up by the tensors' device, and meta has none; on the fake group every "
    "send and receive completes at once anyway. A completed stand-in Work that HOLDS its ops' tensors, as gloo's "
    "Work holds them until it is dropped: the schedules keep waited Works (ScheduleGPipe's `bwd_sends_to_wait`, "
    "Schedule1F1B's `send_work`), and the tensors they keep count (1F1B stage 0: one micro-batch's output)")
PIPELINE_STATIC_VOTE = Bridge(
    "pipeline_static_vote", "torch", ((_PP + "schedules", "_PipelineSchedule._warmup_p2p"),), TORCH_WRITTEN_FOR,
    "a --pp step: the first step's warm-up vote (schedules.py `_PipelineSchedule._warmup_p2p`) sums each "
    "stage's 'metadata given' flag over the group and reads it back with `.item()`, which the fake group and "
    "meta cannot answer: answer what the vote decides when every stage was given its metadata (vramtrace gives "
    "them all, tracer/pipelining.py), `InferenceMode.STATIC`, with no round trip (it allocates nothing kept)")
PIPELINE_MICRO_STEPS = Bridge(
    "pipeline_micro_steps", "torch",
    ((_PP + "stage", "_PipelineStageBase.forward_one_chunk"), (_PP + "stage", "_PipelineStageBase.backward_one_chunk"),
     (_PP + "stage", "_PipelineStageBase.backward_weight_one_chunk")),
    TORCH_WRITTEN_FOR,
    "a --pp step: each forward, backward and weight-gradient micro-step (stage.py `forward_one_chunk`, "
    "`backward_one_chunk`, `backward_weight_one_chunk`: zero-bubble's split backward) is reported to the trace as "
    "it begins and ends, with the micro-batches then in flight (PIPELINE_STAGE_STATE's `fwd_cache`), so the report "
    "says where a stage's peak falls (F<i>/B<i>/W<i>; F<i>@<k>... on stage k when a rank holds several, "
    "interleaved-1f1b and zero-bubble); the originals run unchanged")
PIPELINE_STAGE_STATE = Bridge(
    "pipeline_stage_state", "torch", ((_PP + "stage", "_PipelineStageBase.__init__"),), TORCH_WRITTEN_FOR,
    "a --pp step reads a stage's private state, assigned in stage.py `_PipelineStageBase.__init__` (and emptied "
    "by `clear_runtime_states` at each step's start): `fwd_cache` (micro-batch -> its outputs and inputs, kept "
    "until its backward: the micro-batches in flight), `backward_state` (micro-batch -> what zero-bubble's "
    "input-gradient step keeps for its weight-gradient step: in flight too) and the receive infos of "
    "`args_recv_info` and `grad_recv_info` (micro-batch -> `_RecvInfo`s, PIPELINE_RECV_BUFFER), which the report "
    "counts and categorises", kind=BridgeKind.READ,
    assigns=("fwd_cache", "backward_state", "args_recv_info", "grad_recv_info"))
PIPELINE_RECV_BUFFER = Bridge(
    "pipeline_recv_buffer", "torch", ((_PP + "stage", "_RecvInfo.__init__"),), TORCH_WRITTEN_FOR,
    "a --pp step reads each receive info's `buffer` (stage.py `_RecvInfo.__init__`: the tensor a micro-batch's "
    "activation or gradient is received into, one per micro-batch and direction, kept for the stage's life; None "
    "for a root argument) to categorise it as a pipeline buffer", kind=BridgeKind.READ, assigns=("buffer",))


# DeepSpeed ZeRO (`--zero`, tracer/zero.py): DeepSpeed's own engine on one fake rank under FakeTensorMode, its
# accelerator's device the meta device. Entered only for a --zero trace (`feature_bridges.deepspeed_zero`), and
# kept out of BRIDGES: deepspeed is an optional extra that the test suite's Python may lack (tests/test_zero_unit.py
# checks these targets where deepspeed is installed).
DEEPSPEED_WRITTEN_FOR = "deepspeed >=0.19.8,<0.20"
_DS_ABSENT = "deepspeed (the optional extra [deepspeed]) is not installed: --zero stops before tracing"
_DS_ZERO = "deepspeed.runtime.zero."
DS_ACCELERATOR_DEVICE = Bridge(
    "ds_accelerator_device", "deepspeed",
    (("deepspeed.accelerator.cpu_accelerator", "CPU_Accelerator.device_name"),
     ("deepspeed.accelerator.cpu_accelerator", "CPU_Accelerator.current_device_name"),
     ("deepspeed.accelerator.cpu_accelerator", "CPU_Accelerator.on_accelerator"),
     ("deepspeed.accelerator.real_accelerator", "set_accelerator")), DEEPSPEED_WRITTEN_FOR,
    "DeepSpeed puts its device buffers on `get_accelerator().current_device_name()` and its offload buffers on "
    "'cpu' (runtime/zero/stage_1_and_2.py, stage3.py): the trace sets DeepSpeed's CPU accelerator (DeepSpeed's "
    "own, chosen whatever DS_ACCELERATOR says) with the meta device as its device, so device buffers are meta "
    "tensors and host buffers fake CPU ones; the previous accelerator, communication backend (`comm.cdb`) "
    "and process groups (deepspeed/comm/comm.py `cdb`, deepspeed/utils/groups.py's module globals, made on the "
    "trace's fake group) are put back on exit", when_absent=_DS_ABSENT)
DS_SHM_COMM = Bridge(
    "ds_shm_comm", "deepspeed", (("deepspeed.comm.torch", "build_shm_op"),), DEEPSPEED_WRITTEN_FOR,
    "TorchBackend.__init__ (comm/torch.py) initializes a shared-memory op that waits for the other ranks' "
    "processes, which one process on a fake group never has (it hangs): None (the op serves only "
    "inference_all_reduce)", when_absent=_DS_ABSENT)
DS_ENGINE_DEVICE = Bridge(
    "ds_engine_device", "deepspeed", (("deepspeed.runtime.engine", "DeepSpeedEngine.__init__"),),
    DEEPSPEED_WRITTEN_FOR,
    "DeepSpeedEngine moves the module to its device (engine.py `_configure_distributed_model`, "
    "`self.module.to(self.device)`): the trace's model is on the meta device already; `dont_change_device=True`",
    when_absent=_DS_ABSENT)
DS_GRAD_NORM_CHECK = Bridge(
    "ds_grad_norm_check", "deepspeed",
    ((_DS_ZERO + "stage_1_and_2", "is_invalid_grad_norm"), (_DS_ZERO + "stage3", "is_invalid_grad_norm")),
    DEEPSPEED_WRITTEN_FOR,
    "runtime/utils.py `is_invalid_grad_norm` reads the norm (`bool(...any())`), imported by name into both ZeRO "
    "optimizers: its ops run, the answer is False (a finite norm: no overflow)", when_absent=_DS_ABSENT)
DS_RANK_CHECKS = Bridge(
    "ds_rank_checks", "deepspeed",
    ((_DS_ZERO + "stage3", "assert_ints_same_as_other_ranks"),
     (_DS_ZERO + "partitioned_param_coordinator", "assert_ints_same_as_other_ranks"),
     (_DS_ZERO + "partition_parameters", "assert_ints_same_as_other_ranks")), DEEPSPEED_WRITTEN_FOR,
    "zero/utils.py `assert_ints_same_as_other_ranks` reads an all-gathered list of ints (`.item()`), a "
    "consistency check between ranks (ZeRO-3's reduce buckets and trace order): nothing to check on one fake rank",
    when_absent=_DS_ABSENT)
DS_OFFLOAD_NORM = Bridge(
    "ds_offload_norm", "deepspeed",
    ((_DS_ZERO + "stage3", "DeepSpeedZeroOptimizer_Stage3.complete_grad_norm_calculation_for_cpu_offload"),),
    DEEPSPEED_WRITTEN_FOR,
    "ZeRO-3 with optimizer offload makes the gradient norm a Python float (`float(total_norm)`, stage3.py): the "
    "same code with the norm kept a tensor, copied into the one-element tensor it allocates",
    when_absent=_DS_ABSENT)
DS_OVERFLOW_CHECK = Bridge(
    "ds_overflow_check", "deepspeed", ((_DS_ZERO + "stage_1_and_2", "DeepSpeedZeroOptimizer.has_overflow"),),
    DEEPSPEED_WRITTEN_FOR,
    "ZeRO-1/2's `has_overflow` (called by `check_overflow` every bf16 step) reads `overflow_gpu[0].item()`: the "
    "same ops (the partitioned gradients' inf/nan check, its byte(), the all-reduce), the answer False",
    when_absent=_DS_ABSENT)
DS_ZERO3_LINEAR_AUTOCAST = Bridge(
    "ds_zero3_linear_autocast", "deepspeed", ((_DS_ZERO + "linear", "get_accelerator"),), DEEPSPEED_WRITTEN_FOR,
    "ZeRO-3's linear (runtime/zero/linear.py `LinearFunctionForZeroStage3`) asks torch's autocast state of the "
    "accelerator's device type (`torch.get_autocast_dtype`, `torch.autocast(device_type=...)`), which torch has no "
    "autocast for when it is meta: that module's accelerator names 'cpu', whose autocast is off as the target "
    "device's is in a ZeRO step (DeepSpeed casts the module itself)", when_absent=_DS_ABSENT)
DS_ZERO3_LINEAR_RESTORE = Bridge(
    "ds_zero3_linear_restore", "deepspeed",
    (("torch.nn.functional", "linear"), (_DS_ZERO + "partition_parameters", "InsertPostInitMethodToModuleSubClasses")),
    DEEPSPEED_WRITTEN_FOR,
    "ZeRO-3's `Init` (runtime/zero/partition_parameters.py `InsertPostInitMethodToModuleSubClasses.__init__`, "
    "'This will persist unless manually reset'; also its quantized-weights wrap) replaces "
    "`torch.nn.functional.linear` for the rest of the process and keeps the original as the class's `linear_bk`: "
    "the trace runs with DeepSpeed's linear as a real ZeRO-3 step does, and puts both back on exit",
    when_absent=_DS_ABSENT)
ZERO_BRIDGES: tuple[Bridge, ...] = (DS_ACCELERATOR_DEVICE, DS_SHM_COMM, DS_ENGINE_DEVICE, DS_GRAD_NORM_CHECK,
                                    DS_RANK_CHECKS, DS_OFFLOAD_NORM, DS_OVERFLOW_CHECK, DS_ZERO3_LINEAR_AUTOCAST,
                                    DS_ZERO3_LINEAR_RESTORE)

BRIDGES: tuple[Bridge, ...] = (HOST_RNG_STATE, MAYBE_AUTOCAST, PACKED_SEQUENCE_CHECK, PADDING_MASK_CHECK,
                               PADDING_WARNING, MOE_GROUPED_MM, CHECKPOINT_FUNCTION, MHA_FAST_PATH,
                               FUNCTIONAL_TORCH_FUNCTION_CHECK, GRAD_SCALER_FOUND_INF, CLIP_GRAD_FOREACH,
                               FUSED_OPTIMIZER_DEVICES, ADAFACTOR_SCALARS, GENERATION_QUESTIONS, FSDP_ON_META,
                               DDP_ON_META, BNB_OPTIMIZER_STATE, INT8_MATMUL_DEVICE, INDUCTOR_GRAPHS, TENSOR_CHECKS,
                               QWEN_VL_POSITIONS, ACCUMULATION_USE_COUNTS, GRAD_SCALER_STATE, DTENSOR_PLAN_CACHES,
                               INDUCTOR_IR, AUTOGRAD_NODE, FUNCTION_MODE_STACK, DISPATCH_TOOLKIT, KERNEL_CHOICES,
                               FLASH_ATTENTION_STANDIN, PACKED_SEQUENCES)
# issue 42, --pp: entered only around a pipeline stage's step (feature_bridges.pipelining_on_meta)
PIPELINE_BRIDGES = (PIPELINE_P2P, PIPELINE_STATIC_VOTE, PIPELINE_MICRO_STEPS, PIPELINE_STAGE_STATE,
                    PIPELINE_RECV_BUFFER)
BRIDGES += PIPELINE_BRIDGES
# the private reads a recorded step makes, checked with the patches before anything is patched (`installed`)
STEP_READS: tuple[Bridge, ...] = (ACCUMULATION_USE_COUNTS, GRAD_SCALER_STATE, AUTOGRAD_NODE, FUNCTION_MODE_STACK,
                                  DISPATCH_TOOLKIT, KERNEL_CHOICES)


def _installed_version(library: str) -> str:
    try:
        return importlib.import_module(library).__version__
    except (ImportError, AttributeError):
        return "(not installed)"


def _missing(bridge: Bridge, what: str) -> BridgeError:
    return BridgeError(
        f"{what} is missing in {bridge.library} {_installed_version(bridge.library)} "
        f"(bridge {bridge.name}, written for {bridge.written_for}): this vramtrace does not support that "
        f"{bridge.library} version; install {bridge.written_for.replace(' ', '==')}.*")


def _lookup(module: str, attribute: str):
    """The object at `module`.`attribute` ('Class.method' allowed), or raise LookupError."""
    try:
        obj = importlib.import_module(module)
    except ImportError:
        raise LookupError(module) from None
    for part in attribute.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise LookupError(attribute) from None
    return obj


def resolve(bridge: Bridge) -> dict[str, object] | None:
    """{'module.attribute': current object} of each target of `bridge`; None when a target is absent and the
    bridge says it is then not needed. Raises BridgeError when a target is absent otherwise."""
    found = {}
    for module, attribute in bridge.targets:
        try:
            found[f"{module}.{attribute}"] = _lookup(module, attribute)
        except LookupError:
            if bridge.when_absent:
                return None
            raise _missing(bridge, f"{module}.{attribute}") from None
    if bridge.assigns:
        module, attribute = bridge.targets[0]
        code = getattr(inspect.unwrap(found[f"{module}.{attribute}"]), "__code__", None)
        if code is None:  # a class's own __init__ gone: `object.__init__` inherited, no Python code to check
            raise _missing(bridge, f"{module}.{attribute}")
        stored = {i.argval for i in dis.get_instructions(code) if i.opname == "STORE_ATTR"}
        for name in bridge.assigns:
            if name not in stored:
                raise _missing(bridge, f"the assignment of self.{name} in {module}.{attribute}")
    return found


def status() -> list[tuple[str, str]]:
    """(bridge name, 'ok' or 'not needed: why') for every bridge. Raises BridgeError for a missing target."""
    return [(b.name, "ok" if resolve(b) is not None else f"not needed: {b.when_absent}") for b in BRIDGES]


# -- the patches ---------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _set(owner, attribute: str, value) -> Iterator[None]:
    """`owner.attribute = value` until exit (also on an exception), then as it was: the original again, or no
    attribute of its own when `owner` (a class) only inherited it."""
    own = attribute in vars(owner)
    original = vars(owner)[attribute] if own else None
    setattr(owner, attribute, value)
    try:
        yield
    finally:
        if own:
            setattr(owner, attribute, original)
        else:
            delattr(owner, attribute)


def _host_rng_state(stack: contextlib.ExitStack, rec: StepRecording) -> None:
    """A `torch.get_rng_state()` state (5,056 B for the CPU generator) is born at the next op: torch.utils.
    checkpoint stashes one per checkpointed region until the recompute, torch.random.fork_rng one during it."""
    original = torch.get_rng_state

    def recorded():
        state = original()
        rec.storage_id(state, op_index=len(rec.ops), op="torch.get_rng_state", category=None)
        return state

    stack.enter_context(_set(torch, "get_rng_state", recorded))


def _maybe_autocast(stack: contextlib.ExitStack, policy: KernelPolicy) -> None:
    """Modeling files import `maybe_autocast` by name: replace it in every transformers module holding it."""
    from transformers.utils import generic

    original = generic.maybe_autocast

    def bridged(device_type, dtype=None, enabled=True, cache_enabled=None):
        if device_type == "meta":
            return contextlib.nullcontext() if enabled else policy.autocast_disabled()
        return original(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)

    for m in list(sys.modules.values()):
        if getattr(m, "__name__", "").startswith("transformers") and getattr(m, "maybe_autocast", None) is original:
            stack.enter_context(_set(m, "maybe_autocast", bridged))


def meta_packed_mask(masking_utils, original, is_tracing, position_ids):
    """`find_packed_sequence_indices` (`original`) of meta `position_ids` with `masking_utils.is_tracing` answering
    True, so it returns its sequence-index mask instead of reading it, then the check's own ops
    (`(mask[:, -1] == 0).all()`) without their answer; `is_tracing` put back. Shared by PACKED_SEQUENCE_CHECK (an
    unpacked step: answers None) and PACKED_SEQUENCES (a packed one: answers the mask)."""
    masking_utils.is_tracing = lambda *a, **k: True
    try:
        mask = original(position_ids)
    finally:
        masking_utils.is_tracing = is_tracing
    (mask[:, -1] == 0).all()
    return mask


def _packed_sequence_check(stack: contextlib.ExitStack) -> None:
    from transformers import masking_utils

    original, is_tracing = masking_utils.find_packed_sequence_indices, masking_utils.is_tracing

    def bridged(position_ids):
        if position_ids.device.type != "meta":
            return original(position_ids)
        meta_packed_mask(masking_utils, original, is_tracing, position_ids)
        return None  # the real answer for our position ids: one sequence per row

    bridged.__wrapped__ = original  # a packed step's bridge (feature_bridges.packed_sequences) calls the original
    stack.enter_context(_set(masking_utils, "find_packed_sequence_indices", bridged))


def _padding_mask_check(stack: contextlib.ExitStack) -> None:
    from transformers import masking_utils

    fast_all = masking_utils.fast_all

    def bridged(tensor):  # `padding_mask is None or fast_all(padding_mask)`: our inputs carry no padding
        out = fast_all(tensor)
        return True if tensor.device.type == "meta" else out

    stack.enter_context(_set(masking_utils, "fast_all", bridged))


def _padding_warning(stack: contextlib.ExitStack) -> None:
    from transformers import PreTrainedModel

    original = PreTrainedModel.warn_if_padding_and_no_attention_mask

    def bridged(self, input_ids, attention_mask):
        if not isinstance(input_ids, torch.Tensor) or input_ids.device.type != "meta":
            return original(self, input_ids, attention_mask)
        pad = getattr(self.config, "pad_token_id", None)
        if attention_mask is None and pad is not None:
            (input_ids[:, [-1, 0]] == pad).any()  # the check's ops, as `Tensor.__contains__` runs them

    stack.enter_context(_set(PreTrainedModel, "warn_if_padding_and_no_attention_mask", bridged))


def _tensor_checks(stack: contextlib.ExitStack) -> None:
    """TENSOR_CHECKS: torch._check_tensor_all_with holds for a meta condition asked by torch_compilable_check."""
    from transformers.utils import import_utils

    asking = inspect.unwrap(import_utils.torch_compilable_check).__code__
    original = torch._check_tensor_all_with

    def check(error_type, cond, message=None):
        if isinstance(cond, torch.Tensor) and cond.device.type == "meta" and sys._getframe(1).f_code is asking:
            return None
        return original(error_type, cond, message)

    stack.enter_context(_set(torch, "_check_tensor_all_with", check))


def _host_positions(original):
    """`get_vision_position_ids` whose result from a CPU grid is moved to meta."""
    def positions(grid_thw, *args, **kwargs):
        out = original(grid_thw, *args, **kwargs)
        return out.to("meta") if grid_thw.device.type == "cpu" and out.device.type == "cpu" else out
    return positions


def _host_generation_positions(original):
    """`_prepare_position_ids_for_generation` run on CPU stand-ins of a meta prompt, its results moved to meta."""
    def prepare(self, inputs_tensor, model_kwargs):
        if inputs_tensor.device.type != "meta":
            return original(self, inputs_tensor, model_kwargs)
        stand_in = {k: (torch.ones_like(v, device="cpu") if k == "attention_mask" else torch.zeros_like(v, device="cpu"))
                    if k in ("attention_mask", "input_ids") and isinstance(v, torch.Tensor) else v
                    for k, v in model_kwargs.items()}
        out = original(self, torch.zeros_like(inputs_tensor, device="cpu"), stand_in)
        if isinstance(self.model.rope_deltas, torch.Tensor):
            self.model.rope_deltas = self.model.rope_deltas.to("meta")
        return out.to("meta")
    return prepare


def _qwen_vl_positions(stack: contextlib.ExitStack) -> None:
    """QWEN_VL_POSITIONS, in each Qwen-VL module loaded."""
    for module, attribute in QWEN_VL_POSITIONS.targets:
        if module not in sys.modules:
            continue
        *path, name = attribute.split(".")
        owner = sys.modules[module]
        for part in path:
            owner = getattr(owner, part)
        wrap = _host_generation_positions if path else _host_positions
        stack.enter_context(_set(owner, name, wrap(getattr(owner, name))))


def _moe_grouped_mm(stack: contextlib.ExitStack) -> None:
    """transformers' default MoE experts (`grouped_mm`, integrations/moe.py): on meta weights take its
    `grouped_mm_fallback` custom op; its fake kernel allocates the same (S, out) output, S = tokens * top_k,
    and its backward the same gradients, so memory does not depend on the routing."""
    from transformers.integrations import moe

    original = moe._can_use_grouped_mm
    stack.enter_context(_set(moe, "_can_use_grouped_mm",
                             lambda input, weight, offs: weight.device.type != "meta" and original(input, weight, offs)))


def _fast_path_forwards() -> set:
    """The code objects of the two forwards whose fast-path checks MHA_FAST_PATH answers; a BridgeError when
    they no longer ask what the bridge answers."""
    from torch.nn.modules.activation import MultiheadAttention
    from torch.nn.modules.transformer import TransformerEncoderLayer

    codes = {MultiheadAttention.forward.__code__, TransformerEncoderLayer.forward.__code__}
    for code in codes:
        if not {"has_torch_function", "is_autocast_enabled", "_privateuse1_backend_name"} & set(code.co_names):
            raise _missing(MHA_FAST_PATH, f"the fast-path checks of {code.co_qualname}")
    return codes


def _mha_fast_path(stack: contextlib.ExitStack, policy: KernelPolicy) -> None:
    from torch.utils import backend_registration

    from .spec import Device

    codes = _fast_path_forwards()
    has_tf, autocast_enabled = torch.overrides.has_torch_function, torch.is_autocast_enabled
    privateuse1 = backend_registration._privateuse1_backend_name
    fast_path_modules = (torch.nn.MultiheadAttention, torch.nn.TransformerEncoderLayer)

    def from_fast_path_check() -> bool:
        return sys._getframe(2).f_code in codes

    def has_torch_function(args):
        if from_fast_path_check() and any(isinstance(a, torch.Tensor) and a.device.type == "meta" for a in args):
            return False
        return has_tf(args)

    def is_autocast_enabled(*args):
        if not args and from_fast_path_check():
            return policy.device is Device.CUDA and policy.autocast_active
        return autocast_enabled(*args)

    def pre(module, args):
        if isinstance(module, fast_path_modules) and not module.training:
            backend_registration._privateuse1_backend_name = "meta"

    def post(module, args, out):
        if isinstance(module, fast_path_modules):
            backend_registration._privateuse1_backend_name = privateuse1

    stack.enter_context(_set(torch.overrides, "has_torch_function", has_torch_function))
    stack.enter_context(_set(torch, "is_autocast_enabled", is_autocast_enabled))
    stack.enter_context(_set(backend_registration, "_privateuse1_backend_name", privateuse1))  # restored on exit
    stack.callback(torch.nn.modules.module.register_module_forward_pre_hook(pre).remove)
    stack.callback(torch.nn.modules.module.register_module_forward_hook(post).remove)


@contextlib.contextmanager
def skip_next_torch_function_check() -> Iterator[None]:
    """FUNCTIONAL_TORCH_FUNCTION_CHECK: the next `has_torch_function(...)` in torch.nn.functional answers False,
    then the original is back (also on exit). Raises BridgeError when the target is gone."""
    import torch.nn.functional as F

    original = resolve(FUNCTIONAL_TORCH_FUNCTION_CHECK)["torch.nn.functional.has_torch_function"]

    def once(*args, **kwargs):
        F.has_torch_function = original
        return False

    F.has_torch_function = once
    try:
        yield
    finally:
        F.has_torch_function = original


def _grad_scaler_found_inf(stack: contextlib.ExitStack) -> None:
    from torch.amp.grad_scaler import GradScaler

    original = GradScaler._maybe_opt_step

    def bridged(self, optimizer, optimizer_state, *args, **kwargs):
        found = optimizer_state["found_inf_per_device"].values()
        if found and all(v.device.type == "meta" for v in found):
            return optimizer.step(*args, **kwargs)  # no inf or NaN found: the step runs
        return original(self, optimizer, optimizer_state, *args, **kwargs)

    stack.enter_context(_set(GradScaler, "_maybe_opt_step", bridged))


def _clip_grad_foreach(stack: contextlib.ExitStack) -> None:
    import torch.nn.utils.clip_grad as clip_grad
    from torch.utils._foreach_utils import _foreach_supported_types

    has, device_has = clip_grad._has_foreach_support, clip_grad._device_has_foreach_support

    def device_bridged(device) -> bool:
        return True if torch.device(device).type == "meta" else device_has(device)

    def has_bridged(tensors, device) -> bool:
        return (all(t is None or type(t) in _foreach_supported_types for t in tensors)
                if torch.device(device).type == "meta" else has(tensors, device))

    stack.enter_context(_set(clip_grad, "_device_has_foreach_support", device_bridged))
    stack.enter_context(_set(clip_grad, "_has_foreach_support", has_bridged))


def _fused_optimizer_devices(stack: contextlib.ExitStack) -> None:
    import torch.optim.optimizer as optimizer

    original = optimizer._get_fused_kernels_supported_devices
    stack.enter_context(_set(optimizer, "_get_fused_kernels_supported_devices", lambda: [*original(), "meta"]))


def _adafactor_scalars(stack: contextlib.ExitStack) -> None:
    from torch.optim import _adafactor

    item = torch.Tensor.item

    def meta_item(self):
        return 1.0 if self.device.type == "meta" else item(self)

    def bridged(function):
        def run(params, *args, **kwargs):  # torch/optim/_adafactor.py::adafactor looks the function up per call
            if not any(p.device.type == "meta" for p in params):
                return function(params, *args, **kwargs)
            with _set(torch.Tensor, "item", meta_item):
                return function(params, *args, **kwargs)
        return run

    for name in ("_single_tensor_adafactor", "_multi_tensor_adafactor"):
        stack.enter_context(_set(_adafactor, name, bridged(getattr(_adafactor, name))))


@contextlib.contextmanager
def installed(policy: KernelPolicy, rec: StepRecording) -> Iterator[None]:
    """Every bridge patched in while a step is recorded by `rec` under `policy`; every target restored on exit,
    also when the step raises. Raises BridgeError, with nothing patched, when a target is missing."""
    apply: dict[Bridge, Callable[[contextlib.ExitStack], None]] = {
        HOST_RNG_STATE: lambda s: _host_rng_state(s, rec),
        MAYBE_AUTOCAST: lambda s: _maybe_autocast(s, policy),
        PACKED_SEQUENCE_CHECK: _packed_sequence_check,
        PADDING_MASK_CHECK: _padding_mask_check,
        PADDING_WARNING: _padding_warning,
        MOE_GROUPED_MM: _moe_grouped_mm,
        MHA_FAST_PATH: lambda s: _mha_fast_path(s, policy),
        GRAD_SCALER_FOUND_INF: _grad_scaler_found_inf,
        CLIP_GRAD_FOREACH: _clip_grad_foreach,
        FUSED_OPTIMIZER_DEVICES: _fused_optimizer_devices,
        ADAFACTOR_SCALARS: _adafactor_scalars,
        BNB_OPTIMIZER_STATE: lambda s: _bnb_optimizer_state(s, policy, rec),
        INT8_MATMUL_DEVICE: lambda s: _int8_matmul_device(s, policy),
        TENSOR_CHECKS: _tensor_checks,
        QWEN_VL_POSITIONS: _qwen_vl_positions,
    }
    resolve(FUNCTIONAL_TORCH_FUNCTION_CHECK)  # patched per call (skip_next_torch_function_check); checked here
    for read in STEP_READS:
        resolve(read)
    if "bitsandbytes" not in sys.modules:  # no bitsandbytes layer or optimizer was made (its import costs seconds)
        del apply[BNB_OPTIMIZER_STATE], apply[INT8_MATMUL_DEVICE]
    if not any(m in sys.modules for m, _ in QWEN_VL_POSITIONS.targets):  # no Qwen-VL model was built
        del apply[QWEN_VL_POSITIONS]
    needed = [b for b in apply if resolve(b) is not None]  # all targets checked before anything is patched
    with contextlib.ExitStack() as stack:
        for b in needed:
            apply[b](stack)
        yield


def _bnb_optimizer_state(stack: contextlib.ExitStack, policy: KernelPolicy, rec: StepRecording) -> None:
    from .analysis.categories import Category
    from .spec import Device

    found = resolve(BNB_OPTIMIZER_STATE)
    original = found["bitsandbytes.optim.optimizer.Optimizer8bit.get_state_buffer"]
    owner = importlib.import_module("bitsandbytes.optim.optimizer").Optimizer8bit
    paged_on_target = policy.device is Device.CUDA

    def buffer(self, p, dtype, shape, real):
        if p.device.type != "meta":
            return real()
        out = torch.zeros(shape, dtype=dtype, device=p.device)
        if paged_on_target and self.is_paged and p.numel() >= 1e5:  # the threshold of get_state_buffer
            rec.managed(out, Category.PAGED_OPTIMIZER_STATE)
        return out

    def get_state_buffer(self, p, dtype=torch.float32):
        return buffer(self, p, dtype, p.shape, lambda: original(self, p, dtype))

    def double_buffer(self, p, dtype=torch.float32):
        return buffer(self, p, dtype, (2, *p.shape), lambda: original_double(self, p, dtype))

    original_double = found["bitsandbytes.optim.ademamix.AdEMAMix._get_state_double_buffer"]
    stack.enter_context(_set(owner, "get_state_buffer", get_state_buffer))
    stack.enter_context(_set(importlib.import_module("bitsandbytes.optim.ademamix").AdEMAMix,
                             "_get_state_double_buffer", double_buffer))


def _int8_matmul_device(stack: contextlib.ExitStack, policy: KernelPolicy) -> None:
    import logging

    from .spec import Device

    found = resolve(INT8_MATMUL_DEVICE)
    original = found["bitsandbytes.matmul"]
    matmul_fp = found["bitsandbytes.autograd._functions.MatMul8bitFp"]
    owner = importlib.import_module("bitsandbytes")
    cpu_target = policy.device is Device.CPU

    def matmul(A, B, out=None, state=None, threshold=0.0, bias=None):
        if cpu_target and A.device.type == "meta" and state is not None and state.is_training:
            if threshold > 0.0:
                state.threshold = threshold
            return matmul_fp.apply(A, B, out, bias, state)
        return original(A, B, out, state, threshold, bias)

    stack.enter_context(_set(owner, "matmul", matmul))
    logger: logging.Logger = found["bitsandbytes.autograd._functions.logger"]
    stack.callback(logger.setLevel, logger.level)
    logger.setLevel(logging.ERROR)
