"""HostGradients bookkeeping and StreamedAdam stepping from staged host copies (forced on the CPU: this machine has
no accelerator, where the copies would be asynchronous and pinned)."""

from __future__ import annotations

import pytest
import torch

from shardspeed.config.offload import OffloadOptimizerConfig
from shardspeed.offload.host_grads import HostGradients
from shardspeed.offload.host_store import HostStore
from shardspeed.offload.optimizer import StreamedAdam


def _with_grads(*sizes: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    tensors = [torch.randn(n, generator=g) for n in sizes]
    for t in tensors:
        t.grad = torch.randn(t.numel(), generator=g)
    return tensors


def test_staged_copies_are_snapshots_and_late_ones_are_counted() -> None:
    a, b = _with_grads(10, 7)
    host = HostGradients([a, b], pin=False)
    expected_a = a.grad.clone()
    host.stage([a, torch.zeros(3)])  # a tensor it does not hold is ignored
    a.grad.mul_(100)  # what the engine does after the copy (clip / unscale) goes through scale_, not the copy
    assert torch.equal(host.take(a), expected_a)
    assert torch.equal(host.take(b), b.grad) and (host.staged, host.late_copies) == (1, 1)
    host.scale_(0.5)
    host.scale_(0.25)
    assert host.scale == 0.125
    host.forget()
    assert host.last_step == (1, 1) and host.scale == 1.0 and (host.staged, host.late_copies) == (0, 0)
    b.grad.fill_(2.0)
    assert torch.equal(host.take(b), torch.full((7,), 2.0))  # forgotten: copied afresh, not the old copy
    assert host.nbytes == 4 * 17


@pytest.mark.parametrize("ratio", [1.0, 0.5])
def test_streamed_adam_steps_from_scaled_host_copies(monkeypatch: pytest.MonkeyPatch, ratio: float) -> None:
    monkeypatch.setattr(StreamedAdam, "FORCE_HOST_GRADS", True)
    ours, reference = _with_grads(50, 130), _with_grads(50, 130)
    streamed = StreamedAdam(
        torch.optim.AdamW(ours, lr=0.01), HostStore(False), 16, offload=OffloadOptimizerConfig(ratio=ratio)
    )
    torch_adam = torch.optim.AdamW(reference, lr=0.01)
    assert streamed.host_grads is not None
    for step, factor in enumerate((0.3, 1.7, 0.05)):  # varying: Adam is blind to one constant scale
        streamed.stage_grads(ours)  # as the stage does when the bucket's gradient is final
        streamed.scale_grads(factor)  # clipping after the copy
        for t in reference:
            t.grad.mul_(factor)
        streamed.step()
        torch_adam.step()
        streamed.forget_grads()  # the engine's end of step
        assert streamed.host_grads.last_step == (2, 0)  # both tensors staged, nothing copied late
        for t in (*ours, *reference):
            t.grad = torch.randn(t.numel(), generator=torch.Generator().manual_seed(step))
    for o, r in zip(ours, reference):
        torch.testing.assert_close(o, r, atol=1e-6, rtol=0)
