"""What one graph's generated Inductor CPU code allocates and frees (tracer/compiled.py lowers the graphs).

`cpu_allocations` reads the Python wrapper that `GraphLowering.codegen` generates for a lowered graph: its `call`
function's allocations, the buffers its memory planning reuses, its aliases and its `del`s, in order, as a
`GraphProgram`, and the bytes it holds at its highest and at its end (`InductorMemory`). `run_program` repeats a
program on fake tensors in place of the compiled code, so the recorder sees each buffer born and dying where the
generated code allocates and deletes it. The Inductor names read here are declared in `bridges.INDUCTOR_GRAPHS`.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable

import torch
from torch import fx


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
    """What one graph's CPU code allocates, read off its generated wrapper (`cpu_allocations`): bytes (ints) above
    what is alive when the graph starts, at its highest (`peak_bytes`, extern kernels' workspaces included when
    measured) and when it returns (`end_bytes`); the buffers fusion removed (`GraphLowering.removed_buffers`) and
    the reuses (buffer, the buffer or input whose storage it takes over); the `program` that repeats it."""

    peak_bytes: int
    end_bytes: int
    removed: tuple[str, ...]
    in_place: tuple[tuple[str, str], ...]
    program: GraphProgram | None = None


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


def cpu_allocations(graph, source: str, kept_inputs: set[str] | None,
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
    per-thread buffers): with `workspace` (a `probe.CpuWorkspaceProbe`) it is measured on this machine's CPU for
    the op and argument layouts of the FX node the kernel was lowered from (`_extern_workspaces`), and held for the
    call ("workspace" events)."""
    from torch._inductor.utils import get_dtype_size

    reader = _WrapperReader(graph, workspace)
    for line in _call_body(source):
        reader.read(line)
    program = GraphProgram(tuple(graph.graph_input_names), tuple(reader.events), _output_specs(graph))
    return _simulated(program, graph, kept_inputs, get_dtype_size)


class _WrapperReader:
    """The events of a wrapper's `call` as its lines are read (`cpu_allocations`)."""

    def __init__(self, graph, workspace: Callable | None):
        from torch._inductor import ir

        self.graph, self.buffers = graph, graph.name_to_buffer
        self.events: list[tuple] = []
        self.named: set[str] = set()  # the names the events so far bind
        self.extern = _extern_workspaces(graph, workspace) if workspace is not None else {}
        self.outputs_of: dict[str, list[str]] = {}  # a fallback kernel -> its MultiOutputs, by index
        for buf in self.buffers.values():
            if isinstance(buf, ir.MultiOutput) and buf.inputs:
                self.outputs_of.setdefault(buf.inputs[0].get_name(), []).append(buf.get_name())

    def layout(self, name: str):
        node = self.buffers[name]
        fixed = node.get_layout()
        return _ints(self.graph, fixed.size), _ints(self.graph, fixed.stride), node.get_dtype()

    def allocation(self, name: str, rhs: str) -> list[tuple]:
        parsed = _empty_strided_args(rhs)
        if parsed is None and name not in self.buffers:
            return []
        size, stride, dtype = parsed if parsed is not None else self.layout(name)
        module, op = _origin(self.buffers[name]) if name in self.buffers else ("", "")
        return [("alloc", name, size, stride, dtype, module, op)]

    def read(self, line: str) -> None:
        """The events of one line of `call` (its statements, `;`-separated, then an extern kernel's workspace)."""
        code, _, comment = line.partition("#")
        code = code.strip()
        target = re.search(r"\bout=(\w+)", code) or re.match(r"^(\w+) = ", code)
        # held while the kernel runs, on top of its outputs (allocated before it, or by the call: below)
        scratch = [("workspace", *self.extern.pop(target.group(1)))] if target is not None and (
            target.group(1) in self.extern and "reuse" not in comment) else []
        for part in [p.strip() for p in code.split(";") if p.strip()]:
            if part.startswith("del "):
                if "reuse" not in comment:  # a reuse line's `del` is the hand-over, not a free
                    self.events += [("free", n.strip()) for n in part[4:].split(",")]
                continue
            match = re.match(r"^(\w+) = (.+)$", part)
            if match is None:
                continue
            self._assignment(*match.groups(), code, comment)
            if self.events and self.events[-1][0] not in ("free", "workspace", "tuple"):
                self.named.add(self.events[-1][1])
        self.events += scratch

    def _assignment(self, name: str, rhs: str, code: str, comment: str) -> None:
        """The events of `name = rhs` (in the line `code`, with its `comment`)."""
        from torch._inductor import ir

        buffers, events = self.buffers, self.events
        base = re.match(r"^(?:reinterpret_tensor\()?(\w+)(?:,|\)|$)", rhs)
        if "reuse" in comment:
            donor = re.search(r"del (\w+)", code)
            events.append(("reuse", name, donor.group(1) if donor else base.group(1),
                           *(_origin(buffers[name]) if name in buffers else ("", "")),
                           *(self.layout(name)[:2] if name in buffers else (None, None))))
        elif rhs.startswith(("empty_strided_cpu(", "empty_strided(")):
            events += self.allocation(name, rhs)
        elif re.match(r"^\w+\[\d+\]$", rhs):  # a fallback kernel's output, allocated by its call
            if name not in self.named:
                aliased = buffers[name].get_inputs_that_alias_output() if name in buffers else []
                events += [("alias", name, aliased[0])] if aliased else self.allocation(name, "")
        elif base is not None and (rhs == base.group(1) or rhs.startswith("reinterpret_tensor(")):
            # a view; of a kernel's output that is no buffer of the graph (`bufN = aten.cumsum(...)` as a
            # FallbackKernel, then `bufM = bufN`): bufM's allocation
            known = base.group(1) in self.named or base.group(1) in self.graph.graph_inputs
            events += [("alias", name, base.group(1))] if known else self.allocation(name, "")
        elif name in buffers and isinstance(buffers[name].get_output_spec(), ir.MultiOutputLayout):
            # a fallback kernel returning several tensors: its call allocates them all, and the tuple it returns
            # (`bufN`, deleted later) holds them; each is named later (`bufM = bufN[i]`)
            children = [c for c in self.outputs_of.get(name, ()) if not buffers[c].get_inputs_that_alias_output()]
            for child in children:
                events += self.allocation(child, "")
                self.named.add(child)
            events.append(("tuple", name, tuple(children)))
        elif name in buffers and not isinstance(buffers[name].get_output_spec(), ir.NoneLayout):
            events += self.allocation(name, "")  # an extern kernel that allocates its output


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
