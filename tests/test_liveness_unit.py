"""Liveness on hand-built ops and storages (no torch)."""

from dataclasses import dataclass

from vramtrace.analysis.categories import Category
from vramtrace.analysis.liveness import build_timeline, round_block


@dataclass
class Op:
    index: int
    phase: str
    step: int = 0


@dataclass
class St:
    sid: int
    nbytes: int
    category: Category
    op_index: int
    free_after: int | None
    last_use: int
    device: str = "meta"


def test_round_block_mirrors_cuda_round_size():
    assert [round_block(n, 512) for n in (0, 1, 512, 513, 1024)] == [0, 512, 512, 1024, 1024]
    assert round_block(3, 1) == 3


def test_eager_vs_last_use_and_the_step_boundary():
    # step 0: ops 0-2 (forward, forward, optimizer); step 1: ops 3-5
    ops = [Op(0, "forward"), Op(1, "forward"), Op(2, "optimizer"),
           Op(3, "forward", 1), Op(4, "forward", 1), Op(5, "optimizer", 1)]
    storages = [
        St(0, 100, Category.PARAMETER, -1, None, 5),        # exists at start, outlives the steps
        St(1, 10, Category.TEMPORARY, 0, 2, 0),             # step 0: used at op 0, eagerly freed after op 2
        St(2, 7, Category.OPTIMIZER_STATE, 2, None, 5),     # created by the first step: at the steady step's start
        St(3, 5, Category.TEMPORARY, 2, 2, 2),              # first-step temporary: not in the steady timeline
        St(4, 3, Category.TEMPORARY, 1, 1, 1, device="cpu"),  # host tensor: not counted for a CUDA target
        St(5, 20, Category.OUTPUTS, 1, 3, 1),               # step 0's output, held into step 1 (script loop)
        St(6, 1, Category.TEMPORARY, 4, 4, 4),
    ]
    steady = build_timeline(ops, storages, 1, ("meta",))
    assert steady.steps == (3, 4, 5)
    assert steady.start_bytes == 127
    assert steady.live_bytes == (127, 108, 107)
    assert steady.after_bytes == (107, 107, 107)
    optimal = build_timeline(ops, storages, 1, ("meta",), graph_optimal=True)
    assert optimal.live_bytes == (127, 108, 107)  # the held output's last use was in step 0: dies at the start
    first = build_timeline(ops, storages, 0, ("meta", "cpu"))
    assert first.start_bytes == 100
    assert first.live_bytes == (110, 133, 142)
    assert first.peak_bytes == 142 and first.peak_step == 2
    assert first.after_bytes == (110, 130, 127)  # the host temporary freed after op 1; the output outlives step 0
