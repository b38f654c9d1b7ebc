"""Pipeline parallelism (`--pp`, tracer/pipelining.py) without the real gloo oracle: the split rules, the stage
classes, the options' checks, the bridges, the report entry, and one pipeline against the stored real run of
docs/research/issue-42-pp (real_pp.py: one gloo process per stage, measured with the profiler; the live oracle's
comparisons are tests/test_pipelining.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import FIXTURES, deep_config, run_cli
from vramtrace import RunSpec, analyze
from vramtrace.errors import UsageError
from vramtrace.spec import PipelineSchedule
from vramtrace.units import format_bytes
from vramtrace.tracer.pipelining import distinct_stages, even_split, rank_stages, stage_split

LLAMA = str(FIXTURES / "tiny-llama-gqa.json")
REAL = Path(__file__).resolve().parent.parent / "docs" / "research" / "issue-42-pp" / "results"


@pytest.mark.parametrize("layers,stages,split", [
    (4, 2, (2, 2)), (5, 2, (3, 2)), (5, 3, (2, 2, 1)), (2, 3, (1, 1, 0)), (80, 8, (10,) * 8)])
def test_the_even_split_puts_the_remainder_on_the_earliest_stages(layers, stages, split):
    assert even_split(layers, stages) == split


def test_a_given_split_must_add_up_to_the_layers():
    spec = RunSpec(LLAMA, batch=4, seq=8, device="cpu", pp=2, pp_split="3,1")
    assert stage_split(spec, 4) == (3, 1)
    with pytest.raises(UsageError, match="--pp-split 3,1 gives 4 decoder layers; the model has 2"):
        stage_split(spec, 2)


@pytest.mark.parametrize("split,schedule,m,classes", [
    ((1, 1, 1, 1), PipelineSchedule.GPIPE, 4, [(0,), (1, 2), (3,)]),
    ((2, 1, 1, 2, 2), PipelineSchedule.GPIPE, 5, [(0,), (1, 2), (3,), (4,)]),
    ((3, 0, 1), PipelineSchedule.GPIPE, 4, [(0,), (1,), (2,)]),
    # 1F1B: stage k warms up min(M, P - k) forwards, so no two stages run the same program
    ((1, 1, 1, 1), PipelineSchedule.ONE_F_ONE_B, 8, [(0,), (1,), (2,), (3,)]),
    # interleaved-1f1b over 2 ranks of 2 stages: grouped by rank, each alone (its own warm-up count)
    ((1, 1, 1, 1), PipelineSchedule.INTERLEAVED_1F1B, 4, [(0,), (1,)]),
    ((1, 1, 1, 1), PipelineSchedule.ZERO_BUBBLE, 4, [(0,), (1,)]),
])
def test_stages_that_run_the_same_program_are_traced_once(split, schedule, m, classes):
    assert distinct_stages(split, schedule, m, 2) == classes


def test_interleaved_stages_are_placed_in_a_loop_and_split_over_p_times_v():
    """Rank r of P holds stages r, r + P, ... (ScheduleInterleaved1F1B's placement); the even split is over the
    P × V stages, V = 2 when not given."""
    assert [rank_stages(r, 3, 2) for r in range(3)] == [(0, 3), (1, 4), (2, 5)]
    spec = RunSpec(LLAMA, batch=4, seq=8, device="cpu", pp=2, pp_schedule="interleaved-1f1b")
    assert spec.pp_virtual_stages == 2
    assert stage_split(spec, 5) == (2, 1, 1, 1)
    spec3 = RunSpec(LLAMA, batch=4, seq=8, device="cpu", pp=2, pp_schedule="interleaved-1f1b", virtual_stages=3)
    assert stage_split(spec3, 6) == (1,) * 6


@pytest.mark.parametrize("kwargs,message", [
    ({"pp": 1}, "pp must be an integer of at least 2"),
    ({"pp": 2, "batch": 3}, "batch 3 does not split into 2 equal micro-batches"),
    ({"pp": 2, "micro_batches": 3}, "batch 4 does not split into 3 equal micro-batches"),
    ({"pp": 4, "pp_schedule": "1f1b", "micro_batches": 2, "batch": 4}, "1f1b needs at least as many micro-batches"),
    ({"pp": 2, "pp_split": "1,1,1"}, "pp_split 1,1,1 names 3 stages; pp is 2"),
    ({"pp": 2, "pp_split": "2,-1"}, "bad pp_split"),
    ({"pp": 2, "pp_split": "a,b"}, "bad pp_split"),
    ({"pp": 2, "stage": 2}, "stage must be in 0..1 for 2 stages"),
    ({"pp": 2, "pp_schedule": "dualpipe"}, "unknown pp_schedule 'dualpipe'"),
    ({"pp": 2, "virtual_stages": 2}, "virtual_stages applies to pp_schedule interleaved-1f1b .* drop virtual_stag"),
    ({"pp": 2, "pp_schedule": "gpipe", "virtual_stages": 2}, "gpipe runs one stage per rank"),
    # torch's schedules with one stage per rank are not 1f1b (more warm-up forwards; zero-bubble's split backward)
    ({"pp": 2, "pp_schedule": "interleaved-1f1b", "virtual_stages": 1}, r"virtual_stages 1 under pp_schedule "
     r"interleaved-1f1b is not modelled \(.*2\(P-1-r\)\+1 forwards.*\); give virtual_stages 2 or more$"),
    ({"pp": 2, "pp_schedule": "zero-bubble", "virtual_stages": 1}, r"virtual_stages 1 under pp_schedule "
     r"zero-bubble is not modelled \(.*input- and weight-gradient steps\); give virtual_stages 2 or more$"),
    ({"pp": 2, "pp_schedule": "interleaved-1f1b", "virtual_stages": 1, "pp_split": "1,1,1,1"}, "virtual_stages 1 "
                                                                                                  "under"),
    # without pp, V = 1 is an option that applies to pp P, as any V
    ({"virtual_stages": 1}, "^virtual_stages applies to pp P"),
    ({"pp": 2, "virtual_stages": 1}, "1f1b runs one stage per rank: drop virtual_stages"),
    ({"pp": 2, "pp_schedule": "interleaved-1f1b", "virtual_stages": 0}, "virtual_stages must be an integer of "
                                                                         "at least 2"),
    # the split names the P × V stages under interleaved-1f1b (V = 2 by default)
    ({"pp": 2, "pp_schedule": "interleaved-1f1b", "pp_split": "1,1"}, r"names 2 stages; pp 2 × virtual_stages 2 "
                                                                        r"make 4"),
    ({"pp": 2, "pp_schedule": "interleaved-1f1b", "virtual_stages": 3, "pp_split": "1,1,1,1"}, "make 6"),
    ({"pp": 2, "pp_schedule": "interleaved-1f1b", "stage": 2}, r"stage must be in 0..1 for 2 ranks \(stage K is "
                                                                r"rank K under interleaved-1f1b\)"),
    ({"pp": 2, "pp_schedule": "zero-bubble", "stage": 3}, r"for 2 ranks \(stage K is rank K under zero-bubble\)"),
    ({"pp": 2, "pp_schedule": "zero-bubble", "pp_split": "2,2"}, r"names 2 stages; pp 2 × virtual_stages 2 make 4"),
    # ScheduleInterleaved1F1B runs max(1, M // P) rounds and needs M a multiple of them: M = 5 over P = 2 is 2
    # rounds; M = 3 over P = 2 is one round, allowed (tests below); M = 6 over P = 2 is 3 rounds, allowed
    ({"pp": 2, "pp_schedule": "interleaved-1f1b", "micro_batches": 5, "batch": 10}, "5 is not a multiple of 2"),
    ({"pp": 4, "pp_schedule": "interleaved-1f1b", "micro_batches": 9, "batch": 9}, "9 is not a multiple of 2"),
    # the advice names M torch takes: M = 7 over P = 2 is 3 rounds; 6 and 8 are taken (9, a multiple of 3, is not)
    ({"pp": 2, "pp_schedule": "zero-bubble", "micro_batches": 7, "batch": 14}, r"7 is not a multiple of 3; use a "
     r"multiple of pp 2 or fewer than 4 \(the nearest accepted: 6 or 8\)$"),
    ({"pp": 4, "pp_schedule": "interleaved-1f1b", "micro_batches": 9, "batch": 9}, r"\(the nearest accepted: 8 or "
                                                                                    r"10\)$"),
    ({"micro_batches": 4, "virtual_stages": 2}, "micro_batches, virtual_stages apply to pp P"),
    ({"micro_batches": 4}, "micro_batches applies to pp P"),
    ({"stage": 0, "pp_split": "1,1"}, "pp_split, stage apply to pp P"),
    ({"pp": 2, "fsdp": 2}, "pp with fsdp is not supported yet"),
    # a PeftModel has no `.model.layers` to cut: refused here, not later as "PeftModel is not modelled yet"
    ({"pp": 2, "lora_rank": 8}, "pp with lora_rank is not supported yet"),
    ({"pp": 2, "recipe": "axolotl"}, "pp with recipe is not supported yet"),
    ({"pp": 2, "quantization": "nf4"}, "pp with quantization is not supported yet"),
    ({"pp": 2, "mode": "inference"}, "pp traces a training step"),
    ({"pp": 2, "grad_accum": 2}, "grad_accum is not supported yet"),
    ({"pp": 2, "loop": "script"}, "pp runs the schedule.s own loop .* loop script does not apply to it: drop loop"),
    ({"pp": 2, "precision": "fp16-mixed"}, "fp16 .* is not modelled yet"),
])
def test_bad_pipeline_options_are_usage_errors(kwargs, message):
    with pytest.raises(UsageError, match=message):
        RunSpec(LLAMA, **{"batch": 4, "seq": 8, "device": "cpu", **kwargs})


def _interleaved_schedule_builds(schedule: str, pp: int, m: int) -> bool:
    """Whether torch's own ScheduleInterleaved1F1B / ScheduleInterleavedZeroBubble takes M micro-batches over P
    ranks of 2 stages (rank 0's stages 0 and P, on torch's fake process group)."""
    import torch.distributed as dist
    from torch.distributed.pipelining import (PipelineStage, ScheduleInterleaved1F1B,
                                              ScheduleInterleavedZeroBubble)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    cls = {"interleaved-1f1b": ScheduleInterleaved1F1B, "zero-bubble": ScheduleInterleavedZeroBubble}[schedule]
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=pp)
    try:
        stages = [PipelineStage(torch.nn.Linear(2, 2), k, 2 * pp, torch.device("cpu")) for k in (0, pp)]
        cls(stages, n_microbatches=m)
        return True
    except ValueError:
        return False
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zero-bubble"])
@pytest.mark.parametrize("pp", [2, 3, 4])
def test_interleaved_micro_batch_counts_are_refused_exactly_where_torch_refuses_them(pp, schedule):
    """--micro-batches M under interleaved-1f1b and zero-bubble is a usage error for exactly the M (1..12) torch's
    schedule raises on when built (M not a multiple of max(1, M // P) rounds)."""
    def accepted(m):
        try:
            RunSpec(LLAMA, batch=m, seq=8, device="cpu", pp=pp, pp_schedule=schedule, micro_batches=m)
            return True
        except UsageError:
            return False
    ms = range(1, 13)
    refused = [m for m in ms if not accepted(m)]
    assert refused == [m for m in ms if not _interleaved_schedule_builds(schedule, pp, m)]
    assert refused  # some M is refused for each P here (e.g. 2 rounds of an odd M)


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_the_micro_batch_counts_a_refusal_suggests_are_accepted(pp):
    """The refusal of a --micro-batches M under interleaved-1f1b names the nearest M below and above it that torch's
    schedule builds with (not a multiple of M's own rounds, which may be refused again: M = 7, P = 2 -> 9)."""
    import re

    for m in range(2 * pp, 6 * pp):
        try:
            RunSpec(LLAMA, batch=m, seq=8, device="cpu", pp=pp, pp_schedule="interleaved-1f1b", micro_batches=m)
        except UsageError as e:
            below, above = map(int, re.search(r"nearest accepted: (\d+) or (\d+)\)$", str(e)).groups())
            assert below < m < above
            assert _interleaved_schedule_builds("interleaved-1f1b", pp, below)
            assert _interleaved_schedule_builds("interleaved-1f1b", pp, above)
            assert not any(_interleaved_schedule_builds("interleaved-1f1b", pp, n) for n in range(below + 1, above))


def _forwards_before_first_backward(cls, pp: int, m: int, rank: int) -> int:
    """How many forwards torch's schedule `cls` (one stage per rank, the fake process group) runs on `rank` of `pp`
    before its first backward, read from its own `pipeline_order`."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=pp)
    try:
        sched = cls([PipelineStage(torch.nn.Linear(2, 2), rank, pp, torch.device("cpu"))], n_microbatches=m)
        kinds = [a.computation_type.name for a in sched.pipeline_order[rank] if a is not None]
        return kinds.index(next(k for k in kinds if k != "FORWARD"))
    finally:
        dist.destroy_process_group()


def test_one_virtual_stage_is_refused_because_torchs_interleaved_schedule_is_not_1f1b():
    """The reason `--virtual-stages 1` gives: torch's ScheduleInterleaved1F1B with one stage per rank runs
    2 (P - 1 - r) + 1 forwards on rank r before its first backward (P = 4, M = 8: 7 on rank 0), not 1F1B's P - r,
    so 1f1b's trace is no stand-in for it."""
    from torch.distributed.pipelining import ScheduleInterleaved1F1B

    counts = [_forwards_before_first_backward(ScheduleInterleaved1F1B, 4, 8, r) for r in range(4)]
    assert counts == [2 * (4 - 1 - r) + 1 for r in range(4)] == [7, 5, 3, 1]
    assert counts[:3] != [4 - r for r in range(3)]


def test_the_cli_words_a_bad_pipeline_option_as_its_flag(capsys):
    r = run_cli(capsys, LLAMA, "--batch", "6", "--seq", "8", "--device", "cpu", "--pp", "4", "--pp-schedule", "gpipe")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "Error: --batch 6 does not split into 4 equal micro-batches (--micro-batches defaults to --pp); make "
        "--batch a multiple of 4"]


def test_the_pipeline_bridges_patch_their_targets_and_restore_them_after_an_error():
    from torch.distributed.pipelining import schedules, stage

    from vramtrace import feature_bridges

    targets = [(schedules, "_batch_p2p"), (schedules, "_sorted_batch_p2p"),
               (schedules._PipelineSchedule, "_warmup_p2p"), (stage._PipelineStageBase, "forward_one_chunk"),
               (stage._PipelineStageBase, "backward_one_chunk")]
    before = [getattr(o, n) for o, n in targets]
    with pytest.raises(KeyError, match="inside"):
        with feature_bridges.pipelining_on_meta(print, print):
            assert all(getattr(o, n) is not b for (o, n), b in zip(targets, before))
            raise KeyError("inside")
    assert all(getattr(o, n) is b for (o, n), b in zip(targets, before))


def test_the_stand_in_work_holds_what_it_sent():
    """gloo's Work keeps its tensor until it is dropped (the doc's 1F1B stage-0 mismatch without this)."""
    import torch.distributed as dist

    from torch.distributed.pipelining import schedules

    from vramtrace import feature_bridges
    from vramtrace.tracer.sharding import fake_rank

    sent = []
    t = torch.empty(3, device="meta")
    with fake_rank(2, 0), feature_bridges.pipelining_on_meta(print, sent.extend):
        works = schedules._batch_p2p([dist.P2POp(dist.isend, t, 1)], desc="bwd_send")
    assert sent == [t] and works[0].tensors == [t] and works[0].wait()


def test_zero_bubble_counts_a_micro_batch_waiting_for_its_weight_gradient_as_in_flight():
    """Under zero-bubble a micro-batch's input-gradient step (B<i>@<k>) pops it from stage k's `fwd_cache` and
    keeps its graph in `backward_state` until its weight-gradient step (W<i>@<k>): it is in flight at every
    micro-step between the two. Rank 1 of torch's real ScheduleInterleavedZeroBubble (P = 2, V = 2, M = 4: I0 on
    stage 1, then W1@3, F3@1, I1@1, and only then W0@1; Linear stages on the CPU, the fake group) under the
    pipeline bridges; what waits is read off the label sequence."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleavedZeroBubble
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from vramtrace import feature_bridges

    meta = torch.empty(1, 4, requires_grad=True)
    steps = []
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        stages = [PipelineStage(torch.nn.Linear(4, 4), k, 4, torch.device("cpu"), input_args=meta, output_args=meta,
                                output_grads=None if k == 3 else meta, input_grads=meta)
                  for k in (1, 3)]
        sched = ScheduleInterleavedZeroBubble(stages, n_microbatches=4, loss_fn=lambda out, target: out.sum())
        with feature_bridges.pipelining_on_meta(lambda label, flight: steps.append((label, flight)), list,
                                                tuple(stages)):
            sched.step(target=torch.randn(4, 4), losses=[])
    finally:
        dist.destroy_process_group()
    waiting, checked = set(), 0
    for label, flight in steps:
        if label != "loop":
            assert {int(w.split('@')[0]) for w in waiting} <= set(flight), (label, flight, waiting)
            checked += bool(waiting - {label[1:]})
            (waiting.add if label[0] == "B" else waiting.discard)(label[1:])
    assert checked  # some micro-step ran while a micro-batch waited for its W step


class _ProgressSession:
    """What `pp_stages.trace_classes` needs of a session, recording its progress lines: each trace a stand-in."""

    def __init__(self):
        self.traces, self.said = {}, []

    def say(self, line):
        self.said.append(line)

    def record(self, spec, loaded, progress):
        return object()


@pytest.mark.parametrize("schedule,said", [("zero-bubble", ["rank 0", "rank 1"]),
                                           ("interleaved-1f1b", ["rank 0", "rank 1"]),
                                           ("gpipe", ["stage 0", "stage 1"])])
def test_the_progress_line_names_a_rank_when_a_rank_holds_several_stages(schedule, said):
    """Tracing rank 1 (stages 1 and 3) under interleaved-1f1b and zero-bubble says 'rank 1', not 'stage 1'."""
    from types import SimpleNamespace

    from vramtrace.pp_stages import trace_classes

    session = _ProgressSession()
    trace_classes(session, RunSpec(LLAMA, batch=4, seq=8, device="cpu", pp=2, pp_schedule=schedule),
                 SimpleNamespace(num_layers=4))
    assert session.said == said


def test_a_lever_pipeline_holds_one_stage_trace_at_a_time():
    """`stage_traces(keep=False)` (a lever's pipeline, levers.py `pipeline_outcome`): each stage's trace leaves
    `session.traces` as soon as `stop` has read it, so a pipeline of 4 distinct stages holds one stage's tables at
    a time (a 70B `--pp 16` combination held 16 and took the run to 1.7 GiB); a trace that was there before is put
    back."""
    from dataclasses import replace
    from types import SimpleNamespace

    from vramtrace.pp_stages import stage_traces

    session = _ProgressSession()
    session.load = lambda spec: SimpleNamespace(num_layers=4)
    session.heap = SimpleNamespace(refreeze=lambda: None)
    spec = RunSpec(LLAMA, batch=4, seq=8, device="cpu", pp=4, pp_schedule="1f1b")
    earlier = object()
    session.traces[replace(spec, stage=2)] = earlier
    held = []

    def stop(k, trace, left):
        held.append(sorted(s.stage for s, t in session.traces.items() if t is not earlier))
        assert session.traces[replace(spec, stage=k)] is trace
        return False

    assert stage_traces(session, spec, keep=False, stop=stop) == {}
    assert held == [[0], [1], [2], [3]]
    assert session.traces == {replace(spec, stage=2): earlier}


MiB = 1 << 20


class _HandTables:
    """A stage's StepTables as `search.evaluate` and `StepTables.peaks` read them: one hand-built timeline for the
    first and the steady step, the default allocator settings."""

    alloc_conf = None

    def __init__(self, *lifetimes):
        from vramtrace.analysis.liveness import Timeline

        steps = max(lt.death for lt in lifetimes) + 1
        live = [sum(lt.bytes for lt in lifetimes if lt.birth <= i <= lt.death) for i in range(steps)]
        peak = max(range(steps), key=lambda i: (live[i], -i))
        self.tl = Timeline(tuple(range(steps)), ("forward",) * steps, tuple(lifetimes), tuple(live), tuple(live),
                           sum(lt.bytes for lt in lifetimes if lt.at_start), live[peak], peak)

    def timeline(self, rows=None, step=None):
        return self.tl

    def replay(self, rows=None):
        from vramtrace.analysis.allocator import replay_steps

        return replay_steps(self.tl, self.tl)

    def peaks(self, rows=None, cuda=False):
        if not cuda:
            return self.tl.peak_bytes, None
        est = self.replay()
        return est.peak_allocated_bytes, est.peak_reserved_bytes


def _hand_stages():
    """Stage 0: a 10 MiB parameter and a 60 MiB temporary: 70 MiB allocated, 70 MiB reserved. Stage 1: the
    parameter; a 40 MiB temporary freed, then 20 MiB (split from its free 40 MiB segment) and 30 MiB alive
    together: 60 MiB allocated, but the 30 MiB finds no free block (20 MiB of its segment are free, the other 20
    MiB hold a live block, so releasing the cache frees nothing), a third segment: 80 MiB reserved
    (CUDACachingAllocator.cpp: blocks over 10 MiB get segments of their size rounded to 2 MiB; a free block is
    split when over 1 MiB remains)."""
    from vramtrace.analysis.categories import Category
    from vramtrace.analysis.liveness import Lifetime

    def param():
        return Lifetime(1, 10 * MiB, 0, 2, Category.PARAMETER, outlives_step=True, at_start=True)

    act = Category.ACTIVATION
    return {0: _HandTables(param(), Lifetime(2, 60 * MiB, 1, 1, act)),
            1: _HandTables(param(), Lifetime(2, 40 * MiB, 0, 0, act), Lifetime(3, 20 * MiB, 1, 2, act),
                           Lifetime(4, 30 * MiB, 2, 2, act))}


class _HandSession(_ProgressSession):
    def __init__(self, stages):
        super().__init__()
        self.stages = stages

    def record(self, spec, loaded, progress):
        return self.stages[spec.stage]


@pytest.mark.parametrize("device,capacity,reported", [("cuda", 75 * MiB, 1), ("cuda", 100 * MiB, 0),
                                                      ("cpu", 75 * MiB, 0)])
def test_a_cuda_report_shows_the_stage_that_runs_out_of_memory_not_the_largest(device, capacity, reported,
                                                                              monkeypatch):
    """By hand (`_hand_stages`): stage 1's peak allocated (60 MiB) is below stage 0's (70 MiB), but its replay
    needs 80 MiB reserved: on a 75 MiB device stage 0 fits and stage 1 runs out of memory, so the report shows
    stage 1 (its verdict is the pipeline's: it does not fit). On a 100 MiB device both fit: the largest, stage 0.
    The CPU target has no replay: the largest peak allocated, stage 0, as before. Only the stage reported keeps
    its tables: the other one is digested (`_digest`, which the hand tables cannot feed, recorded instead)."""
    from types import SimpleNamespace

    from vramtrace import pp_stages
    from vramtrace.pp_stages import trace_stages

    digested = []
    monkeypatch.setattr(pp_stages, "_digest", lambda _session, stage_spec, _cuda: digested.append(stage_spec.stage))

    stages = _hand_stages()
    assert stages[1].peaks(cuda=True)[0] < stages[0].peaks(cuda=True)[0]  # the case is what it is meant to be
    assert stages[1].peaks(cuda=True)[1] == 80 * MiB and stages[0].peaks(cuda=True)[1] == 70 * MiB
    spec = RunSpec(LLAMA, batch=4, seq=8, device=device, pp=2, pp_schedule="gpipe", gpu_memory_bytes=capacity,
                   **({"cuda_context_bytes": 0} if device == "cuda" else {}))
    session = _HandSession(stages)
    shown, tables, _ = trace_stages(session, spec, SimpleNamespace(num_layers=4))
    assert shown.stage == reported and tables is stages[reported]
    assert session.said == ["stage 0", "stage 1"]
    assert set(digested) == {1 - reported}


def test_the_failing_stage_comes_before_a_larger_one_that_fits():
    """`failing_stage` on plain points: one that does not fit first, then the larger peak allocated, then the
    lower stage."""
    from vramtrace.pp_stages import failing_stage
    from vramtrace.search import FitPoint

    def point(allocated, fits):
        return FitPoint(0, allocated, None, fits, True)

    assert failing_stage({0: point(70, True), 1: point(60, False), 2: point(50, False)}) == 1
    assert failing_stage({0: point(70, True), 1: point(60, True), 2: point(80, True)}) == 2
    assert failing_stage({0: point(70, False), 1: point(90, True), 2: point(70, False)}) == 0
    assert failing_stage({3: point(5, True)}) == 3
    with pytest.raises(ValueError):
        failing_stage({})


@pytest.fixture(scope="module")
def real_1f1b_3_301(tmp_path_factory):
    """The stored real run (real_pp.py, 1F1B, 3 stages split 3,0,1: a 0-layer middle stage) and vramtrace's
    report of the same pipeline."""
    real = json.loads((REAL / "real_1f1b_3_3-0-1.json").read_text())
    config = deep_config(tmp_path_factory.mktemp("pp"), "tiny-llama-gqa", real["layers"])
    spec = RunSpec(config, batch=real["batch"], seq=real["seq"], device="cpu", precision="fp32",
                   checkpointing="none", pp=real["pp"], pp_schedule=real["schedule"], micro_batches=real["M"],
                   pp_split=tuple(real["split"]))
    return real, spec, analyze(spec)


def test_every_stage_matches_the_real_gloo_run_to_the_byte(real_1f1b_3_301):
    real, _spec, report = real_1f1b_3_301
    got = {s.stage: (s.peak_bytes, s.at) for s in report.run.pp.stage_peaks}
    assert got == {r["rank"]: (r["peak"], r["where"]) for r in real["stages"]}
    assert report.peak_allocated_bytes == max(r["peak"] for r in real["stages"]) and report.run.pp.stage == 0
    # one stage's loop is its schedule's: no peaks of other training loops, which would be of no real run
    assert report.run.loop.startswith("--pp 1f1b") and not report.run.loop_peaks


def test_the_report_lists_each_stage_and_its_buffers(real_1f1b_3_301):
    real, _spec, report = real_1f1b_3_301
    pp = report.run.pp
    assert (pp.stages, pp.schedule, pp.micro_batches, pp.micro_batch_rows, pp.split) == (
        3, PipelineSchedule.ONE_F_ONE_B, 4, 2, (3, 0, 1))
    # receive buffers, one per micro-batch (real_pp.py measured them on each rank): the ends M, a middle stage 2M
    assert [s.recv_buffer_bytes for s in pp.stage_peaks] == [r["recv_buffers"] for r in real["stages"]]
    d = json.loads(json.dumps(report.to_dict()))
    assert [s["stage"] for s in d["run"]["pp"]["stage_peaks"]] == [0, 1, 2]


def test_the_cli_prints_one_line_per_stage(capsys, real_1f1b_3_301):
    _real, spec, report = real_1f1b_3_301
    r = run_cli(capsys, spec.model, "--batch", "8", "--seq", "32", "--device", "cpu", "--precision", "fp32",
                "--pp", "3", "--pp-split", "3,0,1", "--micro-batches", "4", "--stage", "2")
    assert r.returncode == 0
    out = " ".join(line.strip("│ ") for line in r.stdout.splitlines())  # the panel's wrapped lines joined
    assert "1f1b over 3 stages, 4 micro-batches of 2 rows, split 3,0,1; stage 2 shown" in out
    last = next(s for s in report.run.pp.stage_peaks if s.stage == 2)
    assert f"stage 2  {format_bytes(last.peak_bytes)} at {last.at}" in out and "stage 0 " not in out
    assert f"({last.peak_bytes:,} bytes)" in out


def test_the_cli_traces_one_interleaved_rank_with_stage(capsys, tmp_path):
    """--stage K under interleaved-1f1b is rank K with all its stages: one line for it, its peak the real gloo
    run's (docs/research/issue-42-pipelining.md section 4, tests/pp_oracle.py: tiny Llama of 4 layers, P = 2,
    M = 4, split 1,1,1,1, rank 1 holding stages 1 and 3: 4267940 B in micro-batch 3's backward on stage 3)."""
    config = deep_config(tmp_path, "tiny-llama-gqa", 4)
    out = tmp_path / "r.json"
    r = run_cli(capsys, config, "--batch", "8", "--seq", "32", "--device", "cpu", "--precision", "fp32", "--pp", "2",
                "--pp-schedule", "interleaved-1f1b", "--virtual-stages", "2", "--pp-split", "1,1,1,1",
                "--micro-batches", "4", "--stage", "1", "--no-levers", "--json", out)
    assert r.returncode == 0, r.stderr
    text = " ".join(line.strip("│ ") for line in r.stdout.splitlines())
    assert "interleaved-1f1b over 2 ranks of 2 stages, 4 micro-batches of 2 rows, split 1,1,1,1; rank 1 shown" in text
    assert f"rank 1 (stages 1,3)  {format_bytes(4267940)} at B3@3" in text and "rank 0 " not in text
    assert "(4,267,940 bytes)" in text
    report = json.loads(out.read_text())
    pp = report["run"]["pp"]
    assert (pp["virtual_stages"], pp["stage"], pp["split"]) == (2, 1, [1, 1, 1, 1])
    # the schedule calls each stage's module, not the rank's: what their forwards save is still the forward's
    # activations (micro-batches 2 and 3 are in flight at the peak), not temporaries of the step
    assert report["breakdown_at_peak"]["activation"] > 0 and report["peak_phase"] == "backward"
    assert [(s["stage"], s["holds"], s["peak_bytes"]) for s in pp["stage_peaks"]] == [(1, [1, 3], 4267940)]
    # each stage's tensors are named by its global index (rank 1's head is stage 3's), not the rank-local one
    names = {t["name"] for t in report["tensors"] if t["category"] == "parameter"}
    assert {"stage3.lm_head.weight", "stage1.layers.0.mlp.up_proj.weight", "stage3.norm.weight"} <= names
    assert {n.split(".")[0] for n in names} == {"stage1", "stage3"}
    # and the two stages' layers are two rows, not one mean of a 1-layer stage and the stage with the head
    assert "stage3.lm_head " in text and "stage1.layers.*" in text and "stages.*" not in text


def test_fit_with_pp_and_a_split_is_refused_in_one_line(capsys):
    """`vramtrace fit --pp` searches the depth (tests/test_pp_fit.py); a --pp-split fixes it."""
    r = run_cli(capsys, "fit", LLAMA, "--batch", "4", "--seq", "8", "--device", "cpu", "--gpu-memory", "3MiB",
                "--pp", "2", "--pp-split", "1,1")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "Error: fit --pp searches the pipeline depth, which --pp-split fixes (one layer count per stage): drop "
        "--pp-split"]


def test_validate_with_pp_is_refused_in_one_line(capsys):
    r = run_cli(capsys, "validate", LLAMA, "--batch", "4", "--seq", "8", "--device", "cpu", "--pp", "2")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "Error: validate runs the step in this one process; a pipeline (--pp) runs one stage per rank: launch it "
        "with torchrun and compare each stage's torch.cuda.max_memory_allocated()"]


def test_levers_under_pp_skip_what_does_not_compose_with_it_in_one_row(capsys, tmp_path):
    """The levers of a --pp run size the whole pipeline (tests/test_pp_fit.py); the families --pp does not trace
    (LoRA, QLoRA, FSDP2) are one skipped row. 2 layers: no deeper pipeline than 2 stages."""
    out = tmp_path / "r.json"
    r = run_cli(capsys, LLAMA, "--batch", "4", "--seq", "8", "--device", "cpu", "--pp", "2", "--gpu-memory", "1KiB",
                "--json", out)
    assert r.returncode == 0, r.stderr
    levers = json.loads(out.read_text())["levers"]
    assert {lv["family"] for lv in levers["levers"]} <= {"checkpointing", "micro_batch", "optimizer_8bit"}
    assert {"checkpointing", "micro_batch"} <= {lv["family"] for lv in levers["levers"]}
    assert not any(lv["fits"] for lv in levers["levers"])
    assert levers["skipped"] == [{"family": "not_under_pp", "title": "LoRA, QLoRA and FSDP2",
                                  "options": "--lora-rank / --quantization / --fsdp", "reason": "not_modelled",
                                  "detail": "not traced under --pp yet: --pp does not compose with LoRA, QLoRA or "
                                            "FSDP2 yet"}]


def test_the_checkpointing_lever_under_an_interleaved_schedule_names_the_ranks_stages(capsys, tmp_path):
    """Under interleaved-1f1b a rank's stages are `stage<k>` of one module: the checkpointing lever checkpoints
    `modules:stage*.layers.*` and is traced (it saves bytes), not a skipped row for a pattern that matches nothing."""
    config = deep_config(tmp_path, "tiny-llama-gqa", 4)
    out = tmp_path / "r.json"
    r = run_cli(capsys, config, "--batch", "8", "--seq", "32", "--device", "cpu", "--precision", "fp32", "--pp", "2",
                "--pp-schedule", "interleaved-1f1b", "--pp-split", "1,1,1,1", "--micro-batches", "4", "--stage", "1",
                "--gpu-memory", "3MiB", "--json", out)
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    rows = [lv for lv in report["levers"]["levers"] if lv["family"] == "checkpointing"]
    assert [lv["options"] for lv in rows] == ["--checkpointing modules:stage*.layers.*"], report["levers"]
    assert rows[0]["saves_bytes"] > 0
    assert not any(sk["family"] == "checkpointing" for sk in report["levers"]["skipped"])


def test_on_a_cuda_target_the_stage_peaks_are_on_the_reports_basis():
    """The allocator replay's peak allocated (blocks rounded to 512 B), both to pick the reported stage and for each
    stage's line: the reported stage's line is the header's peak. (On configs this small the liveness peak equals
    the replay's, so this guards the invariant rather than reproducing a difference.)"""
    report = analyze(RunSpec(LLAMA, batch=4, seq=8, device="cuda", gpu="h100", pp=2, pp_schedule="gpipe"))
    peaks = {s.stage: s.peak_bytes for s in report.run.pp.stage_peaks}
    assert peaks[report.run.pp.stage] == report.peak_allocated_bytes == max(peaks.values())
    assert all(p % 512 == 0 for p in peaks.values())


@pytest.mark.parametrize("owner,attribute,name", [
    ("_PipelineStageBase", "grad_recv_info", "self.grad_recv_info"), ("_RecvInfo", "buffer", "self.buffer"),
    ("_PipelineStageBase", "backward_state", "self.backward_state")])
def test_a_renamed_stage_attribute_stops_the_pipeline_bridges(monkeypatch, owner, attribute, name):
    """A torch release that renames what a stage's receive buffers or zero-bubble's waiting micro-batches are read
    from fails loudly, not with receive buffers of 0 bytes or micro-batches left out of `in_flight`."""
    from torch.distributed.pipelining import stage

    from vramtrace import feature_bridges
    from vramtrace.errors import BridgeError

    cls = getattr(stage, owner)
    code = cls.__init__.__code__
    renamed = code.replace(co_names=tuple(n + "_renamed" if n == attribute else n for n in code.co_names))
    monkeypatch.setattr(cls.__init__, "__code__", renamed)
    with pytest.raises(BridgeError, match=f"the assignment of {name} in"):
        with feature_bridges.pipelining_on_meta(print, print):
            pytest.fail("pipelining_on_meta() went on without the attribute")


def test_a_model_type_not_cut_right_is_refused_in_one_line(capsys):
    """A stage runs its layers with no attention mask: mistral's sliding window would be silently dropped."""
    r = run_cli(capsys, FIXTURES / "tiny-mistral-sw.json", "--batch", "4", "--seq", "8", "--device", "cpu", "--pp", "2")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "Error: --pp cuts llama and gpt2 decoder LMs; model_type mistral is not modelled yet (its layers may need "
        "their attention mask, which a stage does not pass)"]


def test_the_stage_traces_of_one_run_share_one_forward_for_the_stage_outputs(monkeypatch):
    """Every stage's trace needs each stage's output metadata (`stage_outputs`, a forward of the whole model): one
    run makes it once for all its stages, and each stage's peak is still the one its own run (`--stage k`) finds."""
    from dataclasses import replace

    from vramtrace.tracer import pipelining

    calls = []
    real = pipelining.stage_outputs
    monkeypatch.setattr(pipelining, "stage_outputs", lambda *a: calls.append(a[1]) or real(*a))
    spec = RunSpec(LLAMA, batch=4, seq=8, device="cpu", precision="fp32", pp=2, pp_schedule="gpipe")
    report = analyze(spec)
    peaks = {s.stage: s.peak_bytes for s in report.run.pp.stage_peaks}
    assert len(calls) == 1 and sorted(peaks) == [0, 1]
    for k, peak in peaks.items():
        assert analyze(replace(spec, stage=k)).peak_allocated_bytes == peak
    assert len(calls) == 3  # a new model per run: its own forward
