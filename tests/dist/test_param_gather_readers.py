"""Parameters read without their owning module's forward, under ``overlap_param_gather`` (ZeRO-1/2).

[Note: owners read without their forward] in zero/param_gather.py: torch's ``MultiheadAttention`` reads
``out_proj.weight`` without calling ``out_proj``; a pipeline stage runs the tied head through ``forward_fn`` without
the tied module's forward. Their buckets must be landed before the reader runs. Asserted through the gather's state
machine (which buckets are pending at the read), and for MHA also by exact loss parity with a slow peer.
"""

from __future__ import annotations

import time
from typing import Any

import torch


def _buckets_of(states: Any, param: torch.Tensor) -> set[int]:
    index = next(i for i, p in enumerate(states.packed.params) if p is param)
    lo, hi = states.layout.span(index)
    return {k for k, b in enumerate(states.layout.buckets) if lo < b.end and b.start < hi}


def _slow_peer(engine: Any, rank: int) -> None:
    """Rank 1 launches its half of every gather 0.5 s late (the note allows a peer that slow)."""
    launch = engine.states.after_optimizer_step

    def slow() -> None:
        if rank == 1:
            time.sleep(0.5)
        launch()

    engine.states.after_optimizer_step = slow


def _mha_run(rank: int, overlap: bool) -> dict:
    import shardspeed

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    model = torch.nn.Sequential(layer, torch.nn.Linear(16, 1))
    zero = {"stage": 1, "reduce_bucket_size": 300, "allgather_bucket_size": 300, "overlap_param_gather": overlap}
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    config["zero_optimization"] = zero
    engine, *_ = shardspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    _slow_peer(engine, rank)
    states, pending_at_attention = engine.states, []
    out_proj = _buckets_of(states, layer.self_attn.out_proj.weight)

    def spy(module: Any, args: Any) -> None:  # registered after the gather's own pre-hook: runs after it
        pending_at_attention.append(sorted(out_proj & set(states.param_gather.pending_buckets())))

    layer.self_attn.register_forward_pre_hook(spy)
    g, losses, waited = torch.Generator().manual_seed(rank), [], set()
    for _ in range(3):
        loss = engine(torch.randn(2, 4, 16, generator=g)).pow(2).mean()
        waited |= set(states.param_gather.waited)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.destroy()
    return {
        "losses": losses,
        "pending_at_attention": pending_at_attention,
        "buckets": len(states.layout.buckets),
        "out_proj_waited_in_forward": bool(out_proj & waited),
    }


def _mha(rank: int, world: int) -> dict:
    return {overlap: _mha_run(rank, overlap) for overlap in (False, True)}


def test_multihead_attention_out_proj_is_landed_before_attention_runs(dist_run) -> None:
    for r in dist_run(_mha, 2):
        on = r[True]
        assert on["buckets"] > 2
        assert on["out_proj_waited_in_forward"]  # out_proj's bucket was pending after a step: the test bites
        assert on["pending_at_attention"] == [[], [], []]
        assert on["losses"] == r[False]["losses"]  # exactly: no stale half of out_proj.weight was read


# --- pipeline at stage 1: the tied head through forward_fn -------------------------------------------------------
def _pipe_tied(rank: int, world: int) -> dict:
    import pipe_models
    from pipe_models import make_batches, rank_iterator
    from test_pipe_parity import MODEL, Case, _config

    import shardspeed
    from shardspeed.pipe import PipelineModule, TiedLayerSpec
    from shardspeed.topology import MeshShape, Topology

    holder: dict[str, Any] = {}
    seen: list[list[int]] = []

    def spy(embedding: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        engine = holder.get("engine")
        if engine is not None:
            tied = _buckets_of(engine.states, embedding.weight)
            seen.append(sorted(tied & set(engine.states.param_gather.pending_buckets())))
        return pipe_models.tied_head(embedding, x)

    layers = pipe_models.gpt_layers(**MODEL, tied=True)
    layers = [
        TiedLayerSpec(s.key, s.typename, *s.module_args, forward_fn=spy, **s.module_kwargs)
        if getattr(s, "forward_fn", None) is pipe_models.tied_head
        else s
        for s in layers
    ]
    topology = Topology.build(MeshShape(pipe=2, data=world // 2))
    module = PipelineModule(layers, topology=topology, loss_fn=pipe_models.gpt_loss_fn, partition_method="uniform")
    config = _config(Case(world=world, zero=1))
    config["zero_optimization"] |= {"reduce_bucket_size": 200, "allgather_bucket_size": 200}
    engine, *_ = shardspeed.initialize(model=module, config=config)
    holder["engine"] = engine
    _slow_peer(engine, rank)
    batches = make_batches(3, 4, 2, engine.topology.data.size, vocab=MODEL["vocab"], seq=MODEL["seq"])
    it = rank_iterator(batches, 4, engine.topology.data.rank, engine.topology.data.size)
    for _ in range(3):
        engine.train_batch(it)
    return {"stage": engine.topology.pipe.rank, "seen": seen, "buckets": len(engine.states.layout.buckets)}


def test_pipeline_tied_head_reads_a_landed_bucket(dist_run) -> None:
    for r in dist_run(_pipe_tied, 4):
        if r["stage"] == 1:
            assert r["buckets"] > 2 and len(r["seen"]) == 12  # 3 batches × 4 micro-batches
            assert all(pending == [] for pending in r["seen"]), r["seen"]
