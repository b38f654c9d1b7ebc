"""The forward and backward FX graphs that `torch.compile` (Inductor) runs for a model's training step, captured
without a device and without Inductor's code generation (issue 17, first part: not yet behind `--compile`).

How (`capture`):
- The model (built on meta) is copied and materialized as fake tensors that claim the CPU (`FakeTensorMode`,
  `to_empty(device="cpu")`). Plain meta tensors do not work: under the Python dispatcher that dynamo, AOTAutograd
  and Inductor enable, the Python meta kernels that torch/_meta_registrations.py `activate_meta` registers for
  CompositeImplicitAutograd ops (`aten.nll_loss` among 109) shadow their autograd decomposition
  (torch/_ops.py `resolve_key`), so the joint graph loses their backward; and SDPA takes its math path on meta.
- The copy is compiled with Inductor's own `compile_fx` (torch/_inductor/compile_fx.py): its decomposition table
  (`select_decomp_table`), its joint-graph passes and its partitioner (`partition_fn`:
  `min_cut_rematerialization_partition(..., compiler="inductor")`) decide what the forward saves; only the
  per-graph code generation (`compile_fx_inner`) is replaced by `_keep_graph`, which runs the post-grad passes
  Inductor runs before lowering (`view_to_reshape`, `_recursive_post_grad_passes`, as
  `_InProcessFxCompile.codegen_and_compile` does) and keeps the graph. One forward and backward run on fake
  inputs, so dynamo's graph breaks give several graphs, in the order they ran.
- The graphs are CPU graphs: a CPU-only torch cannot make fake CUDA tensors. CUDA's differ where a kernel choice
  depends on the device (SDPA's flash or memory-efficient attention saves its output and logsumexp).

What it leaves behind: dynamo's cache entries for the copy's forward functions (one per compiled frame; they
fail their guards for any other module); Inductor's FX-graph and AOTAutograd caches are off while it runs.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import Any

import torch
from torch import fx


@dataclasses.dataclass(frozen=True)
class CapturedGraph:
    """One graph torch.compile runs: `kind` 'forward' or 'backward' (AOTAutograd's partition of one dynamo graph;
    'inference' when nothing needs a gradient), its GraphModule after Inductor's post-grad passes (each node's
    `meta["val"]` a fake tensor), and the indices of the inputs that live beyond the graph (parameters and
    buffers: AOTAutograd's `static_input_idxs`)."""

    kind: str
    gm: fx.GraphModule
    static_inputs: tuple[int, ...]

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
            loss_key: str = "loss") -> list[CapturedGraph]:
    """The graphs `torch.compile(model)` (Inductor, its default mode) runs for `model(**kwargs)[loss_key]
    .backward()`, in the order they ran (the forward graphs first, then the backward graphs as autograd runs them).
    `model` is built on meta and left as it is (a copy is compiled); `kwargs` hold meta tensors (or plain values);
    `autocast_dtype`: the CPU autocast of a mixed-precision step. Raises torch's errors when dynamo or Inductor
    cannot compile the model."""
    from torch._guards import detect_fake_mode
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import _recursive_post_grad_passes, compile_fx
    from torch._inductor.fx_passes.post_grad import view_to_reshape
    from torch._inductor.output_code import OutputCode
    from torch._inductor.virtualized import V
    from torch._subclasses.fake_tensor import FakeTensorMode

    kept: list[CapturedGraph] = []

    @dataclasses.dataclass
    class _Interpreted(OutputCode):  # what the compiled step calls in place of Inductor's generated code
        gm: fx.GraphModule | None = None

        def __post_init__(self):
            self._boxed_call = True

        def __call__(self, inputs):
            args = list(inputs)
            inputs.clear()
            return fx.Interpreter(self.gm).run(*args)

        def post_compile(self, *args, **kwargs):
            pass

        def prepare_for_serialization(self):
            pass

        def set_triton_bundle(self, bundle):
            pass

    def _keep_graph(gm: fx.GraphModule, example_inputs, **kw):
        kind = "backward" if kw.get("is_backward") else "inference" if kw.get("is_inference") else "forward"
        view_to_reshape(gm)
        with V.set_fake_mode(detect_fake_mode(example_inputs)):
            _recursive_post_grad_passes(gm, is_inference=kind == "inference")
        kept.append(CapturedGraph(kind, gm, tuple(kw.get("static_input_idxs") or ())))
        return _Interpreted(gm=gm)

    def backend(gm, example_inputs):
        return compile_fx(gm, example_inputs, inner_compile=_keep_graph)

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    twin = copy.deepcopy(model)
    with contextlib.ExitStack() as stack:
        stack.enter_context(inductor_config.patch(fx_graph_cache=False))  # the kept graphs are not serializable
        stack.enter_context(torch._functorch.config.patch(enable_autograd_cache=False))
        stack.enter_context(fake_mode)
        twin.to_empty(device="cpu")
        if hasattr(twin, "tie_weights"):  # to_empty unties transformers' tied embeddings
            twin.tie_weights()
        fake_kwargs = {k: torch.empty_like(v, device="cpu") if isinstance(v, torch.Tensor) else v
                       for k, v in kwargs.items()}
        compiled = torch.compile(twin, backend=backend)
        autocast = torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()
        with autocast:
            out = compiled(**fake_kwargs)
        loss = out[loss_key] if isinstance(out, dict) or hasattr(out, "keys") else out
        loss.backward()
    return kept
