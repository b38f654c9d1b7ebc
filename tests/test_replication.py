"""Layer replication: tracing 4 layers and rebuilding L must give exactly the records of tracing all L.

Three levels: hand-built records (periodic ones rebuild exactly, a non-periodic one is refused), real models
traced both ways (every timeline equal, step by step), and a replicated prediction against a real CPU run.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import FIXTURES, deep_config
from oracle import measure_cpu_peak
from seam import loaded_model, recording
from tolerance import assert_within
from vramtrace import RunSpec, analyze
from vramtrace.analysis.liveness import build_timeline
from vramtrace.tracer.records import RecOp, RecStorage
from vramtrace.tracer.replication import LayerPlan, NotPeriodic, canonical_frees, replicate_layers
from vramtrace.analysis.storages import storage_table


# -- hand-built records --------------------------------------------------------------------------------------
class _Builder:
    def __init__(self):
        self.ops: list[RecOp] = []
        self.storages: list[RecStorage] = []

    def storage(self, nbytes: int, name: str = "", born: int = -1, category: str | None = None) -> int:
        sid = len(self.storages)
        self.storages.append(RecStorage(sid, nbytes, "float32", (nbytes // 4,), "meta", born, "x", "", "", category,
                                        name))
        return sid

    def op(self, name: str, phase: str, module: str, ins=(), new_bytes=(), frees=()) -> list[int]:
        index = len(self.ops)
        outs = [self.storage(b, born=index) for b in new_bytes]
        self.ops.append(RecOp(index, name, phase, module, tuple(ins), tuple(outs), tuple(frees)))
        return outs

    def free(self, sid: int) -> None:
        """Free `sid` after the last op so far."""
        self.ops[-1].frees = self.ops[-1].frees + (sid,)


def synthetic_step(layers: int, unit: list[int], odd_layer: int | None = None) -> _Builder:
    """A step over `layers` identical layers: per layer a chain of ops allocating `unit` bytes (each output saved
    for the backward), a backward that frees them in reverse, and a for-loop optimizer over one weight per
    layer. `odd_layer` gets one extra op in its forward."""
    b = _Builder()
    weights = [b.storage(64, f"m.layers.{i}.w", category="parameter") for i in range(layers)]
    x = b.op("embed", "forward", "m.embed", new_bytes=[32])[0]
    saved: list[list[int]] = []
    for i in range(layers):
        mine = []
        for nbytes in unit + ([8] if i == odd_layer else []):
            x = b.op("mm", "forward", f"m.layers.{i}.f", ins=(x, weights[i]), new_bytes=[nbytes])[0]
            mine.append(x)
        saved.append(mine)
    g = b.op("loss", "forward", "", ins=(x,), new_bytes=[4])[0]
    grads = {}
    for i in reversed(range(layers)):
        for s in reversed(saved[i]):
            g_new = b.op("mm_backward", "backward", f"m.layers.{i}.f", ins=(g, s), new_bytes=[b.storages[s].nbytes])[0]
            b.free(g)
            b.free(s)
            g = g_new
        grads[i] = b.op("grad", "backward", f"m.layers.{i}.f", ins=(g, weights[i]), new_bytes=[64])[0]
        b.storages[grads[i]].name, b.storages[grads[i]].category = f"m.layers.{i}.w.grad", "gradient"
    b.free(g)
    for i in range(layers):
        tmp = b.op("mul", "optimizer", "optimizer", ins=(grads[i],), new_bytes=[64])[0]
        b.op("add_", "optimizer", "optimizer", ins=(weights[i], tmp))
        b.free(tmp)
        b.free(grads[i])
    return b


def _curve(ops, storages):
    from vramtrace.analysis.categories import Category
    from vramtrace.analysis.storages import StorageInfo

    free_after = {s: o.index for o in ops for s in o.frees}
    infos = [StorageInfo(sid=s.sid, nbytes=s.nbytes, dtype=s.dtype, shape=s.shape, device=s.device,
                         category=Category(s.category or "temporary"), op_index=s.op_index, op=s.op, module=s.module,
                         phase=s.phase, name=s.name, free_after=free_after.get(s.sid), last_use=-1) for s in storages]
    return build_timeline(ops, infos, 0, ("meta",)).live_bytes


def test_canonical_frees_free_interchangeable_storages_first_born_first():
    """Two buffers alike but for their birth, freed last born first (as Inductor's memory planning may in one
    layer and not the next): the canonical record frees the first born first, and every op's bytes are kept. A
    buffer an op reads, or one of another size, keeps its own free."""
    b = _Builder()
    a1, a2 = b.op("alloc", "forward", "m", new_bytes=[16, 16])
    c = b.op("alloc", "forward", "m", new_bytes=[32])[0]
    r1, r2 = b.op("alloc", "forward", "m", new_bytes=[8, 8])
    b.op("read", "forward", "m", ins=(r1,))
    b.free(a2)
    b.free(c)
    b.free(r2)
    b.op("x", "forward", "m")
    b.free(a1)
    b.free(r1)
    ops = canonical_frees(b.ops, b.storages)
    assert ops[3].frees == (a1, c, r2) and ops[4].frees == (a2, r1)
    assert _curve(ops, b.storages) == _curve(b.ops, b.storages)
    b.storages[a2].shape = (2, 2)  # no longer alike: its own free again
    assert canonical_frees(b.ops, b.storages)[3].frees == (a2, c, r2)


@settings(max_examples=30, deadline=None)
@given(layers=st.integers(5, 12), unit=st.lists(st.sampled_from([16, 48, 128, 1000]), min_size=1, max_size=5))
def test_periodic_records_rebuild_exactly(layers, unit):
    traced = synthetic_step(4, unit)
    full = synthetic_step(layers, unit)
    ops, storages, _ = replicate_layers(LayerPlan("m.layers", layers), traced.ops, traced.storages)
    assert [(o.name, o.phase, o.module) for o in ops] == [(o.name, o.phase, o.module) for o in full.ops]
    assert sorted((s.name, s.nbytes) for s in storages) == sorted((s.name, s.nbytes) for s in full.storages)
    assert _curve(ops, storages) == _curve(full.ops, full.storages)


def test_a_layer_unlike_the_others_is_refused():
    traced = synthetic_step(4, [16, 48], odd_layer=2)
    with pytest.raises(NotPeriodic, match="layers 1 and 2"):
        replicate_layers(LayerPlan("m.layers", 8), traced.ops, traced.storages)


def test_a_reference_two_layers_back_is_refused():
    traced = synthetic_step(4, [16, 48])
    skip = next(o for o in traced.ops if o.module == "m.layers.2.f")
    skip.ins = skip.ins + (next(o.outs[0] for o in traced.ops if o.module == "m.layers.0.f"),)
    with pytest.raises(NotPeriodic):
        replicate_layers(LayerPlan("m.layers", 8), traced.ops, traced.storages)


# -- real models, traced both ways ------------------------------------------------------------------------------
VARIANTS = [dict(device="cuda", precision="bf16-mixed"), dict(device="cpu", precision="fp32"),
            dict(device="cuda", precision="fp32", optimizer_impl="for-loop", optimizer="sgd-momentum"),
            dict(device="cpu", precision="bf16", mode="inference"),
            dict(device="cuda", precision="bf16-mixed", checkpointing="layers"),
            dict(device="cpu", precision="fp32", checkpointing="selective"),
            dict(device="cuda", precision="bf16-mixed", loop="script", grad_accum=2, zero_grad="zeros",
                 clip_grad_norm=1.0)]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(map(str, v.values())))
@pytest.mark.parametrize("config", ["tiny-gpt2", "tiny-llama-gqa", "tiny-bert"])
def test_replicated_trace_equals_full_trace(tmp_path, config, variant):
    # 7 layers: 3 rebuilt, next to each other (a rebuilt layer's references into another rebuilt one)
    spec = RunSpec(deep_config(tmp_path, config, 7), batch=2, seq=16, **variant)
    fast, full = recording(spec), recording(dataclasses.replace(spec, replicate_layers=False))
    assert fast.trace_note.startswith("traced 4 of 7 layers"), fast.trace_note
    assert [(o.name, o.phase, o.module) for o in fast.ops] == [(o.name, o.phase, o.module) for o in full.ops]
    assert fast.marks == full.marks
    loop = variant.get("loop", "trainer")
    rows_fast = storage_table(fast.ops, fast.storages, fast.marks, loop)
    rows_full = storage_table(full.ops, full.storages, full.marks, loop)
    key = lambda s: (s.name, s.module, s.op, s.nbytes, s.category, s.op_index, s.free_after, s.last_use)
    assert sorted(map(key, rows_fast)) == sorted(map(key, rows_full))
    assert fast.sdpa_backends == full.sdpa_backends
    block = 512 if spec.device.value == "cuda" else 1
    for step in range(full.steps):
        for optimal in (False, True):
            a = build_timeline(fast.ops, rows_fast, step, fast.counted_devices, block, optimal)
            b = build_timeline(full.ops, rows_full, step, full.counted_devices, block, optimal)
            assert a.live_bytes == b.live_bytes and a.after_bytes == b.after_bytes


def test_alternating_layer_types_trace_every_layer(tmp_path):
    cfg = json.loads((FIXTURES / "tiny-llama-gqa.json").read_text())
    cfg["num_hidden_layers"] = 6
    cfg["layer_types"] = ["full_attention", "sliding_attention"] * 3
    path = tmp_path / "alternating.json"
    path.write_text(json.dumps(cfg))
    spec = RunSpec(str(path), batch=1, seq=8)
    loaded = loaded_model(spec)
    assert loaded.layer_plan is None and "layer_types" in loaded.replication_note


def test_replicated_prediction_matches_profiler(tmp_path):
    spec = RunSpec(deep_config(tmp_path, "tiny-llama-gqa", 5), batch=2, seq=32, device="cpu", precision="fp32")
    report = analyze(spec)
    assert report.run.trace.startswith("traced 4 of 5 layers")
    measured = measure_cpu_peak(spec)
    assert_within(report.peak_allocated_bytes, measured, 0.01)


