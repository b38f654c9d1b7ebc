"""Apply an activation-checkpointing policy to a transformers model, as a user's training code would.

- `layers`: `model.activation_checkpointing_enable({"use_reentrant": False})` (transformers >= 5.23; before,
  `gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})`): each decoder or
  encoder layer (`GradientCheckpointingLayer`) runs its forward under non-reentrant `torch.utils.checkpoint`.
- `layers:reentrant`: the same with `{"use_reentrant": True}`, the variant peft's `prepare_model_for_kbit_training`
  enables by default (`spec.KBIT_TRAINING_CHECKPOINTING`): each layer's forward runs under no_grad and is re-run
  whole in the backward. It saves what the non-reentrant variant does not hook: tensors an autograd Function keeps
  as plain attributes (bitsandbytes' MatMul8bitFp keeps its input as `ctx.A`) are not kept.
- `nth:N`: the same with `every_n_layers=N` (transformers checkpoints layers 0, N, 2N, ...).
- `selective[:OPS]`: the same with `context_fn=partial(create_selective_checkpoint_contexts, policy)`, PyTorch's
  selective activation checkpointing (`torch/utils/checkpoint.py`): the outputs of OPS (default: the matmuls)
  are saved, every other op (pointwise ops, the attention core) is recomputed.
- `modules:PATTERN`: every submodule whose qualified name matches the fnmatch PATTERN (outermost matches only:
  a match inside a matched module is already checkpointed) runs its forward under non-reentrant
  `torch.utils.checkpoint`; works for any `nn.Module`, custom modules included.
- `every:K`: K consecutive layers form one checkpointed segment (Chen et al. 2016; `checkpoint_sequential` does
  this for an `nn.Sequential`): the segment's first layer runs all K under one non-reentrant checkpoint and the
  other K-1 pass its output through.

The same function applies the policy to the meta model that is traced and to a real model that a test runs, so
both run the same checkpoint code. `wrap_region` lets the tracer see each checkpointed region's function (to
mark the recompute and restore its emulated autocast; for transformers' own checkpointing through the
`checkpoint_function` bridge, `vramtrace.feature_bridges.route_checkpoint_functions`); a real run passes none.
"""

from __future__ import annotations

import fnmatch
import functools
from typing import Callable

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from .. import feature_bridges
from ..errors import UsageError
from ..spec import Checkpointing, CheckpointingKind

Region = Callable[[Callable], Callable]


def save_ops_policy(save_ops: tuple[str, ...]):
    """A selective-checkpointing policy function: MUST_SAVE the outputs of `save_ops` ('aten.mm', ...), else
    PREFER_RECOMPUTE. Raises UsageError for a name that is not an aten op."""
    packets = set()
    for name in save_ops:
        ns, _, op = name.partition(".")
        packet = getattr(getattr(torch.ops, ns, None), op.split(".")[0], None) if op else None
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            raise UsageError(f"--checkpointing selective: {name!r} is not an op; name ops like aten.mm,aten.addmm")
        packets.add(packet)

    def policy(ctx, func, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if func.overloadpacket in packets else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _checkpoint_fn(wrap_region: Region | None, **kwargs):
    def run(function, *args, **kw):
        return checkpoint(wrap_region(function) if wrap_region else function, *args, **kwargs, **kw)
    return run


def apply_checkpointing(model: torch.nn.Module, ckpt: Checkpointing, wrap_region: Region | None = None,
                        layers: torch.nn.ModuleList | None = None) -> None:
    """Enable `ckpt` on `model` (a transformers PreTrainedModel; `layers` is its layer stack, needed for
    `every:K`). Raises UsageError when the model does not support checkpointing."""
    if ckpt.kind is CheckpointingKind.NONE:
        return
    kwargs: dict = {"use_reentrant": ckpt.reentrant}
    if ckpt.kind is CheckpointingKind.MODULES:
        matched = matching_modules(model, ckpt.pattern)
        if not matched:
            raise UsageError(f"--checkpointing {ckpt}: no submodule's qualified name matches {ckpt.pattern!r} "
                             f"(names look like {_example_names(model)})")
        run = _checkpoint_fn(wrap_region, **kwargs)
        for _, m in matched:
            _checkpoint_module(m, run)
        return
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise UsageError(f"{type(model).__name__} does not support activation checkpointing in transformers; "
                         "use --checkpointing modules:PATTERN")
    if ckpt.kind is CheckpointingKind.SELECTIVE:
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, save_ops_policy(ckpt.save_ops))
    if ckpt.kind in (CheckpointingKind.LAYERS, CheckpointingKind.NTH, CheckpointingKind.SELECTIVE):
        every_n = ckpt.k if ckpt.kind is CheckpointingKind.NTH else 1
        model.activation_checkpointing_enable(kwargs, every_n_layers=every_n)
        if wrap_region is not None:
            feature_bridges.route_checkpoint_functions(model, _checkpoint_fn(wrap_region, **kwargs))
        return
    if ckpt.kind is CheckpointingKind.EVERY:
        if layers is None:
            raise UsageError("--checkpointing every:K needs a stack of identical layers; this model has none")
        if model.main_input_name == "input_ids":
            model.enable_input_require_grads()  # as activation_checkpointing_enable does
        run = _checkpoint_fn(wrap_region, **kwargs)
        for start in range(0, len(layers), ckpt.k):
            _segment(list(layers[start:start + ckpt.k]), run)
        return
    raise UsageError(f"checkpointing {ckpt} cannot be applied to a model directly")


def matching_modules(model: torch.nn.Module, pattern: str) -> list[tuple[str, torch.nn.Module]]:
    """(qualified name, module) of the outermost submodules whose name matches the fnmatch `pattern`."""
    out: list[tuple[str, torch.nn.Module]] = []
    for name, m in model.named_modules():
        if name and fnmatch.fnmatchcase(name, pattern) and not any(name.startswith(p + ".") for p, _ in out):
            out.append((name, m))
    return out


def _example_names(model: torch.nn.Module) -> str:
    names = [n for n, _ in model.named_children()][:4]
    return ", ".join(names) if names else "(the model has no submodules)"


def _no_kv_cache(kwargs: dict) -> None:
    """As transformers' GradientCheckpointingLayer does (transformers/modeling_layers.py `__call__`): no KV cache
    under checkpointing (a recompute would append to it a second time). transformers 5.24 passes the cache to a
    layer as `cache` (5.23: `past_key_values`)."""
    for key, off in (("use_cache", False), ("past_key_values", None), ("cache", None), ("layer_past", None)):
        if key in kwargs:
            kwargs[key] = off


def _checkpoint_module(module: torch.nn.Module, run_checkpoint) -> None:
    """Run `module`'s forward (any signature, any outputs) under one checkpoint, its arguments as given: the
    snippet `paste_snippet` prints for `modules:` (`functools.partial(checkpoint, m.forward)`) keeps a KV cache
    passed to a decoder layer, and the prediction is of the code the user pastes."""
    original = module.forward

    def forward(*args, **kwargs):
        return run_checkpoint(original, *args, **kwargs)

    module.forward = forward


def _segment(seg: list[torch.nn.Module], run_checkpoint) -> None:
    """Checkpoint the layers `seg` as one region: the first layer's forward runs them all under one
    checkpoint; the others return their input (already the segment's output). Layers return a tensor."""
    state = {"inside": False}
    originals = [m.forward for m in seg]

    def run_all(hidden_states, *args, **kwargs):
        state["inside"] = True
        try:
            for m in seg:
                hidden_states = m(hidden_states, *args, **kwargs)
            return hidden_states
        finally:
            state["inside"] = False

    def first(hidden_states, *args, **kwargs):
        if state["inside"]:
            return originals[0](hidden_states, *args, **kwargs)
        # as transformers' GradientCheckpointingLayer does: no KV cache under checkpointing
        _no_kv_cache(kwargs)
        return run_checkpoint(run_all, hidden_states, *args, **kwargs)

    def make_rest(original):
        def rest(hidden_states, *args, **kwargs):
            return original(hidden_states, *args, **kwargs) if state["inside"] else hidden_states
        return rest

    seg[0].forward = first
    for m, original in zip(seg[1:], originals[1:]):
        m.forward = make_rest(original)


def layer_stack(model: torch.nn.Module) -> torch.nn.ModuleList | None:
    """The model's stack of checkpointable layers: the one ModuleList of transformers
    `GradientCheckpointingLayer`s, or None."""
    layer_class = feature_bridges.gradient_checkpointing_layer()
    stacks = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m)
              and all(isinstance(c, layer_class) for c in m)]
    return stacks[0] if len(stacks) == 1 else None


def paste_snippet(ckpt: Checkpointing) -> str:
    """Python a user pastes after building `model` (transformers) to apply `ckpt` in their training code."""
    if ckpt.kind is CheckpointingKind.MODULES:
        return ("import fnmatch, functools\n"
                "from torch.utils.checkpoint import checkpoint\n"
                "done = []\n"
                "for name, m in model.named_modules():\n"
                f"    if name and fnmatch.fnmatchcase(name, {ckpt.pattern!r}) and not any(name.startswith(d + '.') for d in done):\n"
                "        done.append(name)\n"
                "        m.forward = functools.partial(checkpoint, m.forward, use_reentrant=False)")
    if ckpt.kind in (CheckpointingKind.LAYERS, CheckpointingKind.NTH):
        extra = f", every_n_layers={ckpt.k}" if ckpt.kind is CheckpointingKind.NTH else ""
        return f'model.activation_checkpointing_enable({{"use_reentrant": {ckpt.reentrant}}}{extra})'
    if ckpt.kind is CheckpointingKind.SELECTIVE:
        ops = ", ".join(f"torch.ops.{o}" for o in ckpt.save_ops)
        return ("import functools, torch\n"
                "from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts\n"
                f"SAVE = {{{ops}}}\n"
                "def policy(ctx, func, *args, **kwargs):\n"
                "    return CheckpointPolicy.MUST_SAVE if func.overloadpacket in SAVE else CheckpointPolicy.PREFER_RECOMPUTE\n"
                'model.activation_checkpointing_enable({"use_reentrant": False,\n'
                '    "context_fn": functools.partial(create_selective_checkpoint_contexts, policy)})')
    return ""
