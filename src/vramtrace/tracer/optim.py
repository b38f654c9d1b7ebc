"""The optimizer of the step: the real torch.optim class the spec names, on the model's trainable parameters."""

from __future__ import annotations

import torch

from ..spec import Device, OptimizerImpl, OptimizerKind, RunSpec


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
