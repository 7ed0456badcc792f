"""``engine.flops_profiler`` on several ranks: under ZeRO-3 the parameter counts are the full ones (not the empty
placeholders) and the FLOPs those of stage 0; the whole-model figure is summed over the model scope."""

from __future__ import annotations

import torch

import shardspeed
from shardspeed.demo.model import GPT, GPTConfig

CFG = GPTConfig(vocab_size=64, context_length=16, n_layer=2, d_model=32, n_head=2)
MB, GAS, SEQ = 2, 2, 16


def _profile(rank: int, world: int, stage: int) -> dict:
    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        # threshold 0: every parameter partitioned (the default keeps this small model's tensors whole)
        "zero_optimization": {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})},
        "flops_profiler": {"enabled": True, "profile_step": 1, "detailed": True},
        "steps_per_print": 1000,
    }
    engine, *_ = shardspeed.initialize(model=GPT(CFG), config=config)
    g = torch.Generator().manual_seed(10 + rank)
    for _ in range(2 * GAS):
        tokens = torch.randint(0, CFG.vocab_size, (MB, SEQ), generator=g)
        engine.backward(engine(tokens, tokens))
        engine.step()
    prof = engine.flops_profiler
    fig = prof.figures
    local_params = sum(p.numel() for p in engine.module.parameters())
    return {
        "per_sample": prof.model_flops_per_sample,
        "model_params": prof.model_params,
        "params": fig.params,
        "qkv_params": next(s.params for s in fig.modules if s.path == "blocks.0.attn.qkv"),
        "fwd": fig.flops("forward"),
        "bwd": fig.flops("backward"),
        "local_params": local_params,
        "summary": "\n".join(prof.summary),
    }


def test_zero3_counts_full_parameters_and_the_same_flops_as_stage0(dist_run) -> None:
    stage0 = dist_run(_profile, 2, 0)
    stage3 = dist_run(_profile, 2, 3)
    dense = GPT(CFG)
    weights = sum(p.numel() for n, p in dense.named_parameters() if p.dim() == 2 and "position" not in n)
    per_sample = 6 * SEQ * weights + 12 * CFG.n_layer * SEQ * CFG.d_model * SEQ
    for rank in range(2):
        assert stage3[rank]["local_params"] < dense.num_parameters()  # really partitioned…
        for key in ("params", "model_params"):
            assert stage3[rank][key] == stage0[rank][key] == dense.num_parameters(), key  # …counted whole
        assert stage3[rank]["qkv_params"] == stage0[rank]["qkv_params"] == 32 * 96 + 96
        assert stage3[rank]["fwd"] == stage0[rank]["fwd"] and stage3[rank]["bwd"] == stage0[rank]["bwd"]
        assert stage3[rank]["per_sample"] == stage0[rank]["per_sample"] == per_sample
    assert "params per GPU:" in stage3[0]["summary"] and "(qkv): Linear(" in stage3[0]["summary"]


PIPE_MODEL = {"vocab": 32, "dim": 16, "n_blocks": 2, "seq": 6}
PIPE_M = 3


def _pipe_profile(rank: int, world: int) -> dict:
    from pipe_models import gpt_layers, gpt_loss_fn, make_batches, rank_iterator

    from shardspeed.pipe import PipelineModule
    from shardspeed.topology import MeshShape, Topology

    topology = Topology.build(MeshShape(pipe=2, data=1))
    module = PipelineModule(
        gpt_layers(**PIPE_MODEL), topology=topology, loss_fn=gpt_loss_fn, seed_layers=True, partition_method="uniform"
    )
    config = {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": PIPE_M,
        "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
        "flops_profiler": {"enabled": True, "profile_step": 1},
        "steps_per_print": 1000,
    }
    engine, *_ = shardspeed.initialize(model=module, config=config)
    batches = make_batches(3, PIPE_M, MB, 1, vocab=PIPE_MODEL["vocab"], seq=PIPE_MODEL["seq"])
    it = rank_iterator(batches, PIPE_M, 0, 1)
    for _ in range(3):
        engine.train_batch(it)
    prof = engine.flops_profiler
    fig = prof.figures
    return {
        "per_sample": prof.model_flops_per_sample,
        "model_params": prof.model_params,
        "stage_flops": fig.flops("forward") + fig.flops("backward"),
        "forwards": fig.phases["forward"].count,
    }


def test_pipeline_whole_model_figure_sums_the_stages(dist_run) -> None:
    """PP=2: each stage counts its own layers; the model-scope sum per sample equals the dense model's."""
    from pipe_models import reference_model

    from shardspeed.profiling.session import ProfileSession

    results = dist_run(_pipe_profile, 2)
    dense = reference_model(**PIPE_MODEL)
    tokens = torch.randint(0, PIPE_MODEL["vocab"], (MB, PIPE_MODEL["seq"]))
    session = ProfileSession(dense)
    session.start()
    session.begin_phase("forward")
    loss = dense.loss(tokens, tokens)
    session.end_phase("forward")
    session.begin_phase("backward")
    loss.backward()
    session.end_phase("backward")
    session.stop()
    fig = session.figures()
    dense_per_sample = (fig.flops("forward") + fig.flops("backward")) / MB
    assert all(r["forwards"] == PIPE_M for r in results)  # every micro-batch of the train_batch profiled
    assert 0 < results[0]["stage_flops"] < PIPE_M * MB * dense_per_sample  # a stage is a part …
    assert sum(r["stage_flops"] for r in results) == PIPE_M * MB * dense_per_sample  # … the stages the whole
    for r in results:
        assert r["per_sample"] == dense_per_sample
        assert r["model_params"] == sum(p.numel() for p in dense.parameters())  # the tied copy counted once


TP_MODEL = {"vocab": 32, "h": 16, "heads": 4, "ffn": 24, "layers": 2}
TP_SEQ = 6


def _tp_batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)  # the same batch on both tensor ranks
    ids = torch.randint(0, TP_MODEL["vocab"], (MB, TP_SEQ), generator=g)
    return ids, ids


def _tp_profile(rank: int, world: int) -> dict:
    from tp_block import TPTinyLM

    from shardspeed.tensor_parallel import TensorParallel
    from shardspeed.topology import MeshShape, Topology

    topology = Topology.build(MeshShape(tensor=2, data=1))
    torch.manual_seed(0)
    model = TPTinyLM(TensorParallel.from_topology(topology), **TP_MODEL)
    config = {
        "train_micro_batch_size_per_gpu": MB,
        "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
        "flops_profiler": {"enabled": True, "profile_step": 0},
        "steps_per_print": 1000,
    }
    engine, *_ = shardspeed.initialize(model=model, mpu=topology, config=config)
    ids, labels = _tp_batch(rank)
    engine.backward(engine(ids, labels))
    engine.step()
    prof = engine.flops_profiler
    fig = prof.figures
    return {
        "per_sample": prof.model_flops_per_sample,
        "model_params": prof.model_params,
        "params": fig.params,
        "local_params": sum(p.numel() for p in model.parameters()),
        "summary": "\n".join(prof.summary),
    }


def test_tensor_parallel_counts_slices_per_rank_and_the_model_once(dist_run) -> None:
    """TP=2: "params per GPU" is the rank's slices; the model's parameters sum to the dense count; the model FLOPs
    are the dense model's plus the replicated head once more ([Note: the whole-model figure])."""
    from tp_block import TPTinyLM, dense_tp

    from shardspeed.profiling.session import ProfileSession

    results = dist_run(_tp_profile, 2)
    torch.manual_seed(0)
    dense = TPTinyLM(dense_tp(), **TP_MODEL)
    ids, labels = _tp_batch(0)
    session = ProfileSession(dense)
    session.start()
    session.begin_phase("forward")
    loss = dense(ids, labels)
    session.end_phase("forward")
    session.begin_phase("backward")
    loss.backward()
    session.end_phase("backward")
    session.stop()
    fig = session.figures()
    dense_per_sample = (fig.flops("forward") + fig.flops("backward")) / MB
    head = 6 * TP_SEQ * TP_MODEL["h"] * TP_MODEL["vocab"]  # fwd + bwd of the replicated head, per sample
    n_dense = sum(p.numel() for p in dense.parameters())
    for r in results:
        assert r["params"] == r["local_params"] < n_dense
        assert r["model_params"] == n_dense
        assert r["per_sample"] == dense_per_sample + head
    assert "params of model (sum over tensor/pipe ranks): " in results[0]["summary"]
