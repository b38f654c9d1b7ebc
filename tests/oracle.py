"""Ground truth for CPU tests: run the real step on the CPU and read the allocator through torch.profiler.

The truth is the bytes live at step start (every unique storage of parameters, buffers, optimizer state and
inputs) plus the running maximum of the profiler's `[memory]` allocator events of the measured step
(`profile_memory=True`), after one warm-up step. This mirrors a user's training loop exactly.
"""

from __future__ import annotations

import contextlib
import gc

import torch
import transformers

from vramtrace.spec import RunSpec
from vramtrace.tracer.building import build_config, weight_and_compute_dtype
from vramtrace.tracer.checkpointing import apply_checkpointing, layer_stack
from vramtrace.tracer.loading import resolve_config
from vramtrace.tracer.trace import make_optimizer


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        st = t.untyped_storage()
        if st._cdata not in seen:
            seen.add(st._cdata)
            total += st.nbytes()
    return total


def _real_model(spec: RunSpec):
    """(model with random weights on the CPU, int64 input_ids (B, S), autocast dtype or None) for `spec`."""
    config = build_config(resolve_config(spec.model), False)
    param_dtype, compute_dtype = weight_and_compute_dtype(spec.effective_precision)
    torch.manual_seed(0)
    model = getattr(transformers, config.architectures[0])._from_config(config, dtype=param_dtype)
    ids = torch.randint(0, config.vocab_size, (spec.batch, spec.seq), dtype=torch.int64)
    return model, ids, compute_dtype


def _alive_at_start(model, ids, opt) -> list:
    """Tensors alive at the start of a steady-state step: parameters, buffers, the input, optimizer state."""
    alive = list(model.parameters()) + list(model.buffers()) + [ids]
    if opt is not None:
        alive += [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return alive


def measure_cpu_peak(spec: RunSpec, setup=None) -> int:
    """Peak bytes of the steady-state step of `spec` run for real on the CPU (profiler allocator events).

    The model gets `spec.checkpointing` as a user's code applies it, or `setup(model)` when given (e.g. a
    printed plan's snippet)."""
    assert spec.device.value == "cpu"
    model, ids, compute_dtype = _real_model(spec)
    train = spec.mode.value == "train"
    model.train(train)
    if setup is not None:
        setup(model)
    elif train:
        apply_checkpointing(model, spec.checkpointing, None, layer_stack(model))
    opt = make_optimizer(spec, [p for p in model.parameters() if p.requires_grad]) if train else None
    autocast = (lambda: torch.autocast("cpu", dtype=compute_dtype)) if compute_dtype else contextlib.nullcontext

    def step():
        if train:
            with autocast():
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            if opt is not None:
                opt.step()
                opt.zero_grad(set_to_none=True)
            else:
                model.zero_grad(set_to_none=True)
        else:
            with torch.no_grad(), autocast():
                out = model(input_ids=ids)
            del out

    step()  # warm-up: optimizer state created
    gc.collect()
    start = _storage_bytes(_alive_at_start(model, ids, opt))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    cur = peak = 0
    for e in events:
        cur += e.nbytes()
        peak = max(peak, cur)
    return start + peak


class _StorageCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Runtime oracle in the style of test/inductor/test_mem_estimation.py: count live storages of a real run
    through weakref.finalize, independently of vramtrace's recorder."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.cur = self.peak = 0

    def track(self, t):
        import weakref

        st = t.untyped_storage()
        key = st._cdata
        if key in self.live:
            return
        self.live[key] = st.nbytes()
        self.cur += st.nbytes()
        self.peak = max(self.peak, self.cur)
        weakref.finalize(st, self._free, key)

    def _free(self, key):
        self.cur -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.track(t)
        return out


def measure_cpu_dispatch_peak(spec: RunSpec) -> int:
    """Peak bytes of the steady-state step run for real on the CPU, counted by a dispatch-mode storage oracle."""
    model, ids, _ = _real_model(spec)
    opt = make_optimizer(spec, list(model.parameters()))

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    counter = _StorageCounter()
    for t in _alive_at_start(model, ids, opt):
        counter.track(t)
    with counter:
        step()
    return counter.peak
