"""Ground truth for CPU tests: the real step run on the CPU.

`measure_cpu_peak` is `vramtrace.validate.measure_step`: the bytes live at step start (every unique storage of
parameters, buffers, optimizer state and inputs) plus the running maximum of the profiler's `[memory]`
allocator events of the measured step (`profile_memory=True`), after one warm-up step, as a user's training
loop runs it. `measure_cpu_dispatch_peak` is a second, independent runtime oracle.
"""

from __future__ import annotations

import torch

from vramtrace.spec import RunSpec
from vramtrace.tracer.trace import make_optimizer
from vramtrace.validate import alive_at_start, measure_step, real_model


def measure_cpu_peak(spec: RunSpec, setup=None) -> int:
    """Peak bytes of the steady-state step of `spec` run for real on the CPU (profiler allocator events), as
    `vramtrace validate` measures it. `setup(model)` replaces applying `spec.checkpointing`."""
    assert spec.device.value == "cpu"
    return measure_step(spec, setup).peak_allocated_bytes


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
    loaded = real_model(spec)
    model, inputs = loaded.model, loaded.inputs
    opt = make_optimizer(spec, list(model.parameters()))

    def step():
        loss = model(**inputs).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    counter = _StorageCounter()
    for t in alive_at_start(model, list(inputs.values()), opt):
        counter.track(t)
    with counter:
        step()
    return counter.peak
