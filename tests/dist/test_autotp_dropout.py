"""AutoTP with sequence parallelism and GPT-2's dropout inside the blocks, at TP=2: the blocks' masks differ per
tensor rank (each holds other tokens), the embedding dropout outside the region stays equal, and HF's gradient
checkpointing replays the forward's masks exactly ([Note: AutoTP block dropout streams])."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shardspeed.config import load_config
from shardspeed.params.spec import ParamSpecs
from shardspeed.tensor_parallel import TensorParallel, register_partial_grad_hooks
from shardspeed.tensor_parallel.autotp import apply_tensor_parallel
from shardspeed.topology import MeshShape, Topology

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH, P = 64, 8, 2, 0.5


def _model(world: int, attn: str) -> tuple[torch.nn.Module, TensorParallel]:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=16, resid_pdrop=P, embd_pdrop=P, attn_pdrop=P
    )
    model = transformers.GPT2LMHeadModel(config).float()
    model.config._attn_implementation = attn
    tp = TensorParallel.from_topology(Topology.build(MeshShape(tensor=world)), sequence_parallel=True)
    section = {"autotp_size": world, "sequence_parallel": True}
    settings = load_config({"train_micro_batch_size_per_gpu": 1, "tensor_parallel": section}, dp_world_size=1)
    apply_tensor_parallel(model, tp, settings.tensor_parallel)
    register_partial_grad_hooks(model, ParamSpecs.collect(model, tp.rank, tp.size), tp.axis, tp.collectives)
    return model.train(), tp


def _step(model: torch.nn.Module, masks: dict[str, list[torch.Tensor]]) -> dict[str, Any]:
    torch.manual_seed(7)  # the same default stream on every rank and in both runs
    model.zero_grad(set_to_none=True)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return {
        "loss": loss.detach(),
        "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
        "masks": {k: list(v) for k, v in masks.items()},
    }


def _run(rank: int, world: int, attn: str) -> dict[str, Any]:
    model, _ = _model(world, attn)
    masks: dict[str, list[torch.Tensor]] = {"embedding": [], "mlp": []}
    model.transformer.drop.register_forward_hook(lambda _m, _i, out: masks["embedding"].append(out.detach() == 0))
    model.transformer.h[0].mlp.dropout.register_forward_hook(lambda _m, _i, out: masks["mlp"].append(out.detach() == 0))
    plain = _step(model, masks)
    for v in masks.values():
        v.clear()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    checkpointed = _step(model, masks)
    return {"plain": plain, "checkpointed": checkpointed}


@pytest.mark.parametrize("attn", ["eager", pytest.param("sdpa", marks=pytest.mark.slow)])
def test_block_dropout_under_sequence_parallelism_differs_per_rank_and_replays(dist_run, attn: str) -> None:
    results = dist_run(_run, 2, attn)
    plain = [r["plain"] for r in results]
    assert not torch.equal(plain[0]["masks"]["mlp"][0], plain[1]["masks"]["mlp"][0])  # split: per-rank masks
    assert torch.equal(plain[0]["masks"]["embedding"][0], plain[1]["masks"]["embedding"][0])  # replicated
    for r in results:  # the recompute drew the forward's masks: the same loss, and gradients up to summation order
        a, b = r["plain"], r["checkpointed"]
        assert torch.equal(a["loss"], b["loss"])
        assert a["grads"].keys() == b["grads"].keys()
        # one wrong mask moves gradients by ~1e-2; the recompute's own rounding differs by ~1e-7
        assert all(torch.allclose(a["grads"][n], b["grads"][n], rtol=0, atol=1e-6) for n in a["grads"])
        forward, recompute = b["masks"]["mlp"]  # block 0's forward, then its (reentrant: whole) recompute
        assert torch.equal(forward, recompute) and torch.equal(forward, a["masks"]["mlp"][0])
