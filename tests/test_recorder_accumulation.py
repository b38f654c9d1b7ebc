"""The autograd engine's gradient accumulation: where two gradients meet in one input buffer, the real engine
(no dispatch mode active) adds in place when it holds the buffer's last reference
(torch/csrc/autograd/input_buffer.cpp `accumulate`); under the recorder's dispatch mode it never does, so the
recorder decides as the real engine would. Truth: a real CPU backward without any mode, observed through hooks
(the accumulated gradient's data pointer is one of the incoming gradients' when the engine added in place)."""

import pytest
import torch

from vramtrace.tracer.recorder import StepRecorder, tag_autograd_nodes

N = 1 << 10
CASES = {  # a fan-out of h whose two gradients the engine accumulates
    "sin+cos": lambda h: (h.sin() + h.cos()).sum(),
    "same tensor twice": lambda h: (h + h).sum(),  # both gradients are one tensor: not in place
    "residual": lambda h: (h + h.sin()).sum(),  # the first gradient is an expanded view: not in place
    "residual, scaled": lambda h: ((h + h.sin()) * 3).sum(),
    "select": lambda h: (torch.stack([h[0], h[1]]) * 2).sum(),
    "view branch": lambda h: (h.view(-1).sin() * 2).sum() + (h.cos() * 2).sum(),
    "two matmuls": lambda h: (h @ torch.ones(N, 4, device=h.device)).sum() + (h @ torch.ones(N, 4, device=h.device)).sum(),
}


def _real_in_place(fn) -> bool:
    x = torch.randn(2, N, requires_grad=True)
    h = x * 1.5
    loss = fn(h)
    incoming, final = [], []
    stack, seen = [loss.grad_fn], set()
    while stack:  # post-hooks on the nodes that hand h a gradient: record only data pointers
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for i, (nxt, _) in enumerate(node.next_functions):
            if nxt is h.grad_fn:
                node.register_hook(lambda gi, go, i=i: incoming.append(gi[i].data_ptr()))
            stack.append(nxt)
    h.register_hook(lambda g: final.append(g.data_ptr()))
    loss.backward()
    assert len(incoming) == 2
    return final[0] in incoming


def _traced_in_place(fn) -> bool:
    x = torch.empty(2, N, requires_grad=True, device="meta")
    rec = StepRecorder()
    with rec:
        rec.phase = "forward"
        h = x * 1.5
        loss = fn(h)
        tag_autograd_nodes(loss, "", rec.watch_node)
        rec.phase = "backward"
        loss.backward()
    rec.detach()
    adds = [o for o in rec.ops if o.phase == "backward" and o.name == "aten.add.Tensor"]  # the accumulation only
    assert len(adds) == 1, [o.name for o in rec.ops if o.phase == "backward"]
    return not adds[0].outs  # in place: no new storage


@pytest.mark.parametrize("case", CASES)
def test_recorder_accumulates_in_place_where_the_real_engine_does(case):
    assert _traced_in_place(CASES[case]) == _real_in_place(CASES[case])


def test_the_cases_cover_both_outcomes():
    outcomes = {_real_in_place(fn) for fn in CASES.values()}
    assert outcomes == {True, False}
