"""Monitors across ranks (gloo, world 2): only the writing rank writes (data rank 0; under a pipeline the last
stage), x = global samples, the loss values the engine returned, one memory gather per step with every rank's
figures, the missing-package error on every rank, and W&B's offline files."""

from __future__ import annotations

import glob
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from pipe_models import gpt_layers, gpt_loss_fn, make_batches, rank_iterator

import shardspeed
from shardspeed.monitor import Monitor, MonitorPackageError
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
    assert len(tb["Train/Samples/grad_norm"]) == STEPS  # computed every step while monitors are on
    for rank, result in enumerate(results):  # every rank's figures, gathered to the writer
        assert tb[f"Memory/rank{rank}/predicted_model_state_bytes"][-1][1] == result["model_states"]
        assert all(v > 0 for _, v in tb[f"Memory/rank{rank}/host_peak_bytes"])
        assert f"Memory/rank{rank}/device_peak_bytes" not in tb  # CPU
        assert result["gather"] == (STEPS, STEPS * 2 * 4)  # one 4-figure all-gather per step, on every rank
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
