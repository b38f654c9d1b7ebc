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
loaded. `_cpu_allocations` reads the wrapper's `call` function: its allocations, the buffers its memory planning
reuses (a freed buffer kept for a later allocation of the same size), its aliases and its `del`s, in order: a
`GraphProgram`. `run_program` repeats that program on fake tensors in place of the compiled code, so the recorder
sees each buffer born and dying where the generated code allocates and deletes it. For the cases of
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
import re
from typing import Any, Callable

import torch
from torch import fx

from ..analysis.graph_liveness import storage_key


@dataclasses.dataclass(frozen=True)
class GraphProgram:
    """What one graph's generated code allocates and frees, in order, for `run_program` to repeat: `inputs` the
    graph's input names; `events` ("alloc", buffer, size, stride, dtype, module path, aten op) | ("reuse", buffer,
    the dying buffer or input whose storage it takes over, module path, aten op, the buffer's size and stride) |
    ("alias", buffer, the buffer or input it views) |
    ("workspace", bytes, module path, aten op: an extern kernel's CPU workspace, held while it runs) | ("tuple",
    a fallback kernel's result, the outputs just allocated that it holds) | ("free", buffer or input: the code
    drops its reference); `outputs` per output (`_output_specs`)."""

    inputs: tuple[str, ...]
    events: tuple[tuple, ...]
    outputs: tuple


@dataclasses.dataclass(frozen=True)
class InductorMemory:
    """What one graph's CPU code allocates, read off its generated wrapper (`_cpu_allocations`): bytes (ints) above
    what is alive when the graph starts, at its highest (`peak_bytes`, extern kernels' workspaces included when
    measured) and when it returns (`end_bytes`); the buffers fusion removed (`GraphLowering.removed_buffers`) and
    the reuses (buffer, the buffer or input whose storage it takes over); the `program` that repeats it."""

    peak_bytes: int
    end_bytes: int
    removed: tuple[str, ...]
    in_place: tuple[tuple[str, str], ...]
    program: GraphProgram | None = None


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
    a `kernels.CpuWorkspaceProbe` measuring the extern kernels' CPU workspaces (`_cpu_allocations`). `mode`:
    torch.compile's, whose Inductor options (torch/_inductor/__init__.py `list_mode_options`) are set while the
    graphs compile, as `_TorchCompileInductorWrapper.apply_mode` sets them (torch/__init__.py). Raises
    BridgeError when a private Inductor name it uses is gone (`bridges.INDUCTOR_GRAPHS`), torch's errors when
    dynamo or Inductor cannot compile the model."""
    from .. import bridges

    bridges.resolve(bridges.INDUCTOR_GRAPHS)
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.output_code import OutputCode
    from torch._subclasses.fake_tensor import FakeTensorMode

    kept: list[CapturedGraph] = []
    held_by_caller: list[tuple[set[str], set[str]]] = []  # per forward graph: (saved outputs the caller holds, saved)
    result: list[CompiledTwin] = []

    @dataclasses.dataclass
    class _Allocating(OutputCode):  # what the compiled step calls in place of Inductor's generated code
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

    def _keep_graph(gm: fx.GraphModule, example_inputs, **kw):
        kind = "backward" if kw.get("is_backward") else "inference" if kw.get("is_inference") else "forward"
        cached = LoweredGraphCache.of(gm, example_inputs, kw, workspace)  # Inductor's key: before post-grad
        with _post_grad(gm, example_inputs, kw):
            if kind == "forward":
                held_by_caller.append(_saved_outputs_held(gm))
            kept_inputs = None if kind != "backward" else _outliving_inputs(
                gm, held_by_caller[-1] if held_by_caller and outputs_held else (set(), set()))
            memory = cached.get(kept_inputs, workspace) if cached is not None else None
            if memory is None:
                before = LoweredGraphCache.probe_records(workspace) if cached is not None else None
                with _lower_and_generate(gm, example_inputs, kw) as (graph, source):
                    memory = _cpu_allocations(graph, source, kept_inputs, workspace)
                if cached is not None:
                    cached.put(kept_inputs, memory, before, workspace)
        _report_output_strides(memory.program.outputs)
        kept.append(CapturedGraph(kind, gm, tuple(kw.get("static_input_idxs") or ()), memory))
        return _Allocating(program=memory.program)

    def backend(gm, example_inputs):
        return compile_fx(gm, example_inputs, inner_compile=_keep_graph)

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    twin = copy.deepcopy(model)
    with contextlib.ExitStack() as stack:
        stack.enter_context(_forget_new_compiled_code())
        stack.enter_context(inductor_config.patch(torch._inductor.list_mode_options(mode)))
        stack.enter_context(inductor_config.patch(fx_graph_cache=False))  # the kept graphs are not serializable
        stack.enter_context(torch._functorch.config.patch(enable_autograd_cache=False))
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
        result.append(CompiledTwin(compiled, twin, fake_args, fake_kwargs, kept))
        yield result[0]


class LoweredGraphCache:
    """What `_cpu_allocations` read off one graph's generated code (its `InductorMemory`) and what the extern
    kernels' workspace probe recorded for it (notes, extrapolations), on disk beside the CPU kernel probe's results
    (`kernels.ProbeDiskCache`: the same directory and setting, `VRAMTRACE_CPU_PROBE_CACHE`, off with "off").

    Key: Inductor's own FX-graph cache key of the graph as compile_fx hands it over, before the post-grad passes
    (torch/_inductor/codecache.py `FxGraphCache.prepare_key`: the graph's code, its inputs' metadata, the compile
    kwargs, Inductor's config, torch's version and Inductor's source), with the inputs the graph keeps, the probe's
    settings and file (this machine's CPU environment and kernels.py's source) and this module's source. A real
    torch.compile finds a graph it compiled before in its FX-graph cache the same way; here the lowering and
    code generation it saves are about half of a repeated Llama-2-7b `--compile` run. Only with a
    `kernels.CpuWorkspaceProbe` (its records are part of the result); a graph Inductor would not cache
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

        from .kernels import CpuWorkspaceProbe, _disk_cache

        probes = _disk_cache().path
        if probes is None or not isinstance(workspace, CpuWorkspaceProbe):
            return None
        with _disable_current_modes():  # as compile_fx_inner computes it: the caller's FakeTensorMode off
            key, _info = FxGraphCache.prepare_key(
                gm, example_inputs, kw, get_input_idxs_to_check(example_inputs, kw.get("static_input_idxs") or ()),
                remote=False)
        if key is None:
            return None
        try:
            source = Path(__file__).read_bytes()
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


def run_program(program: GraphProgram, inputs: list, on_alloc: Callable | None = None) -> list:
    """Run one compiled graph's allocations and frees (`GraphProgram`) on `inputs` (a list the call empties, as
    Inductor's generated code clears its argument list) and return its outputs: tensors of each output's size,
    stride and dtype over the storage of the buffer or input it views. `on_alloc(tensor, module path, aten op,
    reused)` is called after each allocation (reused None) and each reuse (reused: the new buffer's sizes; `tensor`
    is the dying buffer, whose storage it takes over), with the module and op the buffer was lowered from. No values
    are computed (the inputs are fake tensors), and no op runs but the allocations."""
    args = list(inputs)
    inputs.clear()
    index = {name: i for i, name in enumerate(program.inputs)}
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
    bufs: dict[str, torch.Tensor] = {}
    tuples: dict[str, list[torch.Tensor]] = {}
    for event in program.events:
        if event[0] == "alloc":
            _, name, size, stride, dtype, module, op = event
            bufs[name] = torch.empty_strided(size, stride, dtype=dtype, device=device)
            if on_alloc is not None:
                on_alloc(bufs[name], module, op, None)
        elif event[0] == "tuple":  # a fallback kernel's returned tuple: it holds the outputs allocated just before
            tuples[event[1]] = [bufs[child] for child in event[2]]
        elif event[0] == "workspace":  # held while the extern kernel runs
            scratch = torch.empty((event[1],), dtype=torch.uint8, device=device)
            if on_alloc is not None:
                on_alloc(scratch, event[2], event[3], None)
            del scratch
        elif event[0] in ("reuse", "alias"):  # a reuse takes over the dying buffer's storage; an alias views it
            name, source = event[1:3]
            if source in bufs:
                bufs[name] = bufs.pop(source) if event[0] == "reuse" else bufs[source]
            elif source in index and args[index[source]] is not None:
                bufs[name] = args[index[source]]
                if event[0] == "reuse":
                    args[index[source]] = None
            if event[0] == "reuse" and name in bufs and on_alloc is not None:
                # the buffer's own sizes (its storage's bytes are the dying buffer's), with no op run for them
                on_alloc(bufs[name], event[3], event[4], tuple(bufs[name].shape) if event[5] is None else event[5])
        else:
            tuples.pop(event[1], None)
            if event[1] in bufs:
                del bufs[event[1]]
            elif event[1] in index:
                args[index[event[1]]] = None
    outputs = []
    for spec in program.outputs:
        if not isinstance(spec, tuple):
            outputs.append(spec)
            continue
        name, size, stride, offset, dtype = spec
        base = bufs.get(name)
        if base is None and name in index:
            base = args[index[name]]
        if base is None:
            raise RuntimeError(f"compiled graph output {name} has no buffer or input")
        if base.dtype != dtype:
            base = base.detach().view(torch.uint8).view(dtype) if base.is_contiguous() else base.view(dtype)
        outputs.append(torch.as_strided(base, size, stride, base.storage_offset() + offset))
    del args, bufs, tuples
    return outputs


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


def _cpu_allocations(graph, source: str, kept_inputs: set[str] | None,
                     workspace: Callable | None = None) -> InductorMemory:
    """What the generated CPU code of the lowered `graph` allocates (its Python wrapper `source`, from
    `GraphLowering.codegen`), as a `GraphProgram`, and the bytes it holds above its start: graph inputs not in
    `kept_inputs` are freed where the code deletes them (None: every input kept). The wrapper's `call` is read line
    by line (torch/_inductor/codegen/wrapper.py writes these lines):
    - `bufN = empty_strided_cpu(size, stride, dtype)`: an allocation (`AllocateLine`);
    - `bufN = bufM; del bufM  # reuse` or `bufN = reinterpret_tensor(bufM, ...); del bufM  # reuse`: bufN takes over
      bufM's storage (`ReuseLine`: Inductor's in-place updates and its memory planning, `memory_plan_reuse`, which
      keeps a freed buffer for a later allocation of the same size instead of freeing it);
    - `bufN = reinterpret_tensor(bufM, ...)  # alias` or `bufN = bufM`: a view of bufM's storage;
    - `bufP = <call>(...)` of a fallback kernel with several outputs: the call allocates every output
      (`MultiOutput`), and the tuple bufP holds them until `del bufP`; `bufN = bufP[i]` names one;
    - `bufN = <call>(...)` for a buffer of the graph with a plain layout: an extern kernel that allocates its output;
    - `del x`: the code drops a buffer or an input (`FreeIfNotReusedLine` not reused, or an input's free).
    What fusion removed never appears. Inductor's C++ kernels (`cpp_fused_*`) allocate nothing through PyTorch's
    allocator. An extern kernel (`extern_kernels.mm(..., out=bufN)`, a fallback `bufN = torch.ops.aten...`) runs an
    aten op whose CPU kernel may hold a workspace while it runs (oneDNN's scratchpads, the CPU flash attention's
    per-thread buffers): with `workspace` (a `kernels.CpuWorkspaceProbe`) it is measured on this machine's CPU for
    the op and argument layouts of the FX node the kernel was lowered from (`_extern_workspaces`), and held for the
    call ("workspace" events)."""
    from torch._inductor import ir
    from torch._inductor.utils import get_dtype_size

    body = _call_body(source)
    buffers = graph.name_to_buffer

    def layout(name: str):
        node = buffers[name]
        fixed = node.get_layout()
        return _ints(graph, fixed.size), _ints(graph, fixed.stride), node.get_dtype()

    def allocation(name: str, rhs: str) -> list[tuple]:
        parsed = _empty_strided_args(rhs)
        if parsed is None and name not in buffers:
            return []
        size, stride, dtype = parsed if parsed is not None else layout(name)
        module, op = _origin(buffers[name]) if name in buffers else ("", "")
        return [("alloc", name, size, stride, dtype, module, op)]

    events: list[tuple] = []
    named: set[str] = set()  # the names the events so far bind
    extern = _extern_workspaces(graph, workspace) if workspace is not None else {}
    outputs_of: dict[str, list[str]] = {}  # a fallback kernel -> its MultiOutputs, by index
    for buf in buffers.values():
        if isinstance(buf, ir.MultiOutput) and buf.inputs:
            outputs_of.setdefault(buf.inputs[0].get_name(), []).append(buf.get_name())
    for line in body:
        code, _, comment = line.partition("#")
        code = code.strip()
        target = re.search(r"\bout=(\w+)", code) or re.match(r"^(\w+) = ", code)
        # held while the kernel runs, on top of its outputs (allocated before it, or by the call: below)
        scratch = [("workspace", *extern.pop(target.group(1)))] if target is not None and (
            target.group(1) in extern and "reuse" not in comment) else []
        for part in [p.strip() for p in code.split(";") if p.strip()]:
            if part.startswith("del "):
                if "reuse" not in comment:  # a reuse line's `del` is the hand-over, not a free
                    events += [("free", n.strip()) for n in part[4:].split(",")]
                continue
            match = re.match(r"^(\w+) = (.+)$", part)
            if match is None:
                continue
            name, rhs = match.groups()
            base = re.match(r"^(?:reinterpret_tensor\()?(\w+)(?:,|\)|$)", rhs)
            if "reuse" in comment:
                donor = re.search(r"del (\w+)", code)
                events.append(("reuse", name, donor.group(1) if donor else base.group(1),
                               *(_origin(buffers[name]) if name in buffers else ("", "")),
                               *(layout(name)[:2] if name in buffers else (None, None))))
            elif rhs.startswith(("empty_strided_cpu(", "empty_strided(")):
                events += allocation(name, rhs)
            elif re.match(r"^\w+\[\d+\]$", rhs):  # a fallback kernel's output, allocated by its call
                if name not in named:
                    aliased = buffers[name].get_inputs_that_alias_output() if name in buffers else []
                    events += [("alias", name, aliased[0])] if aliased else allocation(name, "")
            elif base is not None and (rhs == base.group(1) or rhs.startswith("reinterpret_tensor(")):
                # a view; of a kernel's output that is no buffer of the graph (`bufN = aten.cumsum(...)` as a
                # FallbackKernel, then `bufM = bufN`): bufM's allocation
                known = base.group(1) in named or base.group(1) in graph.graph_inputs
                events += [("alias", name, base.group(1))] if known else allocation(name, "")
            elif name in buffers and isinstance(buffers[name].get_output_spec(), ir.MultiOutputLayout):
                # a fallback kernel returning several tensors: its call allocates them all, and the tuple it returns
                # (`bufN`, deleted later) holds them; each is named later (`bufM = bufN[i]`)
                children = [c for c in outputs_of.get(name, ()) if not buffers[c].get_inputs_that_alias_output()]
                for child in children:
                    events += allocation(child, "")
                    named.add(child)
                events.append(("tuple", name, tuple(children)))
            elif name in buffers and not isinstance(buffers[name].get_output_spec(), ir.NoneLayout):
                events += allocation(name, "")  # an extern kernel that allocates its output
            if events and events[-1][0] not in ("free", "workspace", "tuple"):
                named.add(events[-1][1])
        events += scratch
    program = GraphProgram(tuple(graph.graph_input_names), tuple(events), _output_specs(graph))
    return _simulated(program, graph, kept_inputs, get_dtype_size)


def _extern_workspaces(graph, workspace: Callable) -> dict[str, tuple[int, str, str]]:
    """Per extern kernel of the lowered `graph` (by its buffer name): (workspace bytes, module path, aten op) of
    its CPU kernel, measured by `workspace(func, args, kwargs, out)` on the FX node the kernel was lowered from (a
    `run_with_rng_state` recompute: the op it wraps); kernels without a workspace are left out."""
    from torch._inductor import ir
    from torch.utils._pytree import tree_map

    found: dict[str, tuple[int, str, str]] = {}
    for snode in graph.scheduler.nodes:
        node = getattr(snode, "node", None)
        if not isinstance(node, ir.ExternKernel) or isinstance(node, ir.MultiOutput) or node.get_name() is None:
            continue
        # the op the kernel runs: a fallback kernel's is the node's own (aten._scaled_dot_product_flash_attention_
        # for_cpu.default); an extern_kernels.mm runs aten.mm.out for an aten.mm.default node (same overload
        # packet); a kernel without one is known by its name
        kernel = getattr(node, "op_overload", None)
        packet = getattr(kernel, "overloadpacket", None)
        name = (getattr(node, "python_kernel_name", None) or "").rsplit(".", 1)[-1]

        def lowered_from(target) -> bool:
            if kernel is not None:
                return target is kernel or (packet is not None and getattr(target, "overloadpacket", None) is packet)
            return getattr(getattr(target, "overloadpacket", None), "__name__", None) == name

        origin = next((o for o in sorted(node.origins, key=lambda n: n.name)
                       if o.op == "call_function" and lowered_from(o.target)), None)
        if origin is None:
            continue
        func, args, kwargs = origin.target, origin.args, origin.kwargs
        if func is torch.ops.higher_order.run_with_rng_state:  # (rng state, op, *args): the op runs
            func, args = args[1], args[2:]
        elif func is torch.ops.higher_order.run_and_save_rng_state:  # (op, *args)
            func, args = args[0], args[1:]
        if not isinstance(func, torch._ops.OpOverload):
            continue
        args, kwargs = tree_map(lambda a: a.meta.get("val") if isinstance(a, fx.Node) else a, (args, kwargs))
        args, kwargs = _as_laid_out(node, args, kwargs, graph)
        nbytes, _ = workspace(func, args, kwargs, origin.meta.get("val"))
        if nbytes > 0:
            module, _op = _origin(node)
            found[node.get_name()] = (nbytes, module, str(func))
    return found


def _as_laid_out(node, args, kwargs, graph):
    """The op's tensor arguments with the sizes and strides of the kernel's inputs as Inductor laid them out (its
    layout optimization may pass a convolution channels-last inputs, which changes the CPU kernel's workspace),
    when the kernel has one input per tensor argument; else as the FX node had them."""
    from torch.utils._pytree import tree_flatten, tree_unflatten

    leaves, spec = tree_flatten((args, kwargs))
    slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    inputs = list(getattr(node, "inputs", ()))
    if len(inputs) != len(slots):
        return args, kwargs
    for i, inp in zip(slots, inputs):
        try:
            layout = inp.get_layout()
            size, stride = _ints(graph, layout.size), _ints(graph, layout.stride)
        except (AttributeError, NotImplementedError, TypeError):
            continue
        if size == tuple(leaves[i].shape):
            leaves[i] = torch.empty_strided(size, stride, dtype=inp.get_dtype(), device="meta")
    return tree_unflatten(leaves, spec)


def _simulated(program: GraphProgram, graph, kept_inputs: set[str] | None, dtype_size) -> InductorMemory:
    """`program`'s bytes above its start, at the highest and at the end: a storage is freed when no name holds it
    (inputs in `kept_inputs`, or all when None, are held by the caller)."""
    def storage_bytes(size, stride, dtype) -> int:
        return 0 if 0 in size else (1 + sum((a - 1) * b for a, b in zip(size, stride))) * dtype_size(dtype)

    holder: dict[str, int] = {}  # name -> storage id
    nbytes: dict[int, int] = {}
    for i, name in enumerate(program.inputs):
        inp = graph.graph_inputs.get(name)
        holder[name] = -1 - i
        try:
            nbytes[-1 - i] = storage_bytes(_ints(graph, inp.get_size()), _ints(graph, inp.get_stride()),
                                           inp.get_dtype())
        except (AttributeError, NotImplementedError, TypeError):
            nbytes[-1 - i] = 0
    pinned = set(range(-len(program.inputs), 0)) if kept_inputs is None else {
        -1 - i for i, n in enumerate(program.inputs) if n in kept_inputs}
    live = peak = 0
    reuses = []

    def drop(name: str) -> None:
        nonlocal live
        sid = holder.pop(name, None)
        if sid is not None and sid not in holder.values() and sid not in pinned:
            live -= nbytes[sid]
            pinned.add(sid)  # counted once

    for event in program.events:
        if event[0] == "alloc":
            sid = len(nbytes)
            nbytes[sid] = storage_bytes(event[2], event[3], event[4])
            holder[event[1]] = sid
            live += nbytes[sid]
            peak = max(peak, live)
        elif event[0] == "workspace":
            peak = max(peak, live + event[1])
        elif event[0] == "tuple":  # the tuple holds its outputs' storages under its own name
            for child in event[2]:
                holder[f"{event[1]}[{child}]"] = holder[child]
        elif event[0] in ("reuse", "alias"):
            if event[2] in holder:
                holder[event[1]] = holder[event[2]]
            if event[0] == "reuse":
                reuses.append((event[1], event[2]))
                holder.pop(event[2], None)
        else:
            for key in [k for k in holder if k.startswith(event[1] + "[")]:
                drop(key)
            drop(event[1])
    return InductorMemory(peak, live, tuple(sorted(graph.removed_buffers)), tuple(sorted(reuses)), program)


def _ints(graph, exprs) -> tuple[int, ...]:
    """Inductor's size expressions as ints (their hints; static shapes are plain numbers)."""
    return tuple(int(graph.sizevars.optimization_hint(x, fallback=0)) for x in exprs)


def _call_body(source: str) -> list[str]:
    """The lines of the wrapper's `call` function (up to its `return`)."""
    lines = source.splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(r"\s*def call\((self, )?args\):", line))
    indent = len(lines[start]) - len(lines[start].lstrip()) + 1
    body = []
    for line in lines[start + 1:]:
        if line.strip() and len(line) - len(line.lstrip()) < indent:
            break
        if line.strip().startswith("return"):
            break
        body.append(line)
    return body


def _empty_strided_args(rhs: str):
    """(size, stride, dtype) of `empty_strided_cpu((8, 128), (128, 1), torch.float32)`, or None."""
    import ast

    match = re.match(r"^empty_strided(?:_cpu)?\((\(.*?\)), (\(.*?\)), torch\.(\w+)\)$", rhs)
    if match is None:
        return None
    try:
        size, stride = ast.literal_eval(match.group(1)), ast.literal_eval(match.group(2))
    except (ValueError, SyntaxError):
        return None
    dtype = getattr(torch, match.group(3), None)
    return (tuple(size), tuple(stride), dtype) if isinstance(dtype, torch.dtype) else None


def _output_specs(graph) -> tuple:
    """Per output of the lowered `graph`: None, a plain value, or (the buffer or input whose storage it views,
    size, stride, offset in that storage beyond the base's own, dtype), laid out as Inductor's IR has it. A view
    kernel's output (`get_inputs_that_alias_output`) is followed to the buffer it aliases."""
    from torch._inductor import ir

    output = next(n for n in reversed(graph.module.graph.nodes) if n.op == "output")
    specs = []
    for arg, value in zip(output.args[0], graph.graph_outputs):
        val = arg.meta.get("val") if isinstance(arg, fx.Node) else None
        if not isinstance(val, torch.Tensor):
            specs.append(None if arg is None or isinstance(arg, fx.Node) else arg)
            continue
        node, view = value, False
        while isinstance(node, (ir.TensorBox, ir.StorageBox, ir.ReinterpretView)):
            view = view or isinstance(node, ir.ReinterpretView)
            node = node.data
        name = node.get_name()
        while name in graph.name_to_buffer and graph.name_to_buffer[name].get_inputs_that_alias_output():
            name = graph.name_to_buffer[name].get_inputs_that_alias_output()[0]
        try:  # as Inductor lays it out (its layout optimization may make it channels-last), offset in its storage
            layout = value.get_layout()
            size, stride = _ints(graph, layout.size), _ints(graph, layout.stride)
            offset = _ints(graph, [layout.offset])[0] if view else 0
        except (AttributeError, NotImplementedError, TypeError):
            size, stride, offset = tuple(map(int, val.shape)), tuple(map(int, val.stride())), 0
        specs.append((name, size, stride, offset, val.dtype))
    return tuple(specs)


def _report_output_strides(specs: tuple) -> None:
    """Tell AOTAutograd the strides of a graph's outputs as Inductor lays them out, as a compiled graph does
    (torch/_inductor/utils.py `set_tracing_context_output_strides`): AOTAutograd restrides the backward graph's
    saved-tensor inputs with them (graph_compile.py `_aot_stage2b_bw_compile`)."""
    context = torch._guards.TracingContext.try_get()
    if context is not None and context.output_strides is not None:
        context.output_strides.extend(spec[2] if isinstance(spec, tuple) else None for spec in specs)


def _origin(node) -> tuple[str, str]:
    """(module path as `named_modules` writes it, aten op) of the FX node a buffer was lowered from (its
    `origin_node`, else the first of its origins that records a module): dynamo's `nn_module_stack` (the forward's
    nodes) or `fwd_nn_module_stack` (the backward's); the op as the graph had it before Inductor's decompositions
    (`original_aten`) when known. A buffer with an origin node outside every module (the loss's gradient) has
    none: a fused kernel's other origins would lend it a module it does not belong to."""
    first = getattr(node, "origin_node", None)
    origins = [first] if first is not None else list(getattr(node, "origins", ()))
    op = ""
    for origin in origins:
        op = op or str(origin.meta.get("original_aten") or origin.target)
        stack = origin.meta.get("nn_module_stack") or origin.meta.get("fwd_nn_module_stack")
        if stack:
            return module_path(list(stack.values())[-1][0]), op
    return "", op


def module_path(dynamo_name: str) -> str:
    """"L['self'].transformer.h[0].attn" (dynamo's source name of a submodule) -> "transformer.h.0.attn".

    The root module is the compiled frame's local `self`, or `args[0]` when its forward is wrapped by a
    `def wrapped(*args, **kwargs)` decorator (transformers 5.24's `deprecate_kwarg` on every model's forward:
    "L['args'][0].model.layers.0"). Names come from torch/_dynamo/variables/nn_module.py
    `record_nn_module_stack` (the source's name, `._modules['x']` already shortened to `.x`)."""
    path = re.sub(r"^L\[(['\"])[^'\"]+\1\](\[\d+\])*\.?", "", dynamo_name)
    return re.sub(r"\[['\"]?([^\]'\"]+)['\"]?\]", r".\1", path).lstrip(".")
