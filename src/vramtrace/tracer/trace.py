"""Trace one training (or inference) step of a meta-device model into a TracedGraph.

The step is run eagerly on meta tensors, exactly as user code runs it:

    loss = loaded.loss(model(*args, **inputs))        # under autocast for a mixed precision
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

under three layers: `KernelPolicyMode` (target device kernels and autocast, above autograd), a
saved-tensors hook (what autograd saves), and `StepRecorder` (every aten op, storage and eager free), with
the patches of `vramtrace.bridges` installed (transformers code that asks meta tensors for a value).
The optimizer step is run twice: first with no state (the first step, where state is created lazily),
then in the steady state; the forward and backward are shared by both timelines.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx
from torch.overrides import _get_current_function_mode_stack

from .. import bridges
from ..analysis.categories import Category
from ..errors import TraceError, UnsupportedOpError, VramtraceError
from ..spec import Device, Mode, OptimizerImpl, OptimizerKind, RunSpec
from .building import LoadedModel, quiet_transformers_logs
from .checkpointing import apply_checkpointing, layer_stack
from .kernels import CpuWorkspaceProbe, KernelPolicyMode, MoeRoutingPolicy, cpu_environment
from .records import RecStorage
from .recorder import StepRecorder, tag_autograd_nodes
from .replication import TRACED_LAYERS, LayerPlan, NotPeriodic, replicate_layers

STEADY_PHASES = ("forward", "backward", "optimizer", "zero_grad")
FIRST_STEP_PHASES = ("forward", "backward", "optimizer_first", "zero_grad")


@dataclass(frozen=True, slots=True)
class OpInfo:
    index: int
    name: str  # aten overload, e.g. 'aten.mm.default'
    phase: str  # forward | backward | optimizer_first | optimizer | zero_grad
    module: str  # qualified module path ('' for the root), 'optimizer' in the optimizer step
    reads: tuple[int, ...] = ()  # storage ids of its tensor arguments
    allocates: tuple[int, ...] = ()  # storage ids it allocated
    flops: int = 0  # torch.utils.flop_counter's count for the op (0 where it has no formula)
    recompute: bool = False  # a checkpointed forward op re-run in the backward


@dataclass(frozen=True, slots=True)
class StorageInfo:
    """One storage. `op_index` -1: alive at step start. `free_after`: index of the last op completed when eager
    freed it, None if it outlives the step. `last_use`: last op reading or writing it (-1: none)."""

    sid: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    device: str  # 'meta' (the target device) or 'cpu' (host tensors such as optimizer step counters)
    category: Category
    op_index: int
    op: str
    module: str
    phase: str
    name: str
    free_after: int | None
    last_use: int


@dataclass(frozen=True, slots=True)
class TracedGraph:
    """The recorded step: its aten ops in execution order and its storages. `to_fx_graph` turns it into an FX
    graph. `trace_note` says how it was traced (every layer, or 4 layers and the middle one replicated)."""

    ops: tuple[OpInfo, ...]
    storages: tuple[StorageInfo, ...]
    counted_devices: tuple[str, ...]
    sdpa_backends: tuple[tuple[str, int], ...]
    has_optimizer: bool
    trace_note: str = ""
    unresolved: tuple[str, ...] = ()  # what the trace could not size, one line each (never counted silently)
    cpu_environment: tuple[tuple[str, str | int], ...] = ()  # CPU target: what its kernel workspaces depend on


def make_optimizer(spec: RunSpec, params: list[torch.nn.Parameter]):
    """The real torch.optim optimizer. Default implementation: foreach on CUDA, for-loop on CPU, as
    `torch/optim/optimizer.py::_default_to_fused_or_foreach` picks for those devices."""
    if spec.optimizer is OptimizerKind.NONE or not params:
        return None
    if spec.optimizer_impl is OptimizerImpl.DEFAULT:
        foreach = spec.device is Device.CUDA
    else:
        foreach = spec.optimizer_impl is OptimizerImpl.FOREACH
    if spec.optimizer is OptimizerKind.ADAMW:
        return torch.optim.AdamW(params, lr=1e-4, foreach=foreach)
    if spec.optimizer is OptimizerKind.ADAM:
        return torch.optim.Adam(params, lr=1e-4, foreach=foreach)
    momentum = 0.9 if spec.optimizer is OptimizerKind.SGD_MOMENTUM else 0.0
    return torch.optim.SGD(params, lr=1e-3, momentum=momentum, foreach=foreach)


@contextlib.contextmanager
def _module_hooks(model: torch.nn.Module, rec: StepRecorder):
    names = {id(m): n for n, m in model.named_modules()}

    def pre(mod, args):
        rec.module_stack.append(names.get(id(mod), type(mod).__name__))

    def post(mod, args, out):
        path = rec.module_stack.pop() if rec.module_stack else ""
        if torch.is_grad_enabled():
            tag_autograd_nodes(out, path, rec.watch_node)

    h1 = torch.nn.modules.module.register_module_forward_pre_hook(pre)
    h2 = torch.nn.modules.module.register_module_forward_hook(post)
    try:
        yield
    finally:
        h1.remove()
        h2.remove()


def experts_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """transformers' MoE experts modules (classes decorated with `use_experts_implementation`)."""
    return [m for m in model.modules() if hasattr(m, "num_experts") and hasattr(type(m), "_apply_gate")]


@contextlib.contextmanager
def _moe_routing(model: torch.nn.Module, spec: RunSpec, policy: KernelPolicyMode):
    """While an experts module runs transformers' `eager` experts forward (a loop over the experts hit, with
    data-dependent `nonzero`/`where`), answer those ops by `spec.moe_routing` (kernels.MoeRoutingPolicy)."""
    handles = []

    def pre(mod, args):
        tokens = args[0].shape[0] if args and isinstance(args[0], torch.Tensor) else 0
        top_k = getattr(mod.config, "num_experts_per_tok", None) or getattr(mod.config, "top_k", 1)
        policy.moe = MoeRoutingPolicy(spec.moe_routing.value, mod.num_experts, top_k, tokens)

    def post(mod, args, out):
        policy.moe = None

    for m in experts_modules(model):
        if getattr(getattr(m, "config", None), "_experts_implementation", None) == "eager":
            handles += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _record(spec: RunSpec, model: torch.nn.Module, loaded: LoadedModel, say: Callable[[str], None],
            layers: torch.nn.ModuleList | None):
    """Apply the checkpointing policy to `model` (`loaded.model` or its shallow copy), then run the step on it
    with `loaded`'s inputs and loss under the recorder. Returns (recorder, kernel policy, optimizer or None)."""
    inputs, args, compute_dtype = loaded.inputs, loaded.args, loaded.compute_dtype
    rec = StepRecorder()
    policy = KernelPolicyMode(spec.device, spec.gpu_preset.sm, compute_dtype)
    policy.current_module = rec.current_module
    rec.strict = spec.strict
    if spec.device is Device.CPU:
        rec.workspace = CpuWorkspaceProbe(autocast_dtype=lambda: policy.kernel_autocast_dtype)

    def wrap_region(function):
        """A checkpointed region's function: its re-run in the backward is marked as recompute and runs under
        the autocast state of its forward, as torch/utils/checkpoint.py's recompute_fn restores it."""
        autocast_at_forward = policy.autocast_active

        def region(*args, **kwargs):
            if rec.phase != "backward":
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

    if spec.mode is Mode.TRAIN:
        apply_checkpointing(model, spec.checkpointing, wrap_region, layers)
    train = spec.mode is Mode.TRAIN
    params = [p for p in model.parameters() if p.requires_grad] if train else []
    optimizer = make_optimizer(spec, params) if train else None
    for n, p in model.named_parameters():
        rec.register_existing(p, Category.PARAMETER, n)
    for n, b in model.named_buffers():
        rec.register_existing(b, Category.INPUT, n)
    for n, t in [*inputs.items(), *((f"args[{i}]", a) for i, a in enumerate(args))]:
        if isinstance(t, torch.Tensor):
            rec.register_existing(t, Category.INPUT, n)
    # Tag each autograd node with the module that created it, as soon as it is created.
    policy.on_output = (lambda out: tag_autograd_nodes(out, rec.current_module(), rec.watch_node)
                        if rec.phase == "forward" else None)
    autocast = policy.autocast_region() if compute_dtype is not None else contextlib.nullcontext()
    try:
        with (bridges.installed(policy, rec), _moe_routing(model, spec, policy), _module_hooks(model, rec), policy,
              torch.autograd.graph.saved_tensors_hooks(rec.pack_hook, lambda t: t), rec):
            rec.phase = "forward"
            say("forward")
            if train:
                with autocast:
                    loss = loaded.loss(model(*args, **inputs))
                rec.phase = "backward"
                say("backward")
                loss.backward()
                for n, p in model.named_parameters():
                    if p.grad is not None:
                        rec.set_category(p.grad, Category.GRADIENT, f"{n}.grad")
                if optimizer is not None:
                    rec.phase = "optimizer_first"
                    say("optimizer step (first step: state created)")
                    optimizer.step()
                    names = {id(p): n for n, p in model.named_parameters()}
                    for p, state in optimizer.state.items():
                        for key, v in state.items():
                            if isinstance(v, torch.Tensor):
                                rec.set_category(v, Category.OPTIMIZER_STATE, f"{names.get(id(p), '?')}:{key}")
                    rec.phase = "optimizer"
                    say("optimizer step (steady state)")
                    optimizer.step()
                rec.phase = "zero_grad"
                if optimizer is not None:
                    optimizer.zero_grad(set_to_none=True)
                else:
                    model.zero_grad(set_to_none=True)
                del loss
            else:
                with torch.no_grad(), autocast:
                    out = model(*args, **inputs)
                del out
    except VramtraceError:
        raise
    except NotImplementedError as e:
        where = rec.current_module() or "(root)"
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UnsupportedOpError(f"an op has no meta kernel in module {where}: {text}") from e
    except Exception as e:  # anything the model, the user's loss or the step raised: one line, cause chained
        where = rec.current_module() or "(root)"
        last = rec.ops[-1].name if rec.ops else "no op yet"
        text = str(e).strip().splitlines()[0] if str(e).strip() else "(no message)"
        raise TraceError(f"tracing failed in phase {rec.phase}, module {where}, after {last}: "
                         f"{type(e).__name__}: {text}") from e
    finally:
        rec.detach()
    return rec, policy, optimizer


def _check_parameters(model: torch.nn.Module, storages: list[RecStorage]) -> None:
    """The rebuilt records must hold exactly the full model's parameters (name and bytes)."""
    want = {}
    for n, p in model.named_parameters():
        want[n] = p.untyped_storage().nbytes()
    got = {s.name: s.nbytes for s in storages if s.category == Category.PARAMETER}
    if got != want:
        missing = sorted(set(want) - set(got))[:3] or sorted(set(got) - set(want))[:3]
        raise NotPeriodic(f"the rebuilt parameters differ from the model's (e.g. {missing})")


def _sdpa_counts(policy: KernelPolicyMode, plan: LayerPlan | None) -> dict[str, int]:
    """SDPA calls per backend in the full model: with a plan, a traced call counts for the layers it stands for."""
    counts: dict[str, int] = {}
    for backend, module in policy.sdpa_calls:
        counts[backend] = counts.get(backend, 0) + (plan.weight(plan.layer_of(module)) if plan else 1)
    return counts


def trace_step(spec: RunSpec, loaded: LoadedModel, progress: Callable[[str], None] | None = None) -> TracedGraph:
    """Run the step of `spec` on `loaded` (meta device) and record it. Raises TraceError, UnsupportedOpError.

    With a `loaded.layer_plan`, the model with 4 layers is traced and the records of all layers are rebuilt
    (`replication.replicate_layers`); if that step turns out not to be periodic, every layer is traced.
    """
    say = progress or (lambda _msg: None)
    plan, note = loaded.layer_plan, loaded.replication_note
    result = None
    if plan is not None:
        say(f"tracing {TRACED_LAYERS} of {plan.num_layers} layers")
        with quiet_transformers_logs():
            rec, policy, optimizer = _record(spec, loaded.traced_model, loaded, say, layer_stack(loaded.traced_model))
        try:
            ops, storages = replicate_layers(plan, rec.ops, rec.storages)
            _check_parameters(loaded.model, storages)
            result = ops, storages, _sdpa_counts(policy, plan), optimizer is not None
            note = f"traced {TRACED_LAYERS} of {plan.num_layers} layers; the middle layer replicated"
        except NotPeriodic as e:
            note = f"traced every layer ({e})"
            say(note)
    if result is None:
        with quiet_transformers_logs():
            rec, policy, optimizer = _record(spec, loaded.model, loaded, say, layer_stack(loaded.model))
        result = rec.ops, rec.storages, _sdpa_counts(policy, None), optimizer is not None
    ops, storages, sdpa, has_optimizer = result
    unresolved = tuple(dict.fromkeys(rec.unresolved + policy.unresolved)) + tuple(
        f"{op}: CPU kernel workspace not measured, counted as 0 bytes ({why})"
        for op, why in getattr(rec.workspace, "failures", {}).items())

    last_use: dict[int, int] = {}
    for o in ops:
        for sid in o.ins:
            last_use[sid] = o.index
        for sid in o.outs:
            last_use[sid] = o.index
    free_after = {sid: o.index for o in ops for sid in o.frees}
    infos = []
    for s in storages:
        # Saved by autograd, or kept past the forward for the backward (a checkpointed region's inputs): an
        # activation; anything else without a category is a temporary.
        kept = s.phase == "forward" and s.sid in free_after and ops[free_after[s.sid]].phase == "backward"
        cat = s.category or (Category.ACTIVATION if s.saved or kept else Category.TEMPORARY)
        infos.append(StorageInfo(
            sid=s.sid, nbytes=s.nbytes, dtype=s.dtype, shape=s.shape, device=s.device, category=Category(cat),
            op_index=s.op_index, op=s.op, module=s.module, phase=s.phase if s.op_index >= 0 else "start",
            name=s.name, free_after=free_after.get(s.sid), last_use=last_use.get(s.sid, -1)))
    counted = ("meta",) if spec.device is Device.CUDA else ("meta", "cpu")
    return TracedGraph(
        ops=tuple(OpInfo(o.index, o.name, o.phase, o.module, o.ins, o.outs, o.flops, o.recompute) for o in ops),
        storages=tuple(infos),
        counted_devices=counted, sdpa_backends=tuple(sorted(sdpa.items())), has_optimizer=has_optimizer,
        trace_note=note, unresolved=unresolved,
        cpu_environment=_cpu_kernels(rec.workspace) if spec.device is Device.CPU else ())


def _cpu_kernels(probe: CpuWorkspaceProbe) -> tuple[tuple[str, str | int], ...]:
    """What the CPU target's kernels depend on (`kernels.cpu_environment`), plus the ops whose CPU outputs the
    trace lays out as the CPU kernel does (measured, so exact; named so that the difference from the meta
    kernels is visible)."""
    env = cpu_environment()
    if probe.notes:
        env["relaid_outputs"] = "; ".join(f"{op}: {why}" for op, why in sorted(probe.notes.items()))
    return tuple(env.items())


def to_fx_graph(traced: TracedGraph, phases: tuple[str, ...] = STEADY_PHASES) -> fx.GraphModule:
    """The step as an FX graph of aten ops, one `call_function` node per op of `phases`, in execution order.

    Edges are storage dataflow: a node's args are the nodes that allocated the storages it reads (placeholders
    for storages alive at step start), so the graph carries exactly what liveness needs, not the ops' scalar
    arguments. `node.meta` holds 'phase', 'nn_module_stack' (module path), 'step' (op index), 'reads' and
    'allocates' (storage ids). Raises TraceError for an op name torch does not know.
    """
    graph = fx.Graph()
    producer: dict[int, fx.Node] = {}
    for s in traced.storages:  # alive at step start: parameters, buffers, inputs, optimizer state
        if s.op_index < 0 or (s.phase not in phases and s.category is Category.OPTIMIZER_STATE):
            node = graph.placeholder(f"s{s.sid}")
            node.meta["storage"] = s.sid
            producer[s.sid] = node
    for o in traced.ops:
        if o.phase not in phases:
            continue
        try:
            ns, op, overload = o.name.split(".")
            target = getattr(getattr(getattr(torch.ops, ns), op), overload)
        except (ValueError, AttributeError):
            raise TraceError(f"unknown op {o.name} at step {o.index}") from None
        args = tuple(dict.fromkeys(producer[s] for s in o.reads if s in producer))
        node = graph.call_function(target, args)
        node.meta.update({"phase": o.phase, "nn_module_stack": o.module, "step": o.index, "reads": o.reads,
                          "allocates": o.allocates})
        for s in o.allocates:
            producer[s] = node
    graph.output(None)
    return fx.GraphModule(torch.nn.Module(), graph)
