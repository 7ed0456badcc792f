"""The difficulty-aware sampler (data/difficulty.py, data/difficulty_sampler.py), pure: only eligible samples,
every sample once per epoch at full difficulty, the same global batches at world 1, 2 and 4, DeepSpeed's percentile
rule, intersections, resumable state, and metrics read from the analyzer's files through the typed config."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from shardspeed.config import load_config
from shardspeed.data.analyzer import analyze
from shardspeed.data.analyzer.files import MetricIndex
from shardspeed.data.curriculum import CurriculumSchedule
from shardspeed.data.difficulty import MetricCurriculum, eligible_mask, eligible_samples, load_metrics
from shardspeed.data.difficulty_sampler import DifficultySampler

N = 240
VALUES = np.random.default_rng(0).integers(1, 65, size=N)  # e.g. sequence lengths 1..64


def _index(values: np.ndarray) -> MetricIndex:
    order = np.argsort(values, kind="stable")
    unique, counts = np.unique(values, return_counts=True)
    return MetricIndex(order.astype(np.int64), counts.astype(np.int64), unique.astype(np.int64))


def _linear(lo: int, hi: int, steps: int, step: int = 1) -> CurriculumSchedule:
    return CurriculumSchedule(lo, hi, "fixed_linear", total_curriculum_step=steps, difficulty_step=step)


def _metric(values: np.ndarray = VALUES, kind: str = "value", schedule: CurriculumSchedule | None = None, name="len"):
    return MetricCurriculum(name, schedule or _linear(8, 64, 10), kind, _index(values))


def _sampler(metrics, *, mbs=2, gas=3, rank=0, world=2, seed=7, num_epochs=1) -> DifficultySampler:
    return DifficultySampler(
        tuple(metrics) if isinstance(metrics, (list, tuple)) else (metrics,),
        N,
        micro_batch_size=mbs,
        gradient_accumulation_steps=gas,
        dp_rank=rank,
        dp_world_size=world,
        seed=seed,
        num_epochs=num_epochs,
    )


def test_only_eligible_samples_are_drawn() -> None:
    metric = _metric()
    sampler = _sampler(metric)
    cursor = sampler._cursor
    for g in range(14):
        batch, cursor = sampler.draw(cursor)
        difficulty = metric.schedule.difficulty_at(g + 1)
        assert dict(cursor.difficulties) == {"len": difficulty}
        assert len(batch) == 12 and np.all(VALUES[batch] <= difficulty), g


def test_full_difficulty_visits_every_sample_once_per_epoch() -> None:
    metric = _metric(schedule=_linear(64, 64, 10))
    sampler = _sampler(metric, mbs=4, gas=3, world=2)  # 24 per global batch, 10 per epoch of 240
    batches = sampler.global_batches(20)
    for epoch in (batches[:10], batches[10:]):
        seen = np.concatenate(epoch)
        assert sorted(seen.tolist()) == list(range(N))
    assert not np.array_equal(np.concatenate(batches[:10]), np.concatenate(batches[10:]))  # a new order per pass


def test_same_global_batches_at_world_1_2_4() -> None:
    metric = _metric()
    reference = _sampler(metric, mbs=8, gas=3, world=1).global_batches(12)
    for world, mbs, gas in ((1, 24, 1), (2, 4, 3), (4, 2, 3), (4, 6, 1)):
        ranks = [iter(_sampler(metric, mbs=mbs, gas=gas, rank=r, world=world, num_epochs=2)) for r in range(world)]
        for g in range(12):
            got = [x for _ in range(gas) for it in ranks for x in next(it)]
            assert got == reference[g].tolist(), (world, mbs, gas, g)


def test_percentile_follows_deepspeeds_rule_and_metrics_intersect() -> None:
    pct = _metric(kind="percentile", schedule=_linear(10, 100, 10))
    at_30 = pct.eligible(30, N)
    assert len(at_30) == (N // 100) * 30 and np.all(VALUES[at_30] <= np.sort(VALUES)[len(at_30) - 1])
    assert len(pct.eligible(100, N)) == N
    other_values = np.arange(N) % 10
    other = _metric(other_values, name="mod", schedule=_linear(2, 9, 10))
    both = eligible_samples((_metric(), other), {"len": 30, "mod": 4}, N)
    assert both.tolist() == [i for i in range(N) if VALUES[i] <= 30 and other_values[i] <= 4]
    assert np.flatnonzero(eligible_mask((_metric(), other), {"len": 30, "mod": 4}, N)).tolist() == both.tolist()
    assert np.array_equal(np.flatnonzero(eligible_mask((pct,), {"len": 30}, N)), at_30)
    single = MetricCurriculum("all", _linear(1, 2, 3), "value", None)
    assert len(single.eligible(1, N)) == N


def test_state_resumes_at_another_world_size_and_checks_mismatches() -> None:
    metric = _metric()
    reference = _sampler(metric, mbs=4, gas=3, world=1).global_batches(12)
    first = _sampler(metric, mbs=2, gas=3, world=2)
    first.advance(5 * 3)  # five optimizer steps
    state = first.state_dict()
    assert state["global_batches"] == 5 and state["difficulties"] == {"len": metric.schedule.difficulty_at(5)}
    world4 = [_sampler(metric, mbs=1, gas=3, rank=r, world=4) for r in range(4)]
    for s in world4:
        s.load_state_dict(state)
    iters = [iter(s) for s in world4]
    for g in range(5, 12):
        assert [x for _ in range(3) for it in iters for x in next(it)] == reference[g].tolist()
    mid = _sampler(metric, mbs=2, gas=3, world=2)
    mid.advance(4)  # one step and one micro-step
    resumed = _sampler(metric, mbs=2, gas=3, world=2)
    resumed.load_state_dict(mid.state_dict())
    assert list(iter(resumed))[:3] == list(iter(mid))[:3]
    with pytest.raises(ValueError, match="train_batch_size"):
        _sampler(metric, mbs=1, gas=3, world=2).load_state_dict(state)
    with pytest.raises(ValueError, match="not a difficulty sampler"):
        first.load_state_dict({"epoch": 0, "samples_consumed_in_epoch": 0})


def test_iteration_length_and_errors() -> None:
    sampler = _sampler(_metric(), mbs=4, gas=3, world=2, num_epochs=2)
    assert len(sampler) == 2 * 10 * 3 and len(list(iter(sampler))) == 60
    empty = _sampler(_metric(schedule=_linear(0, 64, 10, step=64)))
    with pytest.raises(ValueError, match="no sample is eligible"):
        empty.global_batches(1)
    custom = _sampler(_metric(schedule=CurriculumSchedule(8, 64, "custom")))
    custom.set_custom_curriculum_learning_schedule({"len": lambda step: 8 * step})
    assert all(np.all(VALUES[b] <= 8 * (g + 1)) for g, b in enumerate(custom.global_batches(5)))


def _config(tmp_path: Path, metrics: dict) -> object:
    raw = {
        "train_batch_size": 12,
        "data_efficiency": {
            "enabled": True,
            "seed": 3,
            "data_sampling": {
                "enabled": True,
                "curriculum_learning": {
                    "enabled": True,
                    "data_cluster_path": str(tmp_path),
                    "curriculum_metrics": metrics,
                },
            },
        },
    }
    return load_config(raw, dp_world_size=1).data_efficiency.sampling_curriculum


def test_metrics_from_analyzer_files_via_config(tmp_path: Path) -> None:
    samples = [np.ones(int(v), dtype=np.int64) for v in VALUES]
    files = analyze(samples, "seqlen", save_path=tmp_path, progress=False).files
    schedule = {"min_difficulty": 8, "max_difficulty": 64, "schedule_type": "fixed_linear"}
    schedule["schedule_config"] = {"total_curriculum_step": 10, "difficulty_step": 8}
    metrics = {
        "seqlen": {
            "index_to_sample_path": str(files.index_to_sample),
            "index_to_metric_path": str(files.index_to_metric),
            "difficulty_type": "value",
            **schedule,
        }
    }
    loaded = load_metrics(_config(tmp_path, metrics), N)
    assert np.array_equal(loaded[0].eligible(20, N), np.flatnonzero(VALUES <= 20))
    with pytest.raises(ValueError, match="lists 240 samples but the dataset has 100"):
        load_metrics(_config(tmp_path, metrics), 100)
    metrics["seqlen"]["index_to_metric_path"] = str(tmp_path / "missing")
    with pytest.raises(ValueError, match=r"'seqlen'.*missing"):
        load_metrics(_config(tmp_path, metrics), N)


def test_engine_draws_by_difficulty_and_logs_it(tmp_path: Path) -> None:
    """``initialize(training_data=...)`` in a world of one: the loader is the difficulty sampler's, each step's
    samples are eligible, and the difficulty goes to the progress line and the csv monitor's tag."""
    import torch

    import shardspeed
    from shardspeed.monitor.tags import DIFFICULTY, difficulty_events
    from shardspeed.monitor.writers import csv_file_name

    files = analyze([np.ones(int(v)) for v in VALUES], "seqlen", save_path=tmp_path, progress=False).files
    metric = {
        "index_to_sample_path": str(files.index_to_sample),
        "index_to_metric_path": str(files.index_to_metric),
        "difficulty_type": "value",
        "min_difficulty": 8,
        "max_difficulty": 64,
        "schedule_type": "fixed_linear",
        "schedule_config": {"total_curriculum_step": 10, "difficulty_step": 8},
    }
    config = {
        "train_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
        "steps_per_print": 2,
        "csv_monitor": {"enabled": True, "output_path": str(tmp_path / "csv"), "job_name": "j"},
        "data_efficiency": {
            "data_sampling": {"curriculum_learning": {"enabled": True, "curriculum_metrics": {"len": metric}}}
        },
    }
    data = torch.utils.data.TensorDataset(torch.arange(N), torch.randn(N, 4))
    model = torch.nn.Linear(4, 1)
    engine, _, loader, _ = shardspeed.initialize(model=model, training_data=data, config=config)
    assert isinstance(loader.data_sampler, DifficultySampler) and loader.sampler.seed == 1234  # DeepSpeed's default
    assert engine.curriculum_learning_enabled() and not engine.data_efficiency_enabled()
    engine.set_custom_curriculum_learning_schedule({})
    schedule = CurriculumSchedule(8, 64, "fixed_linear", total_curriculum_step=10, difficulty_step=8)
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    engine.logger.addHandler(handler)
    it = iter(loader)
    for step in range(1, 5):
        for _ in range(2):
            idx, x = next(it)
            assert np.all(VALUES[idx.numpy()] <= schedule.difficulty_at(step)), step
            engine.backward(engine(x).pow(2).mean())
            engine.step()
    engine.logger.removeHandler(handler)
    assert f"step 4: data sampling difficulty len {schedule.difficulty_at(4)}" in lines
    engine.destroy()
    rows = (tmp_path / "csv" / "j" / csv_file_name(DIFFICULTY + "len")).read_text().splitlines()
    assert rows[-1] == f"16,{float(schedule.difficulty_at(4))}"
    assert difficulty_events(None, 3) == [] and difficulty_events({"b": 2, "a": 1}, 3)[0] == (DIFFICULTY + "a", 1.0, 3)
