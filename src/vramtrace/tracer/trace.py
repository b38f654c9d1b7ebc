"""Trace the steps of a meta-device model into a TracedGraph.

The step runner (`step.py`) runs the loop eagerly on meta tensors, exactly as user code runs it, for two
optimizer steps (the first, where the optimizer creates its state lazily, and the steady state), under three
layers: `KernelPolicyMode` (target device kernels and autocast, above autograd), a saved-tensors hook (what
autograd saves), and `StepRecorder` (every aten op, storage and eager free), with the patches of
`vramtrace.bridges` installed (transformers and torch code that asks meta tensors for a value). `_TraceObserver`
turns the runner's progress into the recorder's phases, categories and the loops' references, and copies the
steady step's forward and backward from the first step's record where nothing carries over (`replay.py`).
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from dataclasses import dataclass, fields
from typing import Any, Callable

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.overrides import _get_current_function_mode_stack

from .. import bridges, feature_bridges
from ..analysis.categories import Category
from ..errors import TraceError, UnsupportedOpError, UsageError, VramtraceError
from ..spec import Device, Mode, RunSpec, ZeroGrad
from .building import LoadedModel, quiet_transformers_logs
from .checkpointing import apply_checkpointing, layer_stack
from .hooks import module_hooks, moe_routing
from .kernels import CUDA_OUTPUT_ORDER, KernelPolicyMode
from .probe import CpuWorkspaceProbe
from .profiling import cpu_environment, rank_threads
from .optim import make_optimizer
from .records import MicroMarks, OpInfo, Phase, RecStorage
from .recorder import StepRecorder, keeping_args, tag_autograd_nodes
from .replay import MicroRecord, capture, replay, replayable
from .decoding import PATTERN, decode_steps_to_trace, rebuild_decode_steps
from .flash_attn import standin_context
from .sharding import fsdp_op_categories, mixed_precision_policy, param_bytes, tp_layout
from .replication import TRACED_LAYERS, LayerPlan, NotPeriodic, replicate_layers
from .step import STEPS, StepContext, load_user_step, run_generation, run_inference, run_training


@dataclass(frozen=True, slots=True)
class TracedGraph:
    """The recording: its aten ops in execution order over `steps` recorded steps (`OpInfo.step`), its raw storage
    records (`analysis.storages.storage_table` makes the table), and where each micro-step's loop variables could
    be released (`marks`). `trace_note` says how it was traced (every layer, or 4 layers and the middle one
    replicated)."""

    ops: tuple[OpInfo, ...]
    storages: tuple[RecStorage, ...]
    marks: tuple[MicroMarks, ...]
    steps: int
    counted_devices: tuple[str, ...]
    sdpa_backends: tuple[tuple[str, int], ...]
    has_optimizer: bool
    trace_note: str = ""
    unresolved: tuple[str, ...] = ()  # what the trace could not size, one line each (never counted silently)
    cpu_environment: tuple[tuple[str, str | int], ...] = ()  # CPU target: what its kernel workspaces depend on
    compiled: dict | None = None  # --compile: the graphs Inductor compiled (`compiled_step.graphs_summary`)
    # op index -> (args, kwargs, output), tensors as recorder.TensorArg: a trace made with `keep_args`
    # (fx_export.to_fx_graph), else None
    op_args: dict[int, tuple] | None = None
    pipeline: Any = None  # --pp: the traced stage's micro-steps and buffers (pipelining.StageTrace), else None


KV_CACHE_NAME = "past_key_values"
CROSS_ATTENTION_CACHE_NAME = "past_key_values (cross-attention)"  # EncoderDecoderCache.cross_attention_cache


def reachable_tensors(obj: Any, depth: int = 6) -> list[tuple[torch.Tensor, str]]:
    """The tensors reachable from a model's output object (ModelOutput fields, tuples, a transformers Cache and
    its layers' attributes), each with '' or, when reached through a transformers Cache, the cache's name:
    `CROSS_ATTENTION_CACHE_NAME` under an `EncoderDecoderCache`'s `cross_attention_cache` (keys and values of the
    encoder's output, computed once), else `KV_CACHE_NAME`."""
    found: list[tuple[torch.Tensor, str]] = []
    seen: set[int] = set()
    stack = [(obj, depth, "")]  # iterative: a recursive closure would be a reference cycle holding the tensors
    while stack:
        x, d, cache = stack.pop()
        if isinstance(x, torch.Tensor):
            found.append((x, cache))
            continue
        if d < 0 or id(x) in seen or isinstance(x, (str, bytes, int, float, bool, type(None), torch.nn.Module)):
            continue
        seen.add(id(x))
        is_cache = any(c.__module__.startswith("transformers.cache_utils") for c in type(x).__mro__)
        cache = cache or (KV_CACHE_NAME if is_cache else "")
        if isinstance(x, dict):
            items = [(v, cache) for v in x.values()]
        elif isinstance(x, (list, tuple, set)):
            items = [(v, cache) for v in x]
        elif hasattr(x, "__dict__"):
            items = [(v, CROSS_ATTENTION_CACHE_NAME if is_cache and k == "cross_attention_cache" else cache)
                     for k, v in vars(x).items()]
        else:
            continue
        stack.extend((v, d - 1, c) for v, c in reversed(items))
    return found


def graph_leaves(loss: torch.Tensor) -> list[weakref.ref]:
    """Weak references to the leaves of `loss`'s autograd graph that are not parameters (AccumulateGrad nodes'
    `variable`: an embedding output `enable_input_require_grads` made require grad). The graph holds them, and
    they their `.grad`, as long as something holds the loss."""
    leaves, seen = [], set()
    stack = [loss.grad_fn] if isinstance(loss, torch.Tensor) and loss.grad_fn is not None else []
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor) and not isinstance(variable, torch.nn.Parameter):
            leaves.append(weakref.ref(variable))
        stack.extend(nxt for nxt, _ in node.next_functions if nxt is not None)
    return leaves


class _TraceObserver:
    """The step runner's observer while recording: phases and step numbers to the recorder, the loops'
    references (`hold`), the KV cache's category, the release marks; `say` reports progress."""

    def __init__(self, rec: StepRecorder, say: Callable[[str], None], policy: KernelPolicyMode,
                 replay_params: list[torch.nn.Parameter] | None = None):
        """`replay_params`: the parameters, when later steps may replay the first step's micro-steps
        (`replay.py`; the trace passes them when zero_grad sets gradients to None and no GradScaler runs)."""
        self.rec, self.say, self.policy = rec, say, policy
        self.micro_count = -1
        self.marks: list[MicroMarks] = []
        self._pending: dict[str, int] = {}
        self._replay_params = replay_params
        self._first: dict[int, MicroRecord | None] = {}  # the first step's micro-steps, by micro
        self._first_sid = 0  # storages registered before the first step
        self._step_map: dict[int, int] = {}  # a first-step sid -> its copy in the step being replayed
        self._start = (0, 0)  # (op, sid) counts when the current micro-step began
        self._sdpa: dict[int, list] = {}  # the first step's SDPA calls, by micro
        self.sdpa_starts: dict[int, int] = {}  # the first step's micro -> SDPA calls made before it began
        self.replayed = 0
        self._graph_leaves: list[weakref.ref] = []  # the micro-step's loss graph's leaves (`graph_leaves`)

    def _last_op(self) -> int:
        return len(self.rec.ops) - 1

    def begin(self, step: int, micro: int) -> None:
        self.rec.step, self.rec.micro = step, micro
        self.micro_count += 1
        self._pending = {}
        self._start = (len(self.rec.ops), len(self.rec.storages))
        if step == 0 and micro == 0:
            self._first_sid = len(self.rec.storages)
        if micro == 0:
            self._step_map = {}
            self.policy.sdpa_calls.clear()  # the report counts the calls of one (the last) step
            self.say(f"step {step + 1} of {STEPS} ({'first' if step == 0 else 'steady state'})")
        self._sdpa_start = len(self.policy.sdpa_calls)
        if step == 0:
            self.sdpa_starts[micro] = self._sdpa_start

    def backward_returned(self) -> None:
        # a loop that keeps `loss` keeps its graph, and through it the leaves that are not parameters and their
        # gradients (an input made to require grad): held as the loss's "graph" (analysis/storages.py)
        for ref in self._graph_leaves:
            leaf = ref()
            for t in (leaf, getattr(leaf, "grad", None)):
                if t is not None:
                    self.rec.hold(t, "graph", self.micro_count)
        self._graph_leaves = []
        self.rec.backward_done()
        if self._replay_params is not None and self.rec.step == 0:
            self._first[self.rec.micro] = capture(self.rec, self._replay_params, *self._start, self._pending,
                                                  self.micro_count)
            self._sdpa[self.rec.micro] = list(self.policy.sdpa_calls[self._sdpa_start:])

    def replay(self, step: int, micro: int) -> bool:
        r = self._first.get(micro) if step > 0 else None
        if r is None or not replayable(self.rec, r, self._first_sid, self._step_map):
            return False
        self._pending = replay(self.rec, r, step, micro, self.micro_count, self._step_map)
        self.policy.sdpa_calls.extend(self._sdpa[micro])  # the replayed forward makes the same calls
        self.replayed += 1
        return True

    def phase(self, phase: Phase) -> None:
        self.rec.phase = phase

    def forward_returned(self, outputs: Any) -> None:
        self._pending["forward_returned"] = self._last_op()
        for t, cache in reachable_tensors(outputs):
            if cache:
                self.rec.set_category(t, Category.KV_CACHE, cache)
            self.rec.hold(t, "outputs", self.micro_count)

    def loss_taken(self) -> None:
        self._pending["loss_taken"] = self._last_op()

    def loss_held(self, loss: torch.Tensor) -> None:
        self.rec.hold(loss, "loss", self.micro_count)
        self._graph_leaves = graph_leaves(loss)

    def body_end(self) -> None:
        p = self._pending
        self.marks.append(MicroMarks(self.rec.step, self.micro_count, p["forward_returned"], p["loss_taken"],
                                     self._last_op()))


@contextlib.contextmanager
def _optimizer_hooks(model: torch.nn.Module, rec: StepRecorder):
    """While any Optimizer.step runs (also one a --step function or a GradScaler calls): the recorder knows it
    (`in_optimizer`); the gradients it reads are categorised before, and its state after."""
    names = {id(p): n for n, p in model.named_parameters()}

    def pre(opt, args, kwargs):
        rec.in_optimizer += 1
        _tag_gradients(model, rec)

    def post(opt, args, kwargs):
        rec.in_optimizer -= 1
        for p, state in opt.state.items():
            for key, v in state.items():
                if isinstance(v, torch.Tensor):
                    rec.set_category(v, Category.OPTIMIZER_STATE, f"{names.get(id(p), '?')}:{key}")

    h1 = register_optimizer_step_pre_hook(pre)
    h2 = register_optimizer_step_post_hook(post)
    try:
        yield
    finally:
        h1.remove()
        h2.remove()


def _tag_gradients(model: torch.nn.Module, rec: StepRecorder) -> None:
    for n, p in model.named_parameters():
        if p.grad is not None:
            rec.set_category(p.grad, Category.GRADIENT, f"{n}.grad")


def _grad_scaler(spec: RunSpec, loaded: LoadedModel):
    """fp16-mixed, fp16-autocast: `torch.amp.GradScaler` as the AMP recipe (and HF Trainer with fp16=True,
    accelerate/accelerator.py `native_amp`) uses it. Built for "cpu" on either target: its
    device only gates whether it is enabled (torch/amp/grad_scaler.py `__init__` disables a "cuda" scaler without
    a GPU); its tensors are made lazily on the loss's device (meta), with the same ops on both targets."""
    if not loaded.precision.scales_loss or spec.step is not None:
        return None
    if any(p.requires_grad and p.dtype == torch.float16 for p in loaded.model.parameters()):
        # torch/amp/grad_scaler.py `_unscale_grads_` raises "Attempting to unscale FP16 gradients": HF Trainer with
        # fp16=True on a model whose trainable parameters are fp16 stops at its first optimizer step
        raise UsageError(f"--precision {loaded.precision.value} trains fp16 parameters, whose gradients torch's "
                         "GradScaler refuses to unscale (as HF Trainer with fp16=True on an fp16 model does); use "
                         "fp16-mixed (fp32 master weights) or LoRA (peft's fp32 adapters)")
    return torch.amp.GradScaler("cpu")


def _record(spec: RunSpec, model: torch.nn.Module, loaded: LoadedModel, say: Callable[[str], None],
            layers: torch.nn.ModuleList | None, replay_steady: bool = True, stop_after: int | None = None):
    """`_record_on` the model; with `spec.fsdp` and/or `spec.tp`, on a copy of it parallelized as rank `spec.rank`
    (0 when None) of a fake process group (`sharding.parallelize`); with `spec.ddp`, on a copy wrapped by DDP
    there. A distributed step's steady step is traced, not replayed."""
    from .sharding import fake_rank, parallelize, wrap_ddp

    if spec.pp is not None:  # one stage of a pipeline, on a fake rank of spec.pp (tracer/pipelining.py)
        from .pipelining import record_stage

        traced = TRACED_LAYERS if model is loaded.traced_model and model is not None else None
        return record_stage(spec, loaded, lambda s, m, ld, layers, step_of: _record_on(
            s, m, ld, say, layers, False, stop_after, step_of=step_of), traced)
    if spec.ddp is not None:
        with fake_rank(spec.ddp, 0):  # every DDP rank runs the same program
            model = copy.deepcopy(model)  # the reducer hooks the parameters' gradient accumulators
            return _record_on(spec, model, loaded, say, layer_stack(model), False, stop_after, wrap=wrap_ddp)
    if spec.world is None:
        return _record_on(spec, model, loaded, say, layers, replay_steady, stop_after)

    with fake_rank(spec.world, spec.rank or 0):
        model = parallelize(model, spec, loaded.precision)
        return _record_on(spec, model, loaded, say, layer_stack(model), False, stop_after)


@dataclass(frozen=True, slots=True)
class RecorderSettings:
    """The `StepRecorder` attributes a run's spec sets (each documented there), made by `recorder_settings`."""

    strict: bool
    offloading: bool
    op_categories: dict[torch._ops.OpOverload, tuple[str, str]]
    output_order: dict[torch._ops.OpOverload, tuple[int, ...]]
    meta_kernels: dict[torch._ops.OpOverload, Callable]
    derived_categories: dict[tuple[torch._ops.OpOverload, str], str]
    workspace: Callable | None

    def apply(self, rec: StepRecorder) -> None:
        for f in fields(self):
            setattr(rec, f.name, getattr(self, f.name))


def recorder_settings(spec: RunSpec, policy: KernelPolicyMode) -> RecorderSettings:
    """How a step of `spec` is recorded: `--strict`; FSDP2's CPU offload (`offloading`) and its collectives'
    categories; the CUDA kernels' output order; the kernels' workspaces (CPU: measured by `CpuWorkspaceProbe` under
    `policy`'s autocast; CUDA: the reductions' staging buffers and bitsandbytes' kernels' workspaces); a quantized
    model's op categories and, for int8, its meta kernels and derived categories (quantization.py)."""
    op_categories = fsdp_op_categories() if spec.fsdp is not None else {}
    meta_kernels: dict[torch._ops.OpOverload, Callable] = {}
    derived: dict[tuple[torch._ops.OpOverload, str], str] = {}
    if spec.device is Device.CPU:
        workspace = CpuWorkspaceProbe(autocast_dtype=lambda: policy.kernel_autocast_dtype)
    else:
        from ..analysis.cuda_reduce import ReduceDevice
        from .cuda_reductions import cuda_workspace_hook
        from .quantization import cuda_workspace

        gpu = spec.gpu_preset
        workspace = cuda_workspace_hook(ReduceDevice(gpu.sm_count, gpu.max_threads_per_sm),
                                        cuda_workspace if spec.quantization is not None else None)
    if spec.quantization is not None:
        from .quantization import quantized_recording

        quant_categories, meta_kernels, derived = quantized_recording(spec.quantization.four_bit)
        op_categories = {**op_categories, **quant_categories}
    return RecorderSettings(spec.strict, spec.cpu_offload, op_categories,
                            CUDA_OUTPUT_ORDER if spec.device is Device.CUDA else {}, meta_kernels, derived, workspace)


def _region_wrapper(rec: StepRecorder, policy: KernelPolicyMode) -> Callable[[Callable], Callable]:
    """`wrap_region` for the checkpointing policy (checkpointing.py `apply_checkpointing`)."""
    def wrap_region(function):
        """A checkpointed region's function: its re-run in the backward is marked as recompute and runs under
        the autocast state of its forward, as torch/utils/checkpoint.py's recompute_fn restores it."""
        autocast_at_forward = policy.autocast_active

        def region(*args, **kwargs):
            if rec.phase is not Phase.BACKWARD:
                return function(*args, **kwargs)
            rec.recomputing += 1
            depth = len(rec.module_stack)
            # The autograd engine runs the recompute without the thread's torch-function modes: push ours again.
            mode = policy if policy not in _get_current_function_mode_stack() else contextlib.nullcontext()
            # recompute_fn's torch.random.fork_rng stashes the host RNG state for the recompute on the target
            # device; on meta it does nothing (torch/random.py), so make the stash here
            stash = torch.get_rng_state()
            try:
                with mode, policy.autocast_region() if autocast_at_forward else contextlib.nullcontext():
                    return function(*args, **kwargs)
            finally:
                del stash
                rec.recomputing -= 1
                # checkpoint's early stop raises out of the recompute, past the modules' forward hooks
                del rec.module_stack[depth:]
        return region
    return wrap_region


def _register_step_state(rec: StepRecorder, spec: RunSpec, model: torch.nn.Module, loaded: LoadedModel,
                         optimizer) -> dict[int, str]:
    """Register what is alive when the step starts, in this order: parameters (host memory under FSDP2's CPU
    offload), a quantized model's weights' categories, the optimizer's state made in `__init__` (Adagrad's `sum`
    and `step`, not lazily), buffers, inputs, the tensors the loop holds (`LoadedModel.held`). Returns the
    parameters' names by id."""
    for n, p in model.named_parameters():
        rec.register_existing(p, Category.PARAMETER, n)
        if spec.cpu_offload:  # FSDP2's CPUOffloadPolicy: every parameter's shard in host memory
            rec.offload(p)
    if spec.quantization is not None or spec.in_process is not None:  # a module passed in (a Trainer's QLoRA
        from .quantization import categorise  # model, integrations/transformers.py) may hold bitsandbytes weights

        categorise(model, rec.register_existing)
    weight_names = {id(p): n for n, p in model.named_parameters()}
    if optimizer is not None:
        for p, state in optimizer.state.items():
            for key, v in state.items():
                if isinstance(v, torch.Tensor):
                    rec.register_existing(v, Category.OPTIMIZER_STATE, f"{weight_names.get(id(p), '?')}:{key}")
                    if spec.cpu_offload:
                        rec.offload(v)
    for n, b in model.named_buffers():
        rec.register_existing(b, Category.INPUT, n)
    for n, t in [*loaded.inputs.items(), *((f"args[{i}]", a) for i, a in enumerate(loaded.args)),
                 *loaded.held.items()]:
        if isinstance(t, torch.Tensor):
            rec.register_existing(t, Category.INPUT, n)
    return weight_names


def _policy_callbacks(rec: StepRecorder, weight_names: dict[int, str]) -> dict[str, Callable]:
    """The kernel policy's callbacks into the recorder (`KernelPolicyMode`'s keyword arguments): the module
    running now; each autograd node tagged with the module that created it, as soon as it is created; tensors made
    from host data; outputs a CUDA kernel makes on the host; the weights' autocast copies, named from
    `weight_names` (parameter names by id, filled once the step's state is registered)."""
    return dict(current_module=rec.current_module,
                on_output=lambda out: (tag_autograd_nodes(out, rec.current_module(), rec.watch_node)
                                       if rec.phase is Phase.FORWARD else None),
                on_host_data=rec.host_data, on_host_output=rec.offload,
                on_weight_cast=lambda w, copy: rec.set_category(copy, Category.AUTOCAST_WEIGHTS,
                                                                f"{weight_names.get(id(w), '?')} (autocast copy)"))


def _serve_buffers(spec: RunSpec, model: torch.nn.Module, rec: StepRecorder, ctx: StepContext) -> dict:
    """A serving profile run's persistent runner buffers (registered; alive through the recording while the
    caller holds them) and its sampler on `ctx`; {} for another run."""
    if spec.serve_requests is None:
        return {}
    from .serving import dummy_sampler, runner_buffers

    vocab = model.config.get_text_config().vocab_size
    buffers = runner_buffers(spec.seq, spec.serve_requests, vocab, "meta")
    for n, t in buffers.items():
        rec.register_existing(t, Category.INPUT, n)
    ctx.sample = lambda out: dummy_sampler(out.logits[0])  # (R, V): one row per request
    return buffers


def _record_on(spec: RunSpec, model: torch.nn.Module, loaded: LoadedModel, say: Callable[[str], None],
               layers: torch.nn.ModuleList | None, replay_steady: bool = True, stop_after: int | None = None,
               wrap: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
               step_of: Callable[[StepContext, StepRecorder], Callable] | None = None):
    """Apply the checkpointing policy to `model` (`loaded.model` or its shallow copy), then run the step on it
    with `loaded`'s inputs and loss under the recorder; a generation stops after `stop_after` tokens when given
    (`tracer/decoding.py`). Returns (recorder, kernel policy, optimizer or None, the release marks, how many
    micro-steps were replayed rather than traced, the observer). `wrap(model)` (DDP) is built under the recorder
    just before the step, and the step calls what it returns; what it allocates is a collective buffer (DDP's
    gradient buckets)."""
    compute_dtype = loaded.compute_dtype
    if spec.fsdp is not None and mixed_precision_policy(loaded.precision) is not None:
        compute_dtype = None  # FSDP2's MixedPrecisionPolicy casts the parameters; no autocast (sharding.py)
    rec = StepRecorder()
    weight_names: dict[int, str] = {}
    policy = KernelPolicyMode(spec.device, spec.gpu_preset.sm, compute_dtype, **_policy_callbacks(rec, weight_names))
    recorder_settings(spec, policy).apply(rec)
    train = spec.mode is Mode.TRAIN
    if train:
        apply_checkpointing(model, spec.checkpointing, _region_wrapper(rec, policy), layers)
    params = [p for p in model.parameters() if p.requires_grad] if train else []
    optimizer = make_optimizer(spec, params) if train else None  # None without parameters (a --pp stage)
    user_step = load_user_step(spec.step) if spec.step is not None else None
    weight_names.update(_register_step_state(rec, spec, model, loaded, optimizer))
    ctx = StepContext(model, loaded.args, loaded.inputs, loaded.loss, optimizer,
                      (lambda: policy.autocast_region()) if compute_dtype is not None else contextlib.nullcontext,
                      _grad_scaler(spec, loaded), user_step)
    if step_of is not None:  # --pp: one rank's pipeline step (tracer/pipelining.py `pipeline_step`)
        ctx.user_step = user_step = step_of(ctx, rec)
    serve_buffers = _serve_buffers(spec, model, rec, ctx)  # alive through the recording
    # the steady step's micro-steps replay the first step's (replay.py) when nothing carries over between them
    repeatable = (replay_steady and train and user_step is None and ctx.scaler is None
                  and spec.zero_grad is ZeroGrad.NONE)
    obs = _TraceObserver(rec, say, policy, params if repeatable else None)
    try:
        _run_recorded(spec, model, ctx, rec, policy, obs, stop_after, wrap)
    finally:
        rec.detach()
        del serve_buffers
    return rec, policy, optimizer, obs.marks, obs.replayed, obs


def _run_recorded(spec: RunSpec, model: torch.nn.Module, ctx: StepContext, rec: StepRecorder,
                  policy: KernelPolicyMode, obs: _TraceObserver, stop_after: int | None,
                  wrap: Callable[[torch.nn.Module], torch.nn.Module] | None) -> None:
    """Run the step of `ctx` under the bridges, the policy, the hooks and the recorder (`_record_on`). Raises
    VramtraceError, UnsupportedOpError (an op without a meta kernel) and TraceError (anything else the model, the
    loss or the step raised: one line, the cause chained)."""
    try:
        sharded = feature_bridges.fsdp_on_meta(rec) if spec.world is not None else contextlib.nullcontext()
        packed = feature_bridges.packed_sequences() if spec.packing else contextlib.nullcontext()
        with (bridges.installed(policy, rec), standin_context(spec, policy=policy), packed, sharded,
              moe_routing(model, spec, policy), module_hooks(model, rec),
              policy, _optimizer_hooks(model, rec),
              torch.autograd.graph.saved_tensors_hooks(rec.pack_hook, lambda t: t), rec):
            if wrap is not None:
                born = len(rec.storages)
                ctx.model = wrap(model)
                for s in rec.storages[born:]:
                    s.category, s.name = Category.COLLECTIVE_BUFFERS, "DDP gradient bucket"
            if spec.mode is Mode.TRAIN:
                run_training(ctx, spec, obs, literal=False)
                _tag_gradients(model, rec)  # kept by zero_grad(set_to_none=False), or with no optimizer
            elif spec.mode is Mode.GENERATE:
                with feature_bridges.generating(spec.new_tokens, stop_after):
                    run_generation(ctx, spec, obs)
            else:
                run_inference(ctx, obs)
            if ctx.scaler is not None:
                for t in feature_bridges.grad_scaler_state(ctx.scaler):
                    rec.set_category(t, Category.KEPT, "GradScaler state")
    except VramtraceError:
        raise
    except Exception as e:
        raise _trace_error(e, rec) from e


def _trace_error(e: Exception, rec: StepRecorder) -> VramtraceError:
    """What the step raised (`e`), as one line naming where: an op without a meta kernel (NotImplementedError) is
    an UnsupportedOpError; anything else a TraceError with the phase, the module and the last op."""
    where = rec.current_module() or "(root)"
    if isinstance(e, NotImplementedError):
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return UnsupportedOpError(f"an op has no meta kernel in module {where}: {text}")
    last = rec.ops[-1].name if rec.ops else "no op yet"
    text = str(e).strip().splitlines()[0] if str(e).strip() else "(no message)"
    if "got mixed torch.Tensor and DTensor" in text and rec.phase is Phase.OPTIMIZER:
        return TraceError(f"the optimizer step fails as the real one does: {text} (the foreach implementation, "
                          "the CUDA default, gets the TP shards and the replicated parameters in one list, "
                          "pytorch/pytorch#153354); use --optimizer-impl for-loop (foreach=False)")
    return TraceError(f"tracing failed in phase {rec.phase}, module {where}, after {last}: "
                      f"{type(e).__name__}: {text}")



def _check_parameters(model: torch.nn.Module, storages: list[RecStorage], spec: RunSpec) -> None:
    """The rebuilt records must hold exactly the full model's parameters (name and bytes; with `spec.fsdp` or
    `spec.tp`, the storages rank `spec.rank` holds of them: `sharding.param_bytes`)."""
    if spec.pp is not None:  # the traced stage's parameters
        from .pipelining import stage_parameter_bytes

        want = stage_parameter_bytes(spec, model)
    elif spec.world is None or spec.ddp is not None:
        want = {n: p.untyped_storage().nbytes() for n, p in model.named_parameters()}
    else:
        want = param_bytes(model, spec, tp_layout(model, spec))
    got = {s.name: s.nbytes for s in storages if s.category in (Category.PARAMETER, Category.QUANTIZED_WEIGHTS)}
    if got != want:
        missing = sorted(set(want) - set(got))[:3] or sorted(set(got) - set(want))[:3]
        raise NotPeriodic(f"the rebuilt parameters differ from the model's (e.g. {missing})")


def _sdpa_counts(calls: list[tuple[str, str]], plan: LayerPlan | None) -> dict[str, int]:
    """SDPA calls per backend in the full model from the traced (backend, module) `calls`: with a plan, a traced
    call counts for the layers it stands for."""
    counts: dict[str, int] = {}
    for backend, module in calls:
        counts[backend] = counts.get(backend, 0) + (plan.weight(plan.layer_of(module)) if plan else 1)
    return counts


def cache_windows(model: torch.nn.Module) -> tuple[int, ...]:
    """The sliding windows (tokens) of the cache layers transformers makes for `model`'s decoder: what
    `DynamicCache(config=...)` reads (transformers/cache_utils.py `get_layer_types_and_kwargs`: a layer's
    `sliding_window`, or a chunked layer's `attention_chunk_size`); () for a model without a config."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "get_text_config"):
        return ()
    _types, kwargs = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    return tuple(sorted({k["sliding_window"] for k in kwargs if k.get("sliding_window")}))


def trace_step(spec: RunSpec, loaded: LoadedModel, progress: Callable[[str], None] | None = None, *,
               replay_steady: bool = True, rebuild_decode: bool = True, keep_args: bool = False) -> TracedGraph:
    """Run the steps of `spec` on `loaded` (meta device) and record them. Raises TraceError, UnsupportedOpError,
    UsageError (a bad --step file).

    `replay_steady`: the steady step's forward and backward are copied from the first step's record where that
    is exact (`replay.py`); False traces them again (tests compare the two).

    With a `loaded.layer_plan`, the model with 4 layers is traced and the records of all layers are rebuilt
    (`replication.replicate_layers`); if that step turns out not to be periodic, every layer is traced.

    A generation is traced for its first few decode steps and the records of the rest are rebuilt
    (`decoding.rebuild_decode_steps`); if the decode steps turn out not to be periodic, or `rebuild_decode` is
    False, every decode step is traced.

    `keep_args`: keep every op's arguments (`TracedGraph.op_args`, for `fx_export.to_fx_graph`); every layer and
    every step is then traced, none rebuilt or copied.

    On the CPU target, a step of more than one rank is traced with one rank's intra-op thread count
    (`profiling.rank_threads`: 1, as torchrun sets it, unless OMP_NUM_THREADS is set), restored after.
    """
    # the CPU target's kernels are probed with the thread count of one of its ranks
    with rank_threads(spec.world) if spec.device is Device.CPU else contextlib.nullcontext():
        return _trace_steps(spec, loaded, progress, replay_steady, rebuild_decode, keep_args)


def _trace_steps(spec: RunSpec, loaded: LoadedModel, progress: Callable[[str], None] | None, replay_steady: bool,
                 rebuild_decode: bool, keep_args: bool) -> TracedGraph:
    say = progress or (lambda _msg: None)
    if keep_args:
        with keeping_args():
            return _trace_step(spec, loaded, say, False, None, every_layer=True)
    traced_steps = None
    if spec.mode is Mode.GENERATE and rebuild_decode:
        traced_steps = decode_steps_to_trace(spec.new_tokens, spec.seq, cache_windows(loaded.model))
    if traced_steps is not None:
        say(f"tracing {traced_steps} of {spec.new_tokens - 1} decode steps")
        try:
            return _trace_step(spec, loaded, say, replay_steady, traced_steps)
        except NotPeriodic as e:
            say(f"every decode step traced ({e})")
            return _trace_step(spec, loaded, say, replay_steady, None, f"every decode step traced ({e})")
    return _trace_step(spec, loaded, say, replay_steady, None)


def _trace_step(spec: RunSpec, loaded: LoadedModel, say: Callable[[str], None], replay_steady: bool,
                traced_steps: int | None, decode_note: str = "", every_layer: bool = False) -> TracedGraph:
    """`trace_step` with `traced_steps` decode steps traced and the rest rebuilt (None: every step traced), and
    with `every_layer`, no layer replication. Raises NotPeriodic when that rebuild fails (a layer replication that
    fails traces every layer here)."""
    plan, note = (None, "traced every layer") if every_layer else (loaded.layer_plan, loaded.replication_note)
    if plan is not None and spec.ddp is not None:  # the reducer sizes its buckets from every parameter at once
        plan, note = None, "traced every layer (DDP's gradient buckets are built from the whole model's parameters)"
    if plan is not None and spec.pp is not None:  # the stage's layers, not the model's (tracer/pipelining.py)
        from .pipelining import stage_plan

        plan, note = stage_plan(spec, loaded)
    stop_after = None if traced_steps is None else traced_steps + 1  # the prefill makes the first token
    result = None
    if plan is not None:
        say(f"tracing {TRACED_LAYERS} of {plan.num_layers} layers")
        with quiet_transformers_logs():
            rec, policy, optimizer, marks, replayed, obs = _record(
                spec, loaded.traced_model, loaded, say, layer_stack(loaded.traced_model), replay_steady, stop_after)
        try:
            ops, storages, new_index = replicate_layers(plan, rec.ops, rec.storages)
            _check_parameters(loaded.model, storages, spec)
            if rec.pipeline is not None:
                rec.pipeline.remap(new_index, len(ops))
            marks = [MicroMarks(m.step, m.micro, new_index[m.forward_returned], new_index[m.loss_taken],
                                new_index[m.body_end]) for m in marks]
            result = ops, storages, marks, _sdpa_counts(policy.sdpa_calls, plan), optimizer is not None
            note = f"traced {TRACED_LAYERS} of {plan.num_layers} layers; the middle layer replicated"
        except NotPeriodic as e:
            note = f"traced every layer ({e})"
            say(note)
    if result is None:
        plan = None
        with quiet_transformers_logs():
            rec, policy, optimizer, marks, replayed, obs = _record(
                spec, loaded.model, loaded, say, layer_stack(loaded.model), replay_steady, stop_after)
        result = rec.ops, rec.storages, marks, _sdpa_counts(policy.sdpa_calls, None), optimizer is not None
    ops, storages, marks, sdpa, has_optimizer = result
    if traced_steps is not None:
        ops, storages, copies = rebuild_decode_steps(ops, storages, spec.new_tokens)
        last = max(obs.sdpa_starts)  # the template is the step before the last traced one
        template_calls = policy.sdpa_calls[obs.sdpa_starts[last - 1]:obs.sdpa_starts[last]]
        for backend, n in _sdpa_counts(template_calls, plan).items():
            sdpa[backend] = sdpa.get(backend, 0) + copies * n
        decode_note = (f"traced {traced_steps} of {spec.new_tokens - 1} decode steps; the rest rebuilt from the "
                       f"last regular one (sizes affine in the step, checked over {PATTERN})")
    if replayed:
        note = "; ".join(filter(None, [note, "the steady step's forward and backward copied from the first step's "
                                             f"record ({replayed} micro-step{'s' * (replayed > 1)})"]))
    note = "; ".join(filter(None, [note, decode_note]))
    unresolved = tuple(dict.fromkeys(rec.unresolved + policy.unresolved)) + tuple(
        f"{op}: CPU kernel workspace not measured, counted as 0 bytes ({why})"
        for op, why in getattr(rec.workspace, "failures", {}).items())
    counted = ("meta",) if spec.device is Device.CUDA else ("meta", "cpu")
    return TracedGraph(
        ops=tuple(OpInfo(o.index, o.name, o.phase, o.module, o.ins, o.outs, o.flops, o.recompute, o.step, o.micro,
                         o.frees) for o in ops),
        storages=tuple(storages), marks=tuple(marks), steps=max((o.step for o in ops), default=0) + 1,
        counted_devices=counted, sdpa_backends=tuple(sorted(sdpa.items())), has_optimizer=has_optimizer,
        trace_note=note, unresolved=unresolved,
        cpu_environment=_cpu_kernels(rec.workspace) if spec.device is Device.CPU else (), op_args=rec.op_args,
        pipeline=rec.pipeline)


def _cpu_kernels(probe: CpuWorkspaceProbe) -> tuple[tuple[str, str | int], ...]:
    """What the CPU target's kernels depend on (`profiling.cpu_environment`), plus the ops whose CPU outputs the
    trace lays out as the CPU kernel does (measured, so exact; named so that the difference from the meta
    kernels is visible) and the ops whose workspace was extrapolated from runs at reduced sizes."""
    env = cpu_environment()
    if probe.notes:
        env["relaid_outputs"] = "; ".join(f"{op}: {why}" for op, why in sorted(probe.notes.items()))
    if probe.extrapolated:
        env["extrapolated_workspaces"] = "; ".join(f"{op}: {how}" for op, how in sorted(probe.extrapolated.items()))
    return tuple(env.items())
