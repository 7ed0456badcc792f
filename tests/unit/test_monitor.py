"""Monitors (shardspeed/monitor/): DeepSpeed's config keys and CSV layout, the step's tags (pure), the engine's
monitors in one process (TensorBoard read back with tensorboard's own reader, CSV, a user's monitor), the
missing-package error. Multi-rank cases (the writing rank, the memory gather, the pipeline) are in
tests/dist/test_monitor_dist.py."""

from __future__ import annotations

import csv
import glob
import multiprocessing
import os
import sys
from pathlib import Path

import pytest
import torch

import shardspeed
from shardspeed.config import load_config
from shardspeed.monitor import Monitor, MonitorPackageError
from shardspeed.monitor.listener import tokens_per_sample_of
from shardspeed.monitor.memory import model_state_total
from shardspeed.monitor.tags import RankMemory, step_events
from shardspeed.monitor.writers import csv_file_name, csv_header
from shardspeed.training import StepReport

DEEPSPEED_CSV = glob.glob("/work/dsvenv/lib/python3*/site-packages/deepspeed/monitor/csv_monitor.py")


class Recorder(Monitor):
    def __init__(self) -> None:
        self.events: list[tuple[str, float, int]] = []
        self.closed = 0

    def write_events(self, events) -> None:
        self.events.extend(events)

    def close(self) -> None:
        self.closed += 1


def test_monitor_sections_have_deepspeeds_defaults() -> None:
    cfg = load_config(
        {"train_batch_size": 1, "tensorboard": {"enabled": True}, "wandb": {}, "csv_monitor": {}}, dp_world_size=1
    )
    assert (cfg.tensorboard.enabled, cfg.tensorboard.output_path, cfg.tensorboard.job_name) == (
        True,
        "",
        "DeepSpeedJobName",
    )
    assert (cfg.csv_monitor.enabled, cfg.csv_monitor.output_path, cfg.csv_monitor.job_name) == (
        False,
        "",
        "DeepSpeedJobName",
    )
    assert (cfg.wandb.enabled, cfg.wandb.group, cfg.wandb.team, cfg.wandb.project) == (False, None, None, "deepspeed")
    assert cfg.warnings == []  # typed sections now: no "is ignored" line


def test_csv_names_and_headers_follow_deepspeeds_csv_monitor() -> None:
    assert csv_file_name("Train/Samples/train_loss") == "Train_Samples_train_loss.csv"
    assert csv_file_name("Memory/rank1/host peak") == "Memory_rank1_host_peak.csv"
    assert csv_header("Train/Samples/lr") == ["step", "lr"]
    assert csv_header("loss") == ["step", "loss"]
    if DEEPSPEED_CSV:  # the rules are DeepSpeed 0.19.8's own lines
        source = Path(DEEPSPEED_CSV[0]).read_text()
        assert "filename = log_name.replace('/', '_').replace(' ', '_')" in source
        assert "csv_monitor_writer.writerow(['step', header])" in source
        assert "header = record_splits[len(record_splits) - 1]" in source


def test_step_events_tags_values_and_x() -> None:
    report = StepReport(
        global_step=3,
        global_samples=24,
        loss=torch.tensor(1.5),
        lr=(0.1, 0.01),
        grad_norm=2.0,
        loss_scale=1024.0,
        skipped=False,
    )
    memory = [RankMemory(0, 100, None, 40), RankMemory(1, 200, 300, 50)]
    events = step_events(
        report,
        skipped_steps=1,
        samples_per_second=8.0,
        tokens_per_sample=16,
        phase_seconds={"forward": 0.002, "backward": 0.003},
        mfu=0.25,
        memory=memory,
    )
    assert {x for _, _, x in events} == {24}
    assert {tag: value for tag, value, _ in events} == {
        "Train/Samples/train_loss": 1.5,
        "Train/Samples/lr": 0.1,
        "Train/Samples/lr_group1": 0.01,
        "Train/Samples/loss_scale": 1024.0,
        "Train/Samples/elapsed_time_ms_forward": 2.0,
        "Train/Samples/elapsed_time_ms_backward": 3.0,
        "Train/Samples/samples_per_second": 8.0,
        "Train/Samples/tokens_per_second": 128.0,
        "Train/Samples/grad_norm": 2.0,
        "Train/Samples/skipped_steps": 1.0,
        "Train/Samples/mfu": 0.25,
        "Memory/rank0/host_peak_bytes": 100.0,
        "Memory/rank0/predicted_model_state_bytes": 40.0,
        "Memory/rank1/host_peak_bytes": 200.0,
        "Memory/rank1/device_peak_bytes": 300.0,
        "Memory/rank1/predicted_model_state_bytes": 50.0,
    }
    bare = StepReport(1, 2, None, (0.1,), None, None, False)
    assert [tag for tag, _, _ in step_events(bare, skipped_steps=0)] == [
        "Train/Samples/lr",
        "Train/Samples/skipped_steps",
    ]


def test_tokens_per_sample_from_an_integer_batch_by_sequence() -> None:
    ids = torch.zeros(4, 7, dtype=torch.long)
    assert tokens_per_sample_of((ids,), {}) == 7
    assert tokens_per_sample_of((), {"input_ids": ids}) == 7
    assert tokens_per_sample_of(((ids, ids),), {}) == 7  # a pipeline stage's tuple of inputs
    assert tokens_per_sample_of((torch.zeros(4, 7),), {}) is None  # floats are features, not tokens
    assert tokens_per_sample_of((torch.zeros(4, 7, dtype=torch.bool),), {}) is None
    assert tokens_per_sample_of((torch.zeros(4, dtype=torch.long),), {}) is None


def _train(config: dict, steps: int = 3) -> tuple[shardspeed.ShardSpeedEngine, list[float], Recorder]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Flatten(), torch.nn.Linear(12, 1))
    base = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}
    engine, *_ = shardspeed.initialize(model=model, config={**base, "steps_per_print": 1000, **config})
    recorder = Recorder()
    engine.monitor.add(recorder)
    losses = []
    for _ in range(steps):
        loss = engine(torch.randint(0, 10, (2, 3))).square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return engine, losses, recorder


def _read_csv(path: Path) -> list[list[str]]:
    with open(path, newline="") as handle:
        return list(csv.reader(handle))


def test_engine_writes_tensorboard_csv_and_a_user_monitor(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monitors = {"output_path": str(tmp_path), "job_name": "job"}
    engine, losses, recorder = _train(
        {"tensorboard": {"enabled": True, **monitors}, "csv_monitor": {"enabled": True, **monitors}}
    )
    # Before destroy: the CSV files hold every step already (flushed per step); TensorBoard's writer thread flushes
    # every 2 s, or now
    rows = _read_csv(tmp_path / "job" / "Train_Samples_train_loss.csv")
    assert rows[0] == ["step", "train_loss"]
    assert [(int(x), float(v)) for x, v in rows[1:]] == list(zip([2, 4, 6], losses))
    engine.monitor.flush()
    acc = EventAccumulator(str(tmp_path / "job"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {"Train/Samples/train_loss", "Train/Samples/lr", "Train/Samples/grad_norm"} <= set(tags)
    assert "Train/Samples/elapsed_time_ms_forward" not in tags  # wall_clock_breakdown is off
    loss_events = acc.Scalars("Train/Samples/train_loss")
    assert [e.step for e in loss_events] == [2, 4, 6]  # x = global samples
    assert [e.value for e in loss_events] == [float(torch.tensor(v, dtype=torch.float32)) for v in losses]
    tokens = _read_csv(tmp_path / "job" / "Train_Samples_tokens_per_second.csv")
    samples = _read_csv(tmp_path / "job" / "Train_Samples_samples_per_second.csv")
    assert [float(t) for _, t in tokens[1:]] == pytest.approx([3 * float(s) for _, s in samples[1:]])  # S = 3
    predicted = _read_csv(tmp_path / "job" / "Memory_rank0_predicted_model_state_bytes.csv")
    assert float(predicted[-1][1]) == model_state_total(engine.memory_breakdown())
    assert not (tmp_path / "job" / "Memory_rank0_device_peak_bytes.csv").exists()  # CPU: no device figure
    # the user's monitor got exactly what the file monitors got
    assert {(t, x) for t, _, x in recorder.events} == {(t, e.step) for t in tags for e in acc.Scalars(t)}
    engine.destroy()
    engine.monitor.close()  # closing twice closes each monitor once
    assert recorder.closed == 1


def test_wall_clock_tags_add_up(tmp_path: Path) -> None:
    _, _, recorder = _train({"wall_clock_breakdown": True}, steps=2)
    per_step: dict[int, dict[str, float]] = {}
    for tag, value, x in recorder.events:
        per_step.setdefault(x, {})[tag.removeprefix("Train/Samples/")] = value
    for figures in per_step.values():
        names = {n for n in figures if n.startswith("elapsed_time_ms_")}
        assert names == {
            f"elapsed_time_ms_{p}" for p in ("forward", "backward", "backward_inner", "backward_allreduce", "step")
        }
        assert figures["elapsed_time_ms_backward_inner"] + figures["elapsed_time_ms_backward_allreduce"] == (
            pytest.approx(figures["elapsed_time_ms_backward"], rel=1e-9)
        )


def test_missing_monitor_package_is_an_error_naming_the_key_and_the_extra(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if the monitor extra were not installed
    with pytest.raises(MonitorPackageError) as err:
        _train({"wandb": {"enabled": True}}, steps=0)
    message = str(err.value)
    assert "wandb.enabled (wandb)" in message and "pip install shardspeed[monitor]" in message


def test_monitors_stay_off_unless_enabled() -> None:
    torch.manual_seed(0)
    engine, *_ = shardspeed.initialize(
        model=torch.nn.Linear(2, 2), config={"train_batch_size": 1, "optimizer": {"type": "SGD", "params": {"lr": 1}}}
    )
    assert not engine.monitor.enabled and not engine.monitor.active and engine.monitor.monitors == []
    engine.backward(engine(torch.ones(1, 2)).sum())
    engine.step()
    assert engine.monitor.listener.steps_written == 0
    assert engine.get_global_grad_norm() is None  # no monitor: the norm is not computed for it


def test_offloaded_optimizer_io_is_a_wall_clock_tag(tmp_path: Path) -> None:
    offload = {"stage": 1, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}}
    engine, _, recorder = _train({"wall_clock_breakdown": True, "zero_optimization": offload}, steps=2)
    io = [(x, v) for tag, v, x in recorder.events if tag == "Train/Samples/elapsed_time_ms_offload_io"]
    assert [x for x, _ in io] == [2, 4] and all(v >= 0 for _, v in io)
    # within the step phase: the time blocked on the swap file is part of the step's time
    steps = [v for tag, v, _ in recorder.events if tag == "Train/Samples/elapsed_time_ms_step"]
    assert all(v_io <= v_step for (_, v_io), v_step in zip(io, steps))
    engine.destroy()


def test_wandb_monitor_maps_team_to_entity_and_logs_each_x_once(monkeypatch) -> None:
    import types

    from shardspeed.config.monitor import WandbConfig
    from shardspeed.monitor import WandbMonitor

    calls: list[tuple[str, object]] = []

    class Run:
        def log(self, data: dict, step: int) -> None:
            calls.append(("log", (data, step)))

        def finish(self) -> None:
            calls.append(("finish", None))

    def init(**kwargs: object) -> Run:
        calls.append(("init", kwargs))
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    monitor = WandbMonitor(WandbConfig(enabled=True, team="my-team", group="g", project="p"))
    monitor.write_events([("b", 2.0, 8), ("a", 1.0, 4), ("c", 3.0, 8)])
    monitor.close()
    monitor.close()
    assert calls == [
        ("init", {"project": "p", "entity": "my-team", "group": "g"}),
        ("log", ({"a": 1.0}, 4)),  # W&B steps never decrease: each x once, in order
        ("log", ({"b": 2.0, "c": 3.0}, 8)),
        ("finish", None),
    ]


def test_mfu_tag_from_the_flops_profilers_figure(monkeypatch) -> None:
    """S5's wiring: ``model_flops_utilization(per-sample FLOPs, samples/s, world size, peak)`` from
    ``engine.flops_profiler`` (helper F's), stubbed here so the test runs with or without F's branch."""
    import types

    seen: list[tuple] = []

    def model_flops_utilization(*args: float) -> float:
        seen.append(args)
        return 0.125

    try:  # with F's branch merged the real module is patched: a stub module would hide its other names
        import shardspeed.profiling.mfu as mfu

        monkeypatch.setattr(mfu, "model_flops_utilization", model_flops_utilization)
    except ImportError:
        stub = types.ModuleType("shardspeed.profiling.mfu")
        stub.model_flops_utilization = model_flops_utilization  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "shardspeed.profiling.mfu", stub)
    engine, _, recorder = _train({}, steps=1)
    assert "Train/Samples/mfu" not in {tag for tag, _, _ in recorder.events}  # no profiler figure yet
    engine.flops_profiler = types.SimpleNamespace(model_flops_per_sample=1e6, peak_flops=1e9, close=lambda: None)
    engine.backward(engine(torch.randint(0, 10, (2, 3))).square().mean())
    engine.step()
    at = {tag: value for tag, value, x in recorder.events if x == 4}
    assert at["Train/Samples/mfu"] == 0.125
    assert seen == [(1e6, at["Train/Samples/samples_per_second"], 1, 1e9)]
    engine.destroy()


def test_evaluation_between_steps_is_outside_the_throughput_window() -> None:
    engine, _, _ = _train({}, steps=1)
    listener = engine.monitor.listener
    with torch.no_grad():
        engine(torch.randint(0, 10, (2, 3)))  # an evaluation forward: no window yet
    assert listener._window_start is None
    engine.backward(engine(torch.randint(0, 10, (2, 3))).square().mean())  # the next training step opens it
    assert listener._window_start is not None
    engine.step()
    assert listener._window_start is None and listener.steps_written == 2
    engine.destroy()


def _train_then_die(root: str) -> None:
    monitors = {"output_path": root, "job_name": "job"}
    _train({"tensorboard": {"enabled": True, **monitors}, "csv_monitor": {"enabled": True, **monitors}}, steps=2)
    os._exit(1)  # killed mid-run: no destroy(), no atexit


def test_a_crash_mid_run_leaves_readable_files(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    child = multiprocessing.get_context("fork").Process(target=_train_then_die, args=(str(tmp_path),))
    child.start()
    child.join(60)
    assert child.exitcode == 1
    rows = _read_csv(tmp_path / "job" / "Train_Samples_train_loss.csv")
    assert [row[0] for row in rows] == ["step", "2", "4"]  # every step written (flushed per step)
    acc = EventAccumulator(str(tmp_path / "job"))
    acc.Reload()  # readable; scalars queued in the last TENSORBOARD_FLUSH_SECS may be missing
    assert isinstance(acc.Tags()["scalars"], list)
