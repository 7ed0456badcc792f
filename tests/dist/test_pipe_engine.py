"""The pipeline engine end to end: ``initialize(model=PipelineModule(...))`` → ``train_batch`` / ``eval_batch``.

Parity: the tiny GPT of ``pipe_models.py`` (tied embedding/head across the first and last stage) trained by the
pipeline engine equals plain torch on the whole global batch in one process (fp32, 5 steps, ≤ 1e-5), for each
schedule, ZeRO 0 and 1, AdamW with clipping and SGD, PP=2 and PP=2 × DP=2. Then DeepSpeed's API around it: the
loss broadcast to every stage, only the first/last stages reading data, forward/backward/step refused, the live
activation count under 1F1B, eval_batch, and the configuration errors.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from parity import optimizer_config, torch_optimizer
from pipe_models import (
    gpt_layers,
    gpt_loss_fn,
    make_batches,
    rank_iterator,
    reference_model,
    reference_train,
)

import shardspeed
from shardspeed.topology import MeshShape, Topology

M, MB, STEPS = 4, 2, 5
MODEL = {"vocab": 32, "dim": 16, "n_blocks": 2, "seq": 6}
LR = {"adamw": 3e-3, "sgd": 0.05}


def _config(zero: int, kind: str, clip: float, schedule: str = "1f1b", **pipeline: Any) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": M,
        "optimizer": optimizer_config(kind, LR[kind]),
        "gradient_clipping": clip,
        "zero_optimization": {"stage": zero},
        "pipeline": {"schedule": schedule, **pipeline},
        "steps_per_print": 1000,
    }


def _engine(
    world: int,
    pp: int,
    config: dict,
    *,
    tied: bool = True,
    virtual_stages: int = 1,
    n_blocks: int | None = None,
    loss_fn: Any = gpt_loss_fn,
    training_data: Any = None,
) -> Any:
    from shardspeed.pipe import PipelineModule

    topology = Topology.build(MeshShape(pipe=pp, data=world // pp))
    model = {**MODEL, "n_blocks": n_blocks or MODEL["n_blocks"]}
    module = PipelineModule(
        gpt_layers(**model, tied=tied),
        topology=topology,
        loss_fn=loss_fn,
        seed_layers=True,
        partition_method="uniform",
        virtual_stages=virtual_stages,
    )
    engine, *_ = shardspeed.initialize(model=module, config=config, training_data=training_data)
    return engine


def _train_parity(rank: int, world: int, pp: int, zero: int, kind: str, schedule: str, v: int) -> dict:
    clip = 0.05 if kind == "adamw" else 0.0
    engine = _engine(world, pp, _config(zero, kind, clip, schedule), virtual_stages=v)
    dp = world // pp
    batches = make_batches(STEPS, M, MB, dp, vocab=MODEL["vocab"], seq=MODEL["seq"])
    it = rank_iterator(batches, M, engine.topology.data.rank, dp)
    losses = [float(engine.train_batch(it)) for _ in range(STEPS)]

    ref = reference_model(**MODEL)
    ref_losses = reference_train(
        ref, batches, torch_optimizer(kind, ref.parameters(), LR[kind]), micro_batches=M, clip=clip
    )
    ref_params = dict(ref.named_parameters())
    names = [n for n, _ in engine.module.named_parameters()]
    diff = max(float((p.detach() - ref_params[n].detach()).abs().max()) for n, p in engine.module.named_parameters())
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "diff": diff,
        "names": names,
        "steps": engine.global_steps,
        "samples": engine.global_samples,
        "stats": engine.pipe_stats,
        "norm": engine.get_global_grad_norm(),
    }


@pytest.mark.parametrize(
    ("zero", "kind", "schedule", "v"),
    [
        (0, "adamw", "1f1b", 1),
        (1, "sgd", "1f1b", 1),
        pytest.param(1, "adamw", "gpipe", 1, marks=pytest.mark.slow),
        pytest.param(0, "sgd", "interleaved", 2, marks=pytest.mark.slow),
    ],
)
def test_pp2_parity_with_single_process_reference(dist_run, zero: int, kind: str, schedule: str, v: int) -> None:
    results = dist_run(_train_parity, 2, 2, zero, kind, schedule, v)
    first, last = results
    assert "tied_modules.embed.weight" in first["names"] and "tied_modules.embed.weight" in last["names"]
    for r in results:
        assert r["diff"] <= 1e-5, r["diff"]
        assert r["losses"] == pytest.approx(r["ref_losses"], abs=1e-5)
        assert r["steps"] == STEPS and r["samples"] == STEPS * M * MB
    assert first["losses"] == last["losses"]  # broadcast from the last stage, bit for bit
    if kind == "adamw":
        assert first["losses"][-1] < first["losses"][0]


def test_pp2_dp2_zero1_parity(dist_run) -> None:
    results = dist_run(_train_parity, 4, 2, 1, "adamw", "1f1b", 1)
    for r in results:
        assert r["diff"] <= 1e-5, r["diff"]
        assert r["losses"] == pytest.approx(r["ref_losses"], abs=1e-5)
        assert r["samples"] == STEPS * M * MB * 2
    assert all(r["losses"] == results[0]["losses"] for r in results)


class CountingIterator:
    def __init__(self, items: list) -> None:
        self.items, self.reads = iter(items), 0

    def __iter__(self) -> CountingIterator:
        return self

    def __next__(self) -> Any:
        self.reads += 1
        return next(self.items)


def _data_and_buffers(rank: int, world: int) -> dict:
    engine = _engine(world, world, _config(0, "sgd", 0.0), tied=False, n_blocks=2)
    batches = make_batches(2, M, MB, 1, vocab=MODEL["vocab"], seq=MODEL["seq"])
    it = CountingIterator(list(rank_iterator(batches, M, 0, 1)))
    for _ in range(2):
        loss = engine.train_batch(it)
    stats = engine.pipe_stats
    return {
        "reads": it.reads,
        "first": engine.is_first_stage(),
        "last": engine.is_last_stage(),
        "loss": float(loss),
        "peak": stats.peak_buffers,
        "forwards": stats.forwards,
        "backwards": stats.backwards,
        "messages": stats.messages,
    }


def test_only_first_and_last_stage_read_data_and_1f1b_bounds_live_activations(dist_run) -> None:
    results = dist_run(_data_and_buffers, 4)
    assert [r["reads"] for r in results] == [2 * M, 0, 0, 2 * M]
    assert [(r["first"], r["last"]) for r in results] == [(True, False), (False, False), (False, False), (False, True)]
    assert len({r["loss"] for r in results}) == 1
    for s, r in enumerate(results):
        assert r["forwards"] == r["backwards"] == M
        assert r["peak"] <= 4  # 1F1B: at most p micro-batches' activations held
        assert r["peak"] == min(4 - s, M)
    assert results[0]["messages"] > 0


def _api(rank: int, world: int) -> dict:
    from shardspeed.pipe.engine import PipelineEngine, PipelineError

    dataset = list(zip(*(x.unbind(0) for x in make_batches(1, M, MB, 1, vocab=MODEL["vocab"], seq=MODEL["seq"])[0])))
    engine = _engine(world, world, _config(0, "sgd", 0.0), training_data=dataset)
    assert isinstance(engine, PipelineEngine)
    errors = []
    for call in (lambda: engine(torch.zeros(1)), lambda: engine.backward(torch.zeros(())), engine.step):
        with pytest.raises(PipelineError, match=r"Only train_batch\(\) is accessible in pipeline mode"):
            call()
        errors.append(True)
    batches = make_batches(1, M, MB, 1, vocab=MODEL["vocab"], seq=MODEL["seq"])
    if engine.is_first_stage():  # a backward outside train_batch() reaching the stage's parameters is refused
        with pytest.raises(RuntimeError, match=r"outside train_batch\(\)"):
            engine.module(batches[0][0][:MB]).sum().backward()
    ref = reference_model(**MODEL)
    with torch.no_grad():
        ref_loss = sum(float(ref.loss(t, lab)) for t, lab in zip(*(x.chunk(M) for x in batches[0]))) / M
    loss = engine.eval_batch(iter(list(rank_iterator(batches, M, 0, 1))))
    value, logits = engine.eval_batch(iter(list(rank_iterator(batches, M, 0, 1))), return_logits=True)
    per_micro = engine.eval_batch(iter(list(rank_iterator(batches, M, 0, 1))), reduce_output=None)
    no_bcast = engine.eval_batch(iter(list(rank_iterator(batches, M, 0, 1))), bcast_loss=False)
    # Another micro-batch size: the activation shapes negotiated so far no longer hold until they are reset.
    steps_after_eval = engine.global_steps
    smaller = [(t[:1], lab[:1]) for t, lab in rank_iterator(batches, M, 0, 1)]
    engine.reset_activation_shape()
    with torch.no_grad():
        ref_small = sum(float(ref.loss(t, lab)) for t, lab in smaller) / M
    small = engine.eval_batch(iter(smaller))
    engine.reset_activation_shape()
    trained = engine.train_batch()  # no iterator: the engine's training data (initialize(training_data=...))
    train_stats = engine.pipe_stats
    # Evaluation right after training, no reset: its activations do not require grad, its streams are its own.
    after = engine.eval_batch(iter(list(rank_iterator(batches, M, 0, 1))))
    eval_stats = engine.eval_pipe_stats
    return {
        "errors": len(errors),
        "loss": float(loss),
        "ref": ref_loss,
        "value": float(value),
        "logits": None if logits is None else tuple(logits.shape),
        "per_micro": per_micro.tolist(),
        "no_bcast": None if no_bcast is None else float(no_bcast),
        "steps": steps_after_eval,
        "small": float(small),
        "ref_small": ref_small,
        "trained": float(trained),
        "steps_after_train": engine.global_steps,
        "after": float(after),
        # eval_batch keeps its figures apart: the training batch's pipe_stats survive it
        "train_stats_kept": engine.pipe_stats is train_stats and train_stats.backwards == M,
        "eval_stats": (eval_stats.forwards, eval_stats.backwards),
    }


def test_api_refuses_forward_backward_step_and_eval_batch_broadcasts(dist_run) -> None:
    first, last = dist_run(_api, 2)
    for r in (first, last):
        assert r["errors"] == 3
        assert r["loss"] == pytest.approx(r["ref"], abs=1e-6)
        assert r["value"] == r["loss"]
        assert len(r["per_micro"]) == M and sum(r["per_micro"]) / M == pytest.approx(r["loss"], abs=1e-6)
        assert r["steps"] == 0  # eval_batch does not step
        assert r["small"] == pytest.approx(r["ref_small"], abs=1e-6)  # renegotiated shapes
        assert r["steps_after_train"] == 1 and r["trained"] == first["trained"]
        assert r["after"] == first["after"] and r["after"] != r["loss"]  # the trained model, on every stage
        assert r["train_stats_kept"] and r["eval_stats"] == (M, 0), r
    assert first["logits"] is None and last["logits"] == (MB, MODEL["seq"], MODEL["vocab"])
    assert first["no_bcast"] is None and last["no_bcast"] == pytest.approx(last["loss"], abs=1e-6)


CONFIG_ERRORS = [
    ({"schedule": "interleaved"}, 1, "needs a PipelineModule with virtual_stages >= 2"),
    ({"schedule": "1f1b"}, 2, 'virtual_stages=2 (interleaved model chunks) but pipeline.schedule is "1f1b"'),
    (
        {"zero_hold": "micro_batch"},
        1,
        "zero_hold='micro_batch' cannot be used with tied weights across pipeline stages (embed)",
    ),
    ({"stages": 4}, 1, "pipeline.stages is 4 but the pipeline module has 2 stages"),
    ({"schedule": "interleaved", "gas": 3}, 2, "gradient_accumulation_steps (the micro-batches of a train_batch)"),
]


def _config_errors(rank: int, world: int) -> tuple[list[str], list[str]]:
    import logging

    from shardspeed.log import logger

    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logger.addHandler(handler)
    _engine(world, world, _config(0, "sgd", 0.0, activation_checkpoint_interval=2))  # the module's 0 is used
    warnings = [m for m in seen if "activation_checkpoint_interval" in m]
    for zero in (1, 2):  # per-micro-batch reduction saves nothing at ZeRO 0/1: one warning (rank 0), none at 2
        _engine(world, world, _config(zero, "sgd", 0.0, zero_hold="micro_batch"), tied=False)
    warnings += [m for m in seen if "only multiplies the gradient traffic" in m]
    messages = []
    for pipeline, v, _ in CONFIG_ERRORS:
        pipeline = dict(pipeline)
        gas = pipeline.pop("gas", M)
        try:
            _engine(
                world,
                world,
                {**_config(1, "sgd", 0.0, **pipeline), "gradient_accumulation_steps": gas},
                virtual_stages=v,
            )
        except ValueError as err:
            messages.append(str(err))
        else:
            messages.append("no error")
    return messages, warnings


def test_configuration_errors_on_every_rank(dist_run) -> None:
    """Each is decided from the config and the module's structure: the same error on every rank, no hang. A key
    the module decides (activation_checkpoint_interval) is one warning on rank 0."""
    results = dist_run(_config_errors, 2)
    for messages, _ in results:
        for message, (_, _, expected) in zip(messages, CONFIG_ERRORS, strict=True):
            assert expected in message, message
    (_, first), (_, last) = results
    assert len(first) == 2 and "the module's value is used" in first[0] and last == []
    assert "zero_hold='micro_batch' at zero_optimization.stage 1 only multiplies" in first[1]


def _no_data(rank: int, world: int) -> str:
    engine = _engine(world, world, _config(0, "sgd", 0.0))
    try:
        engine.train_batch()
    except Exception as err:  # ValueError here, or a peer's (PeerFailedError naming it) if that one came first
        return str(err)
    return "no error"


def test_train_batch_without_data_is_a_clear_error(dist_run) -> None:
    for message in dist_run(_no_data, 2):
        assert "ValueError: train_batch() has no data: pass data_iter" in message or message.startswith(
            "train_batch() has no data: pass data_iter"
        ), message


def _failing(rank: int, world: int) -> tuple[str, str, float]:
    calls = [0]

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("loss exploded at micro-batch 2")
        return gpt_loss_fn(logits, labels)

    config = {**_config(1, "adamw", 0.05), "fault_tolerance": {"watch_interval_s": 0.1}}
    engine = _engine(world, world, config, loss_fn=loss_fn)
    batches = make_batches(1, M, MB, 1, vocab=MODEL["vocab"], seq=MODEL["seq"])
    start = time.monotonic()
    try:
        engine.train_batch(rank_iterator(batches, M, 0, 1))
    except Exception as err:
        elapsed = time.monotonic() - start
        if engine.is_last_stage():  # the harness exits a rank at once: stay until the peers read the failure
            time.sleep(1.0)
        return type(err).__name__, str(err), elapsed
    return "none", "", 0.0


def test_failure_inside_a_micro_batch_reaches_every_stage(dist_run) -> None:
    """The last stage's loss raises mid-batch; the first stage, waiting for a gradient, raises too (no hang)."""
    (first_type, first_msg, first_s), (last_type, last_msg, last_s) = dist_run(_failing, 2)
    assert last_type == "RuntimeError" and "loss exploded at micro-batch 2" in last_msg
    assert first_type == "PeerFailedError" and "loss exploded at micro-batch 2" in first_msg, first_msg
    assert max(first_s, last_s) < 10.0


def _zero_composed(rank: int, world: int, zero: int, hold: str, tied: bool) -> tuple[float, float]:
    config = _config(zero, "adamw", 0.05, zero_hold=hold)
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # nothing stays gathered by its size
    engine = _engine(world, 2, config, tied=tied)
    dp = world // 2
    batches = make_batches(STEPS, M, MB, dp, vocab=MODEL["vocab"], seq=MODEL["seq"])
    it = rank_iterator(batches, M, engine.topology.data.rank, dp)
    losses = [float(engine.train_batch(it)) for _ in range(STEPS)]
    ref = reference_model(**MODEL, tied=tied)
    ref_losses = reference_train(
        ref, batches, torch_optimizer("adamw", ref.parameters(), LR["adamw"]), micro_batches=M, clip=0.05
    )
    full = engine.module_state_dict()  # gathered under ZeRO-3, over the pipe axis too
    ref_params = dict(ref.named_parameters())
    names = [n for n, _ in engine.module.named_parameters()]
    diff = max(float((full[n].float() - ref_params[n].detach()).abs().max()) for n in names)
    return max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)), diff


@pytest.mark.slow
@pytest.mark.parametrize(
    ("zero", "hold", "tied"),
    [(2, "step", True), (3, "step", True), (2, "micro_batch", False), (3, "micro_batch", False)],
)
def test_pp2_dp2_zero2_zero3_parity(dist_run, zero: int, hold: str, tied: bool) -> None:
    for loss_diff, param_diff in dist_run(_zero_composed, 4, zero, hold, tied):
        assert loss_diff <= 1e-5 and param_diff <= 1e-5, (loss_diff, param_diff)


def _checkpoint_across_degrees(rank: int, world: int, save_dir: str) -> tuple[list[float], list[float]]:
    batches = make_batches(4, M, MB, 2, vocab=MODEL["vocab"], seq=MODEL["seq"])

    def run(engine: Any, steps: range) -> list[float]:
        dp = engine.topology.data.size
        mine = rank_iterator([batches[i] for i in steps], M * 2 // dp, engine.topology.data.rank, dp)
        return [float(engine.train_batch(mine)) for _ in steps]

    def config(dp: int) -> dict:  # the same global batch at every degree: micro-batches × data ranks = 2M
        return {**_config(1, "adamw", 0.05), "gradient_accumulation_steps": M * 2 // dp}

    pp2 = _engine(world, 2, config(1))
    run(pp2, range(2))
    pp2.save_checkpoint(save_dir, tag="two")
    expected = run(pp2, range(2, 4))
    pp1 = _engine(world, 1, config(2))
    pp1.load_checkpoint(save_dir, tag="two")
    return expected, run(pp1, range(2, 4))


@pytest.mark.slow
def test_checkpoint_saved_at_pp2_continues_at_pp1(dist_run, tmp_path) -> None:
    """The pipeline engine's save/load (checkpoint/pipe_stages.py): a PP=2 checkpoint continues at PP=1 × DP=2
    with the losses the PP=2 run went on to have."""
    for expected, continued in dist_run(_checkpoint_across_degrees, 2, str(tmp_path / "ckpt")):
        assert continued == pytest.approx(expected, abs=1e-5)


def _reduced_precision(rank: int, world: int, dtype: str) -> dict:
    config = {**_config(0, "adamw", 0.05), dtype: {"enabled": True}}
    if dtype == "fp16":
        config["fp16"]["initial_scale_power"] = 8
    engine = _engine(world, 2, config)
    batches = make_batches(3, M, MB, 1, vocab=MODEL["vocab"], seq=MODEL["seq"])
    losses = [float(engine.train_batch(rank_iterator(batches[i : i + 1], M, 0, 1))) for i in range(3)]
    skipped, overflow = engine.skipped_steps, {}
    if dtype == "fp16":  # an Inf in one last-stage gradient only: every stage skips alike
        before = [p.detach().clone() for p in engine.module.parameters()]
        scale = engine.loss_scaler.scale
        if engine.is_last_stage():
            weight = engine.module.get_parameter(f"{MODEL['n_blocks'] + 2}.weight")  # the final LayerNorm
            weight.register_hook(lambda g: torch.full_like(g, float("inf")))
        engine.train_batch(rank_iterator(batches[:1], M, 0, 1))
        overflow = {
            "unchanged": all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters(), strict=True)),
            "scale": (scale, engine.loss_scaler.scale),  # hysteresis 2 (DeepSpeed's default): kept the first time
            "skipped": engine.skipped_steps,
        }
    ref = reference_model(**MODEL)
    ref_losses = reference_train(
        ref, batches, torch_optimizer("adamw", ref.parameters(), LR["adamw"]), micro_batches=M, clip=0.05
    )
    return {
        "diff": max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)),
        "skipped": skipped,
        "dtype": str(next(engine.module.parameters()).dtype),
        "overflow": overflow,
    }


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_bf16_fp16_train_close_to_fp32_reference(dist_run, dtype: str) -> None:
    """Reduced precision: the first stage's token ids pass, activations travel in the compute dtype, fp16's loss
    scale multiplies the last stage's loss and the norm is unscaled by it (no step skipped at a moderate scale);
    an overflow in one stage's gradients is agreed by every stage (all skip; the scale moves alike everywhere)."""
    results = dist_run(_reduced_precision, 2, dtype)
    for r in results:
        assert r["skipped"] == 0 and r["dtype"] == f"torch.{'bfloat16' if dtype == 'bf16' else 'float16'}"
        assert r["diff"] < 2e-2, r["diff"]
        if dtype == "fp16":
            assert r["overflow"] == {**results[0]["overflow"], "unchanged": True, "skipped": 1}


def _tensor_ranks_disagree(rank: int, world: int) -> tuple[str, str]:
    from shardspeed.tensor_parallel import TensorParallel

    topology = Topology.build(MeshShape(pipe=2, tensor=2))
    from shardspeed.pipe import PipelineModule

    module = PipelineModule(
        gpt_layers(**MODEL, tp=TensorParallel(topology.tensor)),
        topology=topology,
        loss_fn=gpt_loss_fn,
        seed_layers=True,
        partition_method="uniform",
    )
    config = {**_config(0, "sgd", 0.0), "fault_tolerance": {"watch_interval_s": 0.1}}
    engine, *_ = shardspeed.initialize(model=module, config=config)
    # Tensor rank 1 of the first stage reads other tokens: its tensor group must notice, and the last stage, which
    # waits on p2p, must stop too.
    seed = 7 + (topology.tensor.rank if engine.is_first_stage() else 0)
    batches = make_batches(1, M, MB, 1, vocab=MODEL["vocab"], seq=MODEL["seq"], seed=seed)
    try:
        engine.train_batch(rank_iterator(batches, M, 0, 1))
    except Exception as err:
        if engine.is_first_stage():  # the harness exits a rank at once: stay until the peers read the failure
            time.sleep(1.0)
        return type(err).__name__, str(err)
    return "none", ""


@pytest.mark.slow
def test_tensor_ranks_reading_different_batches_stop_every_stage(dist_run) -> None:
    results = dist_run(_tensor_ranks_disagree, 4)
    assert [t for t, _ in results[:2]] == ["BatchMismatchError"] * 2, results
    for kind, message in results[2:]:
        assert kind == "PeerFailedError" and "the first batch differs across the tensor-parallel group" in message
