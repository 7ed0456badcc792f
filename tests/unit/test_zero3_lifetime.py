"""ZeRO-3 unit lifetime pieces without a process group: ``UnitNeeds`` (needs.py), the backward-use marks
(marks.py) and the pool's optional acquire that read-ahead uses (param_offload.py)."""

from __future__ import annotations

import torch
import torch.utils.checkpoint as torch_checkpoint

from shardspeed.zero.stage3.marks import BackwardUse, mark_outputs, watch_inputs
from shardspeed.zero.stage3.needs import UnitNeeds
from shardspeed.zero.stage3.param_offload import ShardBufferPool


def test_unit_needs() -> None:
    needs = UnitNeeds()
    assert not needs.needed
    needs.backward_uses, needs.recompute_hold = 1, True
    assert needs.needed and needs.busy
    needs.end_use()  # the use a recomputation served ended: the hold goes with it
    assert not needs.needed
    needs.unmarked_uses, needs.expected = 1, {0, 2}
    needs.grad_arrived(0)
    assert needs.needed and needs.grads_pending
    needs.grad_arrived(2)  # every expected gradient in: the unmarked use is over
    assert needs.unmarked_uses == 0 and not needs.needed
    needs.expected, needs.forward_calls = {3}, 1
    needs.reset_backward()
    assert needs.forward_calls == 1 and not needs.grads_pending and not needs.backward_uses


class Recorder:
    def __init__(self) -> None:
        self.events: list[str] = []
        self.started: list[BackwardUse] = []

    def start(self, use: BackwardUse) -> None:
        self.events.append("start")
        self.started.append(use)

    def end(self, use: BackwardUse) -> None:
        self.events.append("end")


def _marked_call(fc: torch.nn.Linear, x: torch.Tensor, rec: Recorder) -> tuple[torch.Tensor, BackwardUse]:
    use = BackwardUse((0,))
    use.handle = watch_inputs((x,), {}, use, rec.end)
    inner = fc(x)
    inner.register_hook(lambda g: rec.events.append("module backward"))
    out, marked = mark_outputs(inner, use, rec.start)
    assert marked and use.marked and use.node is not None
    return out, use


def test_use_starts_before_and_ends_after_the_module_backward() -> None:
    torch.manual_seed(0)
    fc = torch.nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    rec = Recorder()
    out, use = _marked_call(fc, x * 1, rec)
    out.sum().backward()
    assert rec.events == ["start", "module backward", "end"]
    use.handle.remove()


def test_in_place_ops_on_marked_outputs_keep_gradients_exact() -> None:
    torch.manual_seed(0)
    fc, emb = torch.nn.Linear(4, 4), torch.nn.Embedding(5, 4)
    pos = torch.nn.Parameter(torch.randn(4))
    tokens = torch.tensor([[1, 2, 3], [4, 0, 1]])

    def run(marked: bool) -> list[torch.Tensor]:
        for p in (*fc.parameters(), emb.weight, pos):
            p.grad = None
        rec = Recorder()
        x = emb(tokens)
        if marked:
            x, _ = mark_outputs(x, BackwardUse((0,)), rec.start)
        x += pos  # an in-place op on a module output
        h = fc(x)  # 3-D input: nn.Linear returns a view of its 2-D result
        if marked:
            h, _ = mark_outputs(h, BackwardUse((1,)), rec.start)
        torch.relu_(h).square().sum().backward()
        return [p.grad.clone() for p in (*fc.parameters(), emb.weight, pos)]

    for a, b in zip(run(False), run(True)):
        assert torch.equal(a, b)


def test_outputs_sharing_memory_keep_views() -> None:
    """A tensor returned with a view of itself: an in-place change of one would silently change the other behind
    a detached alias, so both stay views and torch refuses the in-place op."""
    base = torch.randn(3, 4, requires_grad=True) * 1
    (a, b), _ = mark_outputs((base, base[:, 0]), BackwardUse((0,)), lambda use: None)
    assert a._is_view() and b._is_view()


def test_discarded_recompute_marks_never_start() -> None:
    """Non-reentrant checkpointing throws the recomputed graph away: marks made while recomputing never fire."""
    torch.manual_seed(0)
    fc = torch.nn.Linear(4, 4)
    rec = Recorder()
    uses: list[BackwardUse] = []

    def region(h: torch.Tensor) -> torch.Tensor:
        use = BackwardUse((0,))
        uses.append(use)
        use.handle = watch_inputs((h,), {}, use, rec.end)
        return mark_outputs(torch.tanh(fc(h)), use, rec.start)[0]

    x = torch.randn(2, 4, requires_grad=True)
    torch_checkpoint.checkpoint(region, x * 1, use_reentrant=False).sum().backward()
    assert len(uses) == 2  # the forward and the recomputation
    assert rec.started == [uses[0]]  # only the original forward's output mark ran
    for use in uses:
        use.handle.remove()


def test_pool_try_acquire_never_overflows() -> None:
    pool = ShardBufferPool(1, 64)
    first = pool.try_acquire(8, torch.float32)
    assert first is not None
    assert pool.try_acquire(8, torch.float32) is None and pool.overflows == 0
    pool.release(first)
    assert pool.try_acquire(8, torch.float32) is not None
