"""The optimizer of the step: the real torch.optim (or transformers) class the spec names, on the model's
trainable parameters. Used by the trace (on meta) and by `vramtrace validate` (for real)."""

from __future__ import annotations

import torch

from ..spec import BNB_OPTIMIZER_BUILDS, BNB_OPTIMIZERS, Device, OptimizerImpl, OptimizerKind, RunSpec


def _implementation(spec: RunSpec) -> dict:
    """The `foreach=`/`fused=` keywords of `spec.optimizer_impl`. Default: foreach on CUDA, for-loop on CPU, as
    `torch/optim/optimizer.py::_default_to_fused_or_foreach` picks for parameters on those devices (foreach kernels
    are supported on CUDA, not on the CPU: `torch/utils/_foreach_utils.py::_get_foreach_kernels_supported_devices`);
    it is given explicitly because the trace's parameters are on meta. With FSDP2's CPU offload the parameters are
    on the CPU: for-loop."""
    impl = spec.optimizer_impl
    if impl is OptimizerImpl.FUSED:
        return {"fused": True}
    if impl is OptimizerImpl.DEFAULT:
        return {"foreach": spec.device is Device.CUDA and not spec.cpu_offload}
    return {"foreach": impl is OptimizerImpl.FOREACH}


def make_optimizer(spec: RunSpec, params: list[torch.nn.Parameter]):
    """The real optimizer `spec.optimizer` names (see `OptimizerKind`), or None without one or without trainable
    parameters. Learning rates are placeholders: no rule of memory depends on them."""
    kind = spec.optimizer
    if kind is OptimizerKind.NONE or not params:
        return None
    if kind is OptimizerKind.ADAFACTOR:  # transformers/trainer_optimizer.py::_get_adafactor, one implementation
        from transformers.optimization import Adafactor

        return Adafactor(params, lr=1e-4, scale_parameter=False, relative_step=False)
    if kind in BNB_OPTIMIZERS:  # transformers/trainer_optimizer.py `_get_bitsandbytes_optimizer`
        from .quantization import bitsandbytes_module

        name, bits, paged = BNB_OPTIMIZER_BUILDS[kind]
        optimizer_class = getattr(bitsandbytes_module().optim, name)
        return optimizer_class(params, lr=1e-4, optim_bits=bits, **({} if paged is None else {"is_paged": paged}))
    impl = _implementation(spec)
    if kind is OptimizerKind.ADAMW:
        return torch.optim.AdamW(params, lr=1e-4, **impl)
    if kind is OptimizerKind.ADAM:
        return torch.optim.Adam(params, lr=1e-4, **impl)
    if kind is OptimizerKind.RMSPROP:
        return torch.optim.RMSprop(params, lr=1e-3, **impl)
    if kind is OptimizerKind.ADAGRAD:
        return torch.optim.Adagrad(params, lr=1e-2, **impl)
    if kind is OptimizerKind.TORCH_ADAFACTOR:
        return torch.optim.Adafactor(params, lr=1e-2, **impl)
    momentum = 0.0 if kind is OptimizerKind.SGD else 0.9
    return torch.optim.SGD(params, lr=1e-3, momentum=momentum, nesterov=kind is OptimizerKind.SGD_NESTEROV, **impl)
