"""AutoTP inside ``initialize``: a script written for the dense model keeps working when the config turns
``tensor_parallel.autotp_size`` on — its ``model_parameters`` (a list, or groups) and a client optimizer built before
``initialize`` are remapped to the sliced parameters ([Note: parameters replaced by AutoTP])."""

from __future__ import annotations

import pytest
import torch
from test_tp_parity import _global, _hf

import shardspeed

pytest.importorskip("transformers")
STEPS, MICRO, SEQ = 3, 2, 8


def _groups(model: torch.nn.Module) -> list[dict]:
    """Two groups with different lr: the sliced projections' group must keep its hyperparameters."""
    proj = [p for n, p in model.named_parameters() if "proj" in n]
    rest = [p for n, p in model.named_parameters() if "proj" not in n]
    return [{"params": proj, "lr": 0.05}, {"params": rest, "lr": 0.01}]


def _run(rank: int, world: int, how: str) -> float:
    torch.manual_seed(0)
    model = _hf("llama")
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "tensor_parallel": {"autotp_size": 2},
        "steps_per_print": 1000,
    }
    if how == "client_optimizer":
        engine, *_ = shardspeed.initialize(model=model, optimizer=torch.optim.SGD(_groups(model)), config=config)
    else:
        config["optimizer"] = {"type": "SGD", "params": {"lr": 0.01}}
        engine, *_ = shardspeed.initialize(model=model, model_parameters=_groups(model), config=config)
    assert engine.topology.tensor.size == 2 and engine.topology.data.size == 1
    owned = {id(p) for p in engine.module.parameters()}
    assert all(id(p) in owned for g in engine.optimizer.param_groups for p in g["params"])
    tokens = torch.randint(0, 64, (STEPS, MICRO, SEQ), generator=torch.Generator().manual_seed(3))
    for step in range(STEPS):
        loss = engine(input_ids=tokens[step], labels=tokens[step]).loss
        engine.backward(loss)
        engine.step()
    got = _global(engine)
    torch.manual_seed(0)
    dense = _hf("llama")
    opt = torch.optim.SGD(_groups(dense))
    for step in range(STEPS):
        opt.zero_grad()
        dense(input_ids=tokens[step], labels=tokens[step]).loss.backward()
        opt.step()
    return max((got[n] - p.detach()).abs().max().item() for n, p in dense.named_parameters())


@pytest.mark.parametrize("how", ["client_optimizer", "model_parameters"])
def test_dense_references_are_remapped_to_the_sliced_parameters(dist_run, how: str) -> None:
    assert max(dist_run(_run, 2, how)) <= 1e-5


def _stepped_optimizer(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = _hf("llama")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(input_ids=torch.zeros(1, 4, dtype=torch.long), labels=torch.zeros(1, 4, dtype=torch.long)).loss.backward()
    optimizer.step()  # now it holds moments of the dense shapes
    config = {"train_micro_batch_size_per_gpu": MICRO, "tensor_parallel": {"autotp_size": 2}}
    shardspeed.initialize(model=model, optimizer=optimizer, config=config)


def test_an_optimizer_holding_dense_state_is_one_clear_error(dist_run) -> None:
    from harness import RankFailure

    with pytest.raises(RankFailure) as failure:
        dist_run(_stepped_optimizer, 2)
    messages = failure.value.messages()
    assert len(messages) == 2 and len(set(messages)) == 1, messages
    assert "already holds state" in messages[0] and "autotp_size" in messages[0]
