"""The CPU workspace probe's runs at reduced sizes (tracer/probe.py `CpuWorkspaceProbe`, `at_reduced_sizes`): a large op's
workspace extrapolated from three reduced sizes must equal the one measured at full size, and an op whose
workspace is not affine in the reduced dimension must be measured at full size."""

import pytest
import torch

from vramtrace.tracer.probe import CpuWorkspaceProbe, at_reduced_sizes

aten = torch.ops.aten


def _both(func, args, kwargs=None):
    kwargs = kwargs or {}
    with torch.no_grad():
        out = func(*args, **kwargs)
    full = CpuWorkspaceProbe(reduce_above=1 << 62, reduce_above_flops=1 << 62)
    reduced = CpuWorkspaceProbe(reduce_above=0)
    return full(func, args, kwargs, out)[0], reduced(func, args, kwargs, out)[0], reduced


def test_reduced_tensors_keep_their_dimension_order_and_broadcasts():
    t = torch.empty(2048, 512, device="meta").t()  # (512, 2048), strides (1, 512)
    e = torch.empty(512, 1, device="meta").expand(512, 2048)
    r, re = at_reduced_sizes((t, e), {2048: 128})
    assert r.shape == (512, 128) and r.stride() == (1, 512)
    assert re.shape == (512, 128) and re.stride() == (1, 0)
    assert at_reduced_sizes(([2048, 3],), {2048: 128}) == ([128, 3],)
    assert at_reduced_sizes((torch.empty(4096, device="meta")[::2],), {2048: 128}) is None  # a strided slice: not dense


def test_an_upcast_copy_is_extrapolated_exactly():
    """bf16 + fp32 (the CPU kernel copies the bf16 operand to fp32): the copy is affine in every dimension."""
    a = torch.empty(2, 512, 1024, device="meta", dtype=torch.bfloat16)
    b = torch.empty(2, 512, 1024, device="meta")
    full, extrapolated, probe = _both(aten.add.Tensor, (a, b))
    assert full == extrapolated == 2 * 512 * 1024 * 4
    assert "aten.add.Tensor" in probe.extrapolated


def test_a_workspace_not_affine_in_the_sequence_is_measured_at_full_size(monkeypatch):
    """The CPU flash attention's per-thread buffers follow its block sizes, which step with the sequence length
    (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp): not affine over 128, 256, 512 tokens, the generic cut."""
    from vramtrace.tracer import probe as probe_module

    monkeypatch.setattr(probe_module, "REDUCTION_RULES", {})
    monkeypatch.setattr(probe_module, "PROBED", {})  # no result of the rule from an earlier test
    q = torch.empty(1, 4, 1024, 64, device="meta")
    full, extrapolated, probe = _both(aten._scaled_dot_product_flash_attention_for_cpu.default, (q, q, q),
                                      {"is_causal": True})
    assert full == extrapolated > 0
    assert not probe.extrapolated


@pytest.mark.parametrize("dtype,layout,shape", [
    (torch.bfloat16, "bshd", (2, 8, 2048, 64)),  # transformers' layout: (batch, tokens, heads, dim) transposed
    (torch.float32, "bhsd", (2, 4, 1024, 64)),  # the backward copies a tensor into its layout: grows with the size
    (torch.bfloat16, "bhsd", (1, 16, 1536, 128)),
])
def test_flash_attention_is_extrapolated_within_one_block_size(dtype, layout, shape):
    """The flash-attention rule (`probe.REDUCTION_RULES`) keeps 768 or more tokens, so the block sizes of the
    full run: forward and backward workspaces extrapolated from it equal the ones measured at full size."""
    b, h, s, d = shape
    make = ((lambda: torch.empty(b, s, h, d, dtype=dtype, device="meta").transpose(1, 2)) if layout == "bshd"
            else (lambda: torch.empty(b, h, s, d, dtype=dtype, device="meta")))
    q, k, v = make(), make(), make()
    with torch.no_grad():
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu.default(q, k, v, 0.0, True)
    for func, args in ((aten._scaled_dot_product_flash_attention_for_cpu.default, (q, k, v, 0.0, True)),
                       (aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
                        (torch.empty_like(out), q, k, v, out, lse, 0.0, True))):
        full, extrapolated, probe = _both(func, args)
        assert full == extrapolated > 0
        assert "768 and 1024" in probe.extrapolated[str(func)]


def test_a_step_with_every_large_op_extrapolated_predicts_the_measured_peak(monkeypatch):
    """A tiny Llama at 1024 tokens (the token dimension is cut): the step's peak with every op above 0 bytes run
    at reduced sizes equals the one with every op measured at full size, to the byte."""
    import vramtrace
    from vramtrace.spec import RunSpec
    from vramtrace.tracer import probe as probe_module

    from conftest import FIXTURES

    spec = RunSpec(str(FIXTURES / "tiny-llama-gqa.json"), batch=1, seq=1024, device="cpu", precision="bf16-mixed")
    reports = {}
    for above in (0, 1 << 62):
        monkeypatch.setattr(probe_module, "REDUCE_ABOVE_BYTES", above)
        monkeypatch.setattr(probe_module, "REDUCE_ABOVE_FLOPS", above)
        reports[above] = vramtrace.analyze(spec, levers=False)
    reduced, full = reports[0], reports[1 << 62]
    assert reduced.run.cpu_kernels.extrapolated_workspaces is not None
    assert full.run.cpu_kernels.extrapolated_workspaces is None
    assert reduced.peak_allocated_bytes == full.peak_allocated_bytes


def test_probes_share_their_results_in_the_process(monkeypatch):
    """A second probe (another trace: --compile's eager comparison) finds the first one's result, also with
    another memory limit (each probe reads the memory available when it starts), and its own report lists the
    op's extrapolation; nothing runs again."""
    from vramtrace.tracer import probe as probe_module

    monkeypatch.setattr(probe_module, "PROBED", {})
    a = torch.empty(2, 512, 1024, device="meta", dtype=torch.bfloat16)
    b = torch.empty(2, 512, 1024, device="meta")
    out = aten.add.Tensor(a, b)
    first = CpuWorkspaceProbe(limit_bytes=1 << 40, reduce_above=0)
    measured = first(aten.add.Tensor, (a, b), {}, out)[0]
    runs = []
    monkeypatch.setattr(CpuWorkspaceProbe, "_on_zeros", lambda *args: runs.append(args))
    second = CpuWorkspaceProbe(limit_bytes=1 << 41, reduce_above=0)
    assert second(aten.add.Tensor, (a, b), {}, out)[0] == measured > 0
    assert not runs and second.extrapolated == first.extrapolated != {}


def test_probe_results_on_disk_serve_the_next_process(monkeypatch, tmp_path):
    """What a probe measured is written to the disk cache (one JSON line per signature) and found by a later
    process (here: the in-process tables emptied) without running the kernel, with its output layouts (CPU
    layer norm of bf16 returns bf16 mean and rstd, the meta kernel fp32) and its note; a torn line is skipped."""
    from vramtrace.tracer import probe as probe_module, probe_cache

    monkeypatch.setenv("VRAMTRACE_CPU_PROBE_CACHE", str(tmp_path))
    x = torch.empty(4, 64, 256, device="meta", dtype=torch.bfloat16)
    w = torch.empty(256, device="meta", dtype=torch.bfloat16)
    args = (x, [256], w, w, 1e-5)
    out = aten.native_layer_norm.default(*args)

    def fresh_process():
        monkeypatch.setattr(probe_module, "PROBED", {})
        monkeypatch.setattr(probe_cache, "DISK", {})
        return CpuWorkspaceProbe()

    probe = fresh_process()
    measured, relaid = probe(aten.native_layer_norm.default, args, {}, out)
    assert [t.dtype for t in relaid[1:]] == [torch.bfloat16] * 2 and probe.notes
    files = list(tmp_path.glob("cpu-kernels-*.jsonl"))
    assert len(files) == 1
    with open(files[0], "a") as f:
        f.write('["torn')
    runs = []
    monkeypatch.setattr(CpuWorkspaceProbe, "_on_zeros", lambda *a: runs.append(a))
    again = fresh_process()
    ws, relaid_again = again(aten.native_layer_norm.default, args, {}, out)
    assert not runs and ws == measured and again.notes == probe.notes
    assert [(t.shape, t.stride(), t.dtype) for t in relaid_again] == [(t.shape, t.stride(), t.dtype) for t in relaid]
    monkeypatch.setenv("VRAMTRACE_CPU_PROBE_CACHE", "off")  # off: nothing found, the kernel runs
    fresh_process()(aten.native_layer_norm.default, args, {}, out)
    assert runs


def test_a_process_beside_finds_what_the_other_measured_since(tmp_path):
    """Two processes share the disk cache while both run (`--compile`'s eager comparison in its second process):
    a miss reads the lines written since the last read, and a line still being written is read once whole."""
    from vramtrace.tracer.probe_cache import ProbeDiskCache, Probed

    path = tmp_path / "cpu-kernels-x.jsonl"
    reader, writer = ProbeDiskCache(path), ProbeDiskCache(path)
    key = ("aten.mm.default", 2)
    assert reader.get(key) is None  # nothing yet: the file does not exist
    writer.put(key, Probed(4096, ((0, (2, 3), (3, 1), torch.bfloat16),), note="relaid"))
    assert reader.get(key) == Probed(4096, ((0, (2, 3), (3, 1), torch.bfloat16),), note="relaid")
    other = ("aten.bmm.default", 2)
    ProbeDiskCache(tmp_path / "elsewhere.jsonl").put(other, Probed(8, ()))
    line = (tmp_path / "elsewhere.jsonl").read_text()
    with open(path, "a") as f:
        f.write(line[:10])  # the other process is writing it
    assert reader.get(other) is None
    with open(path, "a") as f:
        f.write(line[10:])
    assert reader.get(other) == Probed(8, ()) and reader.get(key).workspace == 4096


def test_the_probe_disk_cache_is_keyed_by_the_rules_version_and_the_environment(monkeypatch, tmp_path):
    """The cache's file is named by `PROBE_RULES_VERSION` and `cpu_environment()`: the same version and
    environment find the same file (what an earlier process measured); a bumped version or another thread count
    or torch version a new one, so a result measured under other rules or on other kernels is never read."""
    from vramtrace.tracer import probe_cache
    from vramtrace.tracer.probe_cache import ProbeDiskCache, Probed

    monkeypatch.setenv(probe_cache.PROBE_CACHE_ENV, str(tmp_path))
    first = ProbeDiskCache.for_this_machine()
    first.put(("aten.mm.default", 2), Probed(4096, ()))
    assert ProbeDiskCache.for_this_machine().get(("aten.mm.default", 2)) == Probed(4096, ())
    monkeypatch.setattr(probe_cache, "PROBE_RULES_VERSION", probe_cache.PROBE_RULES_VERSION + 1)
    bumped = ProbeDiskCache.for_this_machine()
    assert bumped.path != first.path and bumped.get(("aten.mm.default", 2)) is None
    environment = probe_cache.cpu_environment()
    for changed in ({"threads": environment["threads"] + 1}, {"torch": environment["torch"] + "+other"}):
        monkeypatch.setattr(probe_cache, "cpu_environment", lambda: {**environment, **changed})
        assert ProbeDiskCache.for_this_machine().path not in (first.path, bumped.path)


def test_a_dtensor_op_is_probed_as_the_local_op_each_rank_runs(monkeypatch):
    """A DTensor's shape is the global one; each rank runs the op on its shard (torch.distributed.tensor's
    dispatch). bf16 + fp32 copies the bf16 operand to fp32 on any CPU: a (4, 1024) shard's copy, not (8, 1024)'s.
    An op whose shards do not make its local op (Shard(0) + Shard(1): DTensor redistributes first) is probed as
    given."""
    from torch.distributed.tensor import DTensor, Shard

    from vramtrace.tracer import probe as probe_module, probe_cache
    from vramtrace.tracer.sharding import fake_rank

    monkeypatch.setattr(probe_module, "PROBED", {})
    monkeypatch.setenv(probe_cache.PROBE_CACHE_ENV, "off")
    with fake_rank(2, 0):
        from torch.distributed.device_mesh import DeviceMesh

        mesh = DeviceMesh("meta", torch.arange(2))

        def sharded(dtype, dim):
            return DTensor.from_local(torch.empty(8 // (2 - dim), 1024 // (1 + dim), dtype=dtype, device="meta"),
                                      mesh, [Shard(dim)], run_check=False)

        a, b, out = sharded(torch.bfloat16, 0), sharded(torch.float32, 0), sharded(torch.float32, 0)
        probe = CpuWorkspaceProbe()
        ws, got = probe(aten.add.Tensor, (a, b), {}, out)
        assert got is out and ws == 4 * 1024 * 4
        assert probe_module.dtensor_local_op(aten.add.Tensor, (a, sharded(torch.float32, 1)), {}, out) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_large_convolution_runs_at_full_size(dtype):
    """ResNet-50's last-stage 1x1 convolution, 32 x 1024 x 7 x 7 to 2048 channels: at 1/8, 1/4 and 1/2 of the
    channels oneDNN's workspace lies on a line that misses the full-size one (fp32: 12,845,056 against
    14,811,136 B, measured on AVX-512 and under ONEDNN_MAX_CPU_ISA=AVX2), so it is never extrapolated."""
    x = torch.empty(32, 1024, 7, 7, dtype=dtype, device="meta")
    w = torch.empty(2048, 1024, 1, 1, dtype=dtype, device="meta")
    full, reduced, probe = _both(aten.convolution.default, (x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1))
    assert full == reduced
    assert not probe.extrapolated


def test_op_flops_kept_per_op_and_shapes_are_torchs_flop_counts():
    """`op_flops` keeps a shape-only formula's count per op and shapes: asked again, and for other shapes of the
    same op, it gives what torch.utils.flop_counter's FlopCounterMode counts for the op run on real tensors."""
    from torch.utils.flop_counter import FlopCounterMode

    from vramtrace.tracer.probe import op_flops

    aten = torch.ops.aten
    cases = [(aten.mm.default, (torch.ones(4, 8), torch.ones(8, 16)), {}),
             (aten.mm.default, (torch.ones(4, 8), torch.ones(8, 32)), {}),
             (aten.bmm.default, (torch.ones(2, 4, 8), torch.ones(2, 8, 3)), {}),
             (aten.addmm.default, (torch.ones(16), torch.ones(4, 8), torch.ones(8, 16)), {"beta": 0.5})]
    for _ in range(2):  # the second round from what the first kept
        for op, args, kwargs in cases:
            with FlopCounterMode(display=False) as counter:
                out = op(*args, **kwargs)
            assert op_flops(op, args, kwargs, out) == counter.get_total_flops() > 0
