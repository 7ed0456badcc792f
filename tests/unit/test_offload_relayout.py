"""``StreamedAdam.relayout``/``load_state``: the streamed optimizer rebuilt for new stepped tensors (the ZeRO 1/2
bucket re-layout before the first step, zero/relayout_streamed.py), on a host store, keeping its states."""

from __future__ import annotations

import pytest
import torch

from shardspeed.offload.optimizer import HostStore, StreamedAdam


def _grads(step: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(100 + step))


def _split(flat: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    return [piece.clone() for piece in flat.split(sizes)]


@pytest.mark.parametrize(("ratio", "fast_init"), [(1.0, False), (0.5, False), (1.0, True)])
def test_relayout_keeps_states_and_steps_like_torch(monkeypatch: pytest.MonkeyPatch, ratio: float, fast_init: bool):
    """Two steps on one split of the elements, re-layout to another split (states carried through
    ``read_state``/``load_state``), two more steps: equal to torch AdamW on the whole tensor all along."""
    from shardspeed.config.offload import OffloadOptimizerConfig

    monkeypatch.setattr(StreamedAdam, "FORCE_HOST_GRADS", True)
    numel, old_sizes, new_sizes = 187, [50, 7, 130], [90, 60, 37]
    start = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    reference = start.clone()
    torch_opt = torch.optim.AdamW([reference], lr=0.01, weight_decay=0.1)
    tensors = _split(start, old_sizes)
    inner = torch.optim.AdamW([{"params": tensors}], lr=0.01, weight_decay=0.1)
    opened: list[HostStore] = []

    def reopen() -> HostStore:
        opened.append(HostStore(pin_memory=False))
        return opened[-1]

    offload = OffloadOptimizerConfig(device="cpu", ratio=ratio, fast_init=fast_init)
    optimizer = StreamedAdam(inner, reopen(), chunk_numel=16, offload=offload, reopen=reopen)
    host_grads = optimizer.host_grads
    for step in range(4):
        if step == 2:  # the re-layout: read the states out, swap tensors, rebuild, write them back
            states = [optimizer.read_state(t) for t in tensors]
            values = torch.cat(tensors)
            moments = {k: torch.cat([s[k] for s in states]) for k in ("exp_avg", "exp_avg_sq")}
            tensors = _split(values, new_sizes)
            inner.param_groups[0]["params"] = tensors
            optimizer.relayout(None)
            offset = 0
            for t in tensors:
                entry = {"step": states[0]["step"], **{k: m[offset : offset + t.numel()] for k, m in moments.items()}}
                optimizer.load_state(t, entry)
                offset += t.numel()
            assert len(opened) == 2 and getattr(optimizer.store, "store", optimizer.store) is opened[1]
            assert optimizer.host_grads is host_grads  # the engine and the stage's hook hold this object
            offloaded = {id(c.tensor) for chunks in optimizer.group_chunks for c in chunks if c.offloaded}
            assert set(host_grads._host) == offloaded and offloaded <= {id(t) for t in tensors}
        grad = _grads(step, numel)
        reference.grad = grad.clone()
        torch_opt.step()
        for t, g in zip(tensors, grad.split([t.numel() for t in tensors])):
            t.grad = g.clone()
        optimizer.step()
        optimizer.forget_grads()
        torch.testing.assert_close(torch.cat(tensors), reference, rtol=0, atol=1e-6)


def test_relayout_needs_a_way_to_reopen_the_store() -> None:
    inner = torch.optim.AdamW([torch.zeros(4)], lr=0.01)
    optimizer = StreamedAdam(inner, HostStore(pin_memory=False), chunk_numel=16)
    with pytest.raises(RuntimeError, match="reopen its store"):
        optimizer.relayout(None)
