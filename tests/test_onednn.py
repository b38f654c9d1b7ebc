"""oneDNN's matmul scratchpad, asked of oneDNN (tracer/onednn.py), against what the profiler measures when the matmul
runs; and the probe's use of the answer for large matmuls (probe_module.py `SCRATCHPAD_QUERIES`)."""

import pytest
import torch

from vramtrace.tracer import probe as probe_module, probe_cache
from vramtrace.tracer.probe import CpuWorkspaceProbe
from vramtrace.tracer.onednn import matmul_scratchpad_bytes

aten = torch.ops.aten


def _matrix(rows, cols, transposed, dtype=torch.bfloat16, batch=None):
    """A meta (rows, cols) matrix, stored transposed (column-major) when `transposed`; batched when `batch`."""
    lead = () if batch is None else (batch,)
    if transposed:
        return torch.empty(*lead, cols, rows, dtype=dtype, device="meta").transpose(-1, -2)
    return torch.empty(*lead, rows, cols, dtype=dtype, device="meta")


def _measured(func, *args):
    """The workspace of one real run at full size (zeros), as the probe measures it."""
    probe = CpuWorkspaceProbe(reduce_above=1 << 62, reduce_above_flops=1 << 62)
    return probe(func, args, {}, func(*args))[0]


def _onednn_serves_bf16_matmuls() -> bool:
    a = _matrix(256, 128, False)
    return _measured(aten.mm.default, a, _matrix(128, 344, False)) > 0


needs_onednn_bf16 = pytest.mark.skipif(
    not _onednn_serves_bf16_matmuls(),
    reason="ATen runs bf16 matmuls without oneDNN on this CPU (oneDNN's ISA below avx512_core, e.g. "
           "ONEDNN_MAX_CPU_ISA=AVX2): nothing allocated to state")


@needs_onednn_bf16
@pytest.mark.parametrize("op,m,k,n,batch", [
    (aten.mm.default, 256, 128, 344, None), (aten.mm.default, 1000, 256, 128, None),
    (aten.mm.default, 176, 32, 64, None), (aten.mm.default, 64, 176, 32, None),
    (aten.bmm.default, 128, 64, 96, 8),
])
@pytest.mark.parametrize("ta,tb", [(False, False), (False, True), (True, False), (True, True)])
def test_onednn_states_the_scratchpad_the_profiler_measures(op, m, k, n, batch, ta, tb):
    a, b = _matrix(m, k, ta, batch=batch), _matrix(k, n, tb, batch=batch)
    assert matmul_scratchpad_bytes(a, b, op(a, b)) == _measured(op, a, b) > 0


@needs_onednn_bf16
@pytest.mark.parametrize("m,k,n", [(256, 128, 344), (1000, 256, 128), (512, 768, 2304), (64, 176, 32)])
@pytest.mark.parametrize("ta,tb", [(False, False), (False, True), (True, False), (True, True)])
def test_addmm_allocates_the_plain_matmuls_scratchpad(m, k, n, ta, tb):
    """addmm (a Linear with a bias, GPT-2's Conv1D): ATen copies the bias into the output and oneDNN adds the
    product to it (a sum post-op); the scratchpad is the plain matmul's."""
    a, b = _matrix(m, k, ta), _matrix(k, n, tb)
    bias = torch.empty(n, dtype=torch.bfloat16, device="meta")
    assert matmul_scratchpad_bytes(a, b, torch.mm(a, b)) == _measured(aten.addmm.default, bias, a, b) > 0


@needs_onednn_bf16
@pytest.mark.parametrize("op", [aten.mm.default, aten.addmm.default])
def test_a_large_matmul_takes_onednns_answer_where_a_line_through_its_runs_is_wrong(op):
    """(1024, 4096) @ (4096, 1024) bf16 at 1/8, 1/4, 1/2 of each size: 198,272, 263,808, 394,880 B on this
    AVX-512-BF16 CPU, exactly affine, so a line puts it at 657,024 B; the full-size run allocates 3,442,432 B.
    With a bias (addmm) the same."""
    a, b = _matrix(1024, 4096, False), _matrix(4096, 1024, False)
    args = (a, b) if op == aten.mm.default else (torch.empty(1024, dtype=torch.bfloat16, device="meta"), a, b)
    probe = CpuWorkspaceProbe(reduce_above=0)
    assert probe(op, args, {}, op(*args))[0] == _measured(op, *args)
    assert "asked of oneDNN at full size" in probe.extrapolated[str(op)]


@pytest.mark.parametrize("answers", [
    lambda args, kwargs, out: 12_345,  # disagrees with the measured runs
    lambda args, kwargs, out: 0 if out.shape[0] < 1024 else 999,  # agrees only with zeros: no sign of oneDNN
])
def test_an_answer_that_is_not_the_measured_one_is_not_taken(monkeypatch, answers):
    """fp32 matmuls run MKL's sgemm (nothing allocated): the probe keeps its measured line."""
    monkeypatch.setattr(probe_module, "SCRATCHPAD_QUERIES", {aten.mm.default: answers})
    monkeypatch.setattr(probe_module, "PROBED", {})
    monkeypatch.setenv(probe_cache.PROBE_CACHE_ENV, "off")
    a, b = _matrix(1024, 2048, False, torch.float32), _matrix(2048, 1024, True, torch.float32)
    probe = CpuWorkspaceProbe(reduce_above=0)
    assert probe(aten.mm.default, (a, b), {}, torch.mm(a, b))[0] == _measured(aten.mm.default, a, b)
    assert probe.extrapolated["aten.mm.default"].endswith(": affine")


def test_onednn_is_reachable_in_this_torch():
    """The torch wheel CI installs (2.13.0, CPU) keeps libtorch_cpu's symbol table and oneDNN 3 in it: the query
    answers for an fp32 matmul on any x86 CPU (whether ATen sends a matmul to oneDNN is not what this checks)."""
    from vramtrace.tracer import onednn

    assert onednn._library() is not None
    a = _matrix(256, 128, False, torch.float32)
    b = _matrix(128, 344, False, torch.float32)
    assert matmul_scratchpad_bytes(a, b, torch.mm(a, b)) is not None


def test_no_answer_for_what_onednn_is_not_asked():
    a = _matrix(8, 8, False)
    assert matmul_scratchpad_bytes(a, _matrix(8, 8, False, torch.int64), a) is None
    assert matmul_scratchpad_bytes(a.unsqueeze(0).unsqueeze(0), a.unsqueeze(0).unsqueeze(0), a) is None
