"""Module hooks installed while a step is recorded: which module runs (for the recorder's attribution and the
autograd nodes' tags), and the MoE routing policy of transformers' eager experts."""

from __future__ import annotations

import contextlib

import torch

from ..spec import RunSpec
from .kernels import KernelPolicyMode, MoeRoutingPolicy
from .recorder import StepRecorder, tag_autograd_nodes


@contextlib.contextmanager
def module_hooks(model: torch.nn.Module, rec: StepRecorder):
    """Keep `rec.module_stack` (and `rec.forward_depth`: inside the model's own forward, or one of its
    `_vramtrace_forward_roots` when it declares them: an interleaved pipeline rank's stages, tracer/pipelining.py
    `RankModule`, which the schedule calls one by one; a private name no user's module has) while modules run;
    tag the autograd nodes each module's forward created with its path."""
    names = {id(m): n for n, m in model.named_modules()}
    roots = {id(m) for m in getattr(model, "_vramtrace_forward_roots", (model,))}

    def pre(mod, args):
        rec.forward_depth += id(mod) in roots
        rec.module_stack.append(names.get(id(mod), type(mod).__name__))

    def post(mod, args, out):
        rec.forward_depth -= id(mod) in roots
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
def moe_routing(model: torch.nn.Module, spec: RunSpec, policy: KernelPolicyMode):
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
