"""The forward and backward FX graphs that `torch.compile` (Inductor) runs for a model's training step, captured
without a device, and what each graph's generated CPU code allocates and frees (`--compile`:
tracer/compiled_step.py records the step with them).

How (`compiled_twin`, `capture`):
- The model (built on meta) is copied and materialized as fake tensors that claim the CPU (`FakeTensorMode`,
  `to_empty(device="cpu")`). Plain meta tensors do not work: under the Python dispatcher that dynamo, AOTAutograd
  and Inductor enable, the Python meta kernels that torch/_meta_registrations.py `activate_meta` registers for
  CompositeImplicitAutograd ops (`aten.nll_loss` among 109) shadow their autograd decomposition
  (torch/_ops.py `resolve_key`), so the joint graph loses their backward; and SDPA takes its math path on meta.
- The copy is compiled with Inductor's own `compile_fx` (torch/_inductor/compile_fx.py): its decomposition table
  (`select_decomp_table`), its joint-graph passes and its partitioner (`partition_fn`:
  `min_cut_rematerialization_partition(..., compiler="inductor")`) decide what the forward saves; only the
  per-graph compile (`compile_fx_inner`) is replaced by `_keep_graph`. One forward and backward run on fake
  inputs, so dynamo's graph breaks give several graphs, in the order they ran.
- The graphs are CPU graphs: a CPU-only torch cannot make fake CUDA tensors. CUDA's differ where a kernel choice
  depends on the device (SDPA's flash or memory-efficient attention saves its output and logsumexp).

Each graph is then lowered and its code generated as `_InProcessFxCompile.codegen_and_compile` does
(`_lower_and_generate`: the post-grad passes, `GraphLowering.run`, `GraphLowering.codegen`: the scheduler's fusion,
the C++ kernels' source and the Python wrapper, with the wrapper's memory planning), but nothing is compiled or
loaded. `inductor_code.cpu_allocations` reads the wrapper's `call` function: its allocations, the buffers its
memory planning reuses (a freed buffer kept for a later allocation of the same size), its aliases and its `del`s, in
order: a `GraphProgram`. `run_program` repeats that program on fake tensors in place of the compiled code, so the
recorder sees each buffer born and dying where the generated code allocates and deletes it. For the cases of
benchmarks/bench_compile_graphs.py the wrapper generated here is the real compile's, line for line.

What it leaves behind: nothing it compiled. Dynamo's cache entries for the functions it compiled first here are
dropped after the capture (`torch._C._dynamo.eval_frame.reset_code`, what `torch._dynamo.reset_code_caches` runs
for every code); a function the process had compiled before keeps its entries and the twin's, in the twin's own
recompile bucket (`torch.compile(..., isolate_recompiles=True)`: no recompile limit shared with the caller's
compiles), whose guards fail for any other module (fake tensors). Inductor's FX-graph and AOTAutograd caches are off
while it runs; what each graph allocates is kept on disk in their place (`LoweredGraphCache`, under Inductor's own
FX-graph cache key), so a repeated run lowers no graph.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import Any, Callable

import torch
from torch import fx

from ..analysis.graph_liveness import storage_key
from . import inductor_code
from .inductor_code import GraphProgram, InductorMemory, cpu_allocations, run_program


@dataclasses.dataclass(frozen=True)
class CapturedGraph:
    """One graph torch.compile runs: `kind` 'forward' or 'backward' (AOTAutograd's partition of one dynamo graph;
    'inference' when nothing needs a gradient), its GraphModule after Inductor's post-grad passes (each node's
    `meta["val"]` a fake tensor), and the indices of the inputs that live beyond the graph (parameters and
    buffers: AOTAutograd's `static_input_idxs`)."""

    kind: str
    gm: fx.GraphModule
    static_inputs: tuple[int, ...]
    memory: InductorMemory | None = None

    def kept_inputs(self) -> set[int] | None:
        """The indices of the inputs that outlive the graph: None (all) for a forward graph (the caller holds
        the parameters and inputs); for a backward graph its `primals_*` placeholders, the forward's own inputs
        (parameters, which the module holds), while the saved activations and the tangents are freed after their
        last use (AOTAutograd's `_backward_impl` clears the saved tensors and calls the backward with
        `steal_args=True`, torch/_functorch/_aot_autograd/runtime_wrappers.py; the generated code deletes each
        argument after its last use)."""
        if self.kind != "backward":
            return None
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        return {i for i, n in enumerate(placeholders) if n.name.startswith("primals")}


def capture(model: torch.nn.Module, kwargs: dict[str, Any], autocast_dtype: torch.dtype | None = None,
            loss_key: str = "loss", outputs_held: bool = False) -> list[CapturedGraph]:
    """The graphs `torch.compile(model)` (Inductor, its default mode) runs for `model(**kwargs)[loss_key]
    .backward()`, in the order they ran (the forward graphs first, then the backward graphs as autograd runs them),
    each with its CPU allocations (`CapturedGraph.memory`). `model` is built on meta and left as it is (a copy is
    compiled); `kwargs` hold meta tensors (or plain values; one tensor passed twice stays one input, as dynamo
    sees it); `autocast_dtype`: the CPU autocast of a mixed-precision step; `outputs_held`: whether the caller
    holds the model's outputs through the backward (then a saved tensor that is also an output, the logits or the
    KV cache, is not freed by the backward). Raises what `compiled_twin` raises."""
    def loss_of(out):
        return out[loss_key] if isinstance(out, dict) or hasattr(out, "keys") else out

    with compiled_twin(model, (), kwargs, loss_of, autocast_dtype, outputs_held=outputs_held) as twin:
        return twin.graphs


@dataclasses.dataclass
class CompiledTwin:
    """A fake-tensor copy of a meta model, compiled, with its graphs compiled (one forward and backward ran):
    `module` the `torch.compile` wrapper to call, `twin` the module it wraps (its parameters are what an optimizer
    steps), `args`/`kwargs` the fake inputs, `graphs` what Inductor compiled (in the order it compiled them). Each
    compiled graph, when called, repeats its generated code's allocations and frees (`run_program`) and calls
    `on_alloc(tensor, module path, aten op, reused)` for each allocation (reused None) and reuse (reused: the new
    buffer's sizes) when set."""

    module: torch.nn.Module
    twin: torch.nn.Module
    args: tuple
    kwargs: dict
    graphs: list[CapturedGraph]
    on_alloc: Callable[[torch.Tensor, str, str, tuple | None], None] | None = None  # (tensor, module, op, reused)
    calls: int = 0  # compiled graphs called since the twin was made (dynamo may fall back to eager)


@contextlib.contextmanager
def compiled_twin(model: torch.nn.Module, args: tuple, kwargs: dict[str, Any],
                  loss_of: Callable[[Any], torch.Tensor], autocast_dtype: torch.dtype | None = None, *,
                  prepare: Callable[[torch.nn.Module], None] | None = None, outputs_held: bool = False,
                  workspace: Callable | None = None, mode: str = "default"):
    """Inside: a `CompiledTwin` of `model` (built on meta, left as it is), with the fake-tensor mode it lives in
    entered. `prepare(twin)` runs on the materialized copy before it is compiled (activation checkpointing). One
    training forward (`loss_of(module(*args, **kwargs))`, under the CPU autocast of `autocast_dtype` when given)
    and backward run on fake inputs to compile the graphs; the gradients they leave are set to None. `workspace`:
    a `probe.CpuWorkspaceProbe` measuring the extern kernels' CPU workspaces (`inductor_code.cpu_allocations`).
    `mode`: torch.compile's, whose Inductor options (torch/_inductor/__init__.py `list_mode_options`) are set while the
    graphs compile, as `_TorchCompileInductorWrapper.apply_mode` sets them (torch/__init__.py). Raises
    BridgeError when a private Inductor name it uses is gone (`bridges.INDUCTOR_GRAPHS`, `bridges.INDUCTOR_IR`),
    torch's errors when dynamo or Inductor cannot compile the model."""
    from .. import bridges

    bridges.resolve(bridges.INDUCTOR_GRAPHS)
    bridges.resolve(bridges.INDUCTOR_IR)
    from torch._inductor.compile_fx import compile_fx
    from torch._subclasses.fake_tensor import FakeTensorMode

    result: list[CompiledTwin] = []
    keeper = _GraphKeeper(_allocating_output_code(result), outputs_held, workspace)

    def backend(gm, example_inputs):
        return compile_fx(gm, example_inputs, inner_compile=keeper)

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    twin = copy.deepcopy(model)
    with contextlib.ExitStack() as stack:
        _compile_settings(stack, mode)
        stack.enter_context(fake_mode)
        twin.to_empty(device="cpu")
        if hasattr(twin, "tie_weights"):  # to_empty unties transformers' tied embeddings
            twin.tie_weights()
        if prepare is not None:
            prepare(twin)
        fakes: dict[int, torch.Tensor] = {}  # one fake per tensor (input_ids passed as labels too)

        def fake(v):
            return fakes.setdefault(id(v), torch.empty_like(v, device="cpu")) if isinstance(v, torch.Tensor) else v

        fake_args, fake_kwargs = tuple(fake(v) for v in args), {k: fake(v) for k, v in kwargs.items()}
        # its own recompile bucket: no entry or recompile limit shared with the process's other compiles. Static
        # shapes, as the first compile of a fresh process has them: dynamo's automatic dynamic shapes
        # (torch/_dynamo/pgo.py `update_automatic_dynamic`, off under dynamic=False) would otherwise read the
        # sizes of an earlier compile of the same code (another analysis, the caller's own) and make them symbolic
        compiled = torch.compile(twin, backend=backend, dynamic=False, isolate_recompiles=True)
        autocast = torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()
        with autocast:
            loss = loss_of(compiled(*fake_args, **fake_kwargs))
        loss.backward()
        del loss
        for p in twin.parameters():
            p.grad = None
        result.append(CompiledTwin(compiled, twin, fake_args, fake_kwargs, keeper.kept))
        yield result[0]


def _compile_settings(stack: contextlib.ExitStack, mode: str) -> None:
    """While `stack` is open: dynamo's cache entries of what it compiles first dropped on exit, torch.compile's
    `mode` options, and Inductor's FX-graph and AOTAutograd caches off (the kept graphs are not serializable)."""
    from torch._inductor import config as inductor_config

    stack.enter_context(_forget_new_compiled_code())
    stack.enter_context(inductor_config.patch(torch._inductor.list_mode_options(mode)))
    stack.enter_context(inductor_config.patch(fx_graph_cache=False))  # the kept graphs are not serializable
    stack.enter_context(torch._functorch.config.patch(enable_autograd_cache=False))


def _allocating_output_code(result: list[CompiledTwin]) -> type:
    """The OutputCode the compiled step calls in place of Inductor's generated code: it repeats its graph's
    `program` (`run_program`), counting the calls and telling each allocation to the twin in `result` (once
    made)."""
    from torch._inductor.output_code import OutputCode

    @dataclasses.dataclass
    class _Allocating(OutputCode):
        program: GraphProgram | None = None

        def __post_init__(self):
            self._boxed_call = True

        def __call__(self, inputs):
            if result:
                result[0].calls += 1
            return run_program(self.program, inputs, result[0].on_alloc if result else None)

        def post_compile(self, *args, **kwargs):
            pass

        def prepare_for_serialization(self):
            pass

        def set_triton_bundle(self, bundle):
            pass

    return _Allocating


class _GraphKeeper:
    """compile_fx's per-graph compile (`inner_compile`) in `compiled_twin`: each graph is kept (`kept`, in the
    order compiled) with what its generated code allocates (from `LoweredGraphCache`, else lowered and read), and
    an `output_code` repeating that is returned in place of compiled code."""

    def __init__(self, output_code: type, outputs_held: bool, workspace: Callable | None):
        self.output_code, self.outputs_held, self.workspace = output_code, outputs_held, workspace
        self.kept: list[CapturedGraph] = []
        # per forward graph: (its saved tensors that are outputs the caller holds, every saved tensor)
        self.held_by_caller: list[tuple[set[str], set[str]]] = []

    def __call__(self, gm: fx.GraphModule, example_inputs, **kw):
        kind = "backward" if kw.get("is_backward") else "inference" if kw.get("is_inference") else "forward"
        workspace, held_by_caller = self.workspace, self.held_by_caller
        cached = LoweredGraphCache.of(gm, example_inputs, kw, workspace)  # Inductor's key: before post-grad
        with _post_grad(gm, example_inputs, kw):
            if kind == "forward":
                held_by_caller.append(_saved_outputs_held(gm))
            kept_inputs = None if kind != "backward" else _outliving_inputs(
                gm, held_by_caller[-1] if held_by_caller and self.outputs_held else (set(), set()))
            memory = cached.get(kept_inputs, workspace) if cached is not None else None
            if memory is None:
                before = LoweredGraphCache.probe_records(workspace) if cached is not None else None
                with _lower_and_generate(gm, example_inputs, kw) as (graph, source):
                    memory = cpu_allocations(graph, source, kept_inputs, workspace)
                if cached is not None:
                    cached.put(kept_inputs, memory, before, workspace)
        _report_output_strides(memory.program.outputs)
        self.kept.append(CapturedGraph(kind, gm, tuple(kw.get("static_input_idxs") or ()), memory))
        return self.output_code(program=memory.program)


class LoweredGraphCache:
    """What `inductor_code.cpu_allocations` read off one graph's generated code (its `InductorMemory`) and what the
    extern kernels' workspace probe recorded for it (notes, extrapolations), on disk beside the CPU kernel probe's
    results (`probe_cache.ProbeDiskCache`: the same directory and setting, `VRAMTRACE_CPU_PROBE_CACHE`, off with "off").

    Key: Inductor's own FX-graph cache key of the graph as compile_fx hands it over, before the post-grad passes
    (torch/_inductor/codecache.py `FxGraphCache.prepare_key`: the graph's code, its inputs' metadata, the compile
    kwargs, Inductor's config, torch's version and Inductor's source), with the inputs the graph keeps, the probe's
    settings and file (this machine's CPU environment and `PROBE_RULES_VERSION`) and the source of this module and of
    inductor_code.py (which reads the generated code). A real torch.compile finds a graph it compiled before in its
    FX-graph cache the same way; here the lowering and code generation it saves are about half of a repeated
    Llama-2-7b `--compile` run. Only with a
    `probe.CpuWorkspaceProbe` (its records are part of the result); a graph Inductor would not cache
    (`BypassFxGraphCache`) or whose probe failed (a failure may depend on the memory free at the time) is not kept.
    Best effort: a file it cannot read or write is a cache that finds nothing."""

    def __init__(self, path_of: Callable[[set[str] | None], Any]):
        self._path_of = path_of

    @classmethod
    def of(cls, gm: fx.GraphModule, example_inputs, kw: dict, workspace) -> "LoweredGraphCache | None":
        """The cache entry of this graph (call before the post-grad passes change `gm`), or None: no cache."""
        import hashlib
        from pathlib import Path

        from torch._inductor.codecache import FxGraphCache
        from torch._inductor.compile_fx import get_input_idxs_to_check
        from torch.utils._python_dispatch import _disable_current_modes

        from .probe import CpuWorkspaceProbe
        from .probe_cache import disk_cache

        probes = disk_cache().path
        if probes is None or not isinstance(workspace, CpuWorkspaceProbe):
            return None
        with _disable_current_modes():  # as compile_fx_inner computes it: the caller's FakeTensorMode off
            key, _info = FxGraphCache.prepare_key(
                gm, example_inputs, kw, get_input_idxs_to_check(example_inputs, kw.get("static_input_idxs") or ()),
                remote=False)
        if key is None:
            return None
        try:
            source = b"".join(Path(f).read_bytes() for f in (__file__, inductor_code.__file__))
        except OSError:
            return None
        settings = repr((workspace.reduce_above, workspace.reduce_above_flops, workspace.autocast_dtype()))

        def path_of(kept: set[str] | None) -> Path:
            kept_names = repr(sorted(kept) if kept is not None else None)
            digest = hashlib.sha256("\0".join((key[0], kept_names, settings, probes.name)).encode() + source)
            return probes.parent / "inductor-graphs" / f"{digest.hexdigest()[:32]}.pkl"

        return cls(path_of)

    @staticmethod
    def probe_records(workspace) -> tuple[dict, dict, dict]:
        """Copies of the probe's failures, notes and extrapolations (what a graph adds is kept with it)."""
        return dict(workspace.failures), dict(workspace.notes), dict(workspace.extrapolated)

    def get(self, kept: set[str] | None, workspace) -> InductorMemory | None:
        """The graph's memory found on disk, its probe records applied to `workspace`; None when not found."""
        import pickle

        try:
            with open(self._path_of(kept), "rb") as f:
                memory, notes, extrapolated = pickle.load(f)
        except (OSError, pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError):
            return None
        workspace.notes.update(notes)
        workspace.extrapolated.update(extrapolated)
        return memory

    def put(self, kept: set[str] | None, memory: InductorMemory, before: tuple[dict, dict, dict], workspace) -> None:
        """Keep `memory` with what the probe recorded since `before` (`probe_records`), unless a probe failed."""
        import os
        import pickle
        import tempfile

        added = [{k: v for k, v in now.items() if was.get(k) != v}
                 for was, now in zip(before, self.probe_records(workspace))]
        if added[0]:
            return
        path = self._path_of(kept)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("wb", dir=path.parent, suffix=".tmp", delete=False) as f:
                try:
                    pickle.dump((memory, added[1], added[2]), f)
                except pickle.PicklingError:
                    f.close()
                    os.unlink(f.name)
                    return
            os.replace(f.name, path)  # whole or absent: another process may read it meanwhile
        except OSError:
            pass


@contextlib.contextmanager
def _forget_new_compiled_code():
    """On exit, dynamo's cache entries of the code objects it compiled first inside are dropped (the trackers
    torch/_dynamo/convert_frame.py `input_codes` and `output_codes`; torch/_dynamo/__init__.py
    `reset_code_caches`), so the capture's compiled twin holds no cache slot of those functions."""
    from torch._C._dynamo.eval_frame import reset_code
    from torch._dynamo import convert_frame

    trackers = (convert_frame.input_codes, convert_frame.output_codes)
    before = set().union(*(t.seen_ids for t in trackers))
    try:
        yield
    finally:
        with convert_frame.compile_lock:
            for ref in [r for t in trackers for r in t.seen]:
                code = ref()
                if code is not None and id(code) not in before:
                    reset_code(code)


def _saved_outputs_held(gm: fx.GraphModule) -> tuple[set[str], set[str]]:
    """A forward graph's (saved tensors whose storage is also a user-visible output, every saved tensor), by node
    name (AOTAutograd marks the user outputs: the output node's `user_visible_output_idxs`)."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    args = output.args[0]
    visible = set(output.meta.get("user_visible_output_idxs", []))
    users = {storage_key(a) for i, a in enumerate(args) if i in visible} - {None}
    saved = [a for i, a in enumerate(args) if i not in visible and isinstance(a, fx.Node)]
    return {a.name for a in saved if storage_key(a) in users}, {a.name for a in saved}


def _outliving_inputs(gm: fx.GraphModule, held: tuple[set[str], set[str]]) -> set[str]:
    """The inputs of a backward graph that its code deletes but that stay alive: the forward's own inputs
    (`primals_*`: parameters, which the module holds), the 0-dim root gradient (`torch.autograd.backward` holds
    it) and, when `held` comes from the forward graph this backward belongs to, the saved tensors that are also
    outputs the caller holds. A graph's inputs are otherwise freed at their last use: AOTAutograd clears the
    saved tensors and calls the backward with `steal_args=True` (torch/_functorch/_aot_autograd/
    runtime_wrappers.py) and the generated code deletes each argument after its last use."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    saved = {n.name for n in placeholders} - {n.name for n in placeholders
                                             if n.name.startswith(("primals", "tangents"))}
    caller = held[0] if held[1] >= saved else set()  # the last forward graph is the one returned to the caller
    return {n.name for n in placeholders if n.name.startswith("primals") or n.name in caller
            or (n.name.startswith("tangents") and isinstance(n.meta.get("val"), torch.Tensor)
                and n.meta["val"].dim() == 0)}


@contextlib.contextmanager
def _post_grad(gm: fx.GraphModule, example_inputs, kw: dict):
    """Inside: `gm` changed in place as `_InProcessFxCompile.codegen_and_compile` (torch/_inductor/compile_fx.py)
    prepares it for lowering: `view_to_reshape`, fake propagation, the original output strides, the post-grad
    passes; with the caller's FakeTensorMode off, Inductor's debug context and the graph's fake mode set."""
    from torch._inductor.compile_fx import (_recursive_post_grad_passes, _recursive_record_original_output_strides,
                                            fake_tensor_prop)
    from torch._inductor.debug import DebugContext
    from torch._inductor.fx_passes.post_grad import view_to_reshape
    from torch._inductor.virtualized import V
    from torch.utils._python_dispatch import _disable_current_modes

    with contextlib.ExitStack() as stack:
        stack.enter_context(_disable_current_modes())  # as compile_fx_inner: the caller's FakeTensorMode is off
        stack.enter_context(DebugContext())  # V.debug, which the scheduler logs through
        view_to_reshape(gm)
        with torch.no_grad():
            fake_mode = fake_tensor_prop(gm, example_inputs)
        _recursive_record_original_output_strides(gm)
        stack.enter_context(V.set_fake_mode(fake_mode))
        _recursive_post_grad_passes(gm, is_inference=bool(kw.get("is_inference")))
        yield


@contextlib.contextmanager
def _lower_and_generate(gm: fx.GraphModule, example_inputs, kw: dict):
    """Inside `_post_grad`: `V.graph` is `gm` lowered and scheduled by Inductor as `codegen_and_compile` does
    before generating code, `GraphLowering(...).run` and `_update_scheduler` (fusion, `reorder_for_peak_memory`,
    `compute_last_usage`); yields (the GraphLowering, the Python wrapper's source)."""
    from torch._inductor.compile_fx import (get_input_idxs_to_check, maybe_disable_comprehensive_padding,
                                            maybe_disable_graph_partition)
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.graph import GraphLowering
    from torch._inductor.utils import shape_env_from_inputs
    from torch._inductor.virtualized import V

    with contextlib.ExitStack() as stack:
        stack.enter_context(maybe_disable_comprehensive_padding(example_inputs))
        stack.enter_context(maybe_disable_graph_partition(False, False))
        graph = GraphLowering(
            gm, example_inputs=example_inputs, shape_env=gm.shape_env or shape_env_from_inputs(example_inputs),
            graph_id=kw.get("graph_id"), cpp_wrapper=False, aot_mode=False,
            extern_node_serializer=kw.get("extern_node_serializer"), is_inference=bool(kw.get("is_inference")),
            is_backward=bool(kw.get("is_backward")), const_output_index=None, const_wrapper_code=None,
            const_kernel_code=None, const_module=None,
            inputs_to_check=get_input_idxs_to_check(example_inputs, kw.get("static_input_idxs") or ()),
            fx_wrapper=False, get_decomp_fn=kw.get("get_decomp_fn", select_decomp_table))
        graph.freeze_runtime_asserts()
        stack.enter_context(V.set_graph_handler(graph))
        stack.enter_context(V.set_extern_kernel_nodes([]))
        graph.run(*example_inputs)
        code, _kernels = graph.codegen()  # the Python wrapper and the C++ source; nothing is compiled
        yield graph, getattr(code, "value", code)


def _report_output_strides(specs: tuple) -> None:
    """Tell AOTAutograd the strides of a graph's outputs as Inductor lays them out, as a compiled graph does
    (torch/_inductor/utils.py `set_tracing_context_output_strides`): AOTAutograd restrides the backward graph's
    saved-tensor inputs with them (graph_compile.py `_aot_stage2b_bw_compile`)."""
    context = torch._guards.TracingContext.try_get()
    if context is not None and context.output_strides is not None:
        context.output_strides.extend(spec[2] if isinstance(spec, tuple) else None for spec in specs)


