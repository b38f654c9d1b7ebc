"""Liveness on hand-built ops and storages (no torch)."""

from dataclasses import dataclass

from vramtrace.analysis.categories import Category
from vramtrace.analysis.liveness import build_timeline, round_block


@dataclass
class Op:
    index: int
    phase: str


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


def test_eager_vs_last_use_and_excluded_phase():
    ops = [Op(0, "forward"), Op(1, "forward"), Op(2, "optimizer_first"), Op(3, "optimizer")]
    storages = [
        St(0, 100, Category.PARAMETER, -1, None, 3),        # exists at start, outlives the step
        St(1, 10, Category.TEMPORARY, 0, 2, 0),             # used at op 0, eagerly freed after op 2
        St(2, 7, Category.OPTIMIZER_STATE, 2, None, 3),     # created by the first step: pre-existing when steady
        St(3, 5, Category.TEMPORARY, 2, 2, 2),              # first-step temporary: not in the steady timeline
        St(4, 3, Category.TEMPORARY, 1, 1, 1, device="cpu"),  # host tensor: not counted for a CUDA target
    ]
    steady = build_timeline(ops, storages, ("forward", "optimizer"), ("meta",))
    assert steady.steps == (0, 1, 3)
    assert steady.start_bytes == 107
    assert steady.live_bytes == (117, 117, 107)  # temp 1 freed after op 2 -> dies at op 1, the last steady op <= 2
    assert steady.after_bytes == (117, 107, 107)
    optimal = build_timeline(ops, storages, ("forward", "optimizer"), ("meta",), graph_optimal=True)
    assert optimal.live_bytes == (117, 107, 107)
    first = build_timeline(ops, storages, ("forward", "optimizer_first"), ("meta", "cpu"))
    assert first.start_bytes == 100
    assert first.live_bytes == (110, 113, 122)
    assert first.peak_bytes == 122 and first.peak_step == 2
