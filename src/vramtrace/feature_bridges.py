"""The bridges applied around one feature, not around every recorded step (`bridges.installed`): a traced
generation (`generating`: GENERATION_QUESTIONS), FSDP2 and DDP on the meta device (`fsdp_on_meta`, `ddp_on_meta`:
FSDP_ON_META, DDP_ON_META) and activation checkpointing's function (`route_checkpoint_functions`,
`gradient_checkpointing_layer`: CHECKPOINT_FUNCTION), FlashAttention-2's stand-in (`flash_attention_standin`:
FLASH_ATTENTION_STANDIN), a packed step's sequence mask (`packed_sequences`: PACKED_SEQUENCES), and the
private reads of fp16's GradScaler and of sharding (`grad_scaler_state`, `clear_dtensor_caches`). Each bridge is declared, with its targets, the versions it
was written for and why, in the ledger `vramtrace.bridges`; this module holds only these patches and reads, and
checks every target there (`resolve`) before it patches or reads anything.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import sys
from typing import TYPE_CHECKING, Callable, Iterator

import torch

from .bridges import (_FA_UTILS, _FSDP, _WHISPER, CHECKPOINT_FUNCTION, DDP_ON_META, DTENSOR_PLAN_CACHES,
                      FLASH_ATTENTION_STANDIN, FSDP_ON_META, GENERATION_QUESTIONS, GRAD_SCALER_STATE, PACKED_SEQUENCES,
                      KernelPolicy, StepRecording, _lookup, _missing, _set, meta_packed_mask, resolve)

if TYPE_CHECKING:
    from torch.distributed.pipelining import PipelineStage


def _filled_list(shape: tuple[int, ...], value: int) -> list | int:
    """What `Tensor.tolist()` gives for an int tensor of `shape` filled with `value`, with no tensor allocated."""
    return [_filled_list(shape[1:], value) for _ in range(shape[0])] if shape else value


@contextlib.contextmanager
def generating(new_tokens: int, stop_after: int | None = None) -> Iterator[None]:
    """GENERATION_QUESTIONS while a `model.generate()` of `new_tokens` tokens is traced: Tensor.__bool__,
    Tensor.item and Tensor.tolist of meta tensors answered by the transformers function asking (see the bridge's `why`); the
    originals back on exit. `stop_after`: the stop check answers "every row finished" after that many tokens
    instead (a generation traced in part, `tracer/decoding.py`: the loop exits there as it does after the N-th
    token). Raises BridgeError (nothing patched) when a target is missing; while it runs, a
    question from another function raises TraceError."""
    from .errors import TraceError

    found = resolve(GENERATION_QUESTIONS)
    mod = "transformers.generation.utils."
    code = {name: inspect.unwrap(found[mod + name]).__code__
            for name in ("GenerationMixin.generate", "GenerationMixin._prepare_special_tokens",
                         "GenerationMixin._get_logits_processor")}
    code["_ignore_bidirectional_mask_sdpa"] = inspect.unwrap(
        found["transformers.masking_utils._ignore_bidirectional_mask_sdpa"]).__code__
    stop_call = vars(found[mod + "StopCheck"]).get("__call__")  # a class is callable without its own __call__
    if stop_call is None:
        raise _missing(GENERATION_QUESTIONS, mod + "StopCheck.__call__")
    code["StopCheck.__call__"] = stop_call.__code__
    for name in ("generate_with_fallback", "_retrieve_segment"):  # staticmethods and methods alike
        code[name] = inspect.unwrap(found[f"{_WHISPER}.WhisperGenerationMixin.{name}"]).__code__
    stops = [0]

    def stop_check() -> bool:
        stops[0] += 1
        return stops[0] >= (new_tokens if stop_after is None else min(stop_after, new_tokens))

    answers: dict[tuple[object, str], Callable[[], bool]] = {
        (code["GenerationMixin.generate"], "item"): lambda: False,  # has_right_padding
        (code["GenerationMixin.generate"], "__bool__"): lambda: True,  # (attention_mask == 1).all()
        (code["GenerationMixin._prepare_special_tokens"], "__bool__"): lambda: False,
        (code["GenerationMixin._get_logits_processor"], "__bool__"): lambda: False,
        (code["_ignore_bidirectional_mask_sdpa"], "__bool__"): lambda: True,  # the prompt's mask: all ones
        (code["StopCheck.__call__"], "__bool__"): stop_check,
        # Whisper: the last token is neither pad nor EOS; no token is a timestamp
        (code["generate_with_fallback"], "__bool__"): lambda: False,
        (code["_retrieve_segment"], "tolist"): lambda: 0,  # token 0 at every place
    }

    def answering(name: str):
        original = getattr(torch.Tensor, name)

        def answer(self):
            if self.device.type != "meta":
                return original(self)
            caller = sys._getframe(1)
            known = answers.get((caller.f_code, name))
            if known is None:
                raise TraceError(f"model.generate() asked for a value of a meta tensor (Tensor.{name}) in "
                                 f"{caller.f_code.co_qualname} ({caller.f_code.co_filename}:{caller.f_lineno}), a "
                                 f"question bridge {GENERATION_QUESTIONS.name} does not answer")
            value = known()
            if name == "tolist":
                return _filled_list(tuple(self.shape), int(value))
            return value if name == "__bool__" else int(value)
        return answer

    with (_set(torch.Tensor, "__bool__", answering("__bool__")), _set(torch.Tensor, "item", answering("item")),
          _set(torch.Tensor, "tolist", answering("tolist"))):
        yield


@contextlib.contextmanager
def fsdp_on_meta(rec: StepRecording | None = None) -> Iterator[None]:
    """FSDP_ON_META while FSDP2 is applied (`rec` None) or a sharded step is recorded by `rec`: the originals back
    on exit. Raises BridgeError, with nothing patched, when a target is missing."""
    found = resolve(FSDP_ON_META)
    handle = found["torch.distributed.device_mesh._get_device_handle"]

    def device_handle(device_type: str = "cuda"):
        return torch.cpu if device_type == "meta" else handle(device_type)

    param_mod = importlib.import_module(_FSDP + "_fsdp_param")
    alloc, free = found[_FSDP + "_fsdp_param.alloc_storage"], found[_FSDP + "_fsdp_param.free_storage"]

    def alloc_storage(tensor: torch.Tensor) -> None:
        before = tensor.untyped_storage().nbytes()
        alloc(tensor)
        if rec is not None and tensor.untyped_storage().nbytes() != before:
            rec.storage_resized(tensor)

    def free_storage(tensor: torch.Tensor) -> None:
        before = tensor.untyped_storage().nbytes()
        free(tensor)
        if rec is not None and before:
            rec.storage_resized(tensor)

    from .analysis.categories import Category

    group_class = importlib.import_module(_FSDP + "_fsdp_param_group").FSDPParamGroup
    device_from_mesh = found[_FSDP + "_fully_shard._get_device_from_mesh"]
    gather_inputs = found[_FSDP + "_fsdp_param.FSDPParam.all_gather_inputs"]
    try:
        sharded = _lookup(_FSDP + "_fsdp_param", "ShardedState.SHARDED")  # read, not patched
    except LookupError:
        raise _missing(FSDP_ON_META, _FSDP + "_fsdp_param.ShardedState.SHARDED") from None

    def all_gather_inputs(self) -> list[torch.Tensor]:
        host = getattr(self, "_sharded_param_data", None)
        if (rec is None or not self.offload_to_cpu or self.sharded_state != sharded or host is None
                or host.device.type != "meta" or hasattr(self._sharded_local_tensor, "fsdp_pre_all_gather")):
            return gather_inputs.fget(self)
        with rec.device_copy():  # `sharded_param_data.to(self.device, non_blocking=True)`
            self._sharded_param_data = host.clone()
        rec.set_category(self._sharded_param_data, Category.COLLECTIVE_BUFFERS, "shard copied from host memory")
        try:
            return gather_inputs.fget(self)
        finally:
            self._sharded_param_data = host
    with contextlib.ExitStack() as stack:
        for module in ("torch.distributed.device_mesh", *(_FSDP + m for m in (
                "_fsdp_collectives", "_fsdp_init", "_fsdp_param_group", "_fsdp_state"))):
            stack.enter_context(_set(importlib.import_module(module), "_get_device_handle", device_handle))
        stack.enter_context(_set(importlib.import_module(_FSDP + "_fully_shard"), "_get_device_from_mesh",
                                 lambda mesh: torch.device("meta") if mesh.device_type == "meta"
                                 else device_from_mesh(mesh)))
        stack.enter_context(_set(group_class, "_validate_no_meta_params", lambda self: None))
        stack.enter_context(_set(group_class, "_validate_cpu_offload_params", lambda self: None))
        stack.enter_context(_set(param_mod.FSDPParam, "all_gather_inputs", property(all_gather_inputs)))
        stack.enter_context(_set(param_mod, "alloc_storage", alloc_storage))
        stack.enter_context(_set(param_mod, "free_storage", free_storage))
        stack.enter_context(_set(importlib.import_module(_FSDP + "_fsdp_param_group"), "alloc_storage",
                                 alloc_storage))
        yield


class _Overridden:
    """`target` with the methods in `overrides` replaced (name -> the value they return); every other attribute is
    the target's."""

    def __init__(self, target, **overrides) -> None:
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_overrides", overrides)

    def __getattr__(self, name: str):
        if name in self._overrides:
            return lambda *args, **kwargs: self._overrides[name]
        return getattr(self._target, name)


def ddp_on_meta(ddp) -> None:
    """DDP_ON_META on the DistributedDataParallel object `ddp` (for as long as it lives). Raises BridgeError when a
    target is missing."""
    resolve(DDP_ON_META)
    ddp.reducer = _Overridden(ddp.reducer, _rebuild_buckets=False)
    ddp.logger = _Overridden(ddp.logger, set_runtime_stats_and_log=None)


def gradient_checkpointing_layer() -> type:
    """transformers' `GradientCheckpointingLayer` (modeling_layers.py), the class of the layers that
    activation_checkpointing_enable checkpoints. Raises BridgeError when it is missing."""
    return resolve(CHECKPOINT_FUNCTION)["transformers.modeling_layers.GradientCheckpointingLayer"]


def route_checkpoint_functions(model: torch.nn.Module, function: Callable) -> int:
    """After `activation_checkpointing_enable`, replace each module's `_gradient_checkpointing_func` (where
    transformers' GradientCheckpointingLayer looks up the checkpoint function) by `function`. The model is the
    trace's own, so nothing is restored. Returns how many modules; raises BridgeError when none holds one."""
    resolve(CHECKPOINT_FUNCTION)
    count = 0
    for m in model.modules():
        if getattr(m, "_gradient_checkpointing_func", None) is not None:
            m._gradient_checkpointing_func = function
            count += 1
    if count == 0:
        raise _missing(CHECKPOINT_FUNCTION, f"_gradient_checkpointing_func on {type(model).__name__}'s modules after "
                                            "activation_checkpointing_enable")
    return count


def grad_scaler_state(scaler: torch.amp.GradScaler) -> tuple[torch.Tensor, ...]:
    """GRAD_SCALER_STATE: `scaler`'s scale and growth tracker tensors (made at its first `scale()`). Raises
    BridgeError when torch no longer makes them there."""
    resolve(GRAD_SCALER_STATE)
    return tuple(getattr(scaler, name) for name in GRAD_SCALER_STATE.assigns)


def clear_dtensor_caches() -> None:
    """DTENSOR_PLAN_CACHES: DTensor's sharding and redistribution caches emptied. Raises BridgeError when one of
    them is gone."""
    for clear in resolve(DTENSOR_PLAN_CACHES).values():
        clear()


@contextlib.contextmanager
def flash_attention_standin(flash_fn: Callable, varlen_fn: Callable, policy: KernelPolicy | None = None
                            ) -> Iterator[None]:
    """FLASH_ATTENTION_STANDIN while a flash_attention_2 model is built or its step recorded: transformers' checks
    for the flash_attn package pass, and its lazy import gives `flash_fn` and `varlen_fn` (tracer/flash_attn.py
    `standins`) instead of the package's; while a step is recorded under `policy`, an fp32 query's target dtype
    is the emulated autocast's; the originals back on exit (also on an exception). Raises BridgeError,
    with nothing patched, when a target is missing."""
    found = resolve(FLASH_ATTENTION_STANDIN)
    utils = importlib.import_module(_FA_UTILS)
    modeling = importlib.import_module("transformers.modeling_utils")
    process = found[_FA_UTILS + "._lazy_define_process_function"](varlen_fn)
    funcs = (flash_fn, varlen_fn, None, found[_FA_UTILS + "._pad_input"], found[_FA_UTILS + "._unpad_input"])

    def lazy_import(implementation, attention_wrapper=None, allow_all_kernels=False):
        return funcs, (process, dict)  # lazy_import_flash_attention's ((fn, varlen, kvcache, pad, unpad), kwargs fns)

    packed = found[_FA_UTILS + "._is_packed_sequence"]

    def is_packed(position_ids, batch_size):
        answer = packed(position_ids, batch_size)  # its ops run; a tensor on meta
        return False if isinstance(answer, torch.Tensor) and answer.device.type == "meta" else answer

    integration = importlib.import_module("transformers.integrations.flash_attention")
    target_dtype = found["transformers.integrations.flash_attention.get_target_dtype"]

    def get_target_dtype(query, module):
        if query.dtype != torch.float32 or query.device.type != "meta":
            return target_dtype(query, module)
        if policy is not None and policy.autocast_active:  # torch.is_autocast_enabled("cuda") on the target
            return policy.autocast_dtype
        if hasattr(module.config, "_is_quantized"):  # the rest of get_target_dtype, unchanged
            return module.config.dtype
        return next(m for m in module.modules() if isinstance(m, torch.nn.Linear)).weight.dtype

    with (_set(modeling.PreTrainedModel, "_flash_attn_import_error", lambda self, *a, **k: None),
          _set(integration, "get_target_dtype", get_target_dtype),
          _set(modeling, "lazy_import_flash_attention", lazy_import),
          _set(utils, "lazy_import_flash_attention", lazy_import),
          _set(utils, "_is_packed_sequence", is_packed)):
        yield


@contextlib.contextmanager
def packed_sequences() -> Iterator[None]:
    """PACKED_SEQUENCES while a --packing step is recorded: masking_utils.find_packed_sequence_indices of meta position
    ids runs its ops and returns the sequence-index mask (the real run's answer for packed rows) instead of asking
    its values; the original back on exit. Raises BridgeError, with nothing patched, when a target is missing."""
    found = resolve(PACKED_SEQUENCES)
    masking_utils = importlib.import_module("transformers.masking_utils")
    # the function itself, not PACKED_SEQUENCE_CHECK's answer (installed around every step, `__wrapped__`)
    original = inspect.unwrap(found["transformers.masking_utils.find_packed_sequence_indices"])
    is_tracing = found["transformers.masking_utils.is_tracing"]

    def bridged(position_ids):
        if position_ids.device.type != "meta":
            return original(position_ids)
        return meta_packed_mask(masking_utils, original, is_tracing, position_ids)  # the real answer for packed rows

    with _set(masking_utils, "find_packed_sequence_indices", bridged):
        yield


class _HeldWork:
    """A completed `dist.Work` stand-in that keeps its ops' tensors until it is dropped, as ProcessGroupGloo's
    send/recv Works keep theirs (PIPELINE_P2P)."""

    def __init__(self, ops):
        self.tensors = [op.tensor for op in ops]

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


@contextlib.contextmanager
def pipelining_on_meta(on_micro_step: Callable[[str, tuple[int, ...]], None],
                       on_send: Callable[[list[torch.Tensor]], None],
                       several: tuple[PipelineStage, ...] = ()) -> Iterator[None]:
    """PIPELINE_P2P, PIPELINE_STATIC_VOTE and PIPELINE_MICRO_STEPS while one rank's `schedule.step` of a --pp run
    is traced (tracer/pipelining.py): the schedule's batched sends and receives complete at once with a Work that
    holds their tensors (`on_send(tensors)` told of each backward send's), the warm-up vote answers STATIC, and
    `on_micro_step(label, in_flight)` is told where each forward/backward/weight-gradient micro-step begins ('F<i>',
    'B<i>', 'W<i>') and ends ('loop'), with the micro-batches then in the stage's `fwd_cache` or, zero-bubble's,
    waiting in its `backward_state` for their weight-gradient step (plus the running one). `several`: the rank's
    stages when it holds several (interleaved-1f1b, zero-bubble): each label then names its stage ('F<i>@<k>', as
    tests/pp_oracle.py `_instrument` does) and the micro-batches in flight are those in any of their stages'.
    The originals back on exit. Raises BridgeError (nothing patched) when a target is missing."""
    from .bridges import PIPELINE_BRIDGES

    for bridge in PIPELINE_BRIDGES:  # the stage-state reads too (tracer/pipelining.py), checked before anything
        resolve(bridge)
    from torch.distributed import isend
    from torch.distributed.pipelining import schedules, stage as stages
    from torch.distributed.pipelining.stage import InferenceMode, PipelineStage

    def batch_p2p(ops, desc=None):
        if not ops:
            return []
        if desc is not None and desc.startswith("bwd_send"):
            on_send([op.tensor for op in ops if op.op is isend])
        return [_HeldWork(ops)]

    def sorted_batch_p2p(ops, desc=None):
        return {0: batch_p2p(ops, desc)} if ops else {}

    def static_vote(self, stage_list, has_backward, p2p_done):
        for s in stage_list:
            if isinstance(s, PipelineStage):
                s._inference_mode = InferenceMode.STATIC

    base = stages._PipelineStageBase
    forward, backward, weight = base.forward_one_chunk, base.backward_one_chunk, base.backward_weight_one_chunk

    def in_flight(stage, *running: int) -> tuple[int, ...]:
        # zero-bubble's input-gradient step pops a micro-batch from `fwd_cache` and parks its graph in
        # `backward_state` until its weight-gradient step (stage.py `backward_one_chunk(full_backward=False)`)
        held = [c for s in several or (stage,) for c in (s.fwd_cache, s.backward_state)]
        return tuple(sorted(set(running).union(*held)))

    def labelled(original, letter):
        def run(self, chunk_id, *args, **kwargs):
            on_micro_step(f"{letter}{chunk_id}" + (f"@{self.stage_index}" if several else ""),
                          in_flight(self, chunk_id))
            try:
                return original(self, chunk_id, *args, **kwargs)
            finally:
                on_micro_step("loop", in_flight(self))
        return run

    with contextlib.ExitStack() as stack:
        stack.enter_context(_set(schedules, "_batch_p2p", batch_p2p))
        stack.enter_context(_set(schedules, "_sorted_batch_p2p", sorted_batch_p2p))
        stack.enter_context(_set(schedules._PipelineSchedule, "_warmup_p2p", static_vote))
        stack.enter_context(_set(base, "forward_one_chunk", labelled(forward, "F")))
        stack.enter_context(_set(base, "backward_one_chunk", labelled(backward, "B")))
        stack.enter_context(_set(base, "backward_weight_one_chunk", labelled(weight, "W")))
        yield


# -- DeepSpeed ZeRO (`--zero`, tracer/zero.py; bridges.ZERO_BRIDGES) --------------------------------------------
DEEPSPEED_MISSING = "--zero needs DeepSpeed: pip install 'vramtrace[deepspeed]'"
# the environment DeepSpeed's comm layer reads for one rank (deepspeed/comm/comm.py `init_distributed`: without
# LOCAL_RANK it tries MPI discovery); set while tracing, the caller's values back on exit
_DS_PARTITION = "deepspeed.runtime.zero.partition_parameters"
_DS_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "LOCAL_WORLD_SIZE", "CROSS_RANK", "CROSS_SIZE",
           "MASTER_ADDR", "MASTER_PORT")


def import_deepspeed():
    """The `deepspeed` module, imported with the caller's environment, root logger level and warning filters put
    back (its import reads DS_* variables and configures its own logger `DeepSpeed`, which it keeps). Raises
    MissingExtraError without it."""
    import logging
    import os
    import warnings

    from .errors import MissingExtraError

    env, level = dict(os.environ), logging.getLogger().level
    try:
        with warnings.catch_warnings():
            import deepspeed
    except ImportError:
        raise MissingExtraError(DEEPSPEED_MISSING) from None
    finally:
        os.environ.clear()
        os.environ.update(env)
        logging.getLogger().setLevel(level)
    return deepspeed


def _ds_resolve(bridge) -> dict[str, object]:
    """`resolve(bridge)` of a ZeRO bridge once deepspeed imports: a missing target is a BridgeError naming it and
    the extra that pins the version written for (its `when_absent` covers a missing deepspeed only)."""
    from .errors import BridgeError

    found = resolve(bridge)
    if found is not None:
        return found
    for module, attribute in bridge.targets:
        try:
            _lookup(module, attribute)
        except LookupError:
            import deepspeed

            raise BridgeError(f"{module}.{attribute} is missing in deepspeed {deepspeed.__version__} (bridge "
                              f"{bridge.name}, written for {bridge.written_for}): this vramtrace does not support "
                              "that deepspeed version; pip install 'vramtrace[deepspeed]'") from None
    raise BridgeError(f"bridge {bridge.name}: a target did not resolve")


@contextlib.contextmanager
def deepspeed_zero(world: int, rank: int) -> Iterator[object]:
    """ZERO_BRIDGES while DeepSpeed's engine is built and stepped as rank `rank` of `world` on torch's fake process
    group (which the caller starts): DeepSpeed's CPU accelerator with the meta device as its device, set as
    DeepSpeed's accelerator; the shared-memory op skipped; the engine's module left where it is; DeepSpeed's
    reads of tensor values answered (no overflow, a finite norm, ranks consistent); DeepSpeed's logger (whose
    handler writes to stdout) at ERROR. Yields the accelerator. On exit the originals, DeepSpeed's previous
    accelerator, communication backend and logger level, `torch.nn.functional.linear`, and the environment are back.
    Raises MissingExtraError without deepspeed, BridgeError (nothing patched) when a target is missing."""
    import logging
    import os

    from .bridges import (DS_ACCELERATOR_DEVICE, DS_ENGINE_DEVICE, DS_GRAD_NORM_CHECK, DS_OFFLOAD_NORM,
                          DS_OVERFLOW_CHECK, DS_RANK_CHECKS, DS_SHM_COMM, ZERO_BRIDGES)

    import_deepspeed()
    for bridge in ZERO_BRIDGES:
        _ds_resolve(bridge)
    cpu_acc = importlib.import_module("deepspeed.accelerator.cpu_accelerator").CPU_Accelerator
    real = importlib.import_module("deepspeed.accelerator.real_accelerator")
    comm = importlib.import_module("deepspeed.comm.comm")
    env = {k: os.environ.get(k) for k in _DS_ENV}
    previous_accelerator, previous_cdb = real.ds_accelerator, comm.cdb
    groups = importlib.import_module("deepspeed.utils.groups")  # its process groups, made on this trace's fake group
    init_class = importlib.import_module(_DS_PARTITION).InsertPostInitMethodToModuleSubClasses  # DS_ZERO3_LINEAR_RESTORE
    linear, linear_bk = torch.nn.functional.linear, dict(vars(init_class)).get("linear_bk")
    saved_groups = {k: dict(v) if isinstance(v, dict) else v for k, v in vars(groups).items()
                    if not k.startswith("__") and (v is None or isinstance(v, dict))}
    ds_logger = logging.getLogger("DeepSpeed")  # deepspeed/utils/logging.py: a handler to stdout, the report's
    ds_level = ds_logger.level
    ds_logger.setLevel(logging.ERROR)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), CROSS_RANK="0", CROSS_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="29500")
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(_set(cpu_acc, "device_name", lambda self, device_index=None: "meta"))
            stack.enter_context(_set(cpu_acc, "current_device_name", lambda self: "meta"))
            stack.enter_context(_set(cpu_acc, "on_accelerator", lambda self, t: t.device.type == "meta"))
            accelerator = cpu_acc()
            real.set_accelerator(accelerator)
            comm.cdb = None  # a backend of this trace's fake group, made by `deepspeed.initialize`
            _ds_patches(stack, _ds_resolve(DS_SHM_COMM), _ds_resolve(DS_ENGINE_DEVICE), _ds_resolve(DS_GRAD_NORM_CHECK),
                        _ds_resolve(DS_RANK_CHECKS), _ds_resolve(DS_OFFLOAD_NORM), _ds_resolve(DS_OVERFLOW_CHECK))
            yield accelerator
    finally:
        real.ds_accelerator, comm.cdb = previous_accelerator, previous_cdb
        ds_logger.setLevel(ds_level)
        torch.nn.functional.linear = linear
        if linear_bk is not None:
            init_class.linear_bk = linear_bk
        elif "linear_bk" in vars(init_class):
            delattr(init_class, "linear_bk")
        for k, v in saved_groups.items():
            setattr(groups, k, dict(v) if isinstance(v, dict) else v)
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _ds_patches(stack: contextlib.ExitStack, shm: dict, engine: dict, norm_check: dict, rank_checks: dict,
                offload_norm: dict, overflow: dict) -> None:
    """The patches of DS_SHM_COMM, DS_ENGINE_DEVICE, DS_GRAD_NORM_CHECK, DS_RANK_CHECKS, DS_OFFLOAD_NORM and
    DS_OVERFLOW_CHECK (each dict: `resolve`'s targets, the originals), entered on `stack`."""
    ds_torch = importlib.import_module("deepspeed.comm.torch")
    stack.enter_context(_set(ds_torch, "build_shm_op", lambda: None))
    engine_class = importlib.import_module("deepspeed.runtime.engine").DeepSpeedEngine
    engine_init = engine["deepspeed.runtime.engine.DeepSpeedEngine.__init__"]

    def init(self, *args, **kwargs):
        kwargs["dont_change_device"] = True
        return engine_init(self, *args, **kwargs)

    stack.enter_context(_set(engine_class, "__init__", init))

    def is_invalid_grad_norm(norm) -> bool:
        if torch.is_tensor(norm):
            (~torch.isfinite(norm) | (norm < 0)).any()  # its ops, as runtime/utils.py runs them
        return False

    for target in norm_check:
        module, _, attribute = target.rpartition(".")
        stack.enter_context(_set(importlib.import_module(module), attribute, is_invalid_grad_norm))
    for target in rank_checks:
        module, _, attribute = target.rpartition(".")
        stack.enter_context(_set(importlib.import_module(module), attribute, lambda ints: None))
    stage3 = importlib.import_module("deepspeed.runtime.zero.stage3")
    stack.enter_context(_set(stage3.DeepSpeedZeroOptimizer_Stage3, "complete_grad_norm_calculation_for_cpu_offload",
                             _offload_grad_norm))
    stage12 = importlib.import_module("deepspeed.runtime.zero.stage_1_and_2")
    stack.enter_context(_set(stage12.DeepSpeedZeroOptimizer, "has_overflow", _zero12_has_overflow))
    from types import SimpleNamespace

    autocast_device = SimpleNamespace(device_name=lambda device_index=None: "cpu")  # DS_ZERO3_LINEAR_AUTOCAST
    stack.enter_context(_set(importlib.import_module("deepspeed.runtime.zero.linear"), "get_accelerator",
                             lambda: autocast_device))


def _offload_grad_norm(self, params):
    """deepspeed 0.19.8 runtime/zero/stage3.py `complete_grad_norm_calculation_for_cpu_offload` with the norm
    summed as a tensor: `get_accelerator().FloatTensor([float(total_norm)])` becomes a one-element fp32 tensor on
    the accelerator's device that the norm is copied into (the same allocation, no value read)."""
    import deepspeed.comm as dist
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.utils import is_model_parallel_parameter, mask_nan_or_inf_with_val_inplace

    process_group = self._get_param_partition_group(params[0])
    counts_every_rank = self._grad_norm_counts_every_rank(params, process_group)
    total_norm = 0.0
    for p in params:
        if counts_every_rank or is_model_parallel_parameter(p) or self.model_parallel_rank == 0:
            param_id = self.get_param_id(p)
            if param_id in self.norm_for_param_grads:
                total_norm += self.norm_for_param_grads[param_id] ** 2
    total_norm_acc = torch.empty(1, dtype=torch.float, device=get_accelerator().current_device_name())
    if torch.is_tensor(total_norm):
        total_norm_acc.copy_(total_norm.reshape(1))
    dist.all_reduce(total_norm_acc, op=dist.ReduceOp.SUM, group=process_group)
    if not counts_every_rank:
        self._model_parallel_all_reduce(tensor=total_norm_acc, op=dist.ReduceOp.SUM)
    total_norm = total_norm_acc[0] ** 0.5
    mask_nan_or_inf_with_val_inplace(total_norm, device=total_norm.device)
    return total_norm.cpu()


def _zero12_has_overflow(self, partition_gradients=True) -> bool:
    """deepspeed 0.19.8 runtime/zero/stage_1_and_2.py `DeepSpeedZeroOptimizer.has_overflow`: its ops (the
    partitioned gradients' inf/nan check, its `byte()` on the accelerator, the all-reduces), answered False."""
    import deepspeed.comm as dist
    from deepspeed.accelerator import get_accelerator

    device = get_accelerator().current_device_name()
    if self.cpu_offload:
        overflow_acc = torch.empty(1, dtype=torch.uint8, device=device)  # ByteTensor([self.local_overflow])
    else:
        overflow_acc = self.has_overflow_partitioned_grads_serial().byte().to(device)
    dist.all_reduce(overflow_acc, op=dist.ReduceOp.MAX, group=self.dp_process_group)
    self._model_parallel_all_reduce(tensor=overflow_acc, op=dist.ReduceOp.MAX)
    return False
