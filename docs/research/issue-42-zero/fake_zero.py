"""DeepSpeed's own engine under torch's FakeTensorMode, in ONE process, with torch's fake process group (issue 42).

    DS_ACCELERATOR=cpu /work/venv-ds/bin/python docs/research/issue-42-zero/fake_zero.py [--model llama] [CASE ...]

Rank 0 of a world of 2 (`init_process_group("fake")`: every collective returns at once, its outputs untouched;
DeepSpeed's allocations do not depend on the values). Four patches (below, each names its target and the deepspeed
version read) replace DeepSpeed's reads of tensor values. A storage tracker (a TorchDispatchMode above the
FakeTensorMode: every op output's new storage counted, its free seen by `weakref.finalize` on the storage, as
vramtrace's recorder does) gives the same three levels real_zero.py measures, from before the model is built.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import weakref

import torch
import torch.distributed as tdist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import common  # noqa: E402

DS_VERSION = "0.19.8"
FIRED: dict[str, int] = {}


# -- the four patches (each: target module.attr, deepspeed version read) ----------------------------------------
def _count(name):
    FIRED[name] = FIRED.get(name, 0) + 1


def patch_engine_dont_change_device():
    """deepspeed.runtime.engine.DeepSpeedEngine.__init__ (0.19.8 engine.py:526): `dont_change_device=True`, so
    `_configure_distributed_model` skips `self.module.to(self.device)` (engine.py:2093)."""
    from deepspeed.runtime import engine
    orig = engine.DeepSpeedEngine.__init__

    def init(self, *a, **kw):
        _count("dont_change_device")
        kw["dont_change_device"] = True
        return orig(self, *a, **kw)
    engine.DeepSpeedEngine.__init__ = init


def patch_is_invalid_grad_norm():
    """deepspeed.runtime.utils.is_invalid_grad_norm (0.19.8 utils.py:231, `bool(...any())`: a read of the norm's
    value), imported by name into runtime.zero.stage_1_and_2 and runtime.zero.stage3: a finite norm (no overflow),
    which is what a bf16/fp32 step without inf/nan sees. The ops it runs (isfinite, lt, or, any) still run."""
    from deepspeed.runtime.zero import stage3, stage_1_and_2

    def is_invalid_grad_norm(norm):
        _count("is_invalid_grad_norm")
        if torch.is_tensor(norm):
            (~torch.isfinite(norm) | (norm < 0)).any()
        return False
    stage3.is_invalid_grad_norm = stage_1_and_2.is_invalid_grad_norm = is_invalid_grad_norm


def patch_assert_ints_same_as_other_ranks():
    """deepspeed.runtime.zero.utils.assert_ints_same_as_other_ranks (0.19.8 zero/utils.py:114, `.item()` of an
    all-gathered list: a consistency check between ranks), imported by name into runtime.zero.stage3 (its
    reduce-bucket check, stage3.py:1671): nothing to check with one process. Its tensors are a few int64s."""
    import importlib

    def assert_ints_same_as_other_ranks(ints):
        _count("assert_ints_same_as_other_ranks")
    for name in ("stage3", "partitioned_param_coordinator", "partition_parameters"):  # each imports it by name
        # (partitioned_param_coordinator.py:260-267 `reset_step`: the trace order checked at every step end)
        module = importlib.import_module(f"deepspeed.runtime.zero.{name}")
        if hasattr(module, "assert_ints_same_as_other_ranks"):
            module.assert_ints_same_as_other_ranks = assert_ints_same_as_other_ranks


def patch_cpu_offload_grad_norm():
    """deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3.complete_grad_norm_calculation_for_cpu_offload
    (0.19.8 stage3.py:1975): the same code with `total_norm` summed as a tensor, the `float(total_norm)` of
    stage3.py:1989 replaced by a copy into the same one-element FloatTensor it allocates."""
    from deepspeed.runtime.zero import stage3
    from deepspeed.runtime.utils import is_model_parallel_parameter, mask_nan_or_inf_with_val_inplace
    import deepspeed.comm as dist

    def complete(self, params):
        _count("complete_grad_norm_calculation_for_cpu_offload")
        process_group = self._get_param_partition_group(params[0])
        counts_every_rank = self._grad_norm_counts_every_rank(params, process_group)
        total_norm = 0.0
        for p in params:
            if counts_every_rank or is_model_parallel_parameter(p) or (self.model_parallel_rank == 0):
                param_id = self.get_param_id(p)
                if param_id in self.norm_for_param_grads.keys():
                    total_norm += self.norm_for_param_grads[param_id]**2
        total_norm_cuda = torch.empty(1, dtype=torch.float)  # FloatTensor([float(total_norm)])
        total_norm_cuda.copy_(torch.as_tensor(total_norm).reshape(1)) if torch.is_tensor(total_norm) else None
        dist.all_reduce(total_norm_cuda, op=dist.ReduceOp.SUM, group=process_group)
        total_norm = total_norm_cuda[0]**(1. / 2.0)
        mask_nan_or_inf_with_val_inplace(total_norm, device=total_norm.device)
        return total_norm.cpu()
    stage3.DeepSpeedZeroOptimizer_Stage3.complete_grad_norm_calculation_for_cpu_offload = complete


def patch_no_shm_comm():
    """deepspeed.comm.torch.build_shm_op (0.19.8 comm/torch.py:207, `TorchBackend.__init__`): None. Its
    `shm_comm_op.initialize(world_size, rank)` (torch.py:220) waits on shared memory for the other ranks' processes,
    which one process with a fake group never has (it hangs). The op only serves `inference_all_reduce`."""
    import importlib
    ds_torch = importlib.import_module("deepspeed.comm.torch")  # `deepspeed.comm.torch` the attribute is torch

    def build_shm_op():
        _count("build_shm_op")
        return None
    ds_torch.build_shm_op = build_shm_op


def patch_zero12_has_overflow():
    """deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer.has_overflow (0.19.8 stage_1_and_2.py:3237,
    `overflow_gpu[0].item()` at :3248), called by `check_overflow` in every bf16 step (stage_1_and_2.py:3030): the
    same ops (the partitioned grads' inf/nan check, its `byte()`, the all-reduce), the value read replaced by
    False (no overflow)."""
    from deepspeed.runtime.zero import stage_1_and_2
    import deepspeed.comm as dist

    def has_overflow(self, partition_gradients=True):
        _count("zero12_has_overflow")
        if self.cpu_offload:
            overflow_gpu = torch.empty(1, dtype=torch.uint8)  # ByteTensor([self.local_overflow])
        else:
            overflow_gpu = self.has_overflow_partitioned_grads_serial().byte()
        dist.all_reduce(overflow_gpu, op=dist.ReduceOp.MAX, group=self.dp_process_group)
        self._model_parallel_all_reduce(tensor=overflow_gpu, op=dist.ReduceOp.MAX)
        overflow_gpu[0]
        return False
    stage_1_and_2.DeepSpeedZeroOptimizer.has_overflow = has_overflow


PATCHES = (patch_zero12_has_overflow, patch_no_shm_comm, patch_engine_dont_change_device, patch_is_invalid_grad_norm, patch_assert_ints_same_as_other_ranks,
           patch_cpu_offload_grad_norm)


# -- the storage tracker --------------------------------------------------------------------------------------
class StorageTracker(TorchDispatchMode):
    """Bytes of the storages alive that ops made while it was on (`level`), with the highest level (`peak`)."""

    def __init__(self):
        super().__init__()
        self.live: dict = {}
        self.level = self.peak = 0
        self.finalizers = []

    def _free(self, key, nbytes):
        if self.live.pop(key, None) is not None:
            self.level -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            # a meta-device tensor (DeepSpeed/transformers make meta copies of parameters) costs nothing for real
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                st = t.untyped_storage()
                key = StorageWeakRef(st)
                if key not in self.live:
                    n = st.nbytes()
                    self.live[key] = n
                    self.level += n
                    self.finalizers.append(weakref.finalize(st, self._free, key, n))
        self.peak = max(self.peak, self.level)
        return out


def run(model_name, case, world=2):
    stage, precision, bucket, offload = case
    tracker = StorageTracker()
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    import deepspeed
    with fake, tracker:
        model = common.build_model(model_name)
        ids, labels = common.inputs(model.config.vocab_size)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=common.ds_config(stage, precision, bucket, offload, world))
        del model
        common.step(engine, ids, labels)  # warm-up
        start = tracker.level
        tracker.peak = start
        common.step(engine, ids, labels)
        peak, end = tracker.peak, tracker.level
    return {"rank": 0, "start": start, "peak": peak, "increase": peak - start, "end": end}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama", choices=sorted(common.MODELS))
    ap.add_argument("cases", nargs="*")
    a = ap.parse_args()
    common.set_env(0, 2, 29600)
    from torch.testing._internal.distributed.fake_pg import FakeStore
    tdist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    import deepspeed  # noqa: F401
    for p in PATCHES:
        p()
    for case in common.CASES:
        name = common.case_name(*case)
        if a.cases and name not in a.cases:
            continue
        FIRED.clear()
        try:
            res = run(a.model, case)
            print(json.dumps({"model": a.model, "case": name, "ranks": [res], "patches": dict(FIRED)}), flush=True)
        except Exception as e:  # a research probe: record and go on
            import traceback
            traceback.print_exc()
            print(json.dumps({"model": a.model, "case": name, "error": f"{type(e).__name__}: {e}"[:500]}), flush=True)


if __name__ == "__main__":
    main()
