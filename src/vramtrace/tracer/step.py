"""The step the user runs, written once: used by the trace (on meta, recorded) and by `vramtrace validate` (for
real, measured). Monkey-patches and recording live elsewhere (`bridges.py`, `recorder.py`); this module only
runs the loop and tells a `StepObserver` where it is.

One optimizer step of `grad_accum` = N micro-steps, each the literal code of its loop (`spec.Loop`):

    # trainer: a function per micro-step; its outputs released when the loss is taken
    with autocast:
        loss = loss_of(model(**batch))
    if N > 1: loss = loss / N
    (scaler.scale(loss) if scaler else loss).backward()

    # function: def train_step(batch, sync): the same with `outputs = model(**batch)` kept in a local, and the
    # optimizer step inside the function on the last micro-step: outputs live until it returns

    # script: `outputs` and `loss` are the loop's variables, rebound each micro-step: micro-step k's outputs
    # live until micro-step k+1's forward has returned, also across optimizer steps

then, after the last micro-step's backward (`optimizer_step`):

    if clip is not None:
        if scaler: scaler.unscale_(optimizer)              # torch's AMP recipe: unscale before clipping
        torch.nn.utils.clip_grad_norm_(params, clip)        # foreach=None: torch picks (foreach on CUDA and CPU)
    if scaler: scaler.step(optimizer); scaler.update()
    else: optimizer.step()
    optimizer.zero_grad(set_to_none=(zero_grad == "none"))

A user step function (`--step file.py:FUNC`) is called as `FUNC(model, batch, optimizer)` once per step.

Inference is one `no_grad` forward (`run_inference`); a generation is transformers' `model.generate()` as a user
calls it for exactly N greedy tokens (`run_generation`).

`literal=True` (a real run) holds each loop's references as its code does. The trace runs with
`literal=False`: it releases `outputs` as the trainer loop does and reports, through the observer, the
storages each loop would hold and where it would release them (`MicroMarks`), so that one recording gives the
peak of every loop (`analysis/storages.py`); tests check this against literal real runs and against the
literal script loop given as a `--step` function.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

from ..errors import UsageError
from ..custom_inputs import custom_ref
from ..spec import CacheKind, KvDtype, Loop, RunSpec, ZeroGrad
from .records import Phase

STEPS = 2  # the first step (optimizer state created lazily) and the steady state


class StepObserver(Protocol):
    """Told where the runner is. A real run's observer keeps the phase for error messages; the trace's records
    phases and the loops' references."""

    def begin(self, step: int, micro: int) -> None: ...

    def phase(self, phase: Phase) -> None: ...

    def forward_returned(self, outputs: Any) -> None: ...

    def loss_taken(self) -> None: ...

    def loss_held(self, loss: torch.Tensor) -> None: ...

    def backward_returned(self) -> None: ...

    def body_end(self) -> None: ...

    def replay(self, step: int, micro: int) -> bool:
        """Reproduce this micro-step's forward and backward from the record of the same micro-step of an earlier
        step instead of running them, leaving each parameter's `.grad` as running them would; True when it did.
        A real run never replays; the trace does when the two would record the same ops (`trace._TraceObserver`)."""
        ...


class QuietObserver:
    """An observer that only remembers where the step is (`step`, `micro`, `phase`), for error messages."""

    def __init__(self):
        self.step, self.micro, self.phase_now = 0, 0, Phase.FORWARD

    def begin(self, step: int, micro: int) -> None:
        self.step, self.micro = step, micro

    def phase(self, phase: Phase) -> None:
        self.phase_now = phase

    def forward_returned(self, outputs: Any) -> None:
        pass

    def loss_taken(self) -> None:
        pass

    def loss_held(self, loss: torch.Tensor) -> None:
        pass

    def backward_returned(self) -> None:
        pass

    def body_end(self) -> None:
        pass

    def replay(self, step: int, micro: int) -> bool:
        return False


@dataclass
class StepContext:
    """What one step needs. `args`/`kwargs`: the model's inputs (the same tensors every micro-step);
    `loss_of(outputs) -> 0-d tensor`; `autocast() -> context manager` (mixed precision, else a null context);
    `scaler`: a `torch.amp.GradScaler` for fp16-mixed, else None; `user_step`: a `--step` function."""

    model: torch.nn.Module
    args: tuple
    kwargs: dict
    loss_of: Callable[[Any], torch.Tensor]
    optimizer: torch.optim.Optimizer | None
    autocast: Callable[[], contextlib.AbstractContextManager]
    scaler: Any = None
    user_step: Callable | None = None
    held: dict = field(default_factory=dict)  # the script loop's variables, across steps
    sample: Callable[[Any], None] | None = None  # inference: what runs on the outputs after the forward

    @property
    def batch(self):
        """What a `--step` function receives: the inputs dict, or the tuple of positional inputs."""
        return self.kwargs if self.kwargs or not self.args else self.args


def run_training(ctx: StepContext, spec: RunSpec, obs: StepObserver, *, literal: bool, steps: int = STEPS) -> None:
    """Run `steps` optimizer steps of `spec`'s loop (or its `--step` function) on `ctx`, telling `obs`."""
    for k in range(steps):
        if ctx.user_step is not None:
            obs.begin(k, 0)
            obs.phase(Phase.STEP)
            ctx.user_step(ctx.model, ctx.batch, ctx.optimizer)
            continue
        for m in range(spec.grad_accum):
            obs.begin(k, m)
            sync = m == spec.grad_accum - 1
            if literal and spec.loop is Loop.FUNCTION:
                _function_micro_step(ctx, spec, obs, sync)
                continue
            if not obs.replay(k, m):
                _micro_step(ctx, spec, obs, literal)
            if sync:
                optimizer_step(ctx, spec, obs)
            obs.body_end()


def _micro_step(ctx: StepContext, spec: RunSpec, obs: StepObserver, literal: bool) -> None:
    """One micro-step of the trainer loop (or of the script loop when `literal`): forward, loss, backward."""
    obs.phase(Phase.FORWARD)
    with ctx.autocast():
        outputs = ctx.model(*ctx.args, **ctx.kwargs)
        obs.forward_returned(outputs)
        if literal and spec.loop is Loop.SCRIPT:
            ctx.held["outputs"] = outputs
        loss = ctx.loss_of(outputs)
    del outputs  # the trainer loop's output object dies when the loss has been taken
    obs.loss_taken()
    script = literal and spec.loop is Loop.SCRIPT
    if script:
        ctx.held["loss"] = loss  # `loss = outputs.loss` rebinds the previous micro-step's loss
    loss = _divided(loss, spec, obs)
    if script:
        ctx.held["loss"] = loss
    _backward(ctx, loss, obs)
    obs.backward_returned()


def _function_micro_step(ctx: StepContext, spec: RunSpec, obs: StepObserver, sync: bool) -> None:
    """`def train_step(batch)`: `outputs` and `loss` are locals, alive until it returns."""
    obs.phase(Phase.FORWARD)
    with ctx.autocast():
        outputs = ctx.model(*ctx.args, **ctx.kwargs)
        obs.forward_returned(outputs)
        loss = ctx.loss_of(outputs)
    obs.loss_taken()
    loss = _divided(loss, spec, obs)
    _backward(ctx, loss, obs)
    obs.backward_returned()
    if sync:
        optimizer_step(ctx, spec, obs)
    obs.body_end()
    del outputs, loss


def _divided(loss: torch.Tensor, spec: RunSpec, obs: StepObserver) -> torch.Tensor:
    """`loss / N` under gradient accumulation (HF Trainer's training_step); the loop's `loss` variable."""
    if spec.grad_accum > 1:
        loss = loss / spec.grad_accum
    obs.loss_held(loss)
    return loss


def _backward(ctx: StepContext, loss: torch.Tensor, obs: StepObserver) -> None:
    obs.phase(Phase.BACKWARD)
    (ctx.scaler.scale(loss) if ctx.scaler is not None else loss).backward()


def optimizer_step(ctx: StepContext, spec: RunSpec, obs: StepObserver) -> None:
    """Clip, step and zero the gradients, as the module docstring writes it."""
    opt, scaler = ctx.optimizer, ctx.scaler
    if spec.clip_grad_norm is not None:
        obs.phase(Phase.CLIP)
        if scaler is not None and opt is not None:
            scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_([p for p in ctx.model.parameters() if p.requires_grad], spec.clip_grad_norm)
    obs.phase(Phase.OPTIMIZER)
    if opt is not None:
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
    obs.phase(Phase.ZERO_GRAD)
    (opt if opt is not None else ctx.model).zero_grad(set_to_none=spec.zero_grad is ZeroGrad.NONE)


def run_inference(ctx: StepContext, obs: StepObserver) -> None:
    """One forward under `torch.no_grad()` (and autocast), then `ctx.sample(outputs)` if given (a serving
    profile run's dummy sampler, `tracer/serving.py`); the output is dropped."""
    obs.begin(0, 0)
    obs.phase(Phase.FORWARD)
    with torch.no_grad(), ctx.autocast():
        out = ctx.model(*ctx.args, **ctx.kwargs)
        if ctx.sample is not None:
            ctx.sample(out)
    del out


def run_generation(ctx: StepContext, spec: RunSpec, obs: StepObserver) -> None:
    """What a user's `model.generate(**inputs, max_new_tokens=N, min_new_tokens=N, do_sample=False,
    cache_implementation=..., cache_config=...)` does (greedy, exactly N new tokens: the EOS score is masked until
    then), under autocast; the generated ids are dropped. transformers' generate runs under `torch.no_grad()`
    (generation/utils.py `GenerationMixin.generate`). Each call of the model's forward is one micro-step for the
    observer: micro 0 the prefill over the prompt, micro k decode step k (k = 1..N-1); `obs.forward_returned`
    sees each forward's outputs (the cache among them)."""
    calls = [0]

    def before(module, args, kwargs):
        if calls[0]:  # the prefill's micro-step began with generate()
            obs.begin(0, calls[0])
            obs.phase(Phase.FORWARD)

    def after(module, args, kwargs, out):
        calls[0] += 1
        obs.forward_returned(out)

    hooks = [ctx.model.register_forward_pre_hook(before, with_kwargs=True),
             ctx.model.register_forward_hook(after, with_kwargs=True)]
    # None: transformers' default, a DynamicCache; "quantized" with the fp8 backend: a QuantizedCache
    # (transformers/generation/utils.py `GenerationMixin._prepare_cache_for_generation`)
    cache, cache_config = "static" if spec.cache is CacheKind.STATIC else None, None
    if spec.kv_dtype is KvDtype.FP8:
        cache, cache_config = "quantized", {"backend": "fp8"}
    obs.begin(0, 0)  # what generate does before the first forward belongs to the prefill
    obs.phase(Phase.FORWARD)
    try:
        with ctx.autocast():
            out = ctx.model.generate(*ctx.args, **ctx.kwargs, max_new_tokens=spec.new_tokens,
                                     min_new_tokens=spec.new_tokens, do_sample=False, cache_implementation=cache,
                                     cache_config=cache_config)
        del out
    finally:
        for h in hooks:
            h.remove()


def load_user_step(ref: str) -> Callable:
    """The function `FUNC` of `path/to/file.py:FUNC`, from a fresh import of the file (`custom.import_target`: its
    module globals, e.g. an EMA copy, start empty). Raises UsageError for a bad reference or a missing function,
    ModelLoadError when the file is missing or fails to import."""
    from .custom import import_target

    target = custom_ref(ref)
    if target is None or not target[0].endswith(".py"):
        raise UsageError(f"bad --step {ref!r}; use path/to/file.py:FUNC")
    if not os.path.isfile(target[0]):
        raise UsageError(f"--step file {target[0]} does not exist; pass path/to/file.py:FUNC")
    fn = getattr(import_target(target[0], fresh=True), target[1], None)
    if not callable(fn):
        raise UsageError(f"--step file {target[0]} has no function {target[1]!r}")
    return fn
