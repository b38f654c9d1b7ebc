"""Trace the training step of `torch.compile(model)` (`--compile`, issue 17): the step runner's loop (`step.py`) run
on a compiled fake-tensor copy of the model (`compiled.compiled_twin`), under the recorder.

What runs, and what the recorder sees:
- dynamo's compiled code and AOTAutograd's runtime wrappers run for real (on fake tensors claiming the CPU): the
  eager code between graphs (after a graph break), the tangents AOTAutograd allocates for outputs that get no
  gradient, the saved tensors it hands to autograd (`ctx.save_for_backward`, seen by the saved-tensor hook) and
  clears before calling the backward graph with `steal_args=True`;
- each compiled graph is not interpreted node by node: it repeats what Inductor's generated CPU wrapper allocates,
  reuses and deletes, line by line (`inductor_code.run_program`, `inductor_code.cpu_allocations`): fused buffers never
  exist, memory planning keeps freed buffers for reuse, fallback kernels' tuples hold their outputs, and the extern
  kernels' CPU workspaces are measured on this machine (`probe.CpuWorkspaceProbe`);
- the loss outside the model, the loop (`--loop`, gradient accumulation) and the optimizer (eager) run as the
  eager trace runs them.

So the references that keep a tensor alive are the real ones: a saved tensor that is also an output the loop holds
outlives the backward's `del`, as it does in a real compiled step.

Limits: the graphs are Inductor's CPU graphs (a CPU-only torch cannot make fake CUDA tensors), so only the CPU target
is traced; the layers are replicated only where the compiled record is periodic; the eager ops' CPU outputs keep the
fake kernels' layouts (the eager tracer's `CpuWorkspaceProbe.notes` are not applied).
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ..analysis.aggregate import module_pattern
from ..analysis.categories import Category
from ..errors import TraceError, VramtraceError
from ..spec import RunSpec
from .building import LoadedModel, quiet_transformers_logs
from .checkpointing import apply_checkpointing, layer_stack
from .compiled import compiled_twin
from .inductor_code import module_path
from .kernels import KernelPolicyMode
from .probe import CpuWorkspaceProbe
from .optim import make_optimizer
from .records import ZERO_GRADIENT_NAME, MicroMarks, OpInfo, Phase
from .recorder import StepRecorder
from .replication import LayerPlan, NotPeriodic, canonical_frees, replicate_layers
from .step import StepContext, run_training
from .trace import TracedGraph, _check_parameters, _cpu_kernels, _optimizer_hooks, _tag_gradients, _TraceObserver


def trace_compiled(spec: RunSpec, loaded: LoadedModel, progress: Callable[[str], None] | None = None) -> TracedGraph:
    """Record `steps` optimizer steps of `spec`'s loop on `torch.compile(loaded.model)` (Inductor, default mode).
    Raises TraceError when dynamo or Inductor fails on the model (`RunSpec` refuses what is not traced).

    With a `loaded.layer_plan`, the model with `plan.traced` layers is compiled and traced, and the records of
    all layers are rebuilt (`replication.replicate_layers`) as the eager tracer does: Inductor fuses across layer
    boundaries, so the check that the check layer repeats the template op for op runs on the compiled record (after
    `replication.canonical_frees`); if it fails, every layer is compiled and traced."""
    say = progress or (lambda _msg: None)
    plan = loaded.layer_plan
    if plan is not None:
        say(f"compiling {plan.traced} of {plan.num_layers} layers")
        rec, obs, optimizer, twin, probe = _compile_and_record(spec, loaded, loaded.traced_model, say)
        try:
            ops, storages, new_index = replicate_layers(plan, canonical_frees(rec.ops, rec.storages), rec.storages)
            _check_parameters(loaded.model, storages, spec)
            marks = [MicroMarks(m.step, m.micro, new_index[m.forward_returned], new_index[m.loss_taken],
                                new_index[m.body_end]) for m in obs.marks]
            note = f"compiled and traced {plan.traced} of {plan.num_layers} layers; layer {plan.template} replicated"
        except NotPeriodic as e:
            note = f"every layer compiled and traced ({e})"
            say(note)
            plan = None
    else:
        note = f"every layer compiled and traced{f' ({loaded.replication_note})' if loaded.replication_note else ''}"
    if plan is None:
        rec, obs, optimizer, twin, probe = _compile_and_record(spec, loaded, loaded.model, say)
        ops, storages, marks = rec.ops, rec.storages, obs.marks
    return TracedGraph(
        ops=tuple(OpInfo(o.index, o.name, o.phase, o.module, o.ins, o.outs, o.flops, o.recompute, o.step, o.micro,
                         o.frees) for o in ops),
        storages=tuple(storages), marks=tuple(marks), steps=max((o.step for o in ops), default=0) + 1,
        counted_devices=("meta", "cpu"), sdpa_backends=(), has_optimizer=optimizer is not None,
        trace_note=f"torch.compile (Inductor's CPU graphs{_mode_note(spec)}); {note}",
        unresolved=tuple(dict.fromkeys(rec.unresolved)) + tuple(
            f"{op}: CPU kernel workspace not measured, counted as 0 bytes ({why})"
            for op, why in probe.failures.items()),
        cpu_environment=_cpu_kernels(probe), compiled=graphs_summary(twin.graphs, plan))


def _mode_note(spec: RunSpec) -> str:
    return "" if spec.compile_mode == "default" else f", mode {spec.compile_mode}"


def _compile_and_record(spec: RunSpec, loaded: LoadedModel, model: torch.nn.Module, say: Callable[[str], None]):
    """Compile a fake twin of `model` (the full model or its shallow copy) and record the step on it. Returns
    (recorder, observer, optimizer or None, the `CompiledTwin`, the `CpuWorkspaceProbe`). Raises TraceError."""

    def prepare(twin: torch.nn.Module) -> None:
        apply_checkpointing(twin, spec.checkpointing, None, layer_stack(twin))

    say("compiling the model (dynamo, AOTAutograd's partitioner, Inductor's code generation; nothing compiled)")
    try:
        probe = CpuWorkspaceProbe()  # the graphs' dtypes are explicit: no autocast around their extern kernels
        with quiet_transformers_logs(), compiled_twin(model, loaded.args, loaded.inputs, loaded.loss,
                                                      loaded.compute_dtype, prepare=prepare, workspace=probe,
                                                      mode=spec.compile_mode) as twin:
            rec, obs, optimizer = _record(spec, loaded, twin, say, probe)
            if not twin.calls:
                raise TraceError("torch.compile ran the step eagerly (dynamo fell back to the Python code), so the "
                                 "compiled step cannot be traced; run with TORCH_LOGS=recompiles to see why")
    except VramtraceError:
        raise
    except Exception as e:
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TraceError(f"torch.compile failed on the model: {type(e).__name__}: {text}") from e
    return rec, obs, optimizer, twin, probe


def graphs_summary(graphs, plan: LayerPlan | None = None) -> dict:
    """What the report says about the compiled graphs: how many of each kind, the bytes the forward graphs compute
    and save for the backward (their outputs that are not the model's outputs, AOTAutograd's
    `user_visible_output_idxs`, nor graph inputs: the parameters a backward reads are not counted), and
    the ops the partitioner chose to recompute in the backward (backward-graph nodes tagged `is_forward` by
    torch/_functorch/partitioners.py, views left out), grouped by module pattern and op, largest output bytes
    first: [{"module": "transformer.h.*.mlp", "op": "aten.mul.Tensor", "count": int, "bytes": int}].

    With `plan`, the graphs are those of the shallow model: a node of a traced layer counts for the layers of the
    full model it stands for (`LayerPlan.weight`), a node of no layer once."""
    from ..analysis.graph_liveness import storage_key

    def module(node: torch.fx.Node) -> str:
        """The innermost module of dynamo's `nn_module_stack` of `node`, '' outside every module."""
        stack = node.meta.get("nn_module_stack") or {}
        return module_path(list(stack.values())[-1][0]) if stack else ""

    def weight(node: torch.fx.Node) -> int:
        return 1 if plan is None else plan.weight(plan.layer_of(module(node)))

    saved = 0
    recomputed: dict[tuple[str, str], list[int]] = {}
    for g in graphs:
        nodes = list(g.gm.graph.nodes)
        if g.kind == "forward":
            output = nodes[-1]
            visible = set(output.meta.get("user_visible_output_idxs", []))
            keys = {}
            for i, a in enumerate(output.args[0]):
                if (i not in visible and isinstance(a, torch.fx.Node) and a.op != "placeholder"
                        and isinstance(a.meta.get("val"), torch.Tensor)):
                    keys.setdefault(storage_key(a), a.meta["val"].untyped_storage().nbytes() * weight(a))
            saved += sum(keys.values())
        elif g.kind == "backward":
            for n in nodes:
                val = n.meta.get("val")
                if (n.op == "call_function" and n.meta.get("partitioner_tag") == "is_forward"
                        and isinstance(val, torch.Tensor) and not _is_view(n)):
                    entry = recomputed.setdefault((module_pattern(module(n)), str(n.target)), [0, 0])
                    entry[0] += weight(n)
                    entry[1] += val.numel() * val.element_size() * weight(n)
    rows = [{"module": m, "op": op, "count": c, "bytes": b} for (m, op), (c, b) in recomputed.items() if c]
    rows.sort(key=lambda r: (-r["bytes"], r["module"], r["op"]))
    return {"forward_graphs": sum(g.kind == "forward" for g in graphs),
            "backward_graphs": sum(g.kind == "backward" for g in graphs), "saved_bytes": saved,
            "recomputed": rows}


def _is_view(node: torch.fx.Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and target.is_view


class CompiledStepRecorder(StepRecorder):
    """The recorder, marked as a dispatch mode that torch.compile's own internals ignore
    (torch/utils/_python_dispatch.py `TorchDispatchMode.ignore_compile_internals`): dynamo then runs the compiled
    code under it (torch/_dynamo/convert_frame.py skips a frame, falling back to eager, while any other dispatch
    mode is on the stack), and the mode sees the ops the compiled artifacts run."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        """Record the op; a zero gradient that the autograd.Function running a compiled backward materializes for an
        output no loss depends on (torch/autograd/function.py `set_materialize_grads`, default True; made in
        torch/csrc/autograd/python_function.cpp `PyNode::apply`, `VariableInfo::zeros`, while the engine runs
        AOTAutograd's CompiledFunctionBackward node) is named `ZERO_GRADIENT_NAME`: the logits a model returns
        beside the loss it computed get one, and with transformers' KV cache on, the cache's keys and values.

        `prim.device` is not recorded (`StepRecorder.__torch_dispatch__`): here, besides, how often a fake tensor's
        `.device` runs depends on the compile, not the step: dynamo's guards read the parameters' devices once more
        after Inductor lowered a graph in this process than after a graph-cache hit."""
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if func is torch.ops.aten.zeros.default and isinstance(out, torch.Tensor):
            node = torch._C._current_autograd_node()
            if node is not None and node.name() == "CompiledFunctionBackward":
                sid = self.live_sid(out)
                if sid is not None and not self.storages[sid].name:
                    self.storages[sid].name = ZERO_GRADIENT_NAME
        return out


def _record(spec: RunSpec, loaded: LoadedModel, twin, say, probe: CpuWorkspaceProbe):
    """Run the steps of `spec`'s loop on the compiled `twin` under the recorder. Returns (recorder, observer,
    optimizer or None)."""
    rec = CompiledStepRecorder()
    rec.phase = Phase.STEP
    rec.strict = spec.strict

    def workspace(func, args, kwargs, out):
        """The probe of an eager op (between graphs, the optimizer; the graphs' extern kernels are in their
        programs), outside the fake mode: its stand-ins must be real CPU tensors. The output keeps the fake
        kernel's layout (a CPU kernel's other dtype, `CpuWorkspaceProbe.notes`, is not applied here)."""
        with _disable_current_modes():
            return probe(func, args, kwargs, out)[0], out

    rec.workspace = workspace
    model = twin.twin
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(spec, params)
    for n, p in model.named_parameters():
        rec.register_existing(p, Category.PARAMETER, n)
    for n, b in model.named_buffers():
        rec.register_existing(b, Category.INPUT, n)
    for n, t in [*twin.kwargs.items(), *((f"args[{i}]", a) for i, a in enumerate(twin.args))]:
        if isinstance(t, torch.Tensor):
            rec.register_existing(t, Category.INPUT, n)

    def on_alloc(t: torch.Tensor, module: str, op: str, reused: tuple | None) -> None:
        if reused is not None:
            rec.storage_reused(t, module, op, reused)
        else:
            rec.describe(t, module, op)

    twin.on_alloc = on_alloc
    autocast = ((lambda: torch.autocast("cpu", dtype=loaded.compute_dtype)) if loaded.compute_dtype is not None
                else contextlib.nullcontext)
    ctx = StepContext(twin.module, twin.args, twin.kwargs, loaded.loss, optimizer, autocast)
    policy = KernelPolicyMode(spec.device, spec.gpu_preset.sm, None)  # not entered: the observer's SDPA count
    obs = _TraceObserver(rec, say, policy, None)
    try:
        with _optimizer_hooks(model, rec), torch.autograd.graph.saved_tensors_hooks(rec.pack_hook, lambda t: t), rec:
            run_training(ctx, spec, obs, literal=False)
            _tag_gradients(model, rec)
    finally:
        twin.on_alloc = None
        rec.detach()
    return rec, obs, optimizer
