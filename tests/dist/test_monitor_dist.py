"""Monitors across ranks (gloo, world 2-4): only the writing rank writes (data rank 0; under a pipeline the last
stage), x = global samples, the loss values the engine returned, one memory gather per step with every rank's
figures, the missing-package and differing-config errors on every rank, a monitor added on one rank, destroy()
after a peer's failure, the pipeline's throughput window and reduction time, and W&B's offline files."""

from __future__ import annotations

import glob
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from pipe_models import gpt_layers, gpt_loss_fn, make_batches, rank_iterator

import shardspeed
from shardspeed.monitor import Monitor, MonitorConfigError, MonitorPackageError
from shardspeed.monitor.memory import model_state_total
from shardspeed.topology import MeshShape, Topology

STEPS, GAS, MB = 3, 2, 2


class Recorder(Monitor):
    def __init__(self) -> None:
        self.events: list[tuple[str, float, int]] = []

    def write_events(self, events) -> None:
        self.events.extend(events)


def _monitors(root: str, rank: int, *kinds: str) -> dict:
    # each rank points at its own directory, so a test sees which ranks wrote anything
    return {
        kind: {"enabled": True, "output_path": str(Path(root) / f"rank{rank}"), "job_name": "job"} for kind in kinds
    }


def _dp2(rank: int, world: int, root: str) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(16, 4), torch.nn.Flatten(), torch.nn.Linear(20, 1))
    config = {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": 2},
        "wall_clock_breakdown": True,
        "comms_logger": {"enabled": True},
        "steps_per_print": 1000,
        **_monitors(root, rank, "tensorboard", "csv_monitor"),
    }
    engine, *_ = shardspeed.initialize(model=model, config=config)
    recorder = Recorder()
    engine.monitor.add(recorder)
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(STEPS):
        for _ in range(GAS):
            loss = engine(torch.randint(0, 16, (MB, 5), generator=g)).square().mean()
            engine.backward(loss)
            engine.step()
        losses.append(float(loss.detach()))  # what the step's report carries: the last micro-step's loss
    gather = engine.comms_log.totals.get("all_gather:monitor.memory")
    result: dict[str, Any] = {
        "losses": losses,
        "events": recorder.events,
        "writes": engine.monitor.enabled,
        "model_states": model_state_total(engine.memory_breakdown()),
        "predicted": engine.predicted_memory.total(),
        "gather": None if gather is None else (gather.count, gather.elements),
    }
    engine.destroy()
    if rank == 0:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(str(Path(root) / "rank0" / "job"))
        acc.Reload()
        result["tb"] = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    return result


def test_data_rank_0_writes_losses_memory_and_wall_clock(dist_run, tmp_path: Path) -> None:
    results = dist_run(_dp2, 2, str(tmp_path))
    r0, r1 = results
    assert r0["writes"] and not r1["writes"] and r1["events"] == []
    assert (tmp_path / "rank0" / "job").is_dir() and not (tmp_path / "rank1").exists()
    xs = [8, 16, 24]  # x = global samples: micro 2 × GAS 2 × data 2 per step
    tb = r0["tb"]
    assert tb["Train/Samples/train_loss"] == [
        (x, float(torch.tensor(v, dtype=torch.float32))) for x, v in zip(xs, r0["losses"])
    ]
    assert [x for x, _ in tb["Train/Samples/lr"]] == xs
    assert [v for _, v in tb["Train/Samples/skipped_steps"]] == [0.0, 0.0, 0.0]
    assert "Train/Samples/grad_norm" not in tb  # only on steps that compute the norm anyway (none here)
    for rank, result in enumerate(results):  # every rank's figures, gathered to the writer
        assert tb[f"Memory/rank{rank}/predicted_model_state_bytes"][-1][1] == result["predicted"]
        assert tb[f"Memory/rank{rank}/model_state_bytes"][-1][1] == result["model_states"]
        assert all(v > 0 for _, v in tb[f"Memory/rank{rank}/host_peak_bytes"])
        assert f"Memory/rank{rank}/device_peak_bytes" not in tb  # CPU
        assert result["gather"] == (STEPS, STEPS * 2 * 5)  # one 5-figure all-gather per step, on every rank
    for x in xs:
        step = {tag.removeprefix("Train/Samples/"): v for tag, v, at in r0["events"] if at == x}
        backward = step["elapsed_time_ms_backward"]
        assert step["elapsed_time_ms_backward_inner"] + step["elapsed_time_ms_backward_allreduce"] == pytest.approx(
            backward, rel=1e-9
        )
        assert {"elapsed_time_ms_forward", "elapsed_time_ms_step", "samples_per_second", "tokens_per_second"} <= set(
            step
        )
        assert step["tokens_per_second"] == pytest.approx(5 * step["samples_per_second"])  # S = 5
    assert {(t, x) for t, _, x in r0["events"]} == {(t, x) for t, values in tb.items() for x, _ in values}


def _pp2(rank: int, world: int, root: str) -> dict:
    from shardspeed.pipe import PipelineModule

    vocab, seq, m = 32, 6, 4
    topology = Topology.build(MeshShape(pipe=2, data=1))
    module = PipelineModule(
        gpt_layers(vocab=vocab, dim=16, n_blocks=2, seq=seq, tied=True),
        topology=topology,
        loss_fn=gpt_loss_fn,
        seed_layers=True,
        partition_method="uniform",
    )
    config = {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": m,
        "optimizer": {"type": "SGD", "params": {"lr": 0.05}},
        "steps_per_print": 1000,
        **_monitors(root, rank, "csv_monitor"),
    }
    engine, *_ = shardspeed.initialize(model=module, config=config)
    recorder = Recorder()
    engine.monitor.add(recorder)
    batches = make_batches(2, m, MB, 1, vocab=vocab, seq=seq)
    it = rank_iterator(batches, m, 0, 1)
    losses = [float(engine.train_batch(it)) for _ in range(2)]
    engine.destroy()
    return {"losses": losses, "events": recorder.events, "last": engine.is_last_stage()}


def test_pipeline_last_stage_writes(dist_run, tmp_path: Path) -> None:
    first, last = dist_run(_pp2, 2, str(tmp_path))
    assert last["last"] and not first["last"]
    assert first["events"] == [] and not (tmp_path / "rank0").exists()
    rows = (tmp_path / "rank1" / "job" / "Train_Samples_train_loss.csv").read_text().splitlines()
    assert rows[0] == "step,train_loss"
    assert [tuple(map(float, row.split(","))) for row in rows[1:]] == [(8, last["losses"][0]), (16, last["losses"][1])]
    at: dict[tuple[str, int], float] = {(tag, x): value for tag, value, x in last["events"]}
    # token ids reach only the first stage; their S = 6 travels to the last one in the per-step gather, which is
    # waited one step later: from the second step on
    assert ("Train/Samples/tokens_per_second", 8) not in at
    assert at["Train/Samples/tokens_per_second", 16] == pytest.approx(6 * at["Train/Samples/samples_per_second", 16])
    for rank in (0, 1):  # both steps' figures; the last one written by engine.destroy()
        assert {x for tag, x in at if tag == f"Memory/rank{rank}/predicted_model_state_bytes"} == {8, 16}


def _missing_on_rank_1(rank: int, world: int, root: str) -> str:
    if rank == 1:
        sys.modules["tensorboard"] = None  # type: ignore[assignment] # this host lacks the monitor extra
    config = {"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    try:
        shardspeed.initialize(model=torch.nn.Linear(2, 2), config={**config, **_monitors(root, rank, "tensorboard")})
    except MonitorPackageError as err:
        return str(err)
    return "no error"


def test_missing_package_on_one_rank_is_the_same_error_on_every_rank(dist_run, tmp_path: Path) -> None:
    messages = dist_run(_missing_on_rank_1, 2, str(tmp_path))
    assert messages[0] == messages[1]
    assert messages[0].startswith(
        "tensorboard.enabled (tensorboard): the monitor's package does not import on rank(s) 1"
    )
    assert "pip install shardspeed[monitor]" in messages[0]
    assert not (tmp_path / "rank0").exists()  # nothing built before the agreement


def _wandb_offline(rank: int, world: int, root: str) -> list[str]:
    os.environ.update({"WANDB_MODE": "offline", "WANDB_DIR": root, "WANDB_SILENT": "true"})
    config = {
        "train_batch_size": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "wandb": {"enabled": True, "project": "shardspeed-test", "group": "g"},
    }
    engine, *_ = shardspeed.initialize(model=torch.nn.Linear(2, 2), config=config)
    for _ in range(2):
        engine.backward(engine(torch.ones(2, 2)).sum())
        engine.step()
    engine.destroy()  # finishes the run: its files are complete
    return sorted(glob.glob(os.path.join(root, "wandb", "offline-run-*", "*.wandb")))


def test_wandb_offline_run_files(dist_run, tmp_path: Path) -> None:
    pytest.importorskip("wandb")
    (files,) = dist_run(_wandb_offline, 1, str(tmp_path))
    assert len(files) == 1 and os.path.getsize(files[0]) > 0


def _train_steps(engine: Any, steps: int = 2) -> None:
    for _ in range(steps):
        engine.backward(engine(torch.ones(2, 2)).sum())
        engine.step()


def _add_on_rank_0(rank: int, world: int) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "comms_logger": {"enabled": True},
    }
    engine, *_ = shardspeed.initialize(model=torch.nn.Linear(2, 2), config=config)
    recorder = Recorder()
    if rank == 0:  # DeepSpeed's rank-0 pattern: changes no collective
        engine.monitor.add(recorder)
    _train_steps(engine)
    engine.destroy()
    gathered = "all_gather:monitor.memory" in engine.comms_log.totals
    return {"xs": sorted({x for _, _, x in recorder.events}), "gather": gathered}


def test_a_monitor_added_on_one_rank_only(dist_run) -> None:
    r0, r1 = dist_run(_add_on_rank_0, 2)
    assert r0["xs"] == [2, 4] and r1["xs"] == []
    assert not r0["gather"] and not r1["gather"]  # no config-enabled monitor: no memory gather


def _config_on_rank_0(rank: int, world: int, root: str) -> str:
    config = {"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    if rank == 0:  # DeepSpeed's '"enabled": rank == 0'
        config.update(_monitors(root, rank, "tensorboard", "csv_monitor"))
    try:
        shardspeed.initialize(model=torch.nn.Linear(2, 2), config=config)
    except MonitorConfigError as err:
        return str(err)
    return "no error"


def test_monitors_enabled_on_some_ranks_only_are_one_clear_error(dist_run, tmp_path: Path) -> None:
    messages = dist_run(_config_on_rank_0, 2, str(tmp_path))
    assert messages[0] == messages[1]
    assert "rank 0: tensorboard.enabled, csv_monitor.enabled; rank 1: none" in messages[0]
    assert not (tmp_path / "rank0").exists()  # nothing built before the agreement


def _destroy_after_peer_error(rank: int, world: int, root: str) -> dict:
    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "fault_tolerance": {"collective_timeout_s": 20},
        **_monitors(root, rank, "tensorboard", "csv_monitor"),
    }
    engine, *_ = shardspeed.initialize(model=torch.nn.Linear(2, 2), config=config)
    real, calls = engine.optimizer.step, [0]

    def step(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if rank == 1 and calls[0] == 2:  # rank 0 has launched step 1's memory gather; rank 1 never waits it
            raise RuntimeError("simulated OOM in the optimizer step")
        return real(*args, **kwargs)

    engine.optimizer.step = step
    trained = "no error"
    try:
        _train_steps(engine, 3)
    except Exception as err:
        trained = type(err).__name__
    engine.destroy()  # must not raise, and must finish the cleanup
    return {
        "trained": trained,
        "monitors_open": [type(m).__name__ for m in engine.monitor.monitors if getattr(m, "writer", None)],
        "csv_open": sum(len(getattr(m, "_files", {})) for m in engine.monitor.monitors),
        "hooks_left": bool(engine.states.reducer._hooks),
    }


def test_destroy_after_a_peers_failure_closes_everything(dist_run, tmp_path: Path) -> None:
    r0, r1 = dist_run(_destroy_after_peer_error, 2, str(tmp_path))
    assert r1["trained"] == "RuntimeError" and r0["trained"] == "PeerFailedError"
    for result in (r0, r1):
        assert result["monitors_open"] == [] and result["csv_open"] == 0 and not result["hooks_left"]
    rows = (tmp_path / "rank0" / "job" / "Train_Samples_train_loss.csv").read_text().splitlines()
    assert rows[0] == "step,train_loss" and rows[1].startswith("2,")


class _Sleepy(torch.nn.Module):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.lin, self.seconds = torch.nn.Linear(4, 4), seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return self.lin(x)


def _pipe_window(rank: int, world: int) -> dict:
    from shardspeed.pipe import PipelineModule

    torch.manual_seed(0)
    topology = Topology.build(MeshShape(pipe=2, data=1))
    layers = [_Sleepy(0.1), torch.nn.Linear(4, 1)]  # the first stage is slow: the last one waits to fill
    module = PipelineModule(layers, topology=topology, loss_fn=lambda out, y: (out - y).square().mean())
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
        "steps_per_print": 1000,
    }
    engine, *_ = shardspeed.initialize(model=module, config=config)
    recorder = Recorder()
    engine.monitor.add(recorder)
    it = iter([(torch.randn(2, 4), torch.randn(2, 1)) for _ in range(4)])
    walls = []
    for _ in range(2):
        began = time.perf_counter()
        engine.train_batch(it)
        walls.append(time.perf_counter() - began)
    engine.destroy()
    rates = [v for tag, v, _ in recorder.events if tag == "Train/Samples/samples_per_second"]
    return {"rates": rates, "true": [4 / w for w in walls]}


def test_pipeline_throughput_counts_the_fill(dist_run) -> None:
    _, last = dist_run(_pipe_window, 2)
    assert len(last["rates"]) == 2
    for logged, true in zip(last["rates"], last["true"], strict=True):
        assert true <= logged <= 1.15 * true  # the window is train_batch's (less the caller's few us)


def _pipe_reduce(rank: int, world: int) -> dict:
    from shardspeed.pipe import PipelineModule

    torch.manual_seed(0)
    topology = Topology.build(MeshShape(pipe=2, data=2))
    slow = 0.05 if rank == 3 else 0.0  # the writer's data-parallel peer is slow: the writer waits in ReduceGrads
    layers = [torch.nn.Linear(4, 4), _Sleepy(slow)]
    module = PipelineModule(layers, topology=topology, loss_fn=lambda out, y: (out - y).square().mean())
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "wall_clock_breakdown": True,
        "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
        "steps_per_print": 1000,
    }
    engine, *_ = shardspeed.initialize(model=module, config=config)
    recorder = Recorder()
    engine.monitor.add(recorder)
    it = iter([(torch.randn(2, 4), torch.randn(2, 4)) for _ in range(4)])
    for _ in range(2):
        engine.train_batch(it)
    engine.destroy()
    return {t.removeprefix("Train/Samples/elapsed_time_ms_"): v for t, v, x in recorder.events if "elapsed" in t}


def test_pipeline_reduction_is_backward_allreduce(dist_run) -> None:
    results = dist_run(_pipe_reduce, 4)
    (writer,) = [r for r in results if r]
    assert writer["backward_allreduce"] > 40  # ms: two 50 ms forwards of the slow peer, less the writer's own
    assert writer["backward_inner"] + writer["backward_allreduce"] <= writer["backward"] + 1e-6
